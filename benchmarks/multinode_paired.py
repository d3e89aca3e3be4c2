"""smddp against gloo across network-namespace nodes, as a user times them: both groups in the
same processes, alternating rounds, blocking ``dist.*`` calls, the worst rank's median.

    sudo .venv/bin/python -m benchmarks.multinode_paired [--nodes 2,4,8] [--ranks-per-node 1,2] \\
        [--rate 1gbit|none] [--cases all_reduce:4,all_reduce:16MiB,...] [--out DIR]

For each node count and ranks per node, it builds that many namespaces on one bridge
(``tests/multinode/netns_cluster``), shapes each node's egress to ``--rate`` with ``tc tbf``,
and starts every rank in its node's namespace with the ``env://`` variables torchrun would
set. Each rank joins a gloo default group (pinned to the namespace's link) and an smddp group
(``new_group(backend="smddp")``, on an embedded daemon per node that advertises the
namespace's address), then times each case in rounds that alternate between the two
(``benchmarks.collectives.paired``'s timing, one launch for both: the ratio does not depend on
how loaded the machine was between two launches).

Per case it prints both medians (the worst rank's), gloo/smddp (above 1: smddp is faster),
the fraction of the link's bound each reaches, and each backend's CPU per call (every thread
of a rank's process, the mean over ranks). The bound, with B the per-node link rate and S the
tensor's bytes: all_reduce 2(N-1)/N x S/B, broadcast S/B, all_gather (N-1) x s/B with s the
bytes of one node's ranks, barrier and 4-byte ops none (they are latency). It writes
multinode-paired.{json,md} into ``--out`` (a new temporary folder by default).
Needs root; the namespaces are removed at the end, also after a failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.collectives.outdir import OUT_HELP, OutFolder

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "multinode"))

from netns_cluster import IFNAME, NetnsCluster, unavailable_reason  # noqa: E402  (after sys.path)

# The table (32): (op, bytes). all_gather's bytes are one rank's block.
DEFAULT_CASES = (
    ("all_reduce", 4),
    ("all_reduce", 64 << 10),
    ("all_reduce", 1 << 20),
    ("all_reduce", 16 << 20),
    ("broadcast", 16 << 20),
    ("all_gather", 1 << 20),
    ("barrier", 0),
)
OPS = ("all_reduce", "broadcast", "all_gather", "barrier")
# A launch's ranks get this long for every case, then they are killed and the run says so.
CASE_TIMEOUT_S = 240.0
UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


# -- one rank (inside a namespace) ------------------------------------------------------------


def rank_main(cases_json: str, out_path: str) -> int:
    """One rank: both groups, every case timed in alternating rounds; rank 0 writes all ranks'
    figures to ``out_path``."""
    import torch
    import torch.distributed as dist

    import smddp  # noqa: F401  (registers the backend)
    from benchmarks.collectives.paired import _time_case

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://")
    groups = {"smddp": dist.new_group(backend="smddp"), "gloo": dist.group.WORLD}
    mine: dict[str, Any] = {"time": {}, "cpu": {}}
    for op, nbytes in json.loads(cases_json):
        # _time_case's all_gather bytes are the output's: every rank's block.
        total = nbytes * world if op == "all_gather" else nbytes
        key = f"{op}:{nbytes}"
        mine["time"][key], mine["cpu"][key] = _time_case(op, total, groups, world, rank)
        if rank == 0:
            print(f"[rank 0] {key} done", file=sys.stderr, flush=True)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(everyone, f)
    dist.destroy_process_group()
    return 0


# -- the launcher -----------------------------------------------------------------------------


def launch(
    cluster: NetnsCluster, ranks_per_node: int, cases: Sequence[tuple[str, int]], folder: Path
) -> list[dict[str, Any]]:
    """Runs one launch on ``cluster``; every rank's figures.

    Raises:
        RuntimeError: a rank failed or the launch timed out (with the failing rank's log).
    """
    nodes = len(cluster.names)
    world = nodes * ranks_per_node
    port = 20000 + secrets.randbelow(20000)  # a fresh namespace has every port free
    out = folder / "figures.json"
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    for rank in range(world):
        node = rank // ranks_per_node
        env = {k: v for k, v in os.environ.items() if not k.startswith("SMDDP_")}
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank % ranks_per_node),
            LOCAL_WORLD_SIZE=str(ranks_per_node),
            MASTER_ADDR=cluster.addresses[0],
            MASTER_PORT=str(port),
            SMDDP_NODE_ID=f"node{node}",
            # No daemon answers here: the node's first rank starts an embedded one.
            SMDDP_SOCKET=str(folder / f"no-daemon-{node}.sock"),
            GLOO_SOCKET_IFNAME=IFNAME,
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])),
        )
        cmd = [
            *cluster.prefix(node), sys.executable, "-m", "benchmarks.multinode_paired", "--rank",
            json.dumps(list(cases)), str(out),
        ]  # fmt: skip
        log = folder / f"rank{rank}.log"
        logs.append(log)
        with open(log, "wb") as f:
            procs.append(
                subprocess.Popen(
                    cmd, env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=f, stderr=f
                )
            )
    deadline = time.monotonic() + CASE_TIMEOUT_S * max(1, len(cases))
    failed: int | None = None
    while any(p.poll() is None for p in procs):
        bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        if bad or time.monotonic() > deadline:
            failed = bad[0] if bad else -1
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    if failed is None:
        bad = [r for r, p in enumerate(procs) if p.returncode != 0]
        failed = bad[0] if bad else None
    if failed is not None or not out.exists():
        who = f"rank {failed}" if failed not in (None, -1) else "the launch"
        rank_log = logs[failed if failed not in (None, -1) else 0]
        tail = rank_log.read_text(errors="replace")[-3000:]
        what = "timed out" if failed == -1 else "failed"
        raise RuntimeError(f"{nodes} nodes x {ranks_per_node}: {who} {what}:\n{tail}")
    with open(out) as f:
        figures: list[dict[str, Any]] = json.load(f)
    return figures


def bound_s(op: str, nbytes: int, nodes: int, ranks_per_node: int, rate_bps: float | None) -> float:
    """The least time the links allow (0 where the op is latency, or links are not shaped)."""
    if rate_bps is None or nbytes <= 64 or op == "barrier":
        return 0.0
    per_node = rate_bps / 8
    if op == "all_reduce":
        return 2 * (nodes - 1) / nodes * nbytes / per_node
    if op == "broadcast":
        return nbytes / per_node
    return (nodes - 1) * nbytes * ranks_per_node / per_node  # all_gather: one node's blocks


def rows(
    figures: list[dict[str, Any]],
    cases: Sequence[tuple[str, int]],
    nodes: int,
    ranks_per_node: int,
    rate_bps: float | None,
) -> list[dict[str, Any]]:
    """One row per case: the worst rank's median per backend, CPU per call, ratio, bound."""
    out = []
    for op, nbytes in cases:
        key = f"{op}:{nbytes}"
        row: dict[str, Any] = {"op": op, "bytes": nbytes}
        for b in ("smddp", "gloo"):
            row[f"{b}_s"] = max(r["time"][key][b] for r in figures)
            row[f"{b}_cpu_s"] = statistics.mean(r["cpu"][key][b] for r in figures)
        row["gloo_over_smddp"] = row["gloo_s"] / row["smddp_s"]
        bound = bound_s(op, nbytes, nodes, ranks_per_node, rate_bps)
        row["bound_s"] = bound
        for b in ("smddp", "gloo"):
            row[f"{b}_of_bound"] = bound / row[f"{b}_s"] if bound else None
        out.append(row)
    return out


def _t(s: float) -> str:
    return f"{s * 1e6:.0f} µs" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def _size(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def markdown(runs: list[dict[str, Any]], rate: str) -> str:
    """The table of every launch, one section per node count and ranks per node."""
    lines = []
    for run in runs:
        lines += [
            f"### {run['nodes']} nodes x {run['ranks_per_node']} ranks per node, links {rate}",
            "",
            "| op | smddp | gloo | gloo/smddp | smddp of bound | gloo of bound | CPU per call smddp / gloo |",  # noqa: E501
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in run["rows"]:
            what = r["op"] + (f" {_size(r['bytes'])}" if r["op"] != "barrier" else "")
            if r["op"] == "all_gather":
                what += " per rank"
            frac = [
                f"{r[f'{b}_of_bound']:.2f}" if r[f"{b}_of_bound"] else "–"
                for b in ("smddp", "gloo")
            ]
            lines.append(
                f"| {what} | {_t(r['smddp_s'])} | {_t(r['gloo_s'])} | {r['gloo_over_smddp']:.2f} | "
                f"{frac[0]} | {frac[1]} | {_t(r['smddp_cpu_s'])} / {_t(r['gloo_cpu_s'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def parse_cases(text: str) -> list[tuple[str, int]]:
    """``op:bytes`` pairs, e.g. ``all_reduce:4,all_reduce:16MiB,barrier``."""
    cases = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        op, _, size = item.partition(":")
        if op not in OPS:
            raise ValueError(f"unknown op {op!r} in --cases (known: {', '.join(OPS)})")
        m = re.fullmatch(r"(\d+)\s*(B|KiB|MiB|GiB)?", size or "0")
        if not m:
            raise ValueError(f"bad size {size!r} in --cases (e.g. 4, 64KiB, 16MiB)")
        cases.append((op, int(m.group(1)) * UNITS[m.group(2) or ""]))
    return cases


def parse_rate(rate: str) -> float | None:
    """``1gbit`` as bits per second; None for ``none``."""
    if rate == "none":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate)
    if not m:
        raise ValueError(f"bad --rate {rate!r} (e.g. 1gbit, 500mbit, none)")
    return float(m.group(1)) * RATE_UNITS[m.group(2)]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs every launch; prints the tables on stdout and progress on stderr.

    Returns:
        0 when every launch completed, 1 when one failed, 2 on bad usage or no privileges.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--rank"]:
        return rank_main(*argv[1:3])
    p = argparse.ArgumentParser(prog="python -m benchmarks.multinode_paired")
    p.add_argument("--nodes", default="2,4,8", help="node counts, comma-separated (default 2,4,8)")
    p.add_argument("--ranks-per-node", default="1,2", help="ranks per node (default 1,2)")
    p.add_argument("--rate", default="1gbit", help="each node's egress rate, or none (1gbit)")
    p.add_argument(
        "--cases",
        default=",".join(f"{op}:{n}" for op, n in DEFAULT_CASES),
        help="op:bytes pairs (all_gather: one rank's block); default the issue's table",
    )
    p.add_argument("--out", default=None, help=OUT_HELP)
    args = p.parse_args(argv)
    try:
        nodes_list = [int(n) for n in args.nodes.split(",")]
        per_node_list = [int(n) for n in args.ranks_per_node.split(",")]
        cases = parse_cases(args.cases)
        rate_bps = parse_rate(args.rate)
    except ValueError as exc:
        p.error(str(exc))
    if min(nodes_list) < 2 or min(per_node_list) < 1:
        p.error("--nodes must be at least 2 and --ranks-per-node at least 1")
    reason = unavailable_reason()
    if reason:
        print(f"benchmarks.multinode_paired: {reason}", file=sys.stderr)
        return 2
    runs: list[dict[str, Any]] = []
    errors = []
    for nodes in nodes_list:
        for per_node in per_node_list:
            folder = Path(tempfile.mkdtemp(prefix="smddp-bench-"))
            cluster = NetnsCluster(nodes)
            print(
                f"[multinode_paired] {nodes} nodes x {per_node}, links {args.rate}",
                file=sys.stderr,
                flush=True,
            )
            try:
                cluster.create()
                if rate_bps is not None:
                    cluster.shape(args.rate)
                figures = launch(cluster, per_node, cases, folder)
                runs.append(
                    {
                        "nodes": nodes,
                        "ranks_per_node": per_node,
                        "rows": rows(figures, cases, nodes, per_node, rate_bps),
                    }
                )
            except RuntimeError as exc:
                errors.append(str(exc))
                print(f"error: {exc}", file=sys.stderr, flush=True)
            finally:
                cluster.destroy()
                shutil.rmtree(folder, ignore_errors=True)
    table = markdown(runs, args.rate)
    sys.stdout.write(table)
    out = OutFolder(args.out, "smddp-bench-multinode-")
    doc = {"rate": args.rate, "cases": cases, "runs": runs, "errors": errors}
    with open(out.path("multinode-paired.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(out.path("multinode-paired.md"), "w") as f:
        f.write(table)
    out.announce()
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
