"""A node drops off the network in the middle of a job.

Two network namespaces, each a node with its own system smddpd (``netns_nodes``). Job A
spans both (ranks 0, 1 on ns0; 2, 3 on ns1) and all_reduces without pause; job B has two
ranks on ns0 only and does the same. Then ns1's link goes down (``ip link set eth0 down``).
Job A's ranks on ns0 must fail within 10 s (heartbeats stop for 5 s) with
SmddpRankFailedError naming the lost node ns1; ns1's ranks likewise name ns0; every rank
still leaves cleanly. Job B, on the surviving daemon, keeps going with correct results,
and that daemon stays healthy. On each data transport (tcp, ucx).
"""

from __future__ import annotations

import re
import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc

BOUND_S = 10.0


def _lost(node: str, address: str) -> str:
    # Both sides stop hearing each other: a link down drops nothing with a reset, so each node's
    # heartbeat timeout, and nothing else, notices the loss (the README's message).
    return (
        rf"job j[0-9a-f]{{16}} comm 0: lost node {node} \(daemon at {re.escape(address)}:\d+\): "
        r"silent for 5 s "
        r"\(no heartbeat: partitioned or hung\)"
    )


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_lost_node_fails_its_peers_and_spares_other_jobs(
    peer_transport, netns_nodes, launch_failure_world
):
    ns0, ns1 = netns_nodes(2, peer_transport.args, peer_transport.env)
    job_a = launch_failure_world("until_failure", [ns0, ns1], [0, 0, 1, 1], {"run_s": 90})
    job_b = launch_failure_world("until_stopped", [ns0], [0, 0], {})
    job_a.wait_for("ready")
    job_b.wait_for("ready")
    time.sleep(0.5)  # both jobs in full swing

    namespace = ns1.prefix[-1]
    down_at = time.time()
    subprocess.run(["ip", "-n", namespace, "link", "set", "eth0", "down"], check=True)
    results = job_a.join()

    for rank, got in enumerate(results):
        lost = ns1 if rank < 2 else ns0
        assert got["type"] == "SmddpRankFailedError" and got["dist_backend_error"], (
            f"rank {rank}: {got}"
        )
        assert re.fullmatch(_lost(lost.node_id, lost.address), got["message"]), (
            f"rank {rank}: {got['message']!r}"
        )
        took = got["failed_at"] - down_at
        assert took < BOUND_S, f"rank {rank} heard of the lost node after {took:.1f} s"
        assert got["destroy_s"] < 10, got
        print(f"rank {rank} after {took:.1f} s: {got['message']}")
    assert results[0]["message"] == results[1]["message"]

    # Job B ran on through the loss, and its daemon is healthy and forgot job A.
    time.sleep(1.0)
    job_b.send("stop")
    b = job_b.join()
    job_a_failed = max(got["failed_at"] for got in results)
    after = [t for t in b[0]["ends"] if t > job_a_failed]
    assert after, f"job B did no op after job A failed ({b[0]['ops']} ops in all)"
    ends = b[0]["ends"]
    stall = max(later - earlier for earlier, later in zip(ends, ends[1:]))
    assert stall < 3.0, f"job B stalled for {stall:.1f} s"
    with grpc.insecure_channel("unix:" + ns0.daemon.socket) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        st = pb_grpc.NodeStub(ch).Status(pb.StatusRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert st.comms == [], st
