"""The daemon's GPU ops (server/gpu.py) on a fake CUDA runtime: bytes, order, caches, errors.

The fake runtime (``gpu_fakes``) keeps "GPU memory" in host buffers and runs kernels and
copies at once, logging every call. So these tests check, without a GPU: every collective's
result against the host path; that each stream waits on every rank's ready event before any
work and records the done events after all of it (across GPUs too); that handles and events
are opened once and released only after the work queued before has finished; and the errors.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from gpu_fakes import (
    Allocation,
    Buffer,
    FakeComm,
    FakeRuntime,
    FakeSession,
    QueuedFakeRuntime,
    request,
    uuid,
)

from smddp.core.reduce import reduce_into
from smddp.core.wire import dtype_name, numpy_dtype
from smddp.server import gpu
from smddp.server.errors import FailedPrecondition, InvalidRequest
from smddp.server.gpu_supply import DaemonGpu
from smddp.v1 import smddp_pb2 as pb


def fill(buf: Buffer, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(buf.dtype)
    if dt == np.bool_:
        values = rng.integers(0, 2, buf.count).astype(np.bool_)
    elif dt.kind in "iu":
        values = rng.integers(
            np.iinfo(dt).min, np.iinfo(dt).max, buf.count, endpoint=True, dtype=dt
        )
    else:
        values = (rng.standard_normal(buf.count) * 100).astype(np.float32).astype(dt)
    buf.array()[...] = values
    return values.copy()


def host_reduce(inputs: list[np.ndarray], op: int) -> np.ndarray:
    out = np.empty_like(inputs[0])
    reduce_into([out], inputs, op)
    return out


def bits(x: np.ndarray) -> bytes:
    return x.tobytes()


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


class World:
    """W fake ranks on given devices, with a GpuOps over one FakeRuntime."""

    def __init__(self, devices: list[int], rt: FakeRuntime | None = None) -> None:
        self.rt = rt or FakeRuntime(devices={uuid(d): d for d in set(devices)})
        self.ops = gpu.GpuOps(self.rt)
        self.devices = devices
        self.sessions = [FakeSession(r) for r in range(len(devices))]
        self.comm = FakeComm()

    def run(self, reqs: list[pb.OpRequest]) -> None:
        self.ops.execute(self.comm, list(range(len(reqs))), self.sessions, reqs)

    def buffer(
        self, rank: int, count: int, dtype: int, alloc_bytes: int | None = None, offset: int = 0
    ) -> Buffer:
        nbytes = count * numpy_dtype(dtype).itemsize
        alloc = self.rt.allocate(alloc_bytes or nbytes + offset, self.devices[rank])
        return Buffer(alloc, offset, count, dtype)


# -- results ----------------------------------------------------------------------------------

DTYPES = [pb.FLOAT32, pb.BFLOAT16, pb.FLOAT16, pb.INT8, pb.INT64, pb.BOOL]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_reduce_in_place_matches_host_path(dtype: int, world: int) -> None:
    w = World([0] * world)
    n = 1000 + 13  # not a whole number of vectors: scalar tail after the vector body
    op = pb.MAX if dtype == pb.BOOL else pb.SUM
    bufs = [w.buffer(r, n, dtype, offset=64 * r) for r in range(world)]
    inputs = [fill(b, seed=r) for r, b in enumerate(bufs)]
    w.run([request(pb.ALL_REDUCE, dtype, n, r, [b], [b], reduce_op=op) for r, b in enumerate(bufs)])
    want = host_reduce(inputs, op)
    for b in bufs:
        assert bits(b.array()) == bits(want)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("world", [2, 4])
def test_every_collective_matches_host_path(dtype: int, world: int) -> None:
    n = 77
    op = pb.BXOR if numpy_dtype(dtype).kind in "biu" else pb.PRODUCT
    root = world - 1

    # broadcast
    w = World([0] * world)
    bufs = [w.buffer(r, n, dtype) for r in range(world)]
    vals = [fill(b, r) for r, b in enumerate(bufs)]
    w.run([request(pb.BROADCAST, dtype, n, r, [b], [b], root=root) for r, b in enumerate(bufs)])
    assert all(bits(b.array()) == bits(vals[root]) for b in bufs)

    # reduce: only the root's tensor changes
    w = World([0] * world)
    bufs = [w.buffer(r, n, dtype) for r in range(world)]
    vals = [fill(b, r) for r, b in enumerate(bufs)]
    w.run(
        [
            request(pb.REDUCE, dtype, n, r, [b], [b], root=root, reduce_op=op)
            for r, b in enumerate(bufs)
        ]
    )
    assert bits(bufs[root].array()) == bits(host_reduce(vals, op))
    assert all(bits(bufs[r].array()) == bits(vals[r]) for r in range(world) if r != root)

    # all_gather into separate tensors of one allocation (offsets)
    w = World([0] * world)
    srcs = [w.buffer(r, n, dtype) for r in range(world)]
    vals = [fill(b, r) for r, b in enumerate(srcs)]
    outs = []
    for _ in range(world):
        size = numpy_dtype(dtype).itemsize * n
        alloc = w.rt.allocate(world * size + 100, 0)
        outs.append([Buffer(alloc, 100 + s * size, n, dtype) for s in range(world)])
    w.run([request(pb.ALL_GATHER, dtype, n, r, [srcs[r]], outs[r]) for r in range(world)])
    for r in range(world):
        for s in range(world):
            assert bits(outs[r][s].array()) == bits(vals[s])

    # gather: outputs on the root only
    w = World([0] * world)
    srcs = [w.buffer(r, n, dtype) for r in range(world)]
    vals = [fill(b, r) for r, b in enumerate(srcs)]
    gouts = [w.buffer(root, n, dtype) for _ in range(world)]
    w.run(
        [
            request(pb.GATHER, dtype, n, r, [srcs[r]], gouts if r == root else [], root=root)
            for r in range(world)
        ]
    )
    assert all(bits(gouts[s].array()) == bits(vals[s]) for s in range(world))

    # reduce_scatter: rank d gets the reduction of every rank's block d
    w = World([0] * world)
    ins = [[w.buffer(r, n, dtype) for _ in range(world)] for r in range(world)]
    vals2 = [[fill(b, 10 * r + d) for d, b in enumerate(ins[r])] for r in range(world)]
    outs1 = [w.buffer(r, n, dtype) for r in range(world)]
    w.run(
        [
            request(pb.REDUCE_SCATTER, dtype, n, r, ins[r], [outs1[r]], reduce_op=op)
            for r in range(world)
        ]
    )
    for d in range(world):
        assert bits(outs1[d].array()) == bits(host_reduce([vals2[r][d] for r in range(world)], op))

    # scatter: the root's block d to rank d
    w = World([0] * world)
    blocks = [w.buffer(root, n, dtype) for _ in range(world)]
    bvals = [fill(b, 50 + d) for d, b in enumerate(blocks)]
    outs1 = [w.buffer(r, n, dtype) for r in range(world)]
    w.run(
        [
            request(pb.SCATTER, dtype, n, r, blocks if r == root else [], [outs1[r]], root=root)
            for r in range(world)
        ]
    )
    assert all(bits(outs1[d].array()) == bits(bvals[d]) for d in range(world))

    # all_to_all with uneven blocks: rank s sends s + d + 1 elements to rank d
    w = World([0] * world)
    sends = [[w.buffer(s, s + d + 1, dtype) for d in range(world)] for s in range(world)]
    svals = [[fill(b, 100 * s + d) for d, b in enumerate(sends[s])] for s in range(world)]
    recvs = [[w.buffer(d, s + d + 1, dtype) for s in range(world)] for d in range(world)]
    w.run(
        [
            request(pb.ALL_TO_ALL, dtype, sum(b.count for b in sends[r]), r, sends[r], recvs[r])
            for r in range(world)
        ]
    )
    for d in range(world):
        for s in range(world):
            assert bits(recvs[d][s].array()) == bits(svals[s][d])


def test_send_recv_copies_on_the_receivers_stream() -> None:
    w = World([0, 0])
    src, dst = w.buffer(0, 100, pb.FLOAT32), w.buffer(1, 100, pb.FLOAT32)
    vals = fill(src, 1)
    send = request(pb.SEND, pb.FLOAT32, 100, 0, [src], [], root=1)
    recv = request(pb.RECV, pb.FLOAT32, 100, 1, [], [dst], root=0)
    w.ops.execute_p2p(w.comm, (w.sessions[0], send), (w.sessions[1], recv))
    assert bits(dst.array()) == bits(vals)
    (work,) = work_streams(w.rt)
    (gate,) = gate_streams(w.rt)
    assert stream_log(w.rt, gate)[:2] == ["wait ready0", "wait ready1"]
    assert stream_log(w.rt, work) == ["wait flag 1", "copy", "record done0", "record done1"]


def test_empty_op_still_orders_done_after_ready() -> None:
    w = World([0, 0])
    bufs = [Buffer(w.rt.allocate(16), 0, 0, pb.FLOAT32) for _ in range(2)]
    w.run(
        [
            request(pb.ALL_REDUCE, pb.FLOAT32, 0, r, [b], [b], reduce_op=pb.SUM)
            for r, b in enumerate(bufs)
        ]
    )
    (work,) = work_streams(w.rt)
    (gate,) = gate_streams(w.rt)
    assert stream_log(w.rt, gate)[:2] == ["wait ready0", "wait ready1"]
    assert stream_log(w.rt, work) == ["wait flag 1", "record done0", "record done1"]
    assert not w.rt.calls("open_memory")  # nothing to map for empty ranges


# -- ordering ---------------------------------------------------------------------------------


def stream_log(rt: FakeRuntime, stream: object) -> list[str]:
    """The calls queued on one stream, as 'wait X', 'record X', 'reduce', 'copy'."""
    out = []
    for c in rt.log:
        if c[0] == "wait" and c[1] == stream:
            out.append(f"wait {c[2]!r}")
        elif c[0] == "record" and c[2] == stream:
            out.append(f"record {c[1]!r}")
        elif c[0] in ("reduce", "copy") and c[1] == stream:
            out.append(c[0])
        elif c[0] == "wait_flag" and c[1] == stream:
            out.append(f"wait flag {c[3]}")
    return out


def work_streams(rt: FakeRuntime) -> list[object]:
    """The communicators' work streams (they wait on the daemon's flag), in order of use."""
    return list(dict.fromkeys(c[1] for c in rt.calls("wait_flag")))


def gate_streams(rt: FakeRuntime) -> list[object]:
    """The gate streams: the only ones that wait on the ranks' ready events."""
    return list(dict.fromkeys(c[1] for c in rt.calls("wait") if repr(c[2]).startswith("ready")))


