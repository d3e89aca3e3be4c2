"""Multi-node mode of the collectives benchmark: ranks on network-namespace nodes.

    sudo .venv/bin/python -m benchmarks.multinode [--nodes 2] [--ranks-per-node 2] \\
        [--rate 1gbit] [--ops all_reduce,all_gather] [--min-bytes 1MiB] [--max-bytes 256MiB] \\
        [--peer-transport tcp|ucx]

Builds ``--nodes`` network namespaces joined by a bridge (``tests/multinode/netns_cluster``),
shapes each node's egress with ``tc tbf`` to ``--rate`` so that the network, not the CPUs,
limits inter-node traffic, and runs every backend (default smddp, then gloo) with
``--ranks-per-node`` ranks inside each namespace. This module is the multi-node launcher the
collectives benchmark leaves room for (``cli.run_all(config, runner)``): each rank runs
``worker.run_rank`` with the ``env://`` variables set, exactly as under torchrun, and writes
its measurements to a file; everything downstream (rows, busbw as nccl-tests defines it,
ratios against gloo, the table) is the collectives benchmark's own.

smddp runs on embedded daemons (the first rank of each node starts one, which advertises the
namespace's address), their data over ``--peer-transport`` (ucx: UCX over its TCP transport,
``UCX_TLS=tcp``, as no RDMA device exists in a namespace); gloo is pinned to the namespace's link
with GLOO_SOCKET_IFNAME. Needs
root; the namespaces are removed at the end, also after a failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from benchmarks.collectives.cli import build_parser, resolve, run_all
from benchmarks.collectives.errors import BenchmarkError
from benchmarks.collectives.launch import RunResult
from benchmarks.collectives.outdir import OutFolder
from benchmarks.collectives.report import format_table
from benchmarks.collectives.results import Row
from benchmarks.collectives.worker import Measurement, Plan, run_rank

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "multinode"))

from netns_cluster import IFNAME, NetnsCluster, unavailable_reason  # noqa: E402  (after sys.path)

DEFAULT_OPS = "all_reduce,all_gather"
# A rank that failed leaves the others stuck in a collective; they get this long to notice.
FAILED_RANK_GRACE_S = 15.0


# -- one rank (inside a namespace) ------------------------------------------------------------


def rank_main(backend: str, plan_path: str, out_path: str) -> int:
    """Runs one rank's ``plan`` and keeps ``out_path`` up to date with its measurements."""
    with open(plan_path) as f:
        raw = json.load(f)
    plan = Plan(**{**raw, "ops": tuple(raw["ops"]), "sizes": tuple(raw["sizes"])})
    taken: list[Measurement] = []

    def report(m: Measurement) -> None:
        taken.append(m)
        _dump(out_path, {"measurements": taken})

    try:
        run_rank(backend, plan, report)
    except BenchmarkError as exc:
        _dump(out_path, {"measurements": taken, "error": str(exc)})
        return 1
    except BaseException:  # the parent must hear of every failure
        _dump(out_path, {"measurements": taken, "error": traceback.format_exc()})
        return 1
    return 0


def _dump(path: str, value: object) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(value, f)
    os.replace(tmp, path)


# -- the launcher -----------------------------------------------------------------------------


class NamespaceRunner:
    """Starts one backend's ranks on the cluster's nodes and collects a ``RunResult``.

    Rank r runs on node ``r // ranks_per_node``; rank 0's node hosts the c10d store.
    """

    def __init__(
        self, cluster: NetnsCluster, ranks_per_node: int, folder: Path, transport: str = "tcp"
    ) -> None:
        self.cluster = cluster
        self.ranks_per_node = ranks_per_node
        self.transport = transport
        self.folder = folder
        self._runs = 0

    def __call__(self, backend: str, world_size: int, plan: Plan) -> RunResult:
        nodes = len(self.cluster.names)
        if world_size != nodes * self.ranks_per_node:
            raise ValueError(
                f"world size {world_size} is not {nodes} nodes x {self.ranks_per_node} ranks"
            )
        self._runs += 1
        run = self.folder / f"run{self._runs}-{backend}"
        run.mkdir()
        (run / "plan.json").write_text(json.dumps(dataclasses.asdict(plan)))
        port = 20000 + secrets.randbelow(20000)  # a fresh namespace has every port free
        started = time.monotonic()
        procs = []
        for rank in range(world_size):
            node = rank // self.ranks_per_node
            env = {k: v for k, v in os.environ.items() if not k.startswith("SMDDP_")}
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank % self.ranks_per_node),
                LOCAL_WORLD_SIZE=str(self.ranks_per_node),
                MASTER_ADDR=self.cluster.addresses[0],
                MASTER_PORT=str(port),
                SMDDP_NODE_ID=f"node{node}",
                # No daemon answers here: the node's first rank starts an embedded one.
                SMDDP_SOCKET=str(run / f"no-daemon-{node}.sock"),
                # The embedded daemon reads its transport from the environment it inherits.
                SMDDP_PEER_TRANSPORT=self.transport,
                UCX_TLS=os.environ.get("UCX_TLS", "tcp"),
                GLOO_SOCKET_IFNAME=IFNAME,
                PYTHONPATH=os.pathsep.join(
                    filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])
                ),
            )
            cmd = [
                *self.cluster.prefix(node), sys.executable, "-m", "benchmarks.multinode", "--rank",
                backend, str(run / "plan.json"), str(run / f"rank{rank}.pkl"),
            ]  # fmt: skip
            with open(run / f"rank{rank}.log", "wb") as log:
                out = None if rank == 0 else log  # rank 0 reports progress on stderr
                procs.append(
                    subprocess.Popen(
                        cmd, env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=out
                    )
                )
        error = _wait(procs, started + plan.timeout_s, backend, world_size)
        result = RunResult(backend, world_size, {r: [] for r in range(world_size)})
        for rank, proc in enumerate(procs):
            path = run / f"rank{rank}.pkl"
            got = {"measurements": []}
            if path.exists():
                with open(path, "rb") as f:
                    got = pickle.load(f)
            result.measurements[rank] = got["measurements"]
            if proc.returncode != 0 and error is not None and f"rank {rank}:" in error:
                why = (
                    got.get("error")
                    or (run / f"rank{rank}.log").read_text(errors="replace")[-2000:]
                )
                error = f"{error}\n{why}"
        result.error = error
        result.elapsed_s = time.monotonic() - started
        return result


