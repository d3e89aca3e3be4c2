"""The control region of a communicator's ranks on one node: its layout, and waiting on its words.

The daemon creates one region (a memfd) per communicator and hands it to the communicator's
ranks on its node only, with their arenas (a communicator spanning nodes has one per node,
for the local phases of its small ops). The ranks run their collectives through it
without a message to the daemon; the daemon maps it too, as supervisor: it writes a failure
into the header (a rank died, a timeout, shutdown), reads in-flight ops for ``smddpctl
status`` and reads the ranks' counters for its metrics. Both sides import this module, which
depends on numpy only.

Layout (int64 words unless said otherwise): a header of ``HEADER_BYTES``, then one slot of
``slot_bytes`` per rank. A slot holds its rank's step counter (every synchronisation point
bumps it; a rank waits until every other rank's step has reached its own), the op sequence
number it last arrived at and completed, the op's signature per parity (double buffered: op
k's signature and data stay readable until every rank has arrived at op k+1), what the
others need to read its memory in place (its pid, the address of a single-copy op's source,
a probe word, and whether it can read theirs), an error area, the rank's metric counters
and its two data buffers. Only the slot's rank writes its slot; only the daemon writes the
header, except the alarm word, which any side sets once. That is the protocol, not a
protection: every rank maps the whole region read-write, so each side reads what others
wrote as untrusted input (the geometry comes from what the daemon registered and the
region's real size, never from the header; lengths are capped; kinds are checked).

x86-64 keeps stores in order (TSO), so data written before a step is bumped is visible to a
rank that sees the bump; numpy writes each aligned int64 word with one store.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time

import numpy as np

from smddp.core.op import OpSpec

MAGIC = 0x534D_4444_5052_4732  # "SMDDPRG2": the layout's version (2: step words on their own line)
HEADER_BYTES = 8192
# Header words.
H_MAGIC = 0
H_WORLD = 1
H_SLOT_BYTES = 2
H_DATA_BYTES = 3
H_ALARM = 4  # nonzero once the communicator failed (daemon) or a rank recorded an error
H_FAILED = 5  # 1 once the daemon wrote a failure below
H_FAIL_KIND = 6
H_FAIL_LEN = 7
FAIL_MSG_OFFSET = 1024  # bytes; the daemon's failure message, UTF-8
FAIL_MSG_MAX = HEADER_BYTES - FAIL_MSG_OFFSET

# Slot words. The step and sleeping words, which the other ranks read at every op, have a
# cache line to themselves: the words the slot's rank writes at every op (S_SEQ, S_DONE,
# S_LAST, S_OPS) would otherwise move that line away from a rank spinning on it, and back,
# several times an op (false sharing; measured: each bounce costs a spinning peer).
S_STEP = 32  # futex word: its low 32 bits
S_SLEEPING = 33  # 1 while the rank may sleep on another rank's step
S_SEQ = 2  # the op the rank last arrived at
S_DONE = 3  # the op the rank last completed
S_PID = 4
S_STATE = 5  # STATE_*
S_LAST = 6  # ops at which this rank arrived last (straggler count)
S_OPS = 7  # ops this rank completed through the region
S_ERR_KIND = 8
S_ERR_LEN = 9
# Reading the others' memory in place (client/peer_memory.py): the address of this rank's
# source of the single-copy op in flight, the address and value of a word in this rank's
# process that identifies it, and this rank's verdict on reading every other rank (READS_*).
S_SOURCE = 10
S_PROBE_ADDRESS = 11
S_PROBE_VALUE = 12
S_READS = 13
SIG_WORD = 16  # two signatures of SIG_WORDS each, by op parity
SIG_WORDS = 8
# Signature words.
G_SEQ, G_KIND, G_DTYPE, G_COUNT, G_ROOT, G_OP, G_ARRIVAL, G_PACKED = range(SIG_WORDS)
ERR_MSG_OFFSET = 512  # bytes into the slot
ERR_MSG_MAX = 4096 - ERR_MSG_OFFSET

STATE_IDLE = 0
STATE_FAILED = 2

READS_UNKNOWN = 0
READS_YES = 1
READS_NO = 2

# Metric counters, per (op kind, dtype), kept by each rank in its slot (the daemon reads them).
KINDS = 16
DTYPES = 16
# Must equal the daemon's histogram buckets (server/metrics.py) so that counts add up.
LATENCY_BUCKETS = (
    1e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
)
NBUCKETS = len(LATENCY_BUCKETS) + 1
# Op table columns: ops, bytes, duration sum (ns), duration buckets.
C_OPS, C_BYTES, C_DUR_SUM = 0, 1, 2
C_DUR_BUCKET = 3
OP_COLS = C_DUR_BUCKET + NBUCKETS
# Skew table (per kind): count, sum (ns), buckets.
K_COUNT, K_SUM, K_BUCKET = 0, 1, 2
SKEW_COLS = K_BUCKET + NBUCKETS
OP_TABLE_OFFSET = 4096  # bytes into the slot
SKEW_TABLE_OFFSET = OP_TABLE_OFFSET + KINDS * DTYPES * OP_COLS * 8
DATA_OFFSET = -(-(SKEW_TABLE_OFFSET + KINDS * SKEW_COLS * 8) // 4096) * 4096

DEFAULT_DATA_BYTES = 256 << 10  # per buffer; a rank has two
# ...and this many for a communicator of at most SMALL_WORLD ranks on the node. An op in the
# region takes one synchronisation, and every rank reduces all of it (so its cost grows with
# the world); a direct op takes two per chunk, each rank reducing its own segment. Measured
# 2026-12-03, paired benchmark, 1 MiB all_reduce, gloo time / smddp time, two runs each: in
# the region 3.94 / 4.03 at w=2 and 5.07 / 4.73 at w=4 (4 ranks on 2 cores), direct 2.13 /
# 2.42 and 4.42 / 4.05. Pages of a memfd are only allocated once written: a job of small ops
# holds no more memory than before.
SMALL_WORLD_DATA_BYTES = 1 << 20
SMALL_WORLD = 4


def data_bytes_for(world_size: int) -> int:
    """The size of each of a rank's two data buffers in a region of ``world_size`` ranks."""
    return SMALL_WORLD_DATA_BYTES if world_size <= SMALL_WORLD else DEFAULT_DATA_BYTES