def test_one_gpu_waits_for_every_rank_then_works_then_records() -> None:
    w = World([0, 0, 0])
    n = 1 << 16
    bufs = [w.buffer(r, n, pb.FLOAT16) for r in range(3)]
    for r, b in enumerate(bufs):
        fill(b, r)
    w.run(
        [
            request(pb.ALL_REDUCE, pb.FLOAT16, n, r, [b], [b], reduce_op=pb.SUM)
            for r, b in enumerate(bufs)
        ]
    )
    (stream,) = work_streams(w.rt)
    (gate,) = gate_streams(w.rt)
    mark = stream_log(w.rt, gate)[-1]
    assert stream_log(w.rt, gate) == ["wait ready0", "wait ready1", "wait ready2", mark]
    assert mark.startswith("record local")
    calls = stream_log(w.rt, stream)
    assert calls[0] == "wait flag 1"  # raised once the gate passed every ready event
    assert calls[1:-3] and set(calls[1:-3]) == {"reduce"}
    assert calls[-3:] == ["record done0", "record done1", "record done2"]
    assert not [c for c in calls if c.startswith("wait ready")]  # never on a rank's event
    wait_until(lambda: ("set_flag", w.rt.calls("new_flag")[0][1], 1) in w.rt.log)
    # One pass over the data: a single vectorised launch reading 3 inputs, writing 3 outputs.
    (launch,) = w.rt.calls("reduce")
    assert launch[4:6] == (3, 3) and launch[6].vectorized and launch[6].count == n
    assert not w.rt.calls("enable_peer")


