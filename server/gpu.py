"""GPU collectives in the daemon: CUDA IPC handles of the ranks, their events, and the work.

A GPU op names, per rank, CUDA IPC handles of its buffers' allocations (with offsets), an
interprocess "ready" event the rank recorded on its stream after writing its inputs, and a
"done" event for the daemon to record (``CudaOp`` in the proto). For one matched op this
module, on the communicator's own streams (one per GPU involved):

1. makes every stream wait on a flag the daemon owns (``cuStreamWaitValue32``), raised by its
   gate thread once a gate stream has passed every rank's ready event, or at once when the
   communicator fails or is torn down: a killed rank's event, which never fires, holds up
   only the gate stream, never the work, the survivors' done events or the drain;
2. reduces with the kernels of ``gpu_kernels`` (in rank order, so every rank gets the same
   bits as on the host path), or moves bytes with device-to-device copies;
3. records every rank's done event after all of it, which the rank's stream then waits on.

The daemon replies once the work is queued; the GPU does it later, ordered by the events.
Handles are opened once per rank and cached by allocation base and buffer id; events by
handle. A segment the rank's allocator is about to free is unmapped before the free, on the
rank's free channel (``close_before_free``, ``smddp.server.gpu_free``); allocations a rank
reports freed after the fact (``CudaOp.freed``, before its op's buffers) and those superseded
by a new allocation at the same base are closed once the work the rank's streams already hold
has passed them, as are all of a rank's when it leaves: the gate thread closes each as soon
as that work is done (``collect``), so none waits for an op that may never come.

The daemon makes one ``GpuOps`` at its first GPU op (``gpu_supply.DaemonGpu``), which is
when CuPy is imported, never before: the daemon runs without it and answers a GPU op there
with a clear error. All CUDA calls go through ``Runtime``, given to ``GpuOps`` by whoever
makes it, so the logic here is tested with a fake runtime on machines without a GPU.
"""

from __future__ import annotations

import collections
import functools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from smddp.core.wire import (
    KIND_NAMES,
    REDUCING_KINDS,
    ROOTED_KINDS,
    describe_request,
    dtype_name,
    rank_list,
)
from smddp.server import gpu_kernels, gpu_staging, supervise
from smddp.server.arena import Arena
from smddp.server.errors import (
    CudaCallError,
    FailedPrecondition,
    InvalidRequest,
    PeerError,
    SmddpError,
)
from smddp.server.peer_wire import Frame
from smddp.v1 import smddp_pb2 as pb

if TYPE_CHECKING:
    from smddp.server.communicator import Communicator, Session

log = logging.getLogger(__name__)

# Largest part of an op one kernel launch covers, unless configured (--gpu-chunk-bytes): a
# communicator's launches are queued one after another, so other jobs' work on the same GPU
# can run between them.
LAUNCH_CHUNK_BYTES = 256 << 20
# Mappings kept open per rank (least recently used closed first) and events per rank.
MAX_MAPPINGS_PER_RANK = 4096
MAX_EVENTS_PER_RANK = 1024


class Runtime(Protocol):
    """The CUDA calls the daemon makes. Streams and events are opaque to the callers."""

    def device_of(self, uuid: bytes) -> int:
        """This process's ordinal of the GPU with ``uuid``; CudaCallError if it is not visible."""

    def open_memory(self, handle: bytes, device: int) -> int:
        """Maps a cudaIpcMemHandle (opened on ``device``); returns its address here."""

    def close_memory(self, address: int, device: int) -> None:
        """Unmaps what ``open_memory`` returned."""

    def mapped_size(self, address: int) -> int:
        """Size in bytes of the mapped allocation starting at ``address``."""

    def open_event(self, handle: bytes, device: int) -> Any:
        """Opens a cudaIpcEventHandle on ``device``."""

    def destroy_event(self, event: Any, device: int) -> None:
        """Releases an event (opened or created)."""

    def new_event(self, device: int) -> Any:
        """A local event on ``device`` (timing disabled)."""

    def event_done(self, event: Any, device: int) -> bool:
        """True once the work before the event's last record has finished."""

    def new_stream(self, device: int) -> Any:
        """A non-blocking stream on ``device``."""

    def destroy_stream(self, stream: Any, device: int) -> None:
        """Releases a stream from ``new_stream``."""

    def wait_event(self, stream: Any, event: Any, device: int) -> None:
        """Makes ``stream`` (on ``device``) wait for ``event``'s last record."""

    def record_event(self, event: Any, stream: Any, device: int) -> None:
        """Records ``event`` on ``stream`` (on ``device``)."""

    def synchronize(self, stream: Any, device: int) -> None:
        """Blocks until ``stream`` has finished its work."""

    def enable_peer(self, device: int, peer: int) -> None:
        """Lets kernels on ``device`` access memory of ``peer``; CudaCallError if they cannot."""

    def max_grid(self, device: int) -> int:
        """Blocks per launch worth running at once on ``device``."""

    def reduce(
        self,
        stream: Any,
        device: int,
        dtype: int,
        reduce_op: int,
        inputs: Sequence[int],
        outputs: Sequence[int],
        launch: gpu_kernels.Launch,
    ) -> None:
        """Launches the reduction kernel over ``launch`` (addresses are of element 0)."""

    def copy(self, stream: Any, device: int, dst: int, src: int, nbytes: int) -> None:
        """Queues a device-to-device copy on ``stream``."""

    def new_flag(self, device: int) -> Any:
        """A 32-bit word in host memory that ``device``'s streams can wait on (0 at first)."""

    def set_flag(self, flag: Any, value: int) -> None:
        """Writes ``value`` (from the host) into ``flag``."""

    def wait_flag(self, stream: Any, flag: Any, value: int, device: int) -> None:
        """Makes ``stream`` wait until ``flag`` reaches ``value`` (cuStreamWaitValue32, GEQ,
        wrap-around safe)."""

    def destroy_flag(self, flag: Any) -> None:
        """Frees a flag of ``new_flag``."""

    def alloc_host(self, nbytes: int, device: int) -> tuple[int, memoryview]:
        """Pinned (page-locked), mapped and portable host memory of ``nbytes``: its address,
        which every GPU's copies and kernels take (unified addressing), and a writable view
        of its bytes for the host. The staging of ops that span nodes (``gpu_staging``)."""

    def free_host(self, address: int) -> None:
        """Frees memory of ``alloc_host``."""

    def prepare(self, device: int, key: tuple[int, int, int, int]) -> None:
        """Compiles and loads the reduction module of ``key`` (dtype, reduce op, fan-in,
        fan-out) for ``device``; called outside the daemon's lock (a compile takes ~1 s)."""


# -- per-rank handles ---------------------------------------------------------------------------


@dataclass
class _Opened:
    """A handle opened in this daemon, shared by every rank entry that names it: a handle
    opens once per process (one rank in two communicators sends the same ones)."""

    obj: Any  # the mapped address, or the event
    device: int
    size: int = 0
    refs: int = 0


@dataclass
class _Mapping:
    handle: bytes
    address: int
    device: int
    size: int
    buffer_id: int = 0


@dataclass
class _RankHandles:
    """The open mappings (by the rank's allocation base) and events (by handle) of one rank."""

    # By (allocation base, the client's buffer id of it, device the mapping was opened on).
    mappings: collections.OrderedDict[tuple[int, int, int], _Mapping] = field(
        default_factory=collections.OrderedDict
    )
    events: collections.OrderedDict[bytes, tuple[Any, int]] = field(
        default_factory=collections.OrderedDict
    )
    # The streams of the rank's communicator: the only work that can use its handles.
    streams: _CommStreams | None = None


@dataclass
class _Resolved:
    """One rank's op with its handles opened: device, events and buffer addresses."""

    rank: int
    session: Session
    handles: _RankHandles
    req: pb.OpRequest
    device: int
    ready: Any
    done: Any
    inputs: list[int]
    outputs: list[int]
    in_bytes: list[int]
    out_bytes: list[int]


