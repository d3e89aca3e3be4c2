"""Collectives between plain numpy processes through a running smddpd (no torch needed).

Each process is one rank. All ranks of a job give the same job id and job token (a random
secret of at least 16 bytes) and find the daemon through ``--socket`` or ``SMDDP_SOCKET``.

Run (with smddpd serving on /run/smddp/smddpd.sock, or SMDDP_SOCKET pointing at it)::

    TOKEN=$(.venv/bin/python -c 'import secrets; print(secrets.token_hex(16))')
    for r in 0 1; do
        .venv/bin/python examples/numpy_allreduce.py --rank $r --world-size 2 --job-token $TOKEN &
    done
    wait

Across nodes, every node runs smddpd with peers enabled, and every rank names the same root,
the peer address of one of the daemons (``smddpctl topology`` shows it): the daemons meet the
ranks there and work out which ranks share a node::

    .venv/bin/python examples/numpy_allreduce.py --rank $R --world-size 4 --job-token $TOKEN \\
        --root 10.0.0.1:7470

Every rank checks its results and exits with status 1 if one is wrong.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from smddp.client import ReduceOp, connect, rendezvous


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The example's command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True, help="this process's rank")
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks")
    parser.add_argument(
        "--job-id", default="numpy-demo", help="the job's name, the same on every rank"
    )
    parser.add_argument(
        "--job-token",
        default=os.environ.get("SMDDP_JOB_TOKEN"),
        help="the job's secret as hex, the same on every rank (env SMDDP_JOB_TOKEN)",
    )
    parser.add_argument(
        "--socket",
        default=None,
        help="smddpd's socket (default: SMDDP_SOCKET or the standard path)",
    )
    parser.add_argument(
        "--size", type=int, default=1 << 20, help="elements per array (default 1Mi)"
    )
    parser.add_argument(
        "--root",
        default=None,
        help="for a job across nodes: HOST:PORT of the daemon that hosts the rendezvous, the "
        "same on every rank",
    )
    args = parser.parse_args(argv)
    if not args.job_token:
        parser.error("--job-token (or SMDDP_JOB_TOKEN) is required")
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs all_reduce, broadcast, all_gather and a barrier, checking every result."""
    args = parse_args(argv)
    rank, world = args.rank, args.world_size
    token = bytes.fromhex(args.job_token)
    nodes = []
    if args.root is not None:
        nodes = rendezvous(args.job_id, token, rank, world, root=args.root, socket_path=args.socket)
        print(f"rank {rank}: the job spans {max(len(nodes), 1)} node(s)", flush=True)
    comm = connect(args.job_id, token, rank, world, socket_path=args.socket, nodes=nodes)
    try:
        # all_reduce: every rank contributes (rank + 1) * [0, 1, 2, ...]; the sum is known.
        x = np.arange(args.size, dtype=np.float32) * (rank + 1)
        comm.all_reduce(x, ReduceOp.SUM).wait()
        expected = np.arange(args.size, dtype=np.float32) * (world * (world + 1) // 2)
        np.testing.assert_array_equal(x, expected)
        print(f"rank {rank}: all_reduce(SUM) of {args.size} x float32 ok", flush=True)

        # broadcast: rank 0's array reaches everyone.
        y = np.full(1000, rank, dtype=np.int64)
        comm.broadcast(y, root=0).wait()
        np.testing.assert_array_equal(y, np.zeros(1000, dtype=np.int64))
        print(f"rank {rank}: broadcast ok", flush=True)

        # all_gather: each rank's small array lands in slot r on every rank; ops may overlap.
        outs = [np.empty(4, dtype=np.float64) for _ in range(world)]
        gathered = comm.all_gather(outs, np.full(4, rank, dtype=np.float64))
        barrier = comm.barrier()
        gathered.wait()
        barrier.wait()
        for r, out in enumerate(outs):
            np.testing.assert_array_equal(out, np.full(4, r, dtype=np.float64))
        print(f"rank {rank}: all_gather and barrier ok", flush=True)
    finally:
        comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