def test_later_ops_queue_behind_earlier_ones_on_the_same_stream() -> None:
    w = World([0, 0])
    bufs = [w.buffer(r, 64, pb.FLOAT32) for r in range(2)]
    for seq in (1, 2):
        w.run(
            [
                request(pb.ALL_REDUCE, pb.FLOAT32, 64, r, [b], [b], reduce_op=pb.SUM, seq=seq)
                for r, b in enumerate(bufs)
            ]
        )
    # One work stream and one gate stream per communicator and GPU.
    assert len(w.rt.calls("new_stream")) == 2
    (stream,) = work_streams(w.rt)
    calls = stream_log(w.rt, stream)
    first_done = calls.index("record done1")
    assert calls.index("wait flag 2") > first_done  # op 2's work is queued after op 1's


def test_two_gpus_split_the_work_and_join_before_done() -> None:
    w = World([0, 0, 1, 1])
    n = 4096
    bufs = [w.buffer(r, n, pb.FLOAT32) for r in range(4)]
    vals = [fill(b, r) for r, b in enumerate(bufs)]
    w.run(
        [
            request(
                pb.ALL_REDUCE, pb.FLOAT32, n, r, [b], [b], device=w.devices[r], reduce_op=pb.SUM
            )
            for r, b in enumerate(bufs)
        ]
    )
    want = host_reduce(vals, pb.SUM)
    assert all(bits(b.array()) == bits(want) for b in bufs)
    streams = {s.device: s for s in work_streams(w.rt)}
    assert set(streams) == {0, 1}
    for gate in gate_streams(w.rt):  # each GPU's gate waits for all four ranks
        assert stream_log(w.rt, gate)[:4] == [f"wait ready{r}" for r in range(4)]
    assert {("enable_peer", 0, 1), ("enable_peer", 1, 0)} <= set(w.rt.calls("enable_peer"))
    # Each GPU reduces one segment, reading all four ranks.
    segments = [(c[1].device, c[6].start, c[6].count) for c in w.rt.calls("reduce")]
    assert {d for d, _, _ in segments} == {0, 1}
    assert sum(count for _, _, count in segments) == n
    for device, stream in streams.items():
        calls = stream_log(w.rt, stream)
        assert calls[0] == "wait flag 1"
        other_join = [c for c in calls if c.startswith("wait local")]
        assert len(other_join) == 1  # waits for the other GPU's work before its done events
        assert calls.index(other_join[0]) > max(i for i, c in enumerate(calls) if c == "reduce")
        dones = [c for c in calls if c.startswith("record done")]
        assert dones == [f"record done{r}" for r in range(4) if w.devices[r] == device]
        assert calls.index(dones[0]) > calls.index(other_join[0])


def test_missing_peer_access_is_a_clear_error() -> None:
    rt = FakeRuntime(devices={uuid(0): 0, uuid(1): 1}, no_peer={(0, 1), (1, 0)})
    w = World([0, 1], rt)
    bufs = [w.buffer(r, 64, pb.FLOAT32) for r in range(2)]
    with pytest.raises(
        FailedPrecondition, match="GPU 0 cannot access the memory of GPU 1.*peer access"
    ):
        w.run(
            [
                request(pb.ALL_REDUCE, pb.FLOAT32, 64, r, [b], [b], device=r, reduce_op=pb.SUM)
                for r, b in enumerate(bufs)
            ]
        )


# -- caches and release -------------------------------------------------------------------------


def test_handles_and_events_are_opened_once() -> None:
    w = World([0, 0])
    bufs = [w.buffer(r, 256, pb.FLOAT32, alloc_bytes=4096) for r in range(2)]
    # Two tensors in the same allocation of rank 0, then the first again.
    other = Buffer(bufs[0].alloc, 2048, 256, pb.FLOAT32)
    for seq, mine in ((1, bufs[0]), (2, other), (3, bufs[0])):
        w.run(
            [
                request(
                    pb.ALL_REDUCE, pb.FLOAT32, 256, 0, [mine], [mine], reduce_op=pb.SUM, seq=seq
                ),
                request(
                    pb.ALL_REDUCE,
                    pb.FLOAT32,
                    256,
                    1,
                    [bufs[1]],
                    [bufs[1]],
                    reduce_op=pb.SUM,
                    seq=seq,
                ),
            ]
        )
    assert len(w.rt.calls("open_memory")) == 2  # one per rank's allocation
    assert all(count == 1 for count in w.rt.opened_events.values())
    assert len(w.rt.opened_events) == 4  # ready and done of each rank