def slot_bytes(data_bytes: int) -> int:
    """The size of one rank's slot with two data buffers of ``data_bytes``."""
    return DATA_OFFSET + 2 * data_bytes


def region_bytes(world_size: int, data_bytes: int) -> int:
    """The size of a whole region."""
    return HEADER_BYTES + world_size * slot_bytes(data_bytes)


def data_bytes_of(nbytes: int, world: int) -> int | None:
    """The data buffers' size of a region of ``nbytes`` with ``world`` slots, or None when
    no such region has that size."""
    if world < 1:
        return None
    data, rest = divmod(nbytes - HEADER_BYTES - world * DATA_OFFSET, 2 * world)
    return data if rest == 0 and data > 0 and data % 8 == 0 else None


class RegionGeometryError(ValueError):
    """A mapped region whose header disagrees with its size or its registered world."""

    def __init__(self, message: str, trusted: RegionView | None = None) -> None:
        super().__init__(message)
        self.trusted = trusted


def init_header(buf: np.ndarray, world_size: int, data_bytes: int) -> None:
    """Writes a fresh region's header (the daemon, once, before any rank maps it)."""
    words = buf[:HEADER_BYTES].view(np.int64)
    words[H_WORLD] = world_size
    words[H_SLOT_BYTES] = slot_bytes(data_bytes)
    words[H_DATA_BYTES] = data_bytes
    words[H_MAGIC] = MAGIC


def packed_signature(kind: int, dtype: int, count: int, root: int, reduce_op: int) -> int:
    """One int64 that differs whenever two ops' signatures differ (count below 2**35)."""
    return (
        (kind << 58)
        | (dtype << 53)
        | (reduce_op << 49)
        | ((root & 0x3FFF) << 35)
        | (count & ((1 << 35) - 1))
    )


def published_op(sig: tuple[int, ...]) -> OpSpec:
    """The op a rank's signature words (``RegionView.signature_at``) describe."""
    return OpSpec(*sig[G_KIND : G_OP + 1])