class _CommStreams:
    """A communicator's streams on each GPU it uses: the work stream, a gate stream, a flag
    the daemon owns, and an event per GPU to join the work streams.

    The work stream never waits on a rank's event: the gate stream does (and records a
    daemon event after), and the work stream waits on the flag, which the daemon's gate
    thread raises to an op's ticket once that event has fired, or at once when the
    communicator is torn down. So a dead rank's event that never fires holds up a gate
    stream only: the work stream, its done events and the drain still finish, and the
    mappings it used can be closed.
    """

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.streams: dict[int, Any] = {}
        self.gates: dict[int, Any] = {}
        self.flags: dict[int, Any] = {}
        self.joins: dict[int, Any] = {}
        # Gate marks whose gates opened, for the next ops (re-recorded, not created anew:
        # two CUDA calls fewer per op and GPU). Appended by the gate thread, taken under
        # the daemon's lock; list append and pop are atomic.
        self.spare_marks: dict[int, list[Any]] = {}
        self.ticket = 0
        self.pending: collections.deque[tuple[int, list[tuple[Any, int]]]] = collections.deque()
        self.aborted = False
        # Pinned host buffers of its ops that span nodes, made at the first one.
        self.staging: gpu_staging.StagingPool | None = None

    def stream(self, device: int) -> Any:
        if device not in self.streams:
            self.streams[device] = self.rt.new_stream(device)
        return self.streams[device]

    def gate(self, device: int) -> Any:
        if device not in self.gates:
            self.gates[device] = self.rt.new_stream(device)
        return self.gates[device]

    def flag(self, device: int) -> Any:
        if device not in self.flags:
            self.flags[device] = self.rt.new_flag(device)
        return self.flags[device]

    def join(self, device: int) -> Any:
        # Reused by every op: a wait captures the record just before it, never a later one.
        if device not in self.joins:
            self.joins[device] = self.rt.new_event(device)
        return self.joins[device]

    def mark(self, device: int) -> Any:
        """An event for a gate mark on ``device``: a spare one, else a new one."""
        try:
            return self.spare_marks.get(device, []).pop()
        except IndexError:
            return self.rt.new_event(device)

    def open(self, ticket: int) -> None:
        """Lets the work streams past the waits for ``ticket`` (and every one before it)."""
        for flag in self.flags.values():
            self.rt.set_flag(flag, ticket & 0xFFFFFFFF)


# How long the gate thread sleeps between polls of the ranks' events, growing while idle.
_GATE_POLL_S = (0.00001, 0.00005, 0.0002, 0.001)