def _wait(procs: list[subprocess.Popen], deadline: float, backend: str, world: int) -> str | None:
    """Waits for the ranks; kills the rest after a failure or at ``deadline``."""
    error = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed and error is None:
            error = f"{backend} n={world} rank {failed[0]}: exited with code {codes[failed[0]]}"
            deadline = min(deadline, time.monotonic() + FAILED_RANK_GRACE_S)
        if time.monotonic() > deadline:
            error = error or f"{backend} n={world}: timed out"
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed and error is None:
        error = (
            f"{backend} n={world} rank {failed[0]}: exited with code {procs[failed[0]].returncode}"
        )
    return error


# -- the command line -------------------------------------------------------------------------


def build_multinode_parser() -> argparse.ArgumentParser:
    """The collectives benchmark's flags plus the cluster's."""
    p = build_parser()
    p.prog = "python -m benchmarks.multinode"
    p.description = (
        "Time torch.distributed collectives across network-namespace nodes for several backends "
        "(default smddp against gloo): latency, algbw and busbw (nccl-tests definitions). Needs "
        "root."
    )
    p.set_defaults(ops=DEFAULT_OPS, min_bytes="1MiB", max_bytes="256MiB")
    helps = {
        "ops": f"comma-separated (default: {DEFAULT_OPS})",
        "min_bytes": "smallest message, e.g. 64KiB (default 1MiB)",
        "max_bytes": "largest message (default 256MiB)",
        "world_sizes": argparse.SUPPRESS,  # --nodes x --ranks-per-node
        "plot_path": argparse.SUPPRESS,
    }
    for action in p._actions:
        action.help = helps.get(action.dest, action.help)
    p.add_argument("--nodes", type=int, default=2, help="network-namespace nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks in each node (default 2)")
    p.add_argument(
        "--rate",
        default="1gbit",
        help=(
            "egress limit of each node's link (tc tbf rate, e.g. 1gbit, 500mbit; 'none': unshaped)"
        ),
    )
    p.add_argument(
        "--peer-transport",
        choices=("tcp", "ucx"),
        default="tcp",
        help="what carries smddp's bytes between the nodes' daemons (default tcp)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; prints the table on stdout and progress on stderr.

    Returns:
        0 when every backend run completed, 1 when any failed, 2 on bad usage or no privileges.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--rank"]:
        return rank_main(*argv[1:4])
    parser = build_multinode_parser()
    args = parser.parse_args(argv)
    if args.nodes < 2 or args.ranks_per_node < 1:
        parser.error("--nodes must be at least 2 and --ranks-per-node at least 1")
    if args.plot_path or args.world_sizes:
        parser.error("--plot and --world-sizes are not offered in multi-node mode")
    try:
        config = resolve(args)
    except (ValueError, BenchmarkError) as exc:
        parser.error(str(exc))
    world = args.nodes * args.ranks_per_node
    config = dataclasses.replace(config, world_sizes=(world,))
    reason = unavailable_reason()
    if reason:
        print(f"benchmarks.multinode: {reason}", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="smddp-bench-"))
    cluster = NetnsCluster(args.nodes)
    try:
        cluster.create()
        if args.rate != "none":
            cluster.shape(args.rate)
        shaped = (
            f"each node's egress limited to {args.rate}"
            if args.rate != "none"
            else "links not shaped"
        )
        print(
            f"[multinode] {args.nodes} nodes x {args.ranks_per_node} ranks, {shaped}, "
            f"smddp data over {args.peer_transport}",
            file=sys.stderr,
            flush=True,
        )
        doc = run_all(
            config,
            runner=NamespaceRunner(cluster, args.ranks_per_node, folder, args.peer_transport),
        )
    finally:
        cluster.destroy()
        shutil.rmtree(folder, ignore_errors=True)
    doc["meta"].update(
        nodes=args.nodes,
        ranks_per_node=args.ranks_per_node,
        link_rate=args.rate,
        peer_transport=args.peer_transport,
    )
    rows = [Row(**r) for r in doc["rows"]]
    table = (
        f"# {args.nodes} nodes x {args.ranks_per_node} ranks per node, link rate {args.rate}, "
        f"smddp data over {args.peer_transport}\n"
    ) + format_table(rows, config.plan.ops, config.backends)
    sys.stdout.write(table)
    # docs/benchmarks/multinode-{tcp,ucx}.{json,txt} when run with --out docs/benchmarks.
    out = OutFolder(config.out, "smddp-bench-multinode-")
    name = f"multinode-{args.peer_transport}"
    with open(out.path(f"{name}.json", config.json_path), "w") as f:
        json.dump(doc, f, indent=1)
    with open(out.path(f"{name}.txt"), "w") as f:
        f.write(table)
    out.announce()
    for error in doc["errors"]:
        print(f"error: {error['message']}", file=sys.stderr)
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
