"""The client's GPU side without a GPU: CUDA IPC export, GPU op requests, their retirement,
and what a daemon without CuPy answers.

The CUDA driver is faked (``FakeDriver``): allocations with bases, buffer ids and handles.
"""

from __future__ import annotations

import ctypes.util
import itertools
import os
import secrets
from dataclasses import dataclass, field

import numpy as np
import pytest

from smddp.client.communicator import Communicator
from smddp.client.config import ClientConfig
from smddp.client.cuda_ipc import IpcExporter
from smddp.client.cuda_ops import CudaCollectives, DeviceArray
from smddp.client.errors import OpError, UnsupportedError
from smddp.core import cuda_driver
from smddp.v1 import smddp_pb2 as pb

# -- a fake driver ------------------------------------------------------------------------------


@dataclass
class FakeDriver:
    """Allocations by base: (size, buffer id, device); counts exports."""

    allocations: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    exports: list[int] = field(default_factory=list)
    ipc_capable: bool = True
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def allocate(self, base: int, size: int, device: int = 0) -> None:
        self.allocations[base] = (size, next(self._ids), device)

    def pointer_info(self, ptr: int) -> cuda_driver.PointerInfo:
        for base, (size, buffer_id, device) in self.allocations.items():
            if base <= ptr < base + size:
                return cuda_driver.PointerInfo(
                    buffer_id, base, size, device, 2, self.ipc_capable, 0xC0
                )
        raise cuda_driver.CudaUnavailable(
            f"cuPointerGetAttributes(0x{ptr:x}) failed: CUDA_ERROR_INVALID_VALUE"
        )

    def ipc_mem_handle(self, base: int, context: int) -> bytes:
        self.exports.append(base)
        size, buffer_id, _ = self.allocations[base]
        return f"h{base:x}-{buffer_id}".encode().ljust(64, b"\0")

    def device_uuid(self, ordinal: int) -> bytes:
        return bytes([ordinal]) * 16


BASE = 0x7F0000000000


def test_an_allocation_is_exported_once_for_all_its_tensors() -> None:
    drv = FakeDriver()
    drv.allocate(BASE, 1 << 20)
    exporter = IpcExporter(lambda: drv)  # type: ignore[arg-type, return-value]
    a = exporter.export(BASE + 512, 4096, 0, "all_reduce")
    b = exporter.export(BASE + 65536, 100, 0, "all_reduce")
    assert drv.exports == [BASE]
    assert a.ipc_handle == b.ipc_handle and len(a.ipc_handle) == 64
    assert (a.alloc_base, a.alloc_bytes, a.offset, a.nbytes) == (BASE, 1 << 20, 512, 4096)
    assert (b.offset, b.nbytes) == (65536, 100)


def test_a_new_allocation_at_a_recycled_address_gets_a_new_handle() -> None:
    drv = FakeDriver()
    drv.allocate(BASE, 1 << 20)
    exporter = IpcExporter(lambda: drv)  # type: ignore[arg-type, return-value]
    first = exporter.export(BASE, 64, 0, "x")
    drv.allocate(BASE, 1 << 21)  # freed and allocated again at the same base: a new buffer id
    second = exporter.export(BASE, 64, 0, "x")
    assert drv.exports == [BASE, BASE]
    assert first.ipc_handle != second.ipc_handle and second.alloc_bytes == 1 << 21


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        (
            lambda d: setattr(d, "ipc_capable", False),
            (BASE, 64, 0),
            "cannot be shared by CUDA IPC.*expandable_segments",
        ),
        (lambda d: None, (BASE + (1 << 20) - 8, 64, 0), "overrun their allocation"),
        (lambda d: None, (BASE, 64, 1), "is not memory of GPU 1"),
        (lambda d: None, (0x1234, 64, 0), "not GPU memory the driver knows"),
    ],
    ids=["expandable-segments", "overrun", "other-gpu", "host-pointer"],
)
def test_what_cannot_be_exported_is_a_clear_error(setup, args, message: str) -> None:
    drv = FakeDriver()
    drv.allocate(BASE, 1 << 20)
    setup(drv)
    with pytest.raises(UnsupportedError, match=message):
        IpcExporter(lambda: drv).export(*args, "all_reduce")  # type: ignore[arg-type, return-value]


