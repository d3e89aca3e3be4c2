"""``smddpctl``: health, status, topology and metrics of a node's smddpd, for people and scripts.

Every command talks to one daemon: the one on ``--socket`` (or ``SMDDP_SOCKET``, or the
standard paths), over its unix sockets; metrics too, so that what is printed always belongs
to the daemon named, whatever its ``--http-bind``. Status and metrics go over the data
socket, where the kernel tells the daemon who asks (gRPC does not): a user sees their own
jobs, root and the daemon's ``--admin-group`` every job.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from smddp.core.wire import (
    DATA_SOCKET_SUFFIX,
    MAX_MESSAGE_BYTES,
    MSG_METRICS,
    MSG_QUERY_REPLY,
    MSG_STATUS,
    QUERY_MAGIC,
    pack,
    socket_candidates,
    unpack,
)
from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc

TIMEOUT_S = 5.0
SOCKET_ENV = "SMDDP_SOCKET"
# The largest status or metrics reply read (a daemon at --max-jobs 64 and 4096 ranks a job
# answers with a few MiB).
MAX_REPLY_BYTES = 256 << 20


def _target(args: argparse.Namespace) -> str:
    """The gRPC target of the daemon that ``args`` names; exits with a hint when there is none."""
    if args.address:
        address: str = args.address
        return address
    paths: list[str]
    if args.socket:
        paths, origin = [args.socket], "--socket"
    elif os.environ.get(SOCKET_ENV):
        paths, origin = [os.environ[SOCKET_ENV]], SOCKET_ENV
    else:
        paths, origin = socket_candidates(), ""
    for path in paths:
        if os.path.exists(path):
            return "unix:" + path
    if origin:
        # The user named the socket: suggesting --socket again would send them in a circle.
        raise SystemExit(
            "smddpctl: "
            f"no smddpd socket at {paths[0]} (from {origin}): "
            "is smddpd running? "
            f"Start it with `smddpd --socket {paths[0]}`, or give the socket a running smddpd serves on (its startup line 'smddpd serving on ...' names it)"  # noqa: E501
        )
    raise SystemExit(
        f"smddpctl: no smddpd socket at {' or '.join(paths)}: is smddpd running? "
        f"If it serves elsewhere, name its socket with --socket PATH or {SOCKET_ENV}=PATH"
    )


def _fail(target: str, exc: grpc.RpcError) -> SystemExit:
    """The exit message of a failed call; a socket nobody answers on says so."""
    hint = ""
    if exc.code() == grpc.StatusCode.UNAVAILABLE and target.startswith("unix:"):
        hint = " (the socket exists but no daemon answers on it: a smddpd that stopped without removing it; a new smddpd on that socket replaces it)"  # noqa: E501
    elif exc.code() == grpc.StatusCode.UNIMPLEMENTED and not target.startswith("unix:"):
        hint = (
            " (a --grpc-bind listener serves health only: run smddpctl on that node, with --socket)"
        )
    return SystemExit(f"smddpctl: {target}: {exc.code().name}: {exc.details()}{hint}")


def _node(args: argparse.Namespace) -> tuple[str, pb_grpc.NodeStub]:
    if args.address:
        raise SystemExit(
            f"smddpctl {args.command}: "
            "--address reaches a --grpc-bind listener, which serves health only; "
            "run smddpctl on the daemon's node, with --socket or SMDDP_SOCKET"
        )
    target = _target(args)
    return target, pb_grpc.NodeStub(grpc.insecure_channel(target))


_Reply = TypeVar("_Reply")


def _ask(
    args: argparse.Namespace, call: Callable[[pb_grpc.NodeStub], _Reply]
) -> tuple[str, _Reply]:
    """Makes one call on the node's daemon; a failed call is the command's exit message."""
    target, stub = _node(args)
    try:
        return target, call(stub)
    except grpc.RpcError as exc:
        raise _fail(target, exc) from None


def _query(target: str, msg_type: int, request: bytes) -> bytes:
    """Asks the daemon at gRPC ``target`` (``unix:PATH``) over its data socket: the serialized
    reply (see ``smddp.core.wire.MSG_QUERY_REPLY``).

    Raises:
        SystemExit: the daemon cannot be reached or refused, saying why.
    """
    path = target.removeprefix("unix:") + DATA_SOCKET_SUFFIX
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(TIMEOUT_S)
    try:
        conn.connect(path)
        conn.sendall(pack(msg_type, QUERY_MAGIC + request))
        msg, fds, _flags, _addr = socket.recv_fds(conn, MAX_MESSAGE_BYTES, 1)
    except OSError as exc:
        raise SystemExit(f"smddpctl: {path}: {exc.strerror or exc}") from None
    finally:
        conn.close()
    try:
        if not msg:
            raise SystemExit(f"smddpctl: {path}: the daemon closed the connection unanswered")
        kind, payload = unpack(msg)
        header = pb.AttachReply.FromString(payload)
        if kind != MSG_QUERY_REPLY or not header.ok:
            raise SystemExit(f"smddpctl: {path}: {header.error or f'message type {kind}'}")
        if len(fds) != 1:
            raise SystemExit(f"smddpctl: {path}: the answer carried {len(fds)} descriptors, not 1")
        size = os.fstat(fds[0]).st_size
        if size > MAX_REPLY_BYTES:
            raise SystemExit(f"smddpctl: {path}: an answer of {size} bytes is too large")
        return os.pread(fds[0], size, 0) if size else b""
    finally:
        for fd in fds:
            os.close(fd)


def ask_status(socket_path: str) -> pb.StatusReply:
    """The status of the daemon on ``socket_path``, as ``smddpctl status`` gets it: the jobs
    this process's user may see."""
    return pb.StatusReply.FromString(
        _query("unix:" + socket_path, MSG_STATUS, pb.StatusRequest().SerializeToString())
    )