class GpuOps:
    """The daemon's GPU side: handle caches, the communicators' streams, and the work."""

    def __init__(self, runtime: Runtime, chunk_bytes: int = LAUNCH_CHUNK_BYTES) -> None:
        self.rt = runtime
        self.chunk_bytes = chunk_bytes
        self._lock = threading.RLock()
        self._ranks: weakref.WeakKeyDictionary[Session, _RankHandles] = weakref.WeakKeyDictionary()
        # Per communicator: its stream (and a join event) on each GPU it has used.
        self._streams: weakref.WeakKeyDictionary[Communicator, _CommStreams] = (
            weakref.WeakKeyDictionary()
        )
        # Communicators aborted before their first GPU op had streams: those open at once.
        self._aborted: weakref.WeakSet[Communicator] = weakref.WeakSet()
        self._devices: dict[bytes, int] = {}
        # Mappings by (handle, buffer id, device): a handle is opened on each GPU whose kernels or
        # copies access it (as NCCL does): memory opened on one GPU and read from another
        # is an illegal address there.
        # Keyed with the buffer id too: a handle that a new allocation happened to repeat
        # never gets the old one's mapping.
        self._memory: dict[tuple[bytes, int, int], _Opened] = {}
        self._events: dict[bytes, _Opened] = {}
        self._peers: set[tuple[int, int]] = set()
        # What to release once the work queued before it has finished: (events marking that
        # point on every stream, with their devices; the release).
        self._graveyard: list[tuple[list[tuple[Any, int]], Callable[[], None]]] = []
        # Communicators with ops whose gates the gate thread watches.
        self._gated: dict[int, _CommStreams] = {}
        self._gate_wake = threading.Condition(threading.Lock())
        self._gate_thread: threading.Thread | None = None

    # -- resolving a rank's request -------------------------------------------------------------

    def _device(self, session: Session, uuid: bytes) -> int:
        device = self._devices.get(uuid)
        if device is None:
            try:
                device = self.rt.device_of(uuid)
            except CudaCallError as exc:
                raise FailedPrecondition(
                    f"{session.label()} has its tensors on a GPU smddpd cannot see ({exc}); "
                    "give the daemon every GPU of the node (CUDA_VISIBLE_DEVICES, or NVIDIA_VISIBLE_DEVICES=all in a container)"  # noqa: E501
                ) from None
            self._devices[uuid] = device
        return device

    def _event(
        self, session: Session, handles: _RankHandles, handle: bytes, device: int, what: str
    ) -> Any:
        if len(handle) != 64:
            raise InvalidRequest(
                f"{session.label()}: the {what} event handle has {len(handle)} bytes, not 64"
            )
        cached = handles.events.get(handle)
        if cached is not None:
            handles.events.move_to_end(handle)
            return cached[0]
        opened = self._events.get(handle)
        if opened is None:
            try:
                opened = _Opened(self.rt.open_event(handle, device), device)
            except CudaCallError as exc:
                raise InvalidRequest(
                    f"{session.label()}: cannot open its {what} event: {exc}"
                ) from None
            self._events[handle] = opened
        opened.refs += 1
        handles.events[handle] = (opened.obj, device)
        while len(handles.events) > MAX_EVENTS_PER_RANK:
            old, _ = handles.events.popitem(last=False)
            self._bury(handles, functools.partial(self._unref, self._events, old))
        return opened.obj

    def _map(self, session: Session, handles: _RankHandles, buf: pb.CudaBuffer, device: int) -> int:
        """The daemon's address of ``buf``'s first byte, opening the allocation if needed
        (0 for an empty range, which names no allocation)."""
        if buf.nbytes == 0:
            return 0
        if len(buf.ipc_handle) != 64:
            raise InvalidRequest(
                f"{session.label()}: "
                f"a CUDA IPC memory handle has {len(buf.ipc_handle)} bytes, not 64"
            )
        key = (buf.alloc_base, buf.buffer_id, device)
        mapping = handles.mappings.get(key)
        if mapping is not None and mapping.handle != buf.ipc_handle:
            mapping = None  # a client that sends no buffer ids (0) reused the address
        if mapping is None:
            # Any other allocation at that base is gone: the rank freed it and got a new
            # one at the same address (its free not reported, or reported to another
            # communicator).
            self._close_base(handles, buf.alloc_base, lambda m: m.handle != buf.ipc_handle)
            opened = self._memory.get((buf.ipc_handle, buf.buffer_id, device))
            if opened is None:
                try:
                    address = self.rt.open_memory(buf.ipc_handle, device)
                except CudaCallError as exc:
                    raise InvalidRequest(
                        f"{session.label()}: "
                        f"cannot open the CUDA IPC handle of its allocation at 0x{buf.alloc_base:x}: "  # noqa: E501
                        f"{exc}"
                    ) from None
                try:
                    size = self.rt.mapped_size(address)
                except CudaCallError as exc:
                    # Never the size the rank declares (alloc_bytes): a rank could then make
                    # the kernels write past what was mapped.
                    self._quietly(lambda: self.rt.close_memory(address, device))
                    raise InvalidRequest(
                        f"{session.label()}: "
                        f"the size of its allocation at 0x{buf.alloc_base:x} cannot be read from the mapping ({exc}); "  # noqa: E501
                        "smddpd refuses a GPU range it cannot bound"
                    ) from None
                opened = _Opened(address, device, size)
                self._memory[(buf.ipc_handle, buf.buffer_id, device)] = opened
            opened.refs += 1
            mapping = _Mapping(buf.ipc_handle, opened.obj, device, opened.size, buf.buffer_id)
            handles.mappings[key] = mapping
            while len(handles.mappings) > MAX_MAPPINGS_PER_RANK:
                _, old = handles.mappings.popitem(last=False)
                self._bury_mapping(handles, old)
        else:
            handles.mappings.move_to_end(key)
        if buf.offset + buf.nbytes > mapping.size:
            raise InvalidRequest(
                f"{session.label()}: "
                f"GPU range [{buf.offset}, {buf.offset + buf.nbytes}) lies outside its allocation of {mapping.size} bytes at 0x{buf.alloc_base:x}"  # noqa: E501
            )
        return mapping.address + buf.offset

    def _resolve(
        self, comm: Communicator, rank: int, session: Session, req: pb.OpRequest
    ) -> _Resolved:
        cuda = req.cuda
        device = self._device(session, cuda.device_uuid)
        handles = self._ranks.get(session)
        if handles is None:
            handles = _RankHandles(streams=self._comm_streams(comm))
            self._ranks[session] = handles
        # First what the rank freed: a buffer of this op may be a new allocation there.
        for freed in cuda.freed:
            bid = freed.buffer_id
            self._close_base(
                handles,
                freed.alloc_base,
                functools.partial(_of_buffer, bid),
            )
        ready = self._event(session, handles, cuda.ready_event, device, "ready")
        done = self._event(session, handles, cuda.done_event, device, "done")
        return _Resolved(
            rank=rank,
            session=session,
            handles=handles,
            req=req,
            device=device,
            ready=ready,
            done=done,
            inputs=[self._map(session, handles, b, device) for b in cuda.inputs],
            outputs=[self._map(session, handles, b, device) for b in cuda.outputs],
            in_bytes=[b.nbytes for b in cuda.inputs],
            out_bytes=[b.nbytes for b in cuda.outputs],
        )

    # -- releasing ----------------------------------------------------------------------------

    def _close_base(
        self, handles: _RankHandles, base: int, which: Callable[[_Mapping], bool]
    ) -> None:
        """Closes, once the work already queued on the rank's streams has passed them, the
        rank's mappings (on every GPU) at allocation base ``base`` that ``which`` picks."""
        for k in [k for k, m in handles.mappings.items() if k[0] == base and which(m)]:
            self._bury_mapping(handles, handles.mappings.pop(k))

    def _bury_mapping(self, handles: _RankHandles, mapping: _Mapping) -> None:
        key = (mapping.handle, mapping.buffer_id, mapping.device)
        self._bury(handles, lambda: self._unref(self._memory, key))

    def _unref(self, table: dict[Any, _Opened], handle: Any) -> None:
        """Drops one rank entry's reference; the last one closes the handle."""
        opened = table.get(handle)
        if opened is None:
            return
        opened.refs -= 1
        if opened.refs > 0:
            return
        del table[handle]
        if table is self._memory:
            self.rt.close_memory(opened.obj, opened.device)
        else:
            self.rt.destroy_event(opened.obj, opened.device)

    def _marks(self, handles: _RankHandles) -> list[tuple[Any, int]]:
        """Events recorded now on the work streams of the rank's communicator: once they
        have fired, no work queued so far can use the rank's handles. (Other communicators'
        streams never touch them, and may be stuck on a dead rank of theirs.)"""
        marks = []
        if handles.streams is not None:
            for device, stream in handles.streams.streams.items():
                event = self.rt.new_event(device)
                self.rt.record_event(event, stream, device)
                marks.append((event, device))
        return marks

    def _bury(self, handles: _RankHandles, release: Callable[[], None]) -> None:
        """Runs ``release`` (in ``collect``) once the work queued so far on the streams of the
        rank's communicator has finished: queued kernels may still use what it frees."""
        self._graveyard.append((self._marks(handles), release))
        self._wake_gates()

    def close_before_free(self, pid: int, base: int, wait_s: float) -> tuple[int, int]:
        """Unmaps, before returning, every mapping of the allocation at ``base`` in the
        sessions of process ``pid`` (the kernel's pid of their data-socket connections): the
        rank's allocator is about to cudaFree it (its free channel, ``smddp.server.gpu_free``).

        Why closing now is safe: torch's allocator returns only segments none of whose blocks
        is allocated, and a block smddp used was kept alive until the op's reply, after
        which the rank's stream waits on the op's done event; so no later op can name the
        segment. But the free is not synchronised with the GPU (release_block runs just
        before cudaFree, which syncs the rank's own context, not smddpd's streams): work
        smddpd queued may still be running on it. So the mappings close once an event
        recorded now on each of the communicator's work streams has fired, waited for here
        outside the daemon's lock for at most ``wait_s``; a mapping whose work is not done
        by then is closed by the gate thread as soon as it is (``collect``), without
        waiting for the rank's next op.

        Returns:
            (mappings closed before returning, mappings left to close later).
        """
        with self._lock:
            pending: list[tuple[list[tuple[Any, int]], tuple[bytes, int, int]]] = []
            for session, handles in list(self._ranks.items()):
                if getattr(session, "peer_pid", None) != pid:
                    continue
                for key in [k for k in handles.mappings if k[0] == base]:
                    mapping = handles.mappings.pop(key)
                    pending.append(
                        (
                            self._marks(handles),
                            (mapping.handle, mapping.buffer_id, mapping.device),
                        )
                    )
        deadline = time.monotonic() + wait_s
        done = [False] * len(pending)
        step = 0
        while True:
            for i, (marks, _) in enumerate(pending):
                if not done[i]:
                    try:
                        done[i] = all(self.rt.event_done(e, d) for e, d in marks)
                    except CudaCallError:
                        done[i] = True  # a failed query will not succeed later
            if all(done) or time.monotonic() >= deadline:
                break
            time.sleep(_GATE_POLL_S[min(step, len(_GATE_POLL_S) - 1)])
            step += 1
        closed = deferred = 0
        with self._lock:
            for (marks, opened), finished in zip(pending, done):
                if not finished:
                    # Closed by the gate thread as soon as the work has passed it: the
                    # rank's free has gone ahead, and the driver returns the memory only
                    # once this mapping is closed too.
                    self._graveyard.append(
                        (marks, functools.partial(self._unref, self._memory, opened))
                    )
                    deferred += 1
                    continue
                for e, d in marks:
                    self._quietly(functools.partial(self.rt.destroy_event, e, d))
                self._quietly(functools.partial(self._unref, self._memory, opened))
                closed += 1
        if deferred:
            self._wake_gates()
        return closed, deferred

    def collect(self) -> None:
        """Releases what ``_bury`` set aside whose work has finished (never blocks)."""
        with self._lock:
            keep = []
            for marks, release in self._graveyard:
                try:
                    finished = all(self.rt.event_done(e, d) for e, d in marks)
                except CudaCallError:
                    finished = True  # a failed query will not succeed later: release now
                if not finished:
                    keep.append((marks, release))
                    continue
                for e, d in marks:
                    self._quietly(functools.partial(self.rt.destroy_event, e, d))
                self._quietly(release)
            self._graveyard = keep

    def _collect_if_free(self) -> None:
        """``collect`` from the gate thread, unless an op holds the daemon's lock (that op
        collects itself): the gate thread never waits behind the ops."""
        if not self._graveyard or not self._lock.acquire(blocking=False):
            return
        try:
            self.collect()
        finally:
            self._lock.release()

    @staticmethod
    def _quietly(fn: Callable[[], None]) -> None:
        try:
            fn()
        except CudaCallError as exc:
            log.warning("releasing a CUDA resource failed: %s", exc)

    def release_rank(self, session: Session) -> None:
        """Closes a departed rank's mappings and events once queued work no longer needs them."""
        with self._lock:
            handles = self._ranks.pop(session, None)
            if handles is None:
                return
            for mapping in handles.mappings.values():
                self._bury_mapping(handles, mapping)
            for handle in handles.events:
                self._bury(handles, functools.partial(self._unref, self._events, handle))
        self.collect()

    def abort_comm(self, comm: Communicator) -> None:
        """Opens every gate of the failed communicator, now and for any op still queued.

        Its ops whose ranks' events have not fired (a dead rank's never will) go ahead:
        their outputs are undefined, as the communicator has failed, but the work streams
        get to the survivors' done events. Waiting for the teardown instead would wedge a
        survivor whose host waits on its stream (``loss.item()`` after the op): it never
        leaves, so the teardown never comes."""
        with self._lock:
            cs = self._streams.get(comm)
            if cs is None:
                # Its first GPU op may still be on its way here (being resolved, or queued
                # behind another op): its gates must not wait for the teardown either.
                self._aborted.add(comm)
        if cs is not None:
            self._abort(cs)

    def _abort(self, cs: _CommStreams) -> None:
        with self._gate_wake:
            cs.aborted = True
            self._gate_wake.notify()

    def release_comm(self, comm: Communicator) -> None:
        """Destroys the communicator's streams once their work has finished (in the background:
        a stream waiting on a dead rank's event may take long)."""
        with self._lock:
            cs = self._streams.pop(comm, None)
        if cs is None:
            return
        self._abort(cs)  # the work streams finish (``abort_comm``)

        def drain() -> None:
            with supervise.unit("releasing a communicator's GPU streams", comm.name()):
                release()

        def release() -> None:
            while cs.pending:
                time.sleep(0.001)  # the gate thread opens them at once
            for device, stream in cs.streams.items():
                self._quietly(functools.partial(self.rt.synchronize, stream, device))
                self._quietly(functools.partial(self.rt.destroy_stream, stream, device))
            # A gate stream may wait forever on a dead rank's event: destroyed without a
            # wait (CUDA frees it once its work is done, if ever); nothing else waits on it.
            for device, gate in cs.gates.items():
                self._quietly(functools.partial(self.rt.destroy_stream, gate, device))
            for device, event in cs.joins.items():
                self._quietly(functools.partial(self.rt.destroy_event, event, device))
            for device, spare in cs.spare_marks.items():
                for event in spare:
                    self._quietly(functools.partial(self.rt.destroy_event, event, device))
            for flag in cs.flags.values():  # the work streams that read them are done
                self._quietly(functools.partial(self.rt.destroy_flag, flag))
            if cs.staging is not None:  # as the staging buffers
                self._quietly(cs.staging.close)
            self.collect()

        threading.Thread(target=drain, name="smddp-gpu-drain", daemon=True).start()

    # -- the gates ------------------------------------------------------------------------------

    def _gate(self, cs: _CommStreams, marks: list[tuple[Any, int]]) -> int:
        """Queues the next ticket's gate: its work waits until ``marks`` (daemon events after
        the ranks' ready events, on the gate streams) have fired. Returns the ticket."""
        with self._gate_wake:
            cs.ticket += 1
            cs.pending.append((cs.ticket, marks))
            self._gated[id(cs)] = cs
            self._start_gates()
            self._gate_wake.notify()
            return cs.ticket

    def _start_gates(self) -> None:
        """Starts the gate thread if it is not running. ``_gate_wake`` held."""
        if self._gate_thread is None:
            self._gate_thread = threading.Thread(
                target=self._gate_loop, name="smddp-gpu-gates", daemon=True
            )
            self._gate_thread.start()

    def _wake_gates(self) -> None:
        """Has the gate thread watch the graveyard too: what is buried there is released as
        soon as its work is done, not at the next op (which may never come: a rank whose
        retry after an out-of-memory waits for the memory)."""
        with self._gate_wake:
            self._start_gates()
            self._gate_wake.notify()

    def _gate_loop(self) -> None:
        idle = 0
        while True:
            with self._gate_wake:
                if not self._gated and not self._graveyard:
                    self._gate_wake.wait()
                    idle = 0
                comms = list(self._gated.values())
            progressed = False
            for cs in comms:
                # One communicator's gates that raise fail that communicator; the thread
                # goes on opening the others'.
                with supervise.unit(
                    "opening a communicator's GPU gates",
                    on_error=functools.partial(self._gates_failed, cs),
                ):
                    progressed |= self._open_gates(cs)
            buried = len(self._graveyard)
            with supervise.unit("releasing finished GPU work"):
                self._collect_if_free()
            progressed |= len(self._graveyard) < buried
            if progressed:
                idle = 0
                continue
            with self._gate_wake:
                self._gate_wake.wait(_GATE_POLL_S[min(idle, len(_GATE_POLL_S) - 1)])
            idle += 1

    def _gates_failed(self, cs: _CommStreams, exc: Exception) -> None:
        """Fails the communicator whose gates raised, and opens them (as for an abort)."""
        with self._lock:
            comm = next((c for c, s in self._streams.items() if s is cs), None)
        if comm is not None:
            comm.internal_error("opening its GPU gates", exc)
        self._abort(cs)

    def _open_gates(self, cs: _CommStreams) -> bool:
        """Opens ``cs``'s gates whose marks have fired, in ticket order (all of them once it
        is aborted). True when any opened."""
        opened = 0
        last: tuple[int, list[tuple[Any, int]]] | None = None
        while cs.pending:
            ticket, marks = cs.pending[0]
            # A mark that fired is kept for the next op; one of an aborted communicator (it
            # may never fire) or that failed is destroyed.
            reuse = not cs.aborted
            if not cs.aborted:
                try:
                    if not all(self.rt.event_done(e, d) for e, d in marks):
                        break
                except CudaCallError as exc:
                    log.warning("a gate's event failed (%s): opening it", exc)
                    reuse = False
            for e, d in marks:
                if reuse:
                    cs.spare_marks.setdefault(d, []).append(e)
                else:
                    self._quietly(functools.partial(self.rt.destroy_event, e, d))
            # Popped after the marks are put away: the drain, which waits for an empty
            # queue, then finds every spare mark to destroy.
            last = cs.pending.popleft()
            opened += 1
        if last is not None:
            self._quietly(lambda: cs.open(last[0]))
        with self._gate_wake:
            if not cs.pending:
                self._gated.pop(id(cs), None)
        return opened > 0

    # -- running ops --------------------------------------------------------------------------

    def _comm_streams(self, comm: Communicator) -> _CommStreams:
        with self._lock:
            cs = self._streams.get(comm)
            if cs is None:
                cs = _CommStreams(self.rt)
                cs.aborted = comm in self._aborted
                self._streams[comm] = cs
            return cs

    def _peer(self, device: int, peer: int, who: str) -> None:
        if device == peer or (device, peer) in self._peers:
            return
        try:
            self.rt.enable_peer(device, peer)
        except CudaCallError as exc:
            raise FailedPrecondition(
                f"{who}: "
                f"GPU {device} cannot access the memory of GPU {peer} ({exc}); "
                "smddp needs peer access (NVLink or PCIe P2P) between the GPUs of a communicator"
            ) from None
        self._peers.add((device, peer))

    def execute(
        self,
        comm: Communicator,
        ranks: Sequence[int],
        sessions: Sequence[Session],
        reqs: Sequence[pb.OpRequest],
    ) -> None:
        """Queues one matched GPU collective; ``reqs[i]`` is rank ``ranks[i]``'s request.

        Raises:
            InvalidRequest: buffers that do not fit the op, handles that do not open.
            FailedPrecondition: a GPU the daemon cannot see or reach.
        """
        _check_all_gpu(ranks, reqs)
        self._prepare(sessions, reqs)
        with self._lock:
            self.collect()
            resolved = [self._resolve(comm, r, s, q) for r, s, q in zip(ranks, sessions, reqs)]
            # Mappings of freed allocations close now if their streams are idle.
            self.collect()
            work = _Work(self, comm, resolved)
            work.plan()
            work.run()

    def _prepare(self, sessions: Sequence[Session], reqs: Sequence[pb.OpRequest]) -> None:
        """Compiles the op's kernels before the lock is taken: one job's first op of a new
        dtype or fan-in never stalls the other jobs' ops (``_Work.reduce`` finds them ready).
        Bad requests are left to ``execute``'s checks, which name the problem."""
        req = reqs[0]
        w = len(reqs)
        # The one key the kernels' cache is prepared from too (gpu_kernels.module_keys).
        key = gpu_kernels.op_module_key(req.kind, req.dtype, req.reduce_op, w)
        if key is None:
            return
        try:
            devices = [self._device(s, q.cuda.device_uuid) for s, q in zip(sessions, reqs)]
        except SmddpError:
            return
        if req.kind == pb.REDUCE:
            root = req.root if 0 <= req.root < w else 0
            wanted = {(devices[root], key)}
        else:  # all_reduce, reduce_scatter: every rank's GPU launches
            wanted = {(d, key) for d in devices}
        for device, key in sorted(wanted):
            try:
                self.rt.prepare(device, key)
            except CudaCallError:
                return  # the launch meets it again and fails the op with the message

    def execute_p2p(
        self,
        comm: Communicator,
        sender: tuple[Session, pb.OpRequest],
        receiver: tuple[Session, pb.OpRequest],
    ) -> None:
        """Queues one matched send/recv pair (the receiver's stream copies).

        Raises:
            InvalidRequest: sizes that disagree or handles that do not open.
        """
        (s_send, send), (s_recv, recv) = sender, receiver
        _check_all_gpu([s_send.rank, s_recv.rank], [send, recv])
        with self._lock:
            self.collect()
            a = self._resolve(comm, s_send.rank, s_send, send)
            b = self._resolve(comm, s_recv.rank, s_recv, recv)
            self.collect()
            if len(a.inputs) != 1 or len(b.outputs) != 1:
                raise InvalidRequest("a GPU send names one input and a GPU recv one output")
            if a.in_bytes[0] != b.out_bytes[0]:
                raise InvalidRequest(
                    f"send of {a.in_bytes[0]} bytes from rank {a.rank} meets a recv of {b.out_bytes[0]} bytes"  # noqa: E501
                )
            work = _Work(self, comm, [a, b])
            work.copy(b.device, b.outputs[0], work.inp(a, 0, b.device), a.in_bytes[0], a.device)
            work.run()

    # -- ops that span nodes ------------------------------------------------------------------

    def execute_across(
        self,
        comm: Communicator,
        ranks: Sequence[int],
        sessions: Sequence[Session],
        reqs: Sequence[pb.OpRequest],
        exchange: Exchange,
    ) -> None:
        """Runs one matched GPU collective of a communicator that spans nodes, for this
        node's ranks (``reqs[i]`` is rank ``ranks[i]``'s request), chunk by chunk: the
        node's tensors into pinned host memory (reduced by the kernels, in rank order, or
        copied side by side), ``exchange`` (the node-to-node algorithms of host memory) on
        it, the results into every local rank's tensors; a chunk is copied down while the
        one before is in the exchange (``gpu_staging``). Returns once the last chunk's
        copies and the ranks' done events are queued.

        Raises:
            InvalidRequest: buffers that do not fit the op, handles that do not open.
            FailedPrecondition: a GPU the daemon cannot see or reach, a failed CUDA call.
            PeerError: a node did not answer, or the GPU did not finish a chunk in time.
        """
        _check_all_gpu(ranks, reqs)
        self._prepare_node(sessions, reqs)
        with self._lock:
            self.collect()
            resolved = [self._resolve(comm, r, s, q) for r, s, q in zip(ranks, sessions, reqs)]
            self.collect()
            pool = self._staging(comm)
        _NodeShare(self, comm, resolved, pool, exchange).run()

    def send_across(
        self,
        comm: Communicator,
        session: Session,
        req: pb.OpRequest,
        deliver: Callable[[pb.OpRequest, np.ndarray], None],
    ) -> None:
        """A GPU send to a rank on another node: each chunk (cut as the client cuts host
        sends, so that a host recv can take it) is copied into pinned host memory and handed
        to ``deliver`` with its request (part, parts). Blocks until the last is delivered.

        Raises:
            InvalidRequest: a buffer that does not fit the op.
            PeerError: the node cannot be reached, the GPU did not finish in time.
        """
        _check_all_gpu([session.rank], [req])
        with self._lock:
            self.collect()
            a = self._resolve(comm, session.rank, session, req)
            self.collect()
            pool = self._staging(comm)
        ranges = self._p2p_ranges(comm, a, a.in_bytes, "send", "input")
        who = f"{comm.name()}: {describe_request(req)} to rank {req.root}"
        share = _NodeShare(self, comm, [a], pool, None)
        for p, (lo, hi) in enumerate(ranges):
            nbytes = (hi - lo) * share.itemsize
            buf = pool.take(nbytes, a.device)
            try:
                with self._lock:
                    work = _Work(self, comm, [a])
                    work.copy(a.device, buf.address, a.inputs[0] + lo * share.itemsize, nbytes)
                    marks = share.queue(work, buf, last=p + 1 == len(ranges))
                self._wait_events(marks, comm.timeout_s, who, comm)
                part = pb.OpRequest()
                part.CopyFrom(req)
                part.ClearField("cuda")
                part.part, part.parts = p, len(ranges)
                deliver(part, buf.data[:nbytes])
            except BaseException:
                share.fence()
                raise
            finally:
                pool.give(buf, [])

    def recv_across(
        self,
        comm: Communicator,
        session: Session,
        req: pb.OpRequest,
        subscribe: Callable[[int, Callable[[Frame], None]], None],
    ) -> None:
        """A GPU recv from a rank on another node: ``subscribe(part, callback)`` has each
        chunk's frame (cut as host sends are) handed over; each is copied into pinned host
        memory and from there into the rank's tensor. Blocks until the last is queued.

        Raises:
            InvalidRequest: a frame or buffer that does not fit the op.
            PeerError: the communicator failed or closed before every chunk came.
        """
        _check_all_gpu([session.rank], [req])
        with self._lock:
            self.collect()
            b = self._resolve(comm, session.rank, session, req)
            self.collect()
            pool = self._staging(comm)
        ranges = self._p2p_ranges(comm, b, b.out_bytes, "recv", "output")
        arrived: queue.Queue[tuple[int, Frame]] = queue.Queue()
        for p in range(len(ranges)):
            subscribe(p, functools.partial(lambda part, frame: arrived.put((part, frame)), p))
        frames: dict[int, Frame] = {}
        share = _NodeShare(self, comm, [b], pool, None)
        s = share.itemsize
        try:
            for p, (lo, hi) in enumerate(ranges):
                while p not in frames:
                    try:
                        part, frame = arrived.get(timeout=ARRIVAL_POLL_S)
                    except queue.Empty:
                        if pool.closed or comm.failed() is not None:
                            raise PeerError(
                                f"{describe_request(req)} from rank {req.root}: "
                                "the communicator failed or closed before the data came"
                            ) from None
                        continue
                    frames[part] = frame
                frame = frames.pop(p)
                got = (frame.dtype, frame.count, frame.parts, frame.payload.nbytes)
                if got != (req.dtype, req.count, len(ranges), (hi - lo) * s):
                    sent = f"{frame.count} x {dtype_name(frame.dtype)} in {frame.parts} chunks"
                    ours = f"{describe_request(req)} on {session.label()}"
                    chunk = f"chunk {p} of {len(ranges)}: {frame.payload.nbytes} bytes"
                    raise InvalidRequest(
                        f"send of {sent} from rank {req.root} meets {ours} ({chunk})"
                    )
                buf = pool.take(frame.payload.nbytes, b.device)
                marks: list[tuple[Any, int]] = []
                try:
                    buf.data[: frame.payload.nbytes] = frame.payload.view(np.uint8)
                    with self._lock:
                        work = _Work(self, comm, [b])
                        work.copy(b.device, b.outputs[0] + lo * s, buf.address, (hi - lo) * s)
                        marks = share.queue(work, buf, last=p + 1 == len(ranges))
                finally:
                    pool.give(buf, marks)
        except BaseException:
            share.fence()
            raise

    def _p2p_ranges(
        self, comm: Communicator, r: _Resolved, sizes: list[int], what: str, which: str
    ) -> list[tuple[int, int]]:
        """The chunks of a send or recv across nodes, after checking its one buffer."""
        req = r.req
        itemsize = gpu_kernels.SPECS[req.dtype].itemsize
        if len(sizes) != 1 or sizes[0] != req.count * itemsize:
            raise InvalidRequest(
                f"{comm.name()}: "
                f"{describe_request(req)}: "
                f"a GPU {what} names one {which} of {req.count} x {itemsize} bytes, not {sizes}"
            )
        return gpu_staging.p2p_ranges(req, comm.chunk_bytes)

    def _prepare_node(self, sessions: Sequence[Session], reqs: Sequence[pb.OpRequest]) -> None:
        """Compiles the kernel that combines the node's ranks (``_prepare``'s reason): the
        fan-in of the node's ranks, one output (the staging), AVG as SUM (the division
        comes once, after the nodes have reduced)."""
        req = reqs[0]
        if req.kind not in (pb.ALL_REDUCE, pb.REDUCE) or len(reqs) < 2:
            return
        # A reduce of the node's ranks into one output: the key the kernel cache holds too.
        key = gpu_kernels.op_module_key(pb.REDUCE, req.dtype, _node_op(req.reduce_op), len(reqs))
        if key is None:
            return
        try:
            device = self._device(sessions[0], reqs[0].cuda.device_uuid)
            self.rt.prepare(device, key)
        except SmddpError:
            return  # the op meets it again and fails with the message

    def _staging(self, comm: Communicator) -> gpu_staging.StagingPool:
        """The communicator's staging pool, made at its first op that spans nodes."""
        cs = self._comm_streams(comm)
        if cs.staging is None:
            # The pool's waits are bounded by the group's timeout (no reference to the
            # communicator: the streams of a communicator must not keep it alive).
            timeout_s, who = comm.timeout_s, comm.name()
            cs.staging = gpu_staging.StagingPool(
                self.rt, lambda marks: self._wait_events(marks, timeout_s, who)
            )
        return cs.staging

    def _wait_events(
        self,
        marks: list[tuple[Any, int]],
        timeout_s: float,
        who: str,
        comm: Communicator | None = None,
    ) -> None:
        """Blocks until ``marks`` have fired: the host needs what the GPU wrote (or must
        not overwrite what it reads). Polls, as ``close_before_free`` does.

        Raises:
            PeerError: the communicator failed meanwhile, or ``timeout_s`` passed.
        """
        deadline = time.monotonic() + timeout_s
        step = 0
        while True:
            try:
                if all(self.rt.event_done(e, d) for e, d in marks):
                    return
            except CudaCallError as exc:
                raise FailedPrecondition(f"{who}: waiting for the GPU failed: {exc}") from None
            failure = comm.failed() if comm is not None else None
            if failure is not None:
                raise PeerError(failure[1], kind=failure[0])
            if time.monotonic() > deadline:
                raise PeerError(
                    f"{who}: "
                    f"the GPU did not finish staging through host memory within {timeout_s:.0f} s",
                    kind=pb.TIMEOUT,
                )
            time.sleep(_GATE_POLL_S[min(step, len(_GATE_POLL_S) - 1)])
            step += 1