class RegionView:
    """Typed views of a mapped region (both sides use them), over the geometry it was made
    with: ``world`` slots whose data buffers hold ``data_bytes`` each.

    Any rank of the communicator can write any word of the region, the header's included,
    so nothing here takes its geometry from the header: the daemon passes what it created
    the region with, a rank what ``mapped`` checked.
    """

    def __init__(self, buf: np.ndarray, world: int, data_bytes: int) -> None:
        """Raises ValueError when ``buf`` is not exactly the region of that geometry."""
        if world < 1 or data_bytes < 0 or data_bytes % 8:
            raise ValueError(f"no region has {world} slots of data buffers of {data_bytes} bytes")
        if buf.nbytes != region_bytes(world, data_bytes):
            raise ValueError(
                f"a region of {world} slots of data buffers of {data_bytes} bytes has {region_bytes(world, data_bytes)} bytes, not {buf.nbytes}"  # noqa: E501
            )
        self.buf = buf
        self.header = buf[:HEADER_BYTES].view(np.int64)
        self.world = world
        self.slot_bytes = slot_bytes(data_bytes)
        self.data_bytes = data_bytes
        self.words = buf.view(np.int64)
        self.slot_words = self.slot_bytes // 8
        base = HEADER_BYTES // 8
        self.slot_base = [base + r * self.slot_words for r in range(self.world)]
        self.slots = (
            buf[HEADER_BYTES : HEADER_BYTES + self.world * self.slot_bytes]
            .view(np.int64)
            .reshape(self.world, -1)
        )
        self.address = buf.ctypes.data

    @classmethod
    def mapped(cls, buf: np.ndarray, world: int | None = None) -> RegionView:
        """A rank's view of the region the daemon handed it, once its header agrees with
        what the rank knows: the region's real size (the memfd is sealed against resizing)
        and ``world``, its communicator's ranks on this node as the daemon registered them
        (None: the header's, checked against the size only).

        Raises:
            RegionGeometryError: the header disagrees (another rank of the job rewrote it,
                or the daemon and the job's smddp are different releases); ``trusted`` is
                the view the size and ``world`` give, when they give one, so that the
                rank can still record the error in its own slot.
        """
        header = buf[:HEADER_BYTES].view(np.int64) if buf.nbytes >= HEADER_BYTES else None
        if header is None or int(header[H_MAGIC]) != MAGIC:
            raise RegionGeometryError(
                "not an smddp control region of this version (the daemon and the job's smddp must be the same release)"  # noqa: E501
            )
        said = (int(header[H_WORLD]), int(header[H_SLOT_BYTES]), int(header[H_DATA_BYTES]))
        if world is None:
            world = said[0]
        trusted = None
        data_bytes = data_bytes_of(buf.nbytes, world)
        if data_bytes is not None:
            trusted = cls(buf, world, data_bytes)
            if said == (world, slot_bytes(data_bytes), data_bytes):
                return trusted
        says = f"{said[0]} ranks, slots of {said[1]} bytes and data buffers of {said[2]} bytes"
        made = f"{world} ranks on this node in {buf.nbytes} bytes"
        why = "a rank of the job wrote over its header"
        raise RegionGeometryError(
            f"the control region's header says {says}, but smddpd made it for {made} ({why})",
            trusted,
        )

    def op_table(self, rank: int) -> np.ndarray:
        """Rank ``rank``'s op counters, shape (KINDS * DTYPES, OP_COLS)."""
        off = HEADER_BYTES + rank * self.slot_bytes + OP_TABLE_OFFSET
        return (
            self.buf[off : off + KINDS * DTYPES * OP_COLS * 8]
            .view(np.int64)
            .reshape(KINDS * DTYPES, OP_COLS)
        )

    def skew_table(self, rank: int) -> np.ndarray:
        """Rank ``rank``'s arrival-skew counters, shape (KINDS, SKEW_COLS)."""
        off = HEADER_BYTES + rank * self.slot_bytes + SKEW_TABLE_OFFSET
        return self.buf[off : off + KINDS * SKEW_COLS * 8].view(np.int64).reshape(KINDS, SKEW_COLS)

    def data(self, rank: int, parity: int) -> np.ndarray:
        """Rank ``rank``'s data buffer for ops of ``parity``, as bytes."""
        off = HEADER_BYTES + rank * self.slot_bytes + DATA_OFFSET + parity * self.data_bytes
        return self.buf[off : off + self.data_bytes]

    def step_address(self, rank: int) -> int:
        """The address of rank ``rank``'s step word (a futex)."""
        return self.address + (self.slot_base[rank] + S_STEP) * 8

    def signature_at(self, rank: int, parity: int) -> tuple[int, ...]:
        """Rank ``rank``'s signature words of ``parity``.

        Parity counts the ops that ran in the region (not the op sequence number, which
        ops through the daemon advance too): a rank can be at most one region op ahead.
        """
        w = self.slot_base[rank] + SIG_WORD + parity * SIG_WORDS
        return tuple(int(x) for x in self.words[w : w + SIG_WORDS])

    def signature(self, rank: int, seq: int) -> tuple[int, ...] | None:
        """Rank ``rank``'s published signature of op ``seq``, or None if it has none."""
        for parity in (0, 1):
            sig = self.signature_at(rank, parity)
            if sig[0] == seq:
                return sig
        return None

    def slot_error(self, rank: int) -> tuple[int, str]:
        """The error kind and message a rank recorded in its slot, as written there: the
        kind may be any int64 (the reader maps it onto the kinds it knows); the message is
        at most ``ERR_MSG_MAX`` bytes whatever its length word says."""
        b = self.slot_base[rank]
        n = min(max(int(self.words[b + S_ERR_LEN]), 0), ERR_MSG_MAX)
        off = HEADER_BYTES + rank * self.slot_bytes + ERR_MSG_OFFSET
        return int(self.words[b + S_ERR_KIND]), _text(self.buf[off : off + n])

    def set_slot_error(self, rank: int, kind: int, message: str) -> None:
        """Records an error in ``rank``'s slot (by that rank) and raises the alarm."""
        data = message.encode()[:ERR_MSG_MAX]
        b = self.slot_base[rank]
        off = HEADER_BYTES + rank * self.slot_bytes + ERR_MSG_OFFSET
        self.buf[off : off + len(data)] = np.frombuffer(data, np.uint8)
        self.words[b + S_ERR_KIND] = kind
        self.words[b + S_ERR_LEN] = len(data)
        self.words[b + S_STATE] = STATE_FAILED
        self.header[H_ALARM] = 1

    def failure(self) -> tuple[int, str] | None:
        """The failure (kind, message) the header holds, or None: the daemon's, unless a
        rank wrote over it (the kind may then be any int64; the message is at most
        ``FAIL_MSG_MAX`` bytes whatever its length word says)."""
        if not self.header[H_FAILED]:
            return None
        n = min(max(int(self.header[H_FAIL_LEN]), 0), FAIL_MSG_MAX)
        return int(self.header[H_FAIL_KIND]), _text(self.buf[FAIL_MSG_OFFSET : FAIL_MSG_OFFSET + n])

    def write_failure(self, kind: int, message: str) -> None:
        """The daemon fails the communicator: message first, then the flags, then wakes all.

        Written whatever the header holds: a rank may have set the flag itself (with no
        message, or just before it died), and the daemon's failure must still reach the
        others. The daemon writes it once (``ControlRegion`` keeps its own failed state).
        """
        data = message.encode()[:FAIL_MSG_MAX]
        self.buf[FAIL_MSG_OFFSET : FAIL_MSG_OFFSET + len(data)] = np.frombuffer(data, np.uint8)
        self.header[H_FAIL_KIND] = kind
        self.header[H_FAIL_LEN] = len(data)
        self.header[H_FAILED] = 1
        self.header[H_ALARM] = 1
        for r in range(self.world):
            futex_wake(self.step_address(r))

    def first_slot_error(self) -> tuple[int, str] | None:
        """The error of the lowest rank that recorded one (the same choice on every rank)."""
        for r in range(self.world):
            if int(self.slots[r, S_STATE]) == STATE_FAILED:
                return self.slot_error(r)
        return None


def _text(data: np.ndarray) -> str:
    """A message as written into the region, without the zero bytes that pad it when its
    length word says more than was written."""
    return bytes(data).decode("utf-8", "replace").strip("\x00")


# -- futex --------------------------------------------------------------------------------------

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_libc = ctypes.CDLL(None, use_errno=True)  # CDLL releases the GIL around the call


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _as_int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def futex_wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleeps while the 32-bit word at ``address`` equals ``expected``'s low 32 bits (shared
    futex: the region is mapped by several processes), at most ``timeout_s``."""
    if _SYS_FUTEX is None:
        time.sleep(min(timeout_s, 0.001))
        return
    ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    _libc.syscall(
        _SYS_FUTEX,
        ctypes.c_void_p(address),
        _FUTEX_WAIT,
        ctypes.c_int(_as_int32(expected)),
        ctypes.byref(ts),
        None,
        0,
    )


def futex_wake(address: int) -> None:
    """Wakes every process sleeping on the word at ``address``."""
    if _SYS_FUTEX is not None:
        _libc.syscall(
            _SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, ctypes.c_int(1 << 30), None, None, 0
        )


def usable_cores() -> int:
    """The CPUs this process may run on (spinning only pays when ranks have a core each)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
