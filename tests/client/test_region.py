"""The control region's protocol, in one process: the daemon's side and ranks as threads.

No daemon process here: ``ControlRegion`` is the daemon's own object, and each rank is a
``ShmPath`` over the same mapping, driven from its own thread, as the engine drives it.
Every test runs twice: with the C part (``smddp.core._fastregion``, which CI builds, so its absence
fails here) and with the Python reference (``SMDDP_NATIVE=0``).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from smddp.client.config import ClientConfig
from smddp.client.errors import DaemonLostError, MismatchError, OpTimeoutError, RankFailedError
from smddp.client.shm import ShmPath
from smddp.core.region import C_BYTES, C_OPS, DTYPES, K_COUNT
from smddp.server.control_region import ControlRegion
from smddp.v1 import smddp_pb2 as pb

NAME = "job j comm 0"


@pytest.fixture(autouse=True, params=["native", "python"])
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which side runs the protocol: the C part or the Python reference."""
    monkeypatch.setenv("SMDDP_NATIVE", "1" if request.param == "native" else "0")
    return str(request.param)


def _ranks(region: ControlRegion, timeout_s: float = 60.0, alive=lambda: True) -> list[ShmPath]:
    def gone() -> DaemonLostError:
        return DaemonLostError("smddpd at test is gone (it stopped or restarted)")

    native_on = ClientConfig.from_env().native
    ranks = [
        # The rank's configuration, as connect builds it: the fixture set SMDDP_NATIVE.
        ShmPath(NAME, r, region.view.buf, timeout_s, alive, gone, native=native_on)
        for r in range(region.view.world)
    ]
    native = os.environ["SMDDP_NATIVE"] == "1"
    assert all((shm.native is not None) == native for shm in ranks), (
        "smddp.core._fastregion is not built (setup.py builds it: pip install -e .)"
    )
    return ranks


def _in_threads(fns) -> list:
    results: list = [None] * len(fns)

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except Exception as exc:  # returned, compared by the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a rank hung"
    return results


def _all_reduce(shm: ShmPath, seq: int, x: np.ndarray) -> np.ndarray:
    """One small all_reduce the way the engine runs it: fill, publish, wait, agree, reduce."""
    shm.check()
    parity = shm.next_parity()
    bufs = shm.typed(parity, x.dtype)
    np.copyto(bufs[shm.rank][: x.size], x)
    target = shm.publish(seq, parity, pb.ALL_REDUCE, 3, x.size, 0, pb.SUM)
    shm.wait(target, seq)
    shm.agree(seq, parity)
    out = np.zeros_like(x)
    for b in bufs:
        out += b[: x.size]
    shm.done(seq, parity, pb.ALL_REDUCE, 3, x.nbytes)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ops_complete_in_order_with_the_same_bits(world: int) -> None:
    region = ControlRegion(world, data_bytes=4096)
    ranks = _ranks(region)
    rng = np.random.default_rng(0)
    inputs = rng.standard_normal((200, world, 64)).astype(np.float32)

    def rank(r: int):
        return [_all_reduce(ranks[r], k + 1, inputs[k, r]) for k in range(200)]

    results = _in_threads([lambda r=r: rank(r) for r in range(world)])
    for k in range(200):
        expected = inputs[k, 0].copy()
        for r in range(1, world):
            expected += inputs[k, r]
        for r in range(world):
            assert results[r][k].tobytes() == expected.tobytes()
    assert region.all_done() and region.pending() is None
    ops, nbytes, skew, last = region.new_counts()
    row = pb.ALL_REDUCE * DTYPES + 3
    assert ops[row, C_OPS] == 200 and nbytes[row] == 200 * world * 64 * 4
    assert skew[pb.ALL_REDUCE, K_COUNT] == 200 and last.sum() == 200  # one last rank per op
    again = region.new_counts()
    assert not again[0].any() and not again[1].any() and not again[3].any()
    assert ops[row, C_BYTES] == 200 * 64 * 4  # the table's own bytes: rank 0's share


