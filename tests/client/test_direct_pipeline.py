"""Direct ops (large ones, through the peers' arenas) in many pipelined chunks, real daemon.

Three ranks as numpy clients in this process, with a small ``SMDDP_DIRECT_CHUNK_BYTES`` so
that every op runs in many chunks and the buffers are reused many times within one op and
across ops. Results must equal a rank-order reduction bit for bit on every rank; ops
started back to back without waiting (direct and region ops mixed) must keep their order.
"""

from __future__ import annotations

import secrets
import threading

import numpy as np
import pytest

from smddp.client import connect
from smddp.v1 import smddp_pb2 as pb

WORLD = 3
CHUNK = 24 << 10  # bytes per chunk: a 1 MB op is about 40 chunks
N = 300_007  # elements: more than a region buffer holds, not a multiple of anything


def _comms(d) -> list:
    job, token = f"direct-{secrets.token_hex(4)}", secrets.token_bytes(16)
    return [connect(job, token, r, WORLD, socket_path=d.socket) for r in range(WORLD)]


def _inputs(dtype: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return [rng.random(N) < 0.3 for _ in range(WORLD)]
    if dtype.startswith("int"):
        return [rng.integers(-1000, 1000, N).astype(dtype) for _ in range(WORLD)]
    return [(rng.standard_normal(N) * 100).astype(dtype) for _ in range(WORLD)]


def _rank_order(xs: list[np.ndarray], ufunc, avg: bool) -> np.ndarray:
    acc = ufunc(xs[0], xs[1])
    for x in xs[2:]:
        acc = ufunc(acc, x)
    if avg:
        acc = np.divide(acc, np.asarray(len(xs), dtype=acc.dtype)).astype(acc.dtype)
    return acc


def _run_all(comms: list, start) -> list:
    """Starts ``start(rank, comm)`` on every rank (in threads: direct ops may block the
    caller) and returns their results."""
    out: list = [None] * WORLD
    errors: list[BaseException] = []

    def one(r: int) -> None:
        try:
            out[r] = start(r, comms[r])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert not errors, errors
    return out


@pytest.mark.timeout(180)
def test_direct_ops_in_many_chunks_are_bitwise_rank_order(start_daemon, monkeypatch) -> None:
    monkeypatch.setenv("SMDDP_DIRECT_CHUNK_BYTES", str(CHUNK))
    d = start_daemon()
    comms = _comms(d)
    cases = [
        ("float32", pb.SUM, np.add, False),
        ("float32", pb.AVG, np.add, True),
        ("float16", pb.SUM, np.add, False),
        ("float64", pb.MIN, np.minimum, False),
        ("int64", pb.PRODUCT, np.multiply, False),
        ("bool", pb.SUM, np.logical_or, False),
    ]
    for i, (dtype, op, ufunc, avg) in enumerate(cases):
        xs = _inputs(dtype, i)
        want = _rank_order(xs, ufunc, avg)
        arrays = [x.copy() for x in xs]

        def start(r: int, c, arrays=arrays, op=op) -> None:
            c.all_reduce(arrays[r], op).wait()

        _run_all(comms, start)
        for r in range(WORLD):
            assert arrays[r].tobytes() == want.tobytes(), (dtype, op, r)

    # broadcast from a middle rank, and all_gather, in the same chunks.
    xs = _inputs("float32", 99)
    arrays = [x.copy() for x in xs]
    _run_all(comms, lambda r, c: c.broadcast(arrays[r], 1).wait())
    for r in range(WORLD):
        assert arrays[r].tobytes() == xs[1].tobytes(), r
    outs = [[np.empty(N, np.float32) for _ in range(WORLD)] for _ in range(WORLD)]
    _run_all(comms, lambda r, c: c.all_gather(outs[r], xs[r]).wait())
    for r in range(WORLD):
        for j in range(WORLD):
            assert outs[r][j].tobytes() == xs[j].tobytes(), (r, j)
    for c in comms:
        c.close()


@pytest.mark.timeout(180)
def test_ops_started_back_to_back_keep_their_order(start_daemon, monkeypatch) -> None:
    monkeypatch.setenv("SMDDP_DIRECT_CHUNK_BYTES", str(CHUNK))
    d = start_daemon()
    comms = _comms(d)
    rounds = 6
    big = [[np.full(N, r + k, np.float32) for k in range(rounds)] for r in range(WORLD)]
    small = [[np.full(7, (r + 1) * (k + 1), np.int32) for k in range(rounds)] for r in range(WORLD)]
    bcast = [[np.full(N // 2, r * 10 + k, np.float64) for k in range(rounds)] for r in range(WORLD)]

    def start(r: int, c) -> None:
        handles = []
        for k in range(rounds):  # nothing waited for until all are started
            handles.append(c.all_reduce(big[r][k]))
            handles.append(c.all_reduce(small[r][k], pb.MAX))
            handles.append(c.broadcast(bcast[r][k], k % WORLD))
        for h in handles[::-1]:  # waited for in reverse: completion must not depend on it
            h.wait()

    _run_all(comms, start)
    for r in range(WORLD):
        for k in range(rounds):
            assert (big[r][k] == sum(j + k for j in range(WORLD))).all(), (r, k)
            assert (small[r][k] == WORLD * (k + 1)).all(), (r, k)
            assert (bcast[r][k] == (k % WORLD) * 10 + k).all(), (r, k)
    for c in comms:
        c.close()