def test_an_empty_range_needs_no_driver() -> None:
    def no_driver() -> cuda_driver.Driver:
        raise AssertionError("the driver was asked about an empty range")

    assert IpcExporter(no_driver).export(0, 0, 0, "x") == pb.CudaBuffer()


@pytest.mark.skipif(
    ctypes.util.find_library("cuda") is not None, reason="an NVIDIA driver is installed here"
)
def test_without_a_driver_gpu_tensors_are_a_clear_error() -> None:
    with pytest.raises(
        UnsupportedError, match=r"all_reduce: GPU tensors need the NVIDIA driver: .*libcuda\.so\.1"
    ):
        IpcExporter().export(BASE, 64, 0, "all_reduce")


# -- GPU op requests ------------------------------------------------------------------------------


@dataclass
class Events:
    ready: bytes = b"R" * 64
    done: bytes = b"D" * 64
    finished: list[bool] = field(default_factory=list)

    def finish(self, ok: bool) -> None:
        self.finished.append(ok)


@dataclass
class StubComm:
    """What CudaCollectives needs of a Communicator; records submitted requests."""

    rank: int = 0
    world_size: int = 2
    single_node: bool = True
    sent: list[tuple[pb.OpRequest, object, str]] = field(default_factory=list)

    def submit_gpu(self, req: pb.OpRequest, after, what: str) -> str:
        self.sent.append((req, after, what))
        return "handle"


def collectives(
    rank: int = 0, world: int = 2, single_node: bool = True
) -> tuple[CudaCollectives, StubComm, FakeDriver]:
    drv = FakeDriver()
    drv.allocate(BASE, 1 << 24)
    comm = StubComm(rank, world, single_node)
    return CudaCollectives(comm, IpcExporter(lambda: drv)), comm, drv  # type: ignore[arg-type, return-value]


def arr(offset: int, count: int, dtype: int = pb.FLOAT32) -> DeviceArray:
    return DeviceArray(BASE + offset, count, dtype, 0)


def test_all_reduce_request_names_the_buffer_and_events() -> None:
    cc, comm, _ = collectives()
    ev = Events()
    assert cc.all_reduce(arr(256, 1000), pb.AVG, ev) == "handle"
    (req, after, what) = comm.sent[0]
    assert (req.kind, req.dtype, req.count, req.reduce_op, what) == (
        pb.ALL_REDUCE,
        pb.FLOAT32,
        1000,
        pb.AVG,
        "all_reduce",
    )
    assert req.cuda.device_uuid == b"\0" * 16
    assert (req.cuda.ready_event, req.cuda.done_event) == (ev.ready, ev.done)
    assert [b.offset for b in req.cuda.inputs] == [256] and [
        b.offset for b in req.cuda.outputs
    ] == [256]
    assert req.cuda.inputs[0].nbytes == 4000
    assert after == ev.finish