def test_a_new_allocation_at_an_old_address_replaces_the_mapping_after_queued_work() -> None:
    w = World([0, 0])
    bufs = [w.buffer(r, 64, pb.FLOAT32) for r in range(2)]
    w.run(
        [
            request(pb.ALL_REDUCE, pb.FLOAT32, 64, r, [b], [b], reduce_op=pb.SUM)
            for r, b in enumerate(bufs)
        ]
    )
    old_address = w.rt.calls("open_memory")[0][3]
    # Rank 0 freed its allocation; the driver gave the same address to a new one.
    fresh = w.rt.allocate(256)
    fresh.base = bufs[0].alloc.base
    replaced = Buffer(fresh, 0, 64, pb.FLOAT32)
    vals = [fill(replaced, 7), fill(bufs[1], 8)]
    w.rt.pending_marks = True  # the old mapping's queued work has not finished
    w.run(
        [
            request(
                pb.ALL_REDUCE, pb.FLOAT32, 64, 0, [replaced], [replaced], reduce_op=pb.SUM, seq=2
            ),
            request(
                pb.ALL_REDUCE, pb.FLOAT32, 64, 1, [bufs[1]], [bufs[1]], reduce_op=pb.SUM, seq=2
            ),
        ]
    )
    assert bits(replaced.array()) == bits(host_reduce(vals, pb.SUM))
    assert len(w.rt.calls("open_memory")) == 3
    assert not w.rt.calls("close_memory")  # not while work queued before may still use it
    w.rt.pending_marks = False
    w.ops.collect()
    assert [c[1] for c in w.rt.calls("close_memory")] == [old_address]


def _all_reduce_pair(w: World, bufs: list[Buffer], seq: int, freed=()) -> None:
    reqs = [
        request(pb.ALL_REDUCE, pb.FLOAT32, 64, r, [b], [b], reduce_op=pb.SUM, seq=seq)
        for r, b in enumerate(bufs)
    ]
    reqs[0].cuda.freed.extend(freed)
    w.run(reqs)


def test_a_freed_allocation_is_closed_when_the_ranks_next_op_runs() -> None:
    """Rank 0 frees its allocation (empty_cache()) and says so with its next op, which uses
    other memory: the daemon closes the old mapping then, once its queued work has passed
    it, not only when a new allocation appears at that address or the rank leaves."""
    w = World([0, 0])
    bufs = [w.buffer(r, 64, pb.FLOAT32) for r in range(2)]
    _all_reduce_pair(w, bufs, 1)
    old = bufs[0].alloc
    old_address = [c[3] for c in w.rt.calls("open_memory") if c[1] == old.handle]
    other = w.buffer(0, 64, pb.FLOAT32)
    freed = pb.CudaBuffer(alloc_base=old.base, buffer_id=old.buffer_id)
    # Work queued before the free has not finished: the mapping stays open for it.
    w.rt.pending_marks = True
    _all_reduce_pair(w, [other, bufs[1]], 2, [freed])
    assert not w.rt.calls("close_memory")
    w.rt.pending_marks = False
    vals = [fill(other, 3), fill(bufs[1], 4)]
    _all_reduce_pair(w, [other, bufs[1]], 3)  # the next op finds the marks passed
    assert [c[1] for c in w.rt.calls("close_memory")] == old_address
    assert bits(other.array()) == bits(host_reduce(vals, pb.SUM))
    # With idle streams the mapping closes during the op that reports the free.
    third = w.buffer(0, 64, pb.FLOAT32)
    _all_reduce_pair(w, [third, bufs[1]], 4)
    _all_reduce_pair(
        w,
        [w.buffer(0, 64, pb.FLOAT32), bufs[1]],
        5,
        [pb.CudaBuffer(alloc_base=third.alloc.base, buffer_id=third.alloc.buffer_id)],
    )
    third_address = [c[3] for c in w.rt.calls("open_memory") if c[1] == third.alloc.handle]
    assert [c[1] for c in w.rt.calls("close_memory")] == old_address + third_address


def test_close_before_free_unmaps_the_process_s_segment_before_answering() -> None:
    """A rank's free channel (server/gpu_free.py) names a segment about to be freed: every
    mapping of it in that process's sessions is closed before close_before_free returns,
    once the daemon's streams passed it; another process's mappings stay; the next op maps
    the memory afresh; work still queued past the bound defers the close until it is done."""
    w = World([0, 0])
    for r, s in enumerate(w.sessions):
        s.peer_pid = 4000 + r  # type: ignore[attr-defined]
    bufs = [w.buffer(r, 64, pb.FLOAT32) for r in range(2)]
    _all_reduce_pair(w, bufs, 1)
    mine, theirs = bufs[0].alloc, bufs[1].alloc
    opened = {c[1]: c[3] for c in w.rt.calls("open_memory")}
    assert w.ops.close_before_free(4000, mine.base, 1.0) == (1, 0)
    assert [c[1] for c in w.rt.calls("close_memory")] == [opened[mine.handle]]
    # Another process's segment at the same base is not this process's to close.
    assert w.ops.close_before_free(4000, theirs.base, 1.0) == (0, 0)
    vals = [fill(b, 5 + r) for r, b in enumerate(bufs)]
    _all_reduce_pair(w, bufs, 2)
    assert [c[1] for c in w.rt.calls("open_memory")].count(mine.handle) == 2
    assert bits(bufs[0].array()) == bits(host_reduce(vals, pb.SUM))
    # The daemon's work on it is still queued: not closed within the bound, closed later.
    w.rt.pending_marks = True
    start = time.monotonic()
    assert w.ops.close_before_free(4000, mine.base, 0.2) == (0, 1)
    assert time.monotonic() - start >= 0.2
    assert len(w.rt.calls("close_memory")) == 1
    w.rt.pending_marks = False
    wait_until(lambda: len(w.rt.calls("close_memory")) == 2)  # no op, no collect() called


