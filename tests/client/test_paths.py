"""Every collective gives the same results on each of the client's paths.

The same ranks' script runs three times against a real daemon: with the region (small ops
in the control region, large ones direct), with ``SMDDP_REGION=0`` and no direct path
(everything through the daemon, cut into chunks), and with ``SMDDP_REGION=0`` and a low
direct threshold (small ops through the daemon, large all_reduce, broadcast and all_gather
direct). Sizes on both sides of a region buffer (1 MiB at these worlds) and of the daemon's
chunk.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from smddp.client import ClientConfig, connect
from smddp.v1 import smddp_pb2 as pb

WORLD = 3
SIZES = (1, 1000, 300_007)  # elements: 300_007 float32 is past a region buffer


def paths_worker(rank: int, world: int, socket_path: str, job: str, token: bytes) -> list[str]:
    """Runs each collective at each size and checks its result; returns what it ran."""
    config = ClientConfig.from_env()
    comm = connect(job, token, rank, world, socket_path=socket_path, config=config)
    ran = []
    for n in SIZES:
        base = np.arange(n, dtype=np.float32)
        x = base + rank
        comm.all_reduce(x).wait()
        np.testing.assert_array_equal(x, base * world + sum(range(world)))
        x = base * (rank + 1)
        comm.all_reduce(x, pb.MAX).wait()
        np.testing.assert_array_equal(x, base * world)
        x = base + rank
        comm.broadcast(x, 1).wait()
        np.testing.assert_array_equal(x, base + 1)
        x = base + rank
        comm.reduce(x, 2).wait()
        if rank == 2:
            np.testing.assert_array_equal(x, base * world + sum(range(world)))
        outs = [np.empty(n, dtype=np.float32) for _ in range(world)]
        comm.all_gather(outs, base + rank).wait()
        for r, out in enumerate(outs):
            np.testing.assert_array_equal(out, base + r)
        gathered = [np.empty(n, dtype=np.float32) for _ in range(world)] if rank == 0 else None
        comm.gather(gathered, base + rank, 0).wait()
        if gathered is not None:
            for r, out in enumerate(gathered):
                np.testing.assert_array_equal(out, base + r)
        out = np.empty(n, dtype=np.float32)
        comm.reduce_scatter(out, [base + 10 * d + rank for d in range(world)]).wait()
        np.testing.assert_array_equal(out, (base + 10 * rank) * world + sum(range(world)))
        parts = [base + 10 * d for d in range(world)] if rank == 1 else None
        comm.scatter(out, parts, 1).wait()
        np.testing.assert_array_equal(out, base + 10 * rank)
        got = [np.empty(n, dtype=np.float32) for _ in range(world)]
        comm.all_to_all(got, [base + 10 * rank + d for d in range(world)]).wait()
        for s, block in enumerate(got):
            np.testing.assert_array_equal(block, base + 10 * s + rank)
        if rank < 2:
            peer = 1 - rank
            box = np.empty(n, dtype=np.float32)
            sent = comm.send(base + rank, peer)
            comm.recv(box, peer).wait()
            sent.wait()
            np.testing.assert_array_equal(box, base + peer)
        comm.barrier().wait()
        ran.append(f"{n} ok")
    comm.close()
    return ran


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "env",
    [
        {},
        {"SMDDP_REGION": "0", "SMDDP_DIRECT_MIN_BYTES": str(1 << 40)},
        {"SMDDP_REGION": "0", "SMDDP_DIRECT_MIN_BYTES": "4096"},
    ],
    ids=["region-and-direct", "daemon", "daemon-and-direct"],
)
def test_every_collective_on_every_path(daemon, spawn_ranks, env: dict[str, str]) -> None:
    ranks = spawn_ranks(
        paths_worker, WORLD, WORLD, daemon.socket, f"paths-{secrets.token_hex(4)}",
        secrets.token_bytes(16), env=env, timeout_s=200,
    )  # fmt: skip
    assert ranks.join() == [[f"{n} ok" for n in SIZES]] * WORLD
