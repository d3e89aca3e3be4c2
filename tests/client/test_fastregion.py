"""The region path's C part (``core/_fastregion.c``) against its Python reference.

``client/shm.py`` keeps the protocol in Python and hands its hot methods to the C part when
it is built (CI builds it: a missing build fails here). These tests hold the two to the same
words in the region and the same bits in the results; tests/client/test_region.py runs the
protocol's failure paths through both.
"""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

from smddp.client.config import ClientConfig
from smddp.client.errors import DaemonLostError
from smddp.client.region_ops import numpy_rank_order, reduce_rank_order
from smddp.client.shm import ShmPath
from smddp.core import _fastregion, region
from smddp.core.region import (
    C_BYTES,
    C_DUR_BUCKET,
    C_OPS,
    DTYPES,
    G_ARRIVAL,
    K_BUCKET,
    K_COUNT,
    NBUCKETS,
    S_DONE,
    S_LAST,
    S_OPS,
    S_SEQ,
    S_STEP,
    SIG_WORD,
    SIG_WORDS,
)
from smddp.server.control_region import ControlRegion
from smddp.v1 import smddp_pb2 as pb

OPS = 60


def _gone() -> DaemonLostError:
    return DaemonLostError("smddpd at test is gone")


def _ranks(rgn: ControlRegion, native: bool, monkeypatch: pytest.MonkeyPatch) -> list[ShmPath]:
    monkeypatch.setenv("SMDDP_NATIVE", "1" if native else "0")
    ranks = [
        ShmPath(
            "job j comm 0",
            r,
            rgn.view.buf,
            60.0,
            lambda: True,
            _gone,
            native=ClientConfig.from_env().native,  # as connect builds it from SMDDP_NATIVE
        )
        for r in range(rgn.view.world)
    ]
    assert all((s.native is not None) == native for s in ranks)
    return ranks