def test_a_segment_freed_while_its_work_waits_is_unmapped_once_the_work_ran() -> None:
    """What the free's bound leaves: rank 0 frees a segment while smddpd's stream is still
    behind rank 1's ready event, so the free goes ahead unconfirmed (deferred). smddpd
    unmaps the segment as soon as the work on it has run, with no further op or call: the
    driver returns the memory only once smddpd's mapping is closed too."""
    rt = QueuedFakeRuntime(never={"ready1"})
    w = World([0, 0], rt)
    for r, s in enumerate(w.sessions):
        s.peer_pid = 4000 + r  # type: ignore[attr-defined]
    bufs = [w.buffer(r, 64, pb.FLOAT32) for r in range(2)]
    vals = [fill(b, r) for r, b in enumerate(bufs)]
    w.run(
        [
            request(pb.ALL_REDUCE, pb.FLOAT32, 64, r, [b], [b], reduce_op=pb.SUM)
            for r, b in enumerate(bufs)
        ]
    )
    mine = bufs[0].alloc
    (address,) = [c[3] for c in rt.calls("open_memory") if c[1] == mine.handle]
    assert w.ops.close_before_free(4000, mine.base, 0.1) == (0, 1)
    time.sleep(0.05)
    assert not rt.calls("reduce") and not rt.calls("close_memory")  # the work still waits
    rt.never.clear()  # rank 1's stream reaches its ready event
    wait_until(lambda: rt.calls("close_memory"))
    assert [c[1] for c in rt.calls("close_memory")] == [address]
    names = [c[0] for c in rt.log]
    assert names.index("reduce") < names.index("close_memory")  # unmapped after its work
    assert all(bits(b.array()) == bits(host_reduce(vals, pb.SUM)) for b in bufs)


def test_a_new_allocation_at_a_freed_base_gets_a_fresh_mapping() -> None:
    """The free and the new allocation at the same base arrive with one op: the old mapping
    closes, the new one (another buffer id, even under the same handle bytes) is opened."""
    w = World([0, 0])
    bufs = [w.buffer(r, 64, pb.FLOAT32) for r in range(2)]
    _all_reduce_pair(w, bufs, 1)
    old = bufs[0].alloc
    (old_address,) = [c[3] for c in w.rt.calls("open_memory") if c[1] == old.handle]
    # The driver gives the address to a new allocation; its handle repeats the old bytes
    # (the daemon must not trust handles alone) but its buffer id is new.
    fresh = Allocation(np.zeros(256, dtype=np.uint8), 0, old.base, old.handle, 1000)
    w.rt.allocations[old.handle] = fresh
    replaced = Buffer(fresh, 0, 64, pb.FLOAT32)
    vals = [fill(replaced, 5), fill(bufs[1], 6)]
    freed = pb.CudaBuffer(alloc_base=old.base, buffer_id=old.buffer_id)
    _all_reduce_pair(w, [replaced, bufs[1]], 2, [freed])
    opens = [c for c in w.rt.calls("open_memory") if c[1] == old.handle]
    assert len(opens) == 2 and opens[1][3] != old_address
    assert [c[1] for c in w.rt.calls("close_memory")] == [old_address]
    assert bits(replaced.array()) == bits(host_reduce(vals, pb.SUM))
    # A free reported late (its buffer id already superseded) closes nothing else.
    _all_reduce_pair(w, [replaced, bufs[1]], 3, [freed])
    assert [c[1] for c in w.rt.calls("close_memory")] == [old_address]
    assert len(w.rt.calls("open_memory")) == 3


def test_a_departed_ranks_handles_close_once_its_work_is_done() -> None:
    w = World([0, 0])
    bufs = [w.buffer(r, 64, pb.FLOAT32) for r in range(2)]
    w.run(
        [
            request(pb.ALL_REDUCE, pb.FLOAT32, 64, r, [b], [b], reduce_op=pb.SUM)
            for r, b in enumerate(bufs)
        ]
    )
    w.rt.pending_marks = True
    w.ops.release_rank(w.sessions[1])
    assert not w.rt.calls("close_memory")
    w.rt.pending_marks = False
    w.ops.collect()
    closed = [c[1] for c in w.rt.calls("close_memory")]
    opened_by_1 = [c[3] for c in w.rt.calls("open_memory") if c[1] == bufs[1].alloc.handle]
    assert closed == opened_by_1
    assert len(w.rt.calls("destroy_event")) >= 2  # its ready and done events (and marks)
    w.ops.release_rank(w.sessions[1])  # a second release is harmless


def test_a_closed_communicator_drains_and_destroys_its_streams() -> None:
    w = World([0, 0])
    bufs = [w.buffer(r, 64, pb.FLOAT32) for r in range(2)]
    w.run(
        [
            request(pb.ALL_REDUCE, pb.FLOAT32, 64, r, [b], [b], reduce_op=pb.SUM)
            for r, b in enumerate(bufs)
        ]
    )
    w.ops.release_comm(w.comm)
    deadline = time.monotonic() + 10
    while len(w.rt.calls("destroy_stream")) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    (stream,) = work_streams(w.rt)
    (gate,) = gate_streams(w.rt)
    assert ("synchronize", stream) in w.rt.log and ("destroy_stream", stream) in w.rt.log
    # The gate stream may wait forever on a dead rank: destroyed, never synchronised.
    assert ("destroy_stream", gate) in w.rt.log and ("synchronize", gate) not in w.rt.log


# -- errors -------------------------------------------------------------------------------------


def test_a_range_outside_its_allocation_is_refused() -> None:
    w = World([0, 0])
    bufs = [w.buffer(r, 64, pb.FLOAT32) for r in range(2)]
    bad = Buffer(bufs[0].alloc, 128, 64, pb.FLOAT32)  # 128 + 256 bytes > 256
    with pytest.raises(
        InvalidRequest, match=r"rank 0 \(pid 1000, node n1\): GPU range \[128, 384\) lies outside"
    ):
        w.run(
            [
                request(pb.ALL_REDUCE, pb.FLOAT32, 64, 0, [bad], [bad], reduce_op=pb.SUM),
                request(pb.ALL_REDUCE, pb.FLOAT32, 64, 1, [bufs[1]], [bufs[1]], reduce_op=pb.SUM),
            ]
        )
    assert not w.rt.calls("reduce")