def test_freed_allocations_go_to_the_daemon_with_each_communicators_next_op() -> None:
    """Close before free: once the allocator's freed-segment count moves, the next op of
    each communicator names the allocations the driver no longer has (base and buffer id),
    once; a new allocation at the same base travels with its own buffer id."""
    drv = FakeDriver()
    drv.allocate(BASE, 1 << 20)
    other = BASE + (1 << 30)
    drv.allocate(other, 1 << 20)
    exporter = IpcExporter(lambda: drv)  # type: ignore[arg-type, return-value]
    frees = {"count": 0}
    exporter.free_counter = lambda device: frees["count"]
    comms = [StubComm(), StubComm()]
    ccs = [CudaCollectives(c, exporter) for c in comms]  # type: ignore[arg-type]
    mine = DeviceArray(BASE, 64, pb.FLOAT32, 0)
    for cc in ccs:
        cc.all_reduce(mine, pb.SUM, Events())
    first = comms[0].sent[0][0].cuda.inputs[0]
    assert first.buffer_id == drv.allocations[BASE][1] and first.alloc_base == BASE
    old_id = first.buffer_id
    del drv.allocations[BASE]  # empty_cache(): the segment went back to the driver
    # The count has not moved (no sweep asks the driver): nothing to report yet.
    ccs[0].all_reduce(DeviceArray(other, 64, pb.FLOAT32, 0), pb.SUM, Events())
    assert not comms[0].sent[-1][0].cuda.freed
    frees["count"] += 1
    for cc, comm in zip(ccs, comms):
        cc.all_reduce(DeviceArray(other, 64, pb.FLOAT32, 0), pb.SUM, Events())
        assert [(f.alloc_base, f.buffer_id) for f in comm.sent[-1][0].cuda.freed] == [
            (BASE, old_id)
        ]
        cc.all_reduce(DeviceArray(other, 64, pb.FLOAT32, 0), pb.SUM, Events())
        assert not comm.sent[-1][0].cuda.freed  # reported once
    # Freed and allocated again at the same base between two ops, the count not moved:
    # export itself sees the new buffer id; the free goes with the op naming the new one.
    drv.allocate(BASE, 1 << 20)
    ccs[0].all_reduce(mine, pb.SUM, Events())
    new_id = drv.allocations[BASE][1]
    drv.allocate(BASE, 1 << 21)
    ccs[0].all_reduce(mine, pb.SUM, Events())
    req = comms[0].sent[-1][0]
    assert [(f.alloc_base, f.buffer_id) for f in req.cuda.freed] == [(BASE, new_id)]
    assert req.cuda.inputs[0].buffer_id == drv.allocations[BASE][1] != new_id
    # A communicator made after a free has nothing of it to report.
    late = StubComm()
    CudaCollectives(late, exporter).all_reduce(mine, pb.SUM, Events())  # type: ignore[arg-type]
    assert not late.sent[0][0].cuda.freed


class ZeroingDriver(FakeDriver):
    """cuPointerGetAttributes as the driver documents it: an unknown address gets zeros."""

    def pointer_info(self, ptr: int) -> cuda_driver.PointerInfo:
        try:
            return super().pointer_info(ptr)
        except cuda_driver.CudaUnavailable:
            return cuda_driver.PointerInfo(0, 0, 0, -1, 0, False, 0)


@pytest.mark.parametrize("driver", [FakeDriver, ZeroingDriver])
def test_without_a_free_counter_every_op_checks_the_cached_allocations(driver) -> None:
    drv = driver()
    drv.allocate(BASE, 1 << 24)
    comm = StubComm()
    cc = CudaCollectives(comm, IpcExporter(lambda: drv))  # type: ignore[arg-type]
    cc.all_reduce(arr(0, 16), pb.SUM, Events())
    (bid,) = {b.buffer_id for b in comm.sent[0][0].cuda.inputs}
    del drv.allocations[BASE]
    drv.allocate(BASE + (1 << 30), 1 << 20)
    cc.all_reduce(DeviceArray(BASE + (1 << 30), 16, pb.FLOAT32, 0), pb.SUM, Events())
    assert [(f.alloc_base, f.buffer_id) for f in comm.sent[-1][0].cuda.freed] == [(BASE, bid)]