@pytest.mark.timeout(60)
def test_mismatch_gives_every_rank_the_same_message() -> None:
    region = ControlRegion(3, data_bytes=4096)
    ranks = _ranks(region)

    def call(r: int) -> None:
        shm = ranks[r]
        count = 8 if r != 2 else 16
        shm.wait(shm.publish(1, shm.next_parity(), pb.ALL_REDUCE, 3, count, 0, pb.SUM), 1)
        shm.agree(1, 1)

    errors = _in_threads([lambda r=r: call(r) for r in range(3)])
    assert all(isinstance(e, MismatchError) for e in errors), errors
    messages = {str(e) for e in errors}
    assert messages == {
        "job j comm 0: rank 2 called all_reduce(SUM, 16 x float32) as op #1 while ranks 0-1 "
        "called all_reduce(SUM, 8 x float32)"
    }, messages
    assert region.rank_error() == (pb.MISMATCH, messages.pop())
    with pytest.raises(MismatchError):
        ranks[0].check()  # later ops fail with it


@pytest.mark.timeout(60)
def test_daemon_failure_wakes_a_sleeping_rank_within_two_seconds() -> None:
    region = ControlRegion(2, data_bytes=4096)
    ranks = _ranks(region)
    shm = ranks[0]
    target = shm.publish(1, shm.next_parity(), pb.BARRIER, 0, 0, 0, 0)
    time.sleep(0.2)  # long past spinning: rank 0 will sleep on rank 1's step word
    pending = region.pending()
    assert pending is not None and pending.arrived == [0] and pending.missing == [1]
    assert pending.description == "barrier()" and pending.seq == 1

    def fail_later() -> None:
        time.sleep(0.5)
        region.fail(pb.RANK_FAILED, "job j comm 0: rank 1 (pid 1, node n) disconnected")

    threading.Thread(target=fail_later).start()
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 .* disconnected"):
        shm.wait(target, 1)
    assert time.monotonic() - start < 2.0
    with pytest.raises(RankFailedError):
        ranks[1].check()  # a rank arriving later gets the same error at once
    assert region.pending() is None  # a failed communicator shows nothing waiting


@pytest.mark.timeout(60)
def test_a_rank_notices_the_daemon_gone() -> None:
    region = ControlRegion(2, data_bytes=4096)
    alive = [True]
    ranks = _ranks(region, alive=lambda: alive[0])
    shm = ranks[0]
    target = shm.publish(1, shm.next_parity(), pb.BARRIER, 0, 0, 0, 0)
    threading.Timer(0.3, lambda: alive.__setitem__(0, False)).start()
    start = time.monotonic()
    with pytest.raises(DaemonLostError, match="is gone"):
        shm.wait(target, 1)
    assert time.monotonic() - start < 2.0


@pytest.mark.timeout(60)
def test_a_rank_times_out_on_its_own_when_the_daemon_cannot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("smddp.client.shm.GRACE_S", 0.0)
    region = ControlRegion(3, data_bytes=4096)
    ranks = _ranks(region, timeout_s=0.3)
    ranks[1].publish(1, ranks[1].next_parity(), pb.BARRIER, 0, 0, 0, 0)
    target = ranks[0].publish(1, ranks[0].next_parity(), pb.BARRIER, 0, 0, 0, 0)
    with pytest.raises(
        OpTimeoutError,
        match=r"op #1 barrier\(\) timed out: rank 2 never arrived while ranks 0-1 waited",
    ):
        ranks[0].wait(target, 1)


@pytest.mark.timeout(60)
def test_pending_names_the_lagging_ranks_for_the_daemons_timeout() -> None:
    region = ControlRegion(3, data_bytes=4096)
    ranks = _ranks(region)
    for r in (0, 2):
        ranks[r].publish(1, ranks[r].next_parity(), pb.BROADCAST, 3, 4096, 1, 0)
    time.sleep(0.05)
    p = region.pending()
    assert p is not None
    assert (p.seq, p.arrived, p.missing, p.description) == (
        1,
        [0, 2],
        [1],
        "broadcast(src=1, 4096 x float32)",
    )
    assert p.waited_s >= 0.05