def test_a_mapping_of_unknown_size_is_refused_whatever_the_rank_declares() -> None:
    """The daemon bounds ranges by what it mapped, never by the rank's alloc_bytes."""
    w = World([0, 0])
    w.rt.size_unknown = True
    bufs = [w.buffer(r, 64, pb.FLOAT32) for r in range(2)]
    reqs = [
        request(pb.ALL_REDUCE, pb.FLOAT32, 64, r, [b], [b], reduce_op=pb.SUM)
        for r, b in enumerate(bufs)
    ]
    reqs[0].cuda.inputs[0].alloc_bytes = 1 << 40  # a lie that would cover any range
    with pytest.raises(
        InvalidRequest,
        match=r"rank 0 \(pid 1000, node n1\): the size of its allocation at 0x[0-9a-f]+ cannot "
        r"be read from the mapping \(cuPointerGetAttributes: CUDA_ERROR_INVALID_VALUE\)",
    ):
        w.run(reqs)
    assert not w.rt.calls("reduce") and not w.rt.calls("record")
    # The mapping it could not bound is closed again, not kept.
    assert [c[1] for c in w.rt.calls("close_memory")] == [w.rt.calls("open_memory")[0][3]]
    assert not w.rt.mapped


def test_a_launch_failing_midway_still_records_every_done_event() -> None:
    """Launches already queued write the ranks' buffers: their done events must follow them
    (the ranks' streams, and so their allocators, wait on those), though the op fails."""
    w = World([0, 0])
    w.ops.chunk_bytes = 1 << 16
    w.rt.fail_reduce_at = 2  # the third launch of a several-launch op
    n = 1 << 16
    bufs = [w.buffer(r, n, pb.FLOAT32) for r in range(2)]
    with pytest.raises(
        FailedPrecondition,
        match=r"a CUDA call failed while queueing the op: launching the reduction kernel: "
        "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
    ):
        w.run(
            [
                request(pb.ALL_REDUCE, pb.FLOAT32, n, r, [b], [b], reduce_op=pb.SUM)
                for r, b in enumerate(bufs)
            ]
        )
    (stream,) = work_streams(w.rt)
    calls = stream_log(w.rt, stream)
    assert calls == [
        "wait flag 1",
        "reduce",
        "reduce",
        "record done0",
        "record done1",
    ]


def test_an_op_refused_before_any_work_records_nothing() -> None:
    w = World([0, 0])
    bufs = [w.buffer(r, 64, pb.FLOAT32) for r in range(2)]
    reqs = [
        request(pb.ALL_REDUCE, pb.FLOAT32, 64, r, [b], [b], reduce_op=pb.SUM)
        for r, b in enumerate(bufs)
    ]
    reqs[1].cuda.outputs[0].nbytes = 128
    with pytest.raises(InvalidRequest):
        w.run(reqs)
    assert not w.rt.calls("record") and not w.rt.calls("wait")


def test_a_gpu_the_daemon_cannot_see_is_named() -> None:
    w = World([0, 0])
    bufs = [w.buffer(r, 64, pb.FLOAT32) for r in range(2)]
    reqs = [
        request(pb.ALL_REDUCE, pb.FLOAT32, 64, r, [b], [b], reduce_op=pb.SUM)
        for r, b in enumerate(bufs)
    ]
    reqs[1].cuda.device_uuid = uuid(7)
    with pytest.raises(
        FailedPrecondition, match=r"rank 1 .* on a GPU smddpd cannot see .*CUDA_VISIBLE_DEVICES"
    ):
        w.run(reqs)


def test_mixing_gpu_and_host_tensors_names_the_ranks() -> None:
    w = World([0, 0, 0])
    bufs = [w.buffer(r, 64, pb.FLOAT32) for r in range(3)]
    reqs = [
        request(pb.ALL_REDUCE, pb.FLOAT32, 64, r, [b], [b], reduce_op=pb.SUM)
        for r, b in enumerate(bufs)
    ]
    reqs[2].ClearField("cuda")
    with pytest.raises(
        InvalidRequest,
        match=r"mixes GPU and host tensors: ranks 0-1 on GPUs, rank 2 in host memory",
    ):
        w.run(reqs)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda reqs: reqs[1].cuda.outputs[0].__setattr__("nbytes", 128),
            r"rank 1's output holds 128 bytes where 64 x 4",
        ),
        (
            lambda reqs: reqs[0].cuda.inputs.add(),
            r"rank 0 names 2 input and 1 output GPU buffers where 1 and 1",
        ),
        (
            lambda reqs: reqs[0].cuda.__setattr__("ready_event", b"short"),
            r"ready event handle has 5 bytes, not 64",
        ),
        (
            lambda reqs: reqs[1].cuda.inputs[0].__setattr__("ipc_handle", b"x" * 64),
            r"rank 1 .*cannot open the CUDA IPC handle",
        ),
    ],
    ids=["size", "buffers", "event-handle", "unknown-handle"],
)
def test_bad_requests_are_refused_before_any_work(mutate, message: str) -> None:
    w = World([0, 0])
    bufs = [w.buffer(r, 64, pb.FLOAT32) for r in range(2)]
    reqs = [
        request(pb.ALL_REDUCE, pb.FLOAT32, 64, r, [b], [b], reduce_op=pb.SUM)
        for r, b in enumerate(bufs)
    ]
    mutate(reqs)
    with pytest.raises(InvalidRequest, match=message):
        w.run(reqs)
    assert not w.rt.calls("reduce") and not w.rt.calls("record")


def test_all_to_all_split_sizes_must_agree() -> None:
    w = World([0, 0])
    sends = [[w.buffer(s, 4, pb.INT32) for _ in range(2)] for s in range(2)]
    recvs = [
        [w.buffer(d, 4 if (d, s) != (1, 0) else 5, pb.INT32) for s in range(2)] for d in range(2)
    ]
    with pytest.raises(
        InvalidRequest, match="rank 0 sends 16 bytes to rank 1 but rank 1 expects 20 from rank 0"
    ):
        w.run([request(pb.ALL_TO_ALL, pb.INT32, 8, r, sends[r], recvs[r]) for r in range(2)])