@pytest.mark.parametrize("rank", [0, 1])
def test_each_kind_sends_the_buffers_its_layout_names(rank: int) -> None:
    w, root = 2, 1
    cc, comm, _ = collectives(rank, w)
    ev = Events()
    per = [arr(4096 * (i + 1), 10) for i in range(w)]
    cc.broadcast(arr(0, 10), root, ev)
    cc.reduce(arr(0, 10), root, pb.MAX, ev)
    cc.all_gather(per, arr(0, 10), ev)
    cc.gather(per, arr(0, 10), root, ev)
    cc.reduce_scatter(arr(0, 10), per, pb.SUM, ev)
    cc.scatter(arr(0, 10), per, root, ev)
    cc.all_to_all(per, [arr(100000, 3), arr(200000, 4)], ev)
    cc.send(arr(0, 10), 1 - rank, 5, ev)
    cc.recv(arr(0, 10), 1 - rank, 5, ev)
    layout = [
        (r.kind, len(r.cuda.inputs), len(r.cuda.outputs), r.root, r.count) for r, _, _ in comm.sent
    ]
    on_root = rank == root
    assert layout == [
        (pb.BROADCAST, 1, 1, root, 10),
        (pb.REDUCE, 1, 1, root, 10),
        (pb.ALL_GATHER, 1, w, 0, 10),
        (pb.GATHER, 1, w if on_root else 0, root, 10),
        (pb.REDUCE_SCATTER, w, 1, 0, 10),
        (pb.SCATTER, w if on_root else 0, 1, root, 10),
        (pb.ALL_TO_ALL, 2, 2, 0, 7),
        (pb.SEND, 1, 0, 1 - rank, 10),
        (pb.RECV, 0, 1, 1 - rank, 10),
    ]
    assert comm.sent[-1][0].tag == 5


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda cc: cc.all_reduce(arr(0, 4, pb.FLOAT32), pb.BXOR, Events()),
            "BXOR is only defined for integer",
        ),
        (lambda cc: cc.broadcast(arr(0, 4), 5, Events()), "rank 5 is outside a world of 2"),
        (lambda cc: cc.all_gather([arr(0, 4)], arr(64, 4), Events()), "expected 2 tensors"),
        (
            lambda cc: cc.all_gather([arr(0, 4), arr(64, 5)], arr(128, 4), Events()),
            "tensor 1 has 5 elements",
        ),
        (
            lambda cc: cc.all_gather([arr(0, 4, pb.INT32), arr(64, 4)], arr(128, 4), Events()),
            "every tensor must be float32",
        ),
        (lambda cc: cc.send(arr(0, 4), 0, 0, Events()), "cannot send to or from itself"),
        (
            lambda cc: cc.all_reduce(DeviceArray(BASE, 4, pb.FLOAT32, 3), pb.SUM, Events()),
            "not memory of GPU 3",
        ),
    ],
    ids=["op-dtype", "root", "count", "size", "dtype", "self", "device"],
)
def test_bad_calls_send_nothing(call, message: str) -> None:
    cc, comm, _ = collectives()
    with pytest.raises(UnsupportedError, match=message):
        call(cc)
    assert comm.sent == []


def test_gpu_tensors_across_nodes_go_as_on_one_node() -> None:
    """A communicator spanning nodes sends the very request one node does: the daemon
    stages it between nodes (issue 27; this was refused before)."""
    sent = []
    for single_node in (True, False):
        cc, comm, _ = collectives(single_node=single_node)
        cc.all_reduce(arr(0, 4), pb.SUM, Events())
        ((req, _, what),) = comm.sent
        sent.append((req.SerializeToString(deterministic=True), what))
    assert sent[0] == sent[1]


# -- numbering and retiring GPU ops in the Communicator -------------------------------------------


class FakeSession:
    """A DaemonSession that answers every request at once (ok unless told otherwise)."""

    def __init__(self, fail: set[int] = frozenset()) -> None:
        from smddp.client.arena import ClientArena

        self.rank, self.world_size, self.chunk_bytes = 0, 2, 1 << 16
        self.comm_id, self.job_id = "fake-comm", "fake-job"
        self.local_ranks, self.node_region = (0, 1), False
        self.arena = ClientArena(1 << 20)
        self.sent: list[pb.OpRequest] = []
        self.fail = fail

    def send(self, req: pb.OpRequest) -> None:
        self.sent.append(pb.OpRequest.FromString(req.SerializeToString()))

    def wait_reply(self, request_id: int, timeout_s: float) -> pb.OpReply:
        ok = request_id not in self.fail
        return pb.OpReply(
            request_id=request_id,
            ok=ok,
            error_kind=0 if ok else pb.RANK_FAILED,
            error="rank 1 died",
        )

    def has_reply(self, request_id: int) -> bool:
        return True

    def close(self) -> None:
        self.arena.close()