def _print_json(message: Any) -> None:
    print(
        json.dumps(
            MessageToDict(
                message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            )
        )
    )


def _check(target: str, service: str) -> str:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    try:
        # The stub package declares HealthStub without its methods (it has Check at run time).
        reply: health_pb2.HealthCheckResponse = stub.Check(  # type: ignore[attr-defined]
            health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as exc:
        return f"UNREACHABLE ({exc.code().name}: {exc.details()})"


def cmd_health(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.wait
    while True:
        # With --wait, a daemon still starting has no socket yet, or does not answer: retry.
        try:
            target = _target(args)
        except SystemExit:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)
            continue
        status = _check(target, args.service)
        if status == "SERVING" or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if args.json:
        print(json.dumps({"target": target, "service": args.service, "status": status}))
    else:
        print(f"{target}: {status}")
    return 0 if status == "SERVING" else 1


def cmd_status(args: argparse.Namespace) -> int:
    if args.address:
        _node(args)  # says that --address serves health only
    st = pb.StatusReply.FromString(
        _query(_target(args), MSG_STATUS, pb.StatusRequest().SerializeToString())
    )
    if args.json:
        _print_json(st)
        return 0
    print(
        f"node {st.node_id}  smddpd {st.version}  up {st.uptime_seconds:.0f} s  communicators {len(st.comms)}"  # noqa: E501
    )
    for c in st.comms:
        state = f"FAILED: {c.failed}" if c.failed else "ok"
        print(
            f"  job {c.job_id} comm {c.comm_id}: "
            f"{len(c.ranks)}/{c.world_size} ranks, {c.ops_completed} ops, {state}"
        )
        if c.generation and c.joined_ranks:
            print(
                f"    generation {c.generation}: grown from comm {c.parent_comm_id}; ranks {', '.join(map(str, c.joined_ranks))} joined"  # noqa: E501
            )
        elif c.generation:
            print(
                f"    generation {c.generation}: shrunk from comm {c.parent_comm_id}, which left out ranks {', '.join(map(str, c.excluded_ranks))}"  # noqa: E501
            )
        if c.failed_ranks:
            print(f"    failed ranks: {', '.join(map(str, c.failed_ranks))}")
        for r in c.ranks:
            print(
                f"    rank {r.rank} (global {r.global_rank}) pid {r.pid} node {r.node_id} ops {r.ops_completed}{'' if r.attached else ' (not attached)'}"  # noqa: E501
            )
        for line in c.algorithms:
            print(f"    between nodes: {line}")
        for p in c.pending:
            missing = ", ".join(map(str, p.missing_ranks)) or "-"
            print(
                "    waiting: "
                f"op #{p.seq} chunk {p.part} {p.description} for {p.waited_seconds:.1f} s; "
                f"arrived {', '.join(map(str, p.arrived_ranks))}; "
                f"missing {missing}"
            )
    return 0


def cmd_topology(args: argparse.Namespace) -> int:
    _, topo = _ask(args, lambda stub: stub.Topology(pb.TopologyRequest(), timeout=TIMEOUT_S))
    if args.json:
        _print_json(topo)
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
        print(
            f"  job {job.job_id} comm {job.comm_id}: {len(job.nodes)} node(s), local ranks {local}"
        )
        for n in job.nodes:
            here = "  (this node)" if set(n.ranks) == set(job.local_ranks) else ""
            print(
                f"    {n.node_id}  {n.peer_address or '-'}  ranks {', '.join(map(str, n.ranks))}{here}"  # noqa: E501
            )
    return 0


# -- metrics -------------------------------------------------------------------------------------


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """``q``-quantile of a cumulative histogram, interpolated within a bucket (as PromQL's
    ``histogram_quantile``); the largest finite bound when it falls in the +Inf bucket."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def summarize(text: str) -> dict[str, Any]:
    """The readable part of a daemon's exposition: per op and dtype the count, bytes and
    p50/p99 durations; stragglers per job and rank; errors by kind; the gauges."""
    from prometheus_client.parser import text_string_to_metric_families

    ops: dict[tuple[str, str], dict[str, Any]] = defaultdict(
        lambda: {"count": 0, "bytes": 0, "buckets": []}
    )
    stragglers: dict[str, dict[str, int]] = defaultdict(dict)
    errors: dict[str, int] = {}
    gauges: dict[str, float] = {}
    peers: dict[str, dict[str, int]] = defaultdict(lambda: {"sent": 0, "received": 0})
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = s.labels
            key = (labels.get("op", ""), labels.get("dtype", ""))
            if s.name == "smddp_ops_total":
                ops[key]["count"] = int(s.value)
            elif s.name == "smddp_op_bytes_total":
                ops[key]["bytes"] = int(s.value)
            elif s.name == "smddp_op_duration_seconds_bucket":
                ops[key]["buckets"].append((float(labels["le"]), s.value))
            elif s.name == "smddp_straggler_total":
                stragglers[labels["job"]][labels["rank"]] = int(s.value)
            elif s.name == "smddp_errors_total" and s.value:
                errors[labels["kind"]] = int(s.value)
            elif s.name in ("smddp_registered_ranks", "smddp_active_jobs", "smddp_shm_bytes"):
                gauges[s.name.removeprefix("smddp_")] = s.value
            elif s.name == "smddp_peer_bytes_sent_total":
                peers[labels["peer"]]["sent"] = int(s.value)
            elif s.name == "smddp_peer_bytes_received_total":
                peers[labels["peer"]]["received"] = int(s.value)
    rows = []
    for (op, dtype), v in sorted(ops.items()):
        if not v["count"]:
            continue
        rows.append(
            {
                "op": op,
                "dtype": dtype,
                "count": v["count"],
                "bytes": v["bytes"],
                "p50_seconds": _quantile(0.5, v["buckets"]),
                "p99_seconds": _quantile(0.99, v["buckets"]),
            }
        )
    return {
        "ops": rows,
        "stragglers": [
            {"job": job, "rank": int(rank), "ops_last": n}
            for job, ranks in sorted(stragglers.items())
            for rank, n in sorted(ranks.items(), key=lambda kv: -kv[1])
        ],
        "errors": errors,
        "registered_ranks": int(gauges.get("registered_ranks", 0)),
        "active_jobs": int(gauges.get("active_jobs", 0)),
        "shm_bytes": int(gauges.get("shm_bytes", 0)),
        "peers": [{"peer": p, **v} for p, v in sorted(peers.items())],
    }


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def _bytes(n: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n} B"


def print_summary(target: str, summary: dict[str, Any]) -> None:
    """Prints :func:`summarize`'s result as a few tables."""
    print(
        f"smddpd at {target}: "
        f"{summary['registered_ranks']} ranks registered, {summary['active_jobs']} jobs, {_bytes(summary['shm_bytes'])} of arenas mapped"  # noqa: E501
    )
    if summary["ops"]:
        print(f"\n{'op':<16}{'dtype':<10}{'count':>10}{'bytes':>13}{'p50':>11}{'p99':>11}")
        for r in summary["ops"]:
            print(
                f"{r['op']:<16}{r['dtype']:<10}{r['count']:>10}{_bytes(r['bytes']):>13}{_duration(r['p50_seconds']):>11}{_duration(r['p99_seconds']):>11}"
            )
        print("(durations: first rank's arrival to completion, from the histogram's buckets)")
    else:
        print("\nno op completed yet")
    if summary["stragglers"]:
        # True since smddpd removes a job's series when the job ends (only with
        # --metrics-job-labels are there any).
        print("\nstragglers (ops at which a rank arrived last, jobs still running):")
        by_job: dict[str, list[str]] = defaultdict(list)
        for s in summary["stragglers"]:
            by_job[s["job"]].append(f"rank {s['rank']} {s['ops_last']}")
        for job, ranks in by_job.items():
            print(f"  job {job}: {', '.join(ranks)}")
    if summary["peers"]:
        print("\nother nodes' daemons:")
        for p in summary["peers"]:
            print(f"  {p['peer']}: sent {_bytes(p['sent'])}, received {_bytes(p['received'])}")
    errors = ", ".join(f"{k} {v}" for k, v in sorted(summary["errors"].items())) or "none"
    print(f"\nerrors: {errors}")


def cmd_metrics(args: argparse.Namespace) -> int:
    if args.address:
        _node(args)  # says that --address serves health only
    target = _target(args)
    reply = pb.MetricsReply.FromString(
        _query(target, MSG_METRICS, pb.MetricsRequest().SerializeToString())
    )
    text = reply.exposition
    if args.raw and args.json:
        from prometheus_client.parser import text_string_to_metric_families

        samples = [
            {"name": s.name, "labels": s.labels, "value": s.value}
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        ]
        print(json.dumps(samples))
    elif args.raw:
        print(text, end="")
    elif args.json:
        print(json.dumps(summarize(text)))
    else:
        print_summary(target, summarize(text))
    return 0


def _common(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """The options every command takes, before or after its name.

    On the subcommands their defaults are SUPPRESS, so that an option given before the command
    is not reset by the subparser's default.
    """
    default: Any = argparse.SUPPRESS if suppress else None
    parser.add_argument(
        "--socket",
        default=default,
        help="the daemon's unix socket (default: SMDDP_SOCKET, else /run/smddp/smddpd.sock or the per-user path smddpd uses when it may not create /run/smddp)",  # noqa: E501
    )
    parser.add_argument(
        "--address",
        default=default,
        help="HOST:PORT of a daemon's --grpc-bind listener instead of the socket (health only: that listener serves nothing else)",  # noqa: E501
    )
    parser.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS if suppress else False,
        help="machine-readable output (one JSON document)",
    )


def build_parser() -> argparse.ArgumentParser:
    """smddpctl's argparse parser."""
    parser = argparse.ArgumentParser(
        prog="smddpctl",
        description="Look at one node's smddpd: "
        "the one on --socket, SMDDP_SOCKET or the standard socket paths. "
        "Options go before or after the command.",
    )
    _common(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    h = sub.add_parser("health", help="grpc.health.v1 status (exit 1 unless SERVING)")
    h.add_argument(
        "--service", default="", help="service name ('' for the whole daemon, or smddp.v1.Node)"
    )
    h.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to SECONDS for the daemon to serve (for scripts that start one)",
    )
    h.set_defaults(func=cmd_health)
    s = sub.add_parser(
        "status", help="jobs, communicators, ranks and ops in flight (who is missing)"
    )
    s.set_defaults(func=cmd_status)
    t = sub.add_parser(
        "topology", help="this node, its devices and the node layout of every communicator"
    )
    t.set_defaults(func=cmd_topology)
    m = sub.add_parser(
        "metrics",
        help="a summary of the daemon's metrics: per op count, bytes, p50/p99 duration; "
        "stragglers; errors",
    )
    m.add_argument(
        "--raw", action="store_true", help="the Prometheus exposition text as /metrics serves it"
    )
    m.set_defaults(func=cmd_metrics)
    for p in (h, s, t, m):
        _common(p, suppress=True)
    return parser


# What a shell reports for a command that SIGPIPE ended (128 + 13), as `yes | head -1` does.
BROKEN_PIPE_STATUS = 141


def main(argv: list[str] | None = None) -> int:
    """Runs one smddpctl command.

    Returns:
        0 on success; 1 when the daemon is not healthy; 141 (BROKEN_PIPE_STATUS) when the
        reader of stdout closed it before everything was written.
    """
    try:
        try:
            args = build_parser().parse_args(argv)
            status: int = args.func(args)
        except SystemExit:
            # --help and usage errors exit from parse_args: their text is flushed here too.
            sys.stdout.flush()
            raise
        # Flushed here, not at interpreter exit, so that a reader that has gone (`smddpctl
        # status | head -1`) is seen below rather than as "Exception ignored" at shutdown.
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader has closed the pipe: stay quiet, as other command-line tools do. stdout
        # now points at /dev/null so that the interpreter's own flush at exit cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return BROKEN_PIPE_STATUS
    return status


if __name__ == "__main__":
    sys.exit(main())