def test_without_cupy_the_daemon_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    daemon_gpu = DaemonGpu(gpu.LAUNCH_CHUNK_BYTES)  # the daemon's, on CuPy's runtime
    monkeypatch.setitem(sys.modules, "cupy", None)  # where CuPy is installed: as if it were not
    with pytest.raises(
        FailedPrecondition,
        match=(
            r"smddpd on node n7 cannot carry GPU tensors: CuPy is not installed "
            r".*pip install '\.\[cuda\]'"
        ),
    ):
        daemon_gpu.ops("n7")
    assert daemon_gpu.active() is None


def test_releasing_a_rank_waits_only_for_its_own_communicators_work() -> None:
    rt = FakeRuntime()
    ops = gpu.GpuOps(rt)
    comms = [FakeComm("job a comm 0"), FakeComm("job b comm 0")]
    sessions = [[FakeSession(0), FakeSession(1)] for _ in comms]
    for comm, members in zip(comms, sessions):
        bufs = [Buffer(rt.allocate(256), 0, 64, pb.FLOAT32) for _ in members]
        reqs = [
            request(pb.ALL_REDUCE, pb.FLOAT32, 64, r, [b], [b], reduce_op=pb.SUM)
            for r, b in enumerate(bufs)
        ]
        ops.execute(comm, [0, 1], members, reqs)
    stream_a, stream_b = work_streams(rt)
    before = len(rt.log)
    rt.pending_marks = True  # job b's stream might be stuck forever; job a's must not wait on it
    ops.release_rank(sessions[0][1])
    marks = [c for c in rt.log[before:] if c[0] == "record"]
    assert marks and {c[2] for c in marks} == {stream_a}


def test_a_rank_in_two_communicators_opens_its_handles_once() -> None:
    rt = FakeRuntime()
    ops = gpu.GpuOps(rt)
    comms = [FakeComm("job j comm 0"), FakeComm("job j comm 1")]
    bufs = [Buffer(rt.allocate(256), 0, 64, pb.FLOAT32) for _ in range(2)]
    # The same two processes (same buffers, same events) as ranks of both communicators.
    members = [[FakeSession(0), FakeSession(1)] for _ in comms]
    for comm, sessions in zip(comms, members):
        reqs = [
            request(pb.ALL_REDUCE, pb.FLOAT32, 64, r, [b], [b], reduce_op=pb.SUM)
            for r, b in enumerate(bufs)
        ]
        ops.execute(comm, [0, 1], sessions, reqs)
    assert len(rt.calls("open_memory")) == 2 and all(n == 1 for n in rt.opened_events.values())
    ops.release_rank(members[0][0])
    assert not rt.calls("close_memory")  # the other communicator's entry still uses it
    ops.release_rank(members[1][0])
    assert [c[1] for c in rt.calls("close_memory")] == [rt.calls("open_memory")[0][3]]


def test_handles_are_opened_on_the_gpu_whose_kernels_use_them() -> None:
    """Each GPU reduces with mappings opened on itself (never another GPU's mapping of the
    same handle), and each handle opens once per GPU that uses it."""
    w = World([0, 1])
    n = 4096
    bufs = [w.buffer(r, n, pb.FLOAT32) for r in range(2)]
    vals = [fill(b, r) for r, b in enumerate(bufs)]
    for seq in (1, 2):
        w.run(
            [
                request(
                    pb.ALL_REDUCE, pb.FLOAT32, n, r, [b], [b], device=r, reduce_op=pb.SUM, seq=seq
                )
                for r, b in enumerate(bufs)
            ]
        )
    first = host_reduce(vals, pb.SUM)
    assert all(bits(b.array()) == bits(host_reduce([first, first], pb.SUM)) for b in bufs)
    opened_on = {c[3]: c[2] for c in w.rt.calls("open_memory")}  # address -> device
    assert sorted((c[1], c[2]) for c in w.rt.calls("open_memory")) == sorted(
        (b.alloc.handle, d) for b in bufs for d in (0, 1)
    )  # every allocation on both GPUs, once
    for call in w.rt.calls("reduce"):
        stream, inputs_outputs = call[1], call[7]
        assert {opened_on[_base(w.rt, a)] for a in inputs_outputs} == {stream.device}


def test_a_copy_across_gpus_enables_peer_access_and_reads_a_local_mapping() -> None:
    w = World([0, 1])
    bufs = [w.buffer(r, 100, pb.INT32) for r in range(2)]
    vals = [fill(b, r) for r, b in enumerate(bufs)]
    w.run(
        [
            request(pb.BROADCAST, pb.INT32, 100, r, [b], [b], device=r, root=0)
            for r, b in enumerate(bufs)
        ]
    )
    assert bits(bufs[1].array()) == bits(vals[0])
    assert ("enable_peer", 1, 0) in w.rt.log
    opened_on = {c[3]: c[2] for c in w.rt.calls("open_memory")}
    (copy,) = w.rt.calls("copy")
    assert copy[1].device == 1 and opened_on[_base(w.rt, copy[3])] == 1  # src mapped on GPU 1


def test_a_copy_between_gpus_without_peer_access_is_refused() -> None:
    rt = FakeRuntime(devices={uuid(0): 0, uuid(1): 1}, no_peer={(1, 0)})
    w = World([0, 1], rt)
    bufs = [w.buffer(r, 16, pb.INT32) for r in range(2)]
    with pytest.raises(FailedPrecondition, match="GPU 1 cannot access the memory of GPU 0"):
        w.run(
            [
                request(pb.BROADCAST, pb.INT32, 16, r, [b], [b], device=r, root=0)
                for r, b in enumerate(bufs)
            ]
        )
    assert not w.rt.calls("copy") and not w.rt.calls("record")


def _base(rt: FakeRuntime, address: int) -> int:
    """The daemon-side mapping an address lies in."""
    (base,) = [b for b, a in rt.mapped.items() if b <= address < b + a.data.size]
    return base