def _run(ranks: list[ShmPath]) -> None:
    """OPS ops of several kinds, signatures and sizes on every rank, each in its thread."""

    def rank(shm: ShmPath) -> None:
        for k in range(1, OPS + 1):
            kind = (pb.ALL_REDUCE, pb.BROADCAST, pb.BARRIER)[k % 3]
            code, count = (3, k * 7) if kind != pb.BARRIER else (0, 0)
            parity = shm.next_parity()
            target = shm.publish(k, parity, kind, code, count, k % 2, pb.SUM)
            shm.wait(target, k)
            shm.agree(k, parity)
            shm.wait(shm.bump(), k)  # a second step, as a direct op's chunks take
            shm.done(k, parity, kind, code, count * 4)

    threads = [threading.Thread(target=rank, args=(s,)) for s in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a rank hung"


def _words(rgn: ControlRegion) -> dict[str, object]:
    """What the ops leave in the region, but for the clock's readings."""
    v = rgn.view
    out: dict[str, object] = {}
    for r in range(v.world):
        b = v.slot_base[r]
        out[f"rank {r} step/seq/done/ops"] = [
            int(v.words[b + w]) for w in (S_STEP, S_SEQ, S_DONE, S_OPS)
        ]
        for p in (0, 1):
            sig = list(v.signature_at(r, p))
            sig[G_ARRIVAL] = 0
            out[f"rank {r} signature {p}"] = sig
        table = v.op_table(r)
        out[f"rank {r} ops"] = table[:, [C_OPS, C_BYTES]].tolist()
        out[f"rank {r} duration counts"] = (
            table[:, C_DUR_BUCKET : C_DUR_BUCKET + NBUCKETS].sum(1).tolist()
        )
        skew = v.skew_table(r)
        out[f"rank {r} skew"] = [skew[:, K_COUNT].tolist(), skew[:, K_BUCKET:].sum(1).tolist()]
    out["last"] = int(sum(v.words[b + S_LAST] for b in v.slot_base))
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_the_c_part_leaves_the_same_words_as_the_python_reference(
    world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    words = {}
    for native in (True, False):
        rgn = ControlRegion(world, data_bytes=4096)
        _run(_ranks(rgn, native, monkeypatch))
        words[native] = _words(rgn)
        assert rgn.all_done() and rgn.pending() is None
    assert words[True] == words[False]
    assert words[True]["last"] == OPS  # one rank arrived last at each op
    row = pb.ALL_REDUCE * DTYPES + 3
    assert words[True]["rank 0 ops"][row] == [
        OPS // 3,
        sum(k * 7 * 4 for k in range(3, OPS + 1, 3)),
    ]


def _slot(rgn: ControlRegion, rank: int) -> _fastregion.Slot:
    v = rgn.view
    return _fastregion.Slot(
        v.buf,
        rank,
        v.world,
        v.slot_bytes,
        v.data_bytes,
        1000,
        tuple(getattr(region, name) for name in _fastregion.LAYOUT),
        (10, 100),
        pb.SUM,
        pb.AVG,
    )


CASES = [
    (np.float32, pb.SUM),
    (np.float32, pb.AVG),
    (np.float64, pb.SUM),
    (np.float64, pb.AVG),
    (np.int32, pb.SUM),
    (np.int64, pb.SUM),
]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype,op", CASES)
def test_its_reductions_are_numpy_s_to_the_bit(world: int, dtype: type, op: int) -> None:
    rgn = ControlRegion(world, data_bytes=4096)
    slots = [_slot(rgn, r) for r in range(world)]
    rng = np.random.default_rng(world * 10 + op)
    n = 4096 // np.dtype(dtype).itemsize
    if np.dtype(dtype).kind == "f":
        # Magnitudes far apart, so that the order of the additions shows in the bits.
        x = (rng.standard_normal((world, n)) * 10.0 ** rng.integers(-8, 8, (world, n))).astype(
            dtype
        )
    else:
        info = np.iinfo(dtype)
        x = rng.integers(info.min, info.max, (world, n), dtype=dtype, endpoint=True)  # wraps
    for r in range(world):
        assert slots[r].fill(1, x[r])
    want = np.empty(n, dtype)
    numpy_rank_order(
        want, [rgn.view.data(r, 1)[: want.nbytes].view(dtype) for r in range(world)], op
    )
    for r in range(world):
        got = np.empty(n, dtype)
        assert slots[r].reduce(1, got, op)
        assert got.tobytes() == want.tobytes()
    part = np.empty(5, dtype)  # the first elements only
    assert slots[0].reduce(1, part, op) and part.tobytes() == want[:5].tobytes()


@pytest.mark.parametrize(
    "dtype,op",
    [
        (np.float16, pb.SUM),
        (ml_dtypes.bfloat16, pb.SUM),
        (np.bool_, pb.SUM),
        (np.int8, pb.SUM),
        (np.float32, pb.MAX),
        (np.float32, pb.PRODUCT),
        (np.int64, pb.AVG),
    ],
)
def test_what_it_does_not_reduce_it_leaves_to_numpy_untouched(dtype: type, op: int) -> None:
    rgn = ControlRegion(2, data_bytes=4096)
    slot = _slot(rgn, 0)
    out = np.ones(8, dtype)
    assert slot.reduce(0, out, op) is False
    assert out.tobytes() == np.ones(8, dtype).tobytes()


def _far_apart(rng: np.random.Generator, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
    """Values whose sums show the order of the additions in their bits (floats of magnitudes
    far apart; integers over the whole range, which wrap)."""
    if np.dtype(dtype).kind == "f":
        scale = 10.0 ** rng.integers(-8, 8, shape)
        return (rng.standard_normal(shape) * scale).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


@pytest.mark.parametrize("world", [2, 3, 5, 8])
@pytest.mark.parametrize("dtype,op", CASES)
def test_reduce_into_is_numpy_s_to_the_bit_over_many_blocks(
    world: int, dtype: type, op: int
) -> None:
    # Not a multiple of the C part's block (2048 elements) nor of any vector's width.
    n = 3 * 2048 + 13
    x = _far_apart(np.random.default_rng(world * 100 + op), dtype, (world, n))
    ins = [x[r] for r in range(world)]
    want = np.empty(n, dtype)
    numpy_rank_order(want, ins, op)
    got = np.full(n, 7, dtype)
    assert _fastregion.reduce_into(got, ins, op == pb.AVG) is True
    assert got.tobytes() == want.tobytes()
    again = np.empty(n, dtype)
    reduce_rank_order(again, ins, op)  # what the direct path calls: the C part, here
    assert again.tobytes() == want.tobytes()


def test_reduce_into_leaves_to_numpy_what_it_cannot_take_and_touches_nothing() -> None:
    a, b = np.arange(64, dtype=np.float32), np.ones(64, np.float32)
    out = np.zeros(64, np.float32)
    declined = [
        (out, [a]),  # one input
        (out, [a] * 257),  # more inputs than it takes
        (a, [a, b]),  # out is an input
        (a[8:40], [a[:32], b[:32]]),  # out overlaps an input
        (out, [a, b[:63]]),  # lengths differ
        (out, [a, b.astype(np.float64)]),  # formats differ
        (out, [a[::2], b[::2]]),  # not contiguous
        (out.astype(np.float16), [a.astype(np.float16), b.astype(np.float16)]),  # dtype
        (out.astype(ml_dtypes.bfloat16), [a.astype(ml_dtypes.bfloat16)] * 2),  # no buffer
        (np.zeros(64, np.int64), [a.astype(np.int64), b.astype(np.int64)], True),  # int AVG
    ]
    for case in declined:
        dst, ins, *average = case
        before = dst.tobytes()
        assert _fastregion.reduce_into(dst, ins, bool(average)) is False
        assert dst.tobytes() == before
    readonly = np.zeros(64, np.float32)
    readonly.flags.writeable = False
    assert _fastregion.reduce_into(readonly, [a, b], False) is False
    with pytest.raises(TypeError):
        _fastregion.reduce_into(out, 5, False)
    # Declining raised nothing that lingers: the next call reduces.
    assert _fastregion.reduce_into(out, [a, b], False) and (out == a + 1).all()


def test_fill_copies_any_buffer_s_bytes_and_declines_what_has_none() -> None:
    rgn = ControlRegion(2, data_bytes=4096)
    slot = _slot(rgn, 1)
    half = np.arange(16, dtype=np.float16)
    assert slot.fill(0, half)
    assert rgn.view.data(1, 0)[: half.nbytes].tobytes() == half.tobytes()
    assert rgn.view.data(0, 0)[: half.nbytes].tobytes() == bytes(half.nbytes)  # not rank 0's
    brain = np.arange(4, dtype=ml_dtypes.bfloat16)  # its bytes, without a format
    assert slot.fill(1, brain)
    assert rgn.view.data(1, 1)[: brain.nbytes].tobytes() == brain.tobytes()
    assert slot.fill(1, object()) is False  # no buffer at all: numpy's turn
    with pytest.raises(ValueError, match="exceed the buffer"):
        slot.fill(0, np.zeros(4097, np.uint8))
    assert slot.reduce(0, np.zeros(2048, np.float32), pb.SUM) is False  # larger than a buffer


def test_its_layout_is_region_py_s() -> None:
    assert all(isinstance(getattr(region, name), int) for name in _fastregion.LAYOUT)
    rgn = ControlRegion(2, data_bytes=4096)
    v = rgn.view
    with pytest.raises(ValueError, match="layout has 3 values"):
        _fastregion.Slot(v.buf, 0, 2, v.slot_bytes, v.data_bytes, 0, (1, 2, 3), (), 0, 1)
    with pytest.raises(ValueError, match="bad rank"):
        _slot(rgn, 2)  # of a world of 2
    slot = _slot(rgn, 0)
    assert slot.step == 0 and slot.bump() == 1 and slot.step == 1
    assert int(v.words[v.slot_base[0] + S_STEP]) == 1
    # publish writes the signature words the daemon and the Python side read
    assert slot.publish(7, 1, pb.ALL_REDUCE, 3, 99, 1, pb.MAX) == 2
    sig = v.signature_at(0, 1)
    assert sig[:6] == (7, pb.ALL_REDUCE, 3, 99, 1, pb.MAX)
    assert sig[SIG_WORDS - 1] == region.packed_signature(pb.ALL_REDUCE, 3, 99, 1, pb.MAX)
    assert v.words[v.slot_base[0] + SIG_WORD + SIG_WORDS + G_ARRIVAL] > 0
    assert slot.spin(3) == 0  # rank 1 never arrives: the spin gives up
    v.header[region.H_ALARM] = 1
    assert slot.spin(3) == -1  # the alarm ends it at once


def test_it_holds_its_region_and_refuses_what_would_reach_past_it() -> None:
    """The Slot holds the region's buffer (the mapping cannot be closed under it) and checks
    at construction that every word and buffer its methods touch lies inside the region: a
    wrong layout, world or size is a ValueError, never a write past the mapping."""
    import mmap

    rgn = ControlRegion(2, data_bytes=4096)
    v = rgn.view
    layout = tuple(getattr(region, name) for name in _fastregion.LAYOUT)

    def slot_of(buf: object, world: int = 2, slot_bytes: int = v.slot_bytes, **changed: int):
        values = tuple(changed.get(n, x) for n, x in zip(_fastregion.LAYOUT, layout))
        return _fastregion.Slot(buf, 0, world, slot_bytes, v.data_bytes, 0, values, (10,), 0, 1)

    with pytest.raises(ValueError, match="holds no header of 8192 and 3 slots"):
        slot_of(v.buf, world=3)  # a region made for two
    with pytest.raises(ValueError, match="holds no header"):
        slot_of(v.buf[: len(v.buf) // 2])
    for name, value in [
        ("H_ALARM", 1 << 20),
        ("S_STEP", v.slot_bytes // 8),
        ("G_PACKED", 8),
        ("SIG_WORD", v.slot_bytes // 8),
        ("DATA_OFFSET", v.slot_bytes - 4096),
        ("OP_TABLE_OFFSET", -8),
        ("KINDS", 1 << 30),
        ("C_DUR_BUCKET", 23),
    ]:
        with pytest.raises(ValueError, match="layout does not fit"):
            slot_of(v.buf, **{name: value})
    with pytest.raises(BufferError, match="not writable"):
        slot_of(v.buf.tobytes())  # read-only
    with pytest.raises(RuntimeError, match="not initialised"):
        _fastregion.Slot.__new__(_fastregion.Slot).bump()

    mm = mmap.mmap(-1, len(v.buf))
    mm[:] = v.buf.tobytes()
    slot = slot_of(mm)
    with pytest.raises(BufferError):
        mm.close()  # the Slot's hold on it keeps the mapping
    assert slot.bump() == 1
    del slot
    mm.close()