def test_gpu_ops_share_the_numbering_and_retire_in_order_with_host_ops(monkeypatch) -> None:
    monkeypatch.setenv("SMDDP_REGION", "0")  # host ops through the (fake) daemon, no region
    session = FakeSession()
    comm = Communicator(  # type: ignore[arg-type]
        session, timeout_s=10, single_node=True, config=ClientConfig.from_env()
    )
    comm._direct_min = -1  # keep host ops on the daemon path
    done: list[tuple[str, bool]] = []
    x = np.arange(40000, dtype=np.float32)  # several chunks of the arena ring
    h1 = comm.all_reduce(x)
    g1 = comm.submit_gpu(
        pb.OpRequest(kind=pb.ALL_REDUCE, cuda=pb.CudaOp()),
        lambda ok: done.append(("g1", ok)),
        "all_reduce",
    )
    h2 = comm.all_reduce(x.copy())
    g2 = comm.submit_gpu(
        pb.OpRequest(kind=pb.SEND, root=1, cuda=pb.CudaOp()),
        lambda ok: done.append(("g2", ok)),
        "send",
    )
    g3 = comm.submit_gpu(
        pb.OpRequest(kind=pb.SEND, root=1, cuda=pb.CudaOp()),
        lambda ok: done.append(("g3", ok)),
        "send",
    )
    g2.wait()
    assert h1.done() and g1.done() and h2.done() and g2.done() and not g3.done()
    assert done == [("g1", True), ("g2", True)]
    seqs = [(r.kind, r.seq, r.part, r.parts, r.HasField("cuda")) for r in session.sent]
    gpu = [s for s in seqs if s[4]]
    assert gpu == [
        (pb.ALL_REDUCE, 2, 0, 1, True),
        (pb.SEND, 1, 0, 1, True),
        (pb.SEND, 2, 0, 1, True),
    ]
    assert {s[1] for s in seqs if not s[4]} == {1, 3}  # host ops numbered around the GPU op
    comm.close()
    assert done[-1] == ("g3", True)
    assert comm._ring.empty()


def test_a_failed_gpu_op_reports_and_releases_its_events(monkeypatch) -> None:
    monkeypatch.setenv("SMDDP_REGION", "0")
    session = FakeSession(fail={1})
    comm = Communicator(  # type: ignore[arg-type]
        session, timeout_s=10, single_node=True, config=ClientConfig.from_env()
    )
    done: list[bool] = []
    h = comm.submit_gpu(
        pb.OpRequest(kind=pb.ALL_REDUCE, cuda=pb.CudaOp()), done.append, "all_reduce"
    )
    with pytest.raises(OpError, match="rank 1 died"):
        h.wait()
    assert done == [False]
    comm.close()


# -- a daemon without CuPy -------------------------------------------------------------------------


def refused_gpu_rank(rank: int, socket_path: str, token: str) -> tuple[str, str]:
    """Submits a GPU all_reduce to a daemon without CuPy, then a host one."""
    import numpy as np

    from smddp.client import connect
    from smddp.client.errors import SmddpError

    comm = connect(
        "gpu-refused", bytes.fromhex(token), rank, 2, socket_path=socket_path, timeout_s=30
    )
    finished: list[bool] = []
    cuda = pb.CudaOp(
        device_uuid=b"\1" * 16,
        ready_event=b"r" * 64,
        done_event=b"d" * 64,
        inputs=[pb.CudaBuffer(ipc_handle=b"h" * 64, alloc_base=1 << 40, alloc_bytes=64, nbytes=64)],
        outputs=[
            pb.CudaBuffer(ipc_handle=b"h" * 64, alloc_base=1 << 40, alloc_bytes=64, nbytes=64)
        ],
    )
    req = pb.OpRequest(kind=pb.ALL_REDUCE, dtype=pb.FLOAT32, count=16, reduce_op=pb.SUM, cuda=cuda)
    handle = comm.submit_gpu(req, finished.append, "all_reduce")
    try:
        handle.wait()
        first = "no error"
    except SmddpError as exc:
        first = str(exc)
    assert finished == [False]
    try:
        comm.all_reduce(np.ones(4, dtype=np.float32)).wait()
        second = "no error"
    except SmddpError as exc:
        second = str(exc)
    comm.close()
    return first, second


@pytest.mark.timeout(120)
def test_a_daemon_that_cannot_use_a_gpu_fails_gpu_ops_clearly(daemon, spawn_ranks) -> None:
    """Without CuPy the daemon says what to install; with CuPy but no usable GPU (CI, where
    CuPy is installed for the NVRTC check) it says CuPy finds none."""
    import importlib.util

    cause = (
        "CuPy finds no usable GPU"
        if importlib.util.find_spec("cupy") is not None
        else "CuPy is not installed"
    )
    env = dict(os.environ)
    results = spawn_ranks(refused_gpu_rank, 2, daemon.socket, secrets.token_hex(16), env=env).join()
    for first, second in results:
        assert f"cannot carry GPU tensors: {cause}" in first
        assert cause in second  # the communicator failed with that cause
    assert cause in daemon.log()