# -- waits that can be aborted ------------------------------------------------------------------


def test_work_waits_for_the_gate_then_runs() -> None:
    """On streams that really block: the work is held at the flag until every rank's ready
    event has fired, then runs and records done (the gate thread raised the flag)."""
    rt = QueuedFakeRuntime(never={"ready1"})
    w = World([0, 0], rt)
    bufs = [w.buffer(r, 64, pb.FLOAT32) for r in range(2)]
    vals = [fill(b, r) for r, b in enumerate(bufs)]
    w.run(
        [
            request(pb.ALL_REDUCE, pb.FLOAT32, 64, r, [b], [b], reduce_op=pb.SUM)
            for r, b in enumerate(bufs)
        ]
    )
    time.sleep(0.05)
    assert not rt.calls("reduce")  # rank 1's inputs are not ready yet
    rt.never.clear()  # rank 1's stream gets there
    wait_until(lambda: rt.calls("reduce"))
    assert all(bits(b.array()) == bits(host_reduce(vals, pb.SUM)) for b in bufs)


def test_a_killed_ranks_event_never_wedges_the_drain_or_the_survivors_memory() -> None:
    """Rank 1 is killed after recording its ready event, which so never fires. Tearing the
    communicator down opens the gate: the work streams finish, the drain's synchronize
    returns, every done event is recorded, and every mapping (the survivors' too) closes."""
    rt = QueuedFakeRuntime(never={"ready1"})
    w = World([0, 0, 0], rt)
    bufs = [w.buffer(r, 256, pb.FLOAT32) for r in range(3)]
    for r, b in enumerate(bufs):
        fill(b, r)
    w.run(
        [
            request(pb.ALL_REDUCE, pb.FLOAT32, 256, r, [b], [b], reduce_op=pb.SUM)
            for r, b in enumerate(bufs)
        ]
    )
    for session in w.sessions:  # every rank leaves: rank 1 died, the others failed
        w.ops.release_rank(session)
    time.sleep(0.05)
    assert not rt.calls("close_memory")  # queued work may still use them
    (work,) = work_streams(rt)
    w.ops.release_comm(w.comm)
    wait_until(lambda: ("destroy_stream", work) in rt.log)
    assert ("synchronize", work) in rt.log
    wait_until(lambda: len(rt.calls("close_memory")) == 3)
    assert sorted(c[1] for c in rt.calls("close_memory")) == sorted(
        c[3] for c in rt.calls("open_memory")
    )
    dones = [c[1] for c in rt.calls("record") if repr(c[1]).startswith("done")]
    assert sorted(map(repr, dones)) == ["done0", "done1", "done2"]
    # Without the gate the drain would have blocked: the gate stream is still stuck.
    (gate,) = gate_streams(rt)
    assert rt._queues[gate] and ("synchronize", gate) not in rt.log


def test_a_failed_communicators_gates_open_before_its_teardown() -> None:
    """Rank 1 is killed with its ready event unfired; the communicator fails while the
    survivors are still in it (their hosts may wait on their streams): its gates open then,
    so the work stream runs its reductions and every done record, with no rank having left."""
    rt = QueuedFakeRuntime(never={"ready1"})
    w = World([0, 0, 0], rt)
    bufs = [w.buffer(r, 64, pb.FLOAT32) for r in range(3)]
    for r, b in enumerate(bufs):
        fill(b, r)
    w.run(
        [
            request(pb.ALL_REDUCE, pb.FLOAT32, 64, r, [b], [b], reduce_op=pb.SUM)
            for r, b in enumerate(bufs)
        ]
    )
    time.sleep(0.05)
    assert not rt.calls("reduce")  # held at the gate
    w.ops.abort_comm(w.comm)
    (work,) = work_streams(rt)
    wait_until(lambda: not rt._queues[work])  # its reductions and done records have run
    assert rt.calls("reduce") and not rt.calls("destroy_stream")  # no teardown yet


def test_a_communicator_failed_before_its_first_gpu_op_opens_that_op_s_gates() -> None:
    """The communicator fails while its first GPU op is still on its way (no streams yet);
    that op, gated on a ready event that never fires (a dead rank's), must not wait for the
    teardown either: its reductions and done records run, with no rank having left."""
    rt = QueuedFakeRuntime(never={"ready1"})
    w = World([0, 0, 0], rt)
    bufs = [w.buffer(r, 64, pb.FLOAT32) for r in range(3)]
    w.ops.abort_comm(w.comm)  # before any stream of it exists
    w.run(
        [
            request(pb.ALL_REDUCE, pb.FLOAT32, 64, r, [b], [b], reduce_op=pb.SUM)
            for r, b in enumerate(bufs)
        ]
    )
    (work,) = work_streams(rt)
    wait_until(lambda: rt.calls("reduce") and not rt._queues[work])
    assert not rt.calls("destroy_stream")  # no teardown yet


def test_gate_marks_are_reused_and_destroyed_with_the_communicator() -> None:
    """An op's gate mark is a spare event of an earlier op whose gate opened (no event is
    created and destroyed per op); the communicator's teardown destroys the spares."""
    w = World([0, 0])
    bufs = [w.buffer(r, 64, pb.FLOAT32) for r in range(2)]
    _all_reduce_pair(w, bufs, 1)
    wait_until(lambda: not w.ops._gated)
    created = [c[1] for c in w.rt.calls("new_event")]
    for seq in range(2, 8):
        _all_reduce_pair(w, bufs, seq)
        wait_until(lambda: not w.ops._gated)
    assert [c[1] for c in w.rt.calls("new_event")] == created
    # Each op re-recorded the one mark on the gate stream.
    assert sum(c[1] in created for c in w.rt.calls("record")) == 7
    assert not w.rt.calls("destroy_event")
    w.ops.release_comm(w.comm)
    wait_until(lambda: {c[1] for c in w.rt.calls("destroy_event")} >= set(created))