# What a GPU op that spans nodes runs between nodes on its staging: the requests and arenas of
# the node's share (``Communicator``'s phase 2, ``hierarchical.execute``).
Exchange = Callable[[dict[int, pb.OpRequest], dict[int, Arena]], None]
# How often a recv across nodes looks whether its communicator failed while no data comes.
ARRIVAL_POLL_S = 0.5


def _node_op(reduce_op: int) -> int:
    """The op that combines a node's ranks: an AVG is summed there (and divided by the world
    once, after the nodes), as the host path's node partial is."""
    return pb.SUM if reduce_op == pb.AVG else reduce_op


class _NodeShare:
    """One GPU collective of a communicator that spans nodes, on this node: its chunks
    through the staging pool (``GpuOps.execute_across``)."""

    def __init__(
        self,
        ops: GpuOps,
        comm: Communicator,
        ranks: list[_Resolved],
        pool: gpu_staging.StagingPool,
        exchange: Exchange | None,
    ) -> None:
        self.ops = ops
        self.rt = ops.rt
        self.comm = comm
        self.ranks = ranks
        self.by_rank = {r.rank: r for r in ranks}
        self.pool = pool
        self.exchange = exchange
        self.req = ranks[0].req
        self.who = f"{comm.name()}: {describe_request(self.req)}"
        spec = gpu_kernels.SPECS.get(self.req.dtype)
        self.itemsize = spec.itemsize if spec is not None else 1
        # Where the node's reductions run and its buffers are pinned: the lowest rank's GPU.
        self.home = ranks[0].device
        self.gated = False  # the first chunk waited for the ranks' ready events
        self.queued = False  # work on the ranks' buffers may be queued

    def run(self) -> None:
        """Every chunk: down, exchange, up (the next one's down queued before an exchange)."""
        held: list[tuple[gpu_staging.Staging, list[tuple[Any, int]]]] = []
        try:
            chunks = self._plan()
            held.append(self._down(chunks[0]))
            for i, chunk in enumerate(chunks):
                if i + 1 < len(chunks):
                    held.append(self._down(chunks[i + 1]))
                buf, marks = held[0]
                self.ops._wait_events(marks, self.comm.timeout_s, self.who, self.comm)
                held[0] = (buf, [])
                self._exchange(chunk, buf)
                held[0] = (buf, self._up(chunk, buf, last=i + 1 == len(chunks)))
                self.pool.give(*held.pop(0))
        except BaseException:
            self.fence()
            raise
        finally:
            for buf, marks in held:  # a failed op's: free once their copies are done
                self.pool.give(buf, marks)

    def _plan(self) -> list[gpu_staging.Chunk]:
        local = [
            gpu_staging.Local(
                r.rank,
                r.req,
                tuple(r.in_bytes),
                tuple(r.out_bytes),
                bool(r.inputs and r.outputs and r.inputs[0] == r.outputs[0]),
            )
            for r in self.ranks
        ]
        shape = gpu_staging.Shape(self.req, local, self.comm.nodes, self.comm.chunk_bytes)
        if self.req.kind != pb.ALL_TO_ALL:
            return gpu_staging.plan(shape)
        # The nodes agree on the chunks first: each knows only its own ranks' blocks.
        chunk, value = gpu_staging.a2a_agreement(shape, gpu_staging.a2a_footprint(shape))
        buf = self.pool.take(chunk.size, self.home)
        try:
            buf.data[:8] = value.view(np.uint8)
            self._exchange(chunk, buf)
            largest = int(buf.data[:8].view(np.int64)[0])
        finally:
            self.pool.give(buf, [])
        return gpu_staging.plan(shape, gpu_staging.a2a_parts(largest, self.comm.chunk_bytes))

    def _exchange(self, chunk: gpu_staging.Chunk, buf: gpu_staging.Staging) -> None:
        assert self.exchange is not None
        arenas: dict[int, Arena] = {
            rank: buf.arena(f"{self.who}: the staging of rank {rank}") for rank in chunk.reqs
        }
        self.exchange(chunk.reqs, arenas)

    def _down(self, chunk: gpu_staging.Chunk) -> tuple[gpu_staging.Staging, list[tuple[Any, int]]]:
        """Queues the chunk's copies (or reductions) into a staging buffer; returns the
        buffer and the events that fire once they are done."""
        buf = self.pool.take(chunk.size, self.home)
        try:
            with self.ops._lock:
                work = _Work(self.ops, self.comm, self.ranks)
                for d in chunk.down:
                    dst = buf.address + d.at
                    if len(d.sources) == 1:
                        ref = d.sources[0]
                        r = self.by_rank[ref.rank]
                        work.copy(r.device, dst, r.inputs[ref.index] + ref.offset, d.nbytes)
                        continue
                    inputs = [
                        work.inp(self.by_rank[ref.rank], ref.index, self.home) + ref.offset
                        for ref in d.sources
                    ]
                    work.reduce(
                        self.home,
                        inputs,
                        [dst],
                        d.count,
                        {r.device for r in self.ranks},
                        reduce_op=_node_op(self.req.reduce_op),
                    )
                return buf, self.queue(work, buf, last=False)
        except BaseException:
            self.pool.give(buf, [])
            raise

    def _up(
        self, chunk: gpu_staging.Chunk, buf: gpu_staging.Staging, last: bool
    ) -> list[tuple[Any, int]]:
        """Queues the chunk's copies from the staging buffer into the ranks' outputs (and,
        after the last chunk, the ranks' done events); returns the events after them."""
        with self.ops._lock:
            work = _Work(self.ops, self.comm, self.ranks)
            for u in chunk.up:
                r = self.by_rank[u.target.rank]
                dst = r.outputs[u.target.index] + u.target.offset
                work.copy(r.device, dst, buf.address + u.at, u.nbytes)
            return self.queue(work, buf, last)

    def queue(self, work: _Work, buf: gpu_staging.Staging, last: bool) -> list[tuple[Any, int]]:
        """Queues ``work`` (behind the ready events for the op's first work, before the
        done events for its last); returns events recorded after it on every stream it used,
        on which the host waits before it reads or reuses ``buf``. The daemon's lock held."""
        self.queued = True
        streams = work.run(gate=not self.gated, done=last)
        self.gated = True
        if not work.steps:
            return []
        marks = []
        for device, stream in streams.items():
            event = buf.events.get(device)
            if event is None:
                event = buf.events[device] = self.rt.new_event(device)
            self.rt.record_event(event, stream, device)
            marks.append((event, device))
        return marks

    def fence(self) -> None:
        """After a failure: each rank's done event follows whatever was queued on its
        buffers, so that its stream (and allocator) waits for that work."""
        if not self.queued:
            return
        cs = self.ops._comm_streams(self.comm)
        with self.ops._lock:
            for r in self.ranks:
                stream = cs.streams.get(r.device)
                if stream is not None:
                    self.ops._quietly(
                        functools.partial(self.rt.record_event, r.done, stream, r.device)
                    )


