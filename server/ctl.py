"""``smddpctl``: health, status, topology and metrics of a node's smddpd, for people and scripts."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc
from smddp.wire import socket_candidates

TIMEOUT_S = 5.0


def _target(args: argparse.Namespace) -> str:
    if args.address:
        return args.address
    import os

    paths = [args.socket] if args.socket else socket_candidates()
    for path in paths:
        if os.path.exists(path):
            return "unix:" + path
    raise SystemExit(f"smddpctl: no smddpd socket at {', '.join(paths)} (use --socket or SMDDP_SOCKET)")


def cmd_health(args: argparse.Namespace) -> int:
    target = _target(args)
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=TIMEOUT_S)
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as exc:
        status = f"UNREACHABLE ({exc.code().name}: {exc.details()})"
    if args.json:
        print(json.dumps({"target": target, "service": args.service, "status": status}))
    else:
        print(f"{target}: {status}")
    return 0 if status == "SERVING" else 1


def _status(args: argparse.Namespace) -> pb.StatusReply:
    target = _target(args)
    stub = pb_grpc.NodeStub(grpc.insecure_channel(target))
    try:
        return stub.Status(pb.StatusRequest(), timeout=TIMEOUT_S)
    except grpc.RpcError as exc:
        raise SystemExit(f"smddpctl: {target}: {exc.code().name}: {exc.details()}") from None


def cmd_status(args: argparse.Namespace) -> int:
    st = _status(args)
    if args.json:
        print(json.dumps(MessageToDict(st, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)))
        return 0
    print(f"node {st.node_id}  smddpd {st.version}  up {st.uptime_seconds:.0f} s  communicators {len(st.comms)}")
    for c in st.comms:
        state = f"FAILED: {c.failed}" if c.failed else "ok"
        print(f"  job {c.job_id} comm {c.comm_id}: {len(c.ranks)}/{c.world_size} ranks, {c.ops_completed} ops, {state}")
        for r in c.ranks:
            print(f"    rank {r.rank} (global {r.global_rank}) pid {r.pid} node {r.node_id} ops {r.ops_completed}"
                  f"{'' if r.attached else ' (not attached)'}")
        for p in c.pending:
            missing = ", ".join(map(str, p.missing_ranks)) or "-"
            print(f"    waiting: op #{p.seq} chunk {p.part} {p.description} for {p.waited_seconds:.1f} s; "
                  f"arrived {', '.join(map(str, p.arrived_ranks))}; missing {missing}")
    return 0


def cmd_topology(args: argparse.Namespace) -> int:
    target = _target(args)
    stub = pb_grpc.NodeStub(grpc.insecure_channel(target))
    try:
        topo = stub.Topology(pb.TopologyRequest(), timeout=TIMEOUT_S)
    except grpc.RpcError as exc:
        raise SystemExit(f"smddpctl: {target}: {exc.code().name}: {exc.details()}") from None
    if args.json:
        print(json.dumps(MessageToDict(topo, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)))
        return 0
    if topo.peer_address:
        transport = pb.Transport.Name(topo.peer_transport).lower()
        peers = f"peers at {topo.peer_address}, data over {transport} port {topo.data_port}"
    else:
        peers = "no peer listener (--peer-bind off)"
    print(f"node {topo.node_id}  {peers}  CPUs {topo.cpu_count}")
    for d in topo.devices:
        print(f"  {d.kind} {d.index}: {d.name}")
    for job in topo.jobs:
        local = ", ".join(map(str, job.local_ranks))
        print(f"  job {job.job_id} comm {job.comm_id}: {len(job.nodes)} node(s), local ranks {local}")
        for n in job.nodes:
            here = "  (this node)" if set(n.ranks) == set(job.local_ranks) else ""
            print(f"    {n.node_id}  {n.peer_address or '-'}  ranks {', '.join(map(str, n.ranks))}{here}")
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    url = f"http://{args.http}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:
            text = resp.read().decode()
    except OSError as exc:
        raise SystemExit(f"smddpctl: cannot read {url}: {exc}") from None
    if args.json:
        from prometheus_client.parser import text_string_to_metric_families

        out = [
            {"name": s.name, "labels": s.labels, "value": s.value}
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        ]
        print(json.dumps(out))
    else:
        print(text, end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs one smddpctl command.

    Returns:
        0 on success; 1 when the daemon is not healthy.
    """
    parser = argparse.ArgumentParser(prog="smddpctl", description="Look at a node's smddpd.")
    parser.add_argument("--socket", help="the daemon's unix socket (default SMDDP_SOCKET or the standard paths)")
    parser.add_argument("--address", help="a gRPC target instead of the socket, e.g. node1:7471 (health only)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True)
    h = sub.add_parser("health", help="grpc.health.v1 status")
    h.add_argument("--service", default="", help="service name ('' for the whole daemon)")
    h.set_defaults(func=cmd_health)
    sub.add_parser("status", help="jobs, ranks and ops in flight").set_defaults(func=cmd_status)
    sub.add_parser("topology", help="this node, its devices and the node layout of every communicator").set_defaults(
        func=cmd_topology
    )
    m = sub.add_parser("metrics", help="the Prometheus metrics")
    m.add_argument("--http", default="127.0.0.1:9464", help="the daemon's --http-bind address")
    m.set_defaults(func=cmd_metrics)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
