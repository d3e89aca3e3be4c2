"""``smddpctl topology`` on each node while a job spanning two nodes is registered."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

# Interleaved, so the layout cannot be mistaken for "first half, second half".
NODE_OF_RANK = [0, 1, 1, 0]
RANKS = {"node0": [0, 3], "node1": [1, 2]}


def smddpctl(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "smddp.server.ctl", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, f"smddpctl {' '.join(args)}: {proc.returncode}\n{proc.stderr}"
    return proc.stdout


def peer_address(daemon) -> str:
    found = re.search(r"peers ([^\s,)]+)", daemon.log())
    assert found, daemon.log()
    return found.group(1)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_topology_of_a_registered_multinode_job(loopback_nodes, launch_world):
    nodes = loopback_nodes(2)
    addresses = {n.node_id: peer_address(n.daemon) for n in nodes}
    world = launch_world("hold", nodes, NODE_OF_RANK, {}, timeout_s=90)
    world.wait_for("ready")

    job_ids = set()
    for node in nodes:
        topo = json.loads(smddpctl("--socket", node.daemon.socket, "--json", "topology"))
        assert topo["node_id"] == node.node_id
        assert topo["peer_address"] == addresses[node.node_id]
        assert topo["cpu_count"] >= 1
        assert any(d["kind"] == "cpu" for d in topo["devices"])
        assert len(topo["jobs"]) == 1, topo
        job = topo["jobs"][0]
        job_ids.add(job["job_id"])
        assert job["comm_id"] == "0"
        assert job["local_ranks"] == RANKS[node.node_id]
        assert job["nodes"] == [
            {"node_id": n, "peer_address": addresses[n], "ranks": RANKS[n]}
            for n in ("node0", "node1")
        ]

        text = smddpctl("--socket", node.daemon.socket, "topology")
        lines = text.splitlines()
        data_port = topo["data_port"]
        assert topo["peer_transport"] == "TCP" and data_port > 0, topo
        assert lines[0].startswith(
            f"node {node.node_id}  peers at {addresses[node.node_id]}, data over tcp port "
            f"{data_port}  CPUs "
        ), text
        local = ", ".join(map(str, RANKS[node.node_id]))
        assert f"  job {job['job_id']} comm 0: 2 node(s), local ranks {local}" in lines, text
        for n, ranks in RANKS.items():
            here = "  (this node)" if n == node.node_id else ""
            line = f"    {n}  {addresses[n]}  ranks {', '.join(map(str, ranks))}{here}"
            assert line in lines, text
    assert len(job_ids) == 1, f"the daemons disagree on the job: {job_ids}"

    world.send("go")
    assert [r["sum"] for r in world.join()] == [[4.0] * 4] * 4
    # Once the ranks have left, the daemons forget the job. 30 s: each look runs smddpctl twice,
    # a Python start each, which takes seconds on a loaded machine.
    deadline = time.monotonic() + 30
    while True:
        jobs = [
            json.loads(smddpctl("--socket", n.daemon.socket, "--json", "topology"))["jobs"]
            for n in nodes
        ]
        if jobs == [[], []] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert jobs == [[], []]