def _check_all_gpu(ranks: Sequence[int], reqs: Sequence[pb.OpRequest]) -> None:
    gpu = [r for r, q in zip(ranks, reqs) if q.HasField("cuda")]
    if len(gpu) != len(reqs):
        host = [r for r in ranks if r not in gpu]
        raise InvalidRequest(
            f"{describe_request(reqs[0])} mixes GPU and host tensors: "
            f"{rank_list(gpu)} on GPUs, {rank_list(host)} in host memory (every rank must pass tensors on the same kind of device)"  # noqa: E501
        )


def _of_buffer(buffer_id: int, mapping: _Mapping) -> bool:
    """Whether a freed buffer ``buffer_id`` (0: unknown) may be ``mapping``'s: its mapping is
    closed then (one with no buffer id of its own may be any buffer's)."""
    return not buffer_id or not mapping.buffer_id or mapping.buffer_id == buffer_id


@dataclass
class _Step:
    device: int
    run: Callable[[Any], None]  # given the device's stream


class _Work:
    """The steps of one op, placed on devices, then queued between the events."""

    def __init__(self, ops: GpuOps, comm: Communicator, ranks: list[_Resolved]) -> None:
        self.ops = ops
        self.rt = ops.rt
        self.comm = comm
        self.ranks = ranks
        self.req = ranks[0].req
        self.steps: list[_Step] = []
        self.who = f"{comm.name()}: {describe_request(self.req)}"
        spec = gpu_kernels.SPECS.get(self.req.dtype)
        self.itemsize = spec.itemsize if spec is not None else 1

    # -- building blocks ------------------------------------------------------------------------

    def inp(self, r: _Resolved, i: int, device: int) -> int:
        """Rank ``r``'s input ``i`` as mapped on ``device`` (opened there if needed)."""
        if device == r.device:
            return r.inputs[i]
        return self.ops._map(r.session, r.handles, r.req.cuda.inputs[i], device)

    def outp(self, r: _Resolved, i: int, device: int) -> int:
        """Rank ``r``'s output ``i`` as mapped on ``device``."""
        if device == r.device:
            return r.outputs[i]
        return self.ops._map(r.session, r.handles, r.req.cuda.outputs[i], device)

    def _need(self, r: _Resolved, inputs: int | None, outputs: int | None) -> None:
        got = (len(r.inputs), len(r.outputs))
        want = (
            len(r.inputs) if inputs is None else inputs,
            len(r.outputs) if outputs is None else outputs,
        )
        if got != want:
            raise InvalidRequest(
                f"{self.who}: "
                f"rank {r.rank} names {got[0]} input and {got[1]} output GPU buffers where {want[0]} and {want[1]} were expected"  # noqa: E501
            )

    def _size(self, nbytes: int, want_elements: int, r: _Resolved, what: str) -> None:
        if nbytes != want_elements * self.itemsize:
            raise InvalidRequest(
                f"{self.who}: "
                f"rank {r.rank}'s {what} holds {nbytes} bytes where {want_elements} x {self.itemsize} were expected (tensors of mismatched sizes?)"  # noqa: E501
            )

    def copy(self, device: int, dst: int, src: int, nbytes: int, peer: int | None = None) -> None:
        """A device-to-device copy on ``device``'s stream (skipped when in place or empty),
        from memory of GPU ``peer`` (peer access enabled first)."""
        if dst == src or nbytes == 0:
            return
        if peer is not None:
            self.ops._peer(device, peer, self.who)
        self.steps.append(_Step(device, lambda s: self.rt.copy(s, device, dst, src, nbytes)))

    def reduce(
        self,
        device: int,
        inputs: list[int],
        outputs: list[int],
        count: int,
        touches: set[int],
        reduce_op: int | None = None,
    ) -> None:
        """Reduces ``count`` elements of ``inputs`` (rank order) into every output, on
        ``device``, whose kernels must reach the memory of the GPUs in ``touches``
        (with ``reduce_op``, where not the op's own)."""
        req = self.req
        op = req.reduce_op if reduce_op is None else reduce_op
        for other in sorted(touches):
            self.ops._peer(device, other, self.who)
        max_grid = self.rt.max_grid(device)

        def step(launch: gpu_kernels.Launch) -> Callable[[Any], None]:
            return lambda s: self.rt.reduce(s, device, req.dtype, op, inputs, outputs, launch)

        for a, b in gpu_kernels.chunks(count, self.itemsize, self.ops.chunk_bytes):
            for launch in gpu_kernels.plan_launches(
                a, b, self.itemsize, inputs + outputs, max_grid
            ):
                self.steps.append(
                    _Step(
                        device,
                        step(launch),
                    )
                )

    # -- the op kinds -------------------------------------------------------------------------

    def plan(self) -> None:
        """Turns the op into steps; checks every rank's buffers against the op first."""
        req, ranks, w = self.req, self.ranks, len(self.ranks)
        kind, n = req.kind, req.count
        root = req.root if kind in ROOTED_KINDS else -1
        if kind == pb.BARRIER:
            return
        if kind in (pb.ALL_REDUCE, pb.BROADCAST, pb.REDUCE):
            for r in ranks:
                self._need(r, 1, 1)
                if kind != pb.BROADCAST or r.rank == root:
                    self._size(r.in_bytes[0], n, r, "input")
                self._size(r.out_bytes[0], n, r, "output")
        elif kind in (pb.ALL_GATHER, pb.GATHER):
            for r in ranks:
                gets = kind == pb.ALL_GATHER or r.rank == root
                self._need(r, 1, w if gets else 0)
                self._size(r.in_bytes[0], n, r, "input")
                for size in r.out_bytes:
                    self._size(size, n, r, "output")
        elif kind in (pb.REDUCE_SCATTER, pb.SCATTER):
            for r in ranks:
                gives = kind == pb.REDUCE_SCATTER or r.rank == root
                self._need(r, w if gives else 0, 1)
                self._size(r.out_bytes[0], n, r, "output")
                for size in r.in_bytes:
                    self._size(size, n, r, "input")
        elif kind == pb.ALL_TO_ALL:
            for r in ranks:
                self._need(r, w, w)
            for s in ranks:
                for d in ranks:
                    if s.in_bytes[d.rank] != d.out_bytes[s.rank]:
                        raise InvalidRequest(
                            f"{self.who}: "
                            f"rank {s.rank} sends {s.in_bytes[d.rank]} bytes to rank {d.rank} but rank {d.rank} expects {d.out_bytes[s.rank]} from rank {s.rank} (input and output split sizes disagree)"  # noqa: E501
                        )
        else:
            raise InvalidRequest(
                f"{self.who}: op kind {KIND_NAMES.get(kind, kind)} cannot run as a GPU collective"
            )
        if kind in REDUCING_KINDS:
            self._plan_reduction(kind, n, root)
        elif kind == pb.BROADCAST:
            src = ranks[root]
            for r in ranks:
                self.copy(
                    r.device,
                    r.outputs[0],
                    self.inp(src, 0, r.device),
                    n * self.itemsize,
                    src.device,
                )
        elif kind in (pb.ALL_GATHER, pb.GATHER):
            for t in ranks:
                for r in ranks[: len(t.outputs)]:
                    self.copy(
                        t.device,
                        t.outputs[r.rank],
                        self.inp(r, 0, t.device),
                        n * self.itemsize,
                        r.device,
                    )
        elif kind == pb.SCATTER:
            src = ranks[root]
            for d in ranks:
                self.copy(
                    d.device,
                    d.outputs[0],
                    self.inp(src, d.rank, d.device),
                    n * self.itemsize,
                    src.device,
                )
        elif kind == pb.ALL_TO_ALL:
            for d in ranks:
                for s in ranks:
                    self.copy(
                        d.device,
                        d.outputs[s.rank],
                        self.inp(s, d.rank, d.device),
                        s.in_bytes[d.rank],
                        s.device,
                    )

    def _plan_reduction(self, kind: int, n: int, root: int) -> None:
        ranks = self.ranks
        everywhere = {r.device for r in ranks}
        if kind == pb.REDUCE_SCATTER:
            # Rank d's output is reduced on d's GPU from every rank's block d.
            for d in ranks:
                self.reduce(
                    d.device,
                    [self.inp(r, d.rank, d.device) for r in ranks],
                    [d.outputs[0]],
                    n,
                    everywhere,
                )
            return
        if kind == pb.REDUCE:
            at = ranks[root].device
            inputs = [self.inp(r, 0, at) for r in ranks]
            self.reduce(at, inputs, [ranks[root].outputs[0]], n, everywhere)
            return
        # all_reduce: one segment per GPU (in rank order of first use), each reduced once and
        # written to every rank's output; on one GPU this is a single pass.
        devices = list(dict.fromkeys(r.device for r in ranks))
        align = max(1, gpu_kernels.VECTOR_BYTES // self.itemsize)
        for device, (a, b) in zip(devices, gpu_kernels.split(n, len(devices), align)):
            if b > a:
                inputs = [self.inp(r, 0, device) for r in ranks]
                outputs = [self.outp(r, 0, device) for r in ranks]
                off = a * self.itemsize
                self.reduce(
                    device, [x + off for x in inputs], [x + off for x in outputs], b - a, everywhere
                )

    # -- queueing -----------------------------------------------------------------------------

    def run(self, gate: bool = True, done: bool = True) -> dict[int, Any]:
        """Queues the steps between the ranks' ready and done events.

        ``gate``/``done`` False (the chunks of an op that spans nodes, but its first and
        last): no wait for the ready events, no done events; the work stream's order keeps
        the chunks after the first one's gate. Returns the streams used, by GPU.

        Every stream involved (of a GPU that works or holds a rank) first waits on the
        communicator's flag for this op's ticket, which the gate thread raises once the gate
        stream of that GPU has passed every rank's ready event; then the steps go to their
        GPUs' streams; then, with several GPUs,
        every stream waits for every working one (join events); then each rank's done event
        is recorded on the stream of its GPU. So no rank's stream passes its done event before
        all inputs were written and all outputs are complete.
        """
        ranks = self.ranks
        working = list(dict.fromkeys(step.device for step in self.steps))
        involved = list(dict.fromkeys(working + [r.device for r in ranks]))
        cs = self.ops._comm_streams(self.comm)
        streams: dict[int, Any] = {}
        queued = False
        try:
            streams = {d: cs.stream(d) for d in involved}
            if gate:
                self._gate_on_ready(cs, involved, streams)
            queued = True
            for step in self.steps:
                step.run(streams[step.device])
            if len(involved) > 1:
                for device in working:
                    self.rt.record_event(cs.join(device), streams[device], device)
                for device in involved:
                    for other in working:
                        if other != device:
                            self.rt.wait_event(streams[device], cs.join(other), device)
            if done:
                for r in ranks:
                    self.rt.record_event(r.done, streams[r.device], r.device)
        except CudaCallError as exc:
            if queued:
                # Kernels may be queued that write the ranks' buffers: each rank's done
                # event still follows them, so its stream (and its allocator) waits for them
                # before reusing the memory, though the op fails.
                for r in ranks:
                    stream = streams.get(r.device)
                    if stream is not None:
                        self.ops._quietly(
                            functools.partial(self.rt.record_event, r.done, stream, r.device)
                        )
            raise FailedPrecondition(
                f"{self.who}: a CUDA call failed while queueing the op: {exc}"
            ) from None
        return streams

    def _gate_on_ready(
        self, cs: _CommStreams, involved: list[int], streams: dict[int, Any]
    ) -> None:
        """Makes every stream in ``involved`` wait on the communicator's flag for a new
        ticket, which the gate thread raises once every rank's ready event has fired."""
        marks = []
        for device in involved:
            gate = cs.gate(device)
            for r in self.ranks:
                self.rt.wait_event(gate, r.ready, device)
            mark = cs.mark(device)
            self.rt.record_event(mark, gate, device)
            marks.append((mark, device))
            cs.flag(device)
        ticket = self.ops._gate(cs, marks)
        for device in involved:
            self.rt.wait_flag(streams[device], cs.flag(device), ticket & 0xFFFFFFFF, device)


def request_bytes(req: pb.OpRequest) -> int:
    """Bytes a rank's GPU request contributes (inputs), for the metrics."""
    return sum(b.nbytes for b in req.cuda.inputs)
