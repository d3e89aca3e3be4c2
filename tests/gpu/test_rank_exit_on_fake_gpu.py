"""A rank process SIGKILLed in the middle of a GPU op, on the fake GPU with a real smddpd.

The daemon's fake runtime (``tests/server/gpu_fakes.py:ipc_queued_runtime``) runs its
streams in order and blocks them, as a GPU does; the victim's ready event of the op it is
killed in never fires (``fake_device.FakeDevice.stalled``: its stream never got there). The
op was matched (every rank submitted it) and queued, so everything the issue's hazard names
is on the line: the survivors' streams wait on their done events (their host waits on
them, as ``loss.item()`` would), their next op must fail naming the dead rank, the daemon's
drain of the communicator must finish, and every mapping (the survivors' and the victim's)
must close. ``tests/gpu/test_cuda_rank_exit.py`` is the same hazard on a real GPU.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
QUEUED_RUNTIME = f"{HERE.parent / 'server' / 'gpu_fakes.py'}:ipc_queued_runtime"
LEDGER_ENV = "SMDDP_TEST_GPU_LEDGER"  # gpu_fakes.LEDGER_ENV

WORLD = 3
VICTIM = 2
BOUND_S = 10.0  # from the kill to each survivor's failure, and to its host wait's end
N = 4099


def _setup(rank: int, world: int, init_file: str) -> tuple[Any, Any]:
    """Joins the world on the fake GPU; returns (the cuda_ranks module, the fake device)."""
    sys.path.insert(0, str(HERE))
    import cuda_ranks

    cuda_ranks.init(rank, world, init_file, cuda_ranks.FAKE)
    return cuda_ranks, cuda_ranks._fake


def stalled_world_rank(rank: int, world: int, init_file: str, victim: int) -> dict[str, Any]:
    """An all_reduce (checked), then one whose ready event the victim never passes; the test
    kills the victim once every rank has printed ``stuck``. A survivor then waits for its
    stream (the stuck op's done event), runs the next op (which must fail), leaves, and
    waits for the daemon to unmap its allocations."""
    import torch
    import torch.distributed as dist

    from smddp.backend.errors import SmddpBackendError
    from smddp.v1 import smddp_pb2 as pb

    cuda_ranks, fake = _setup(rank, world, init_file)
    print(f"pid {os.getpid()}", flush=True)
    stream = fake.current_stream(0)
    check = cuda_ranks.Checker(rank)
    ins = [cuda_ranks.host_values(r, N, torch.float32) for r in range(world)]
    x = cuda_ranks.to_torch(ins[rank], torch.device("cpu"))
    dist.all_reduce(x)
    stream.synchronize(30.0)  # the daemon's blocking streams run after its reply
    check.same("all_reduce before the kill", x, cuda_ranks.host_reduce(ins, pb.SUM))
    if rank == victim:
        fake.stalled = True
    y = cuda_ranks.to_torch(ins[rank], torch.device("cpu"))
    dist.all_reduce(y)  # matched and queued: the reply comes before the work
    print("stuck", flush=True)
    if rank == victim:
        time.sleep(300)  # killed here
    out: dict[str, Any] = {"failures": check.failures}
    try:
        out["synced_s"] = stream.synchronize(2 * BOUND_S)
    except TimeoutError as exc:
        out["synced_s"] = None
        out["sync_error"] = str(exc)
    out["synced_at"] = time.time()
    try:
        dist.all_reduce(x)
        out["type"] = "no error"
    except SmddpBackendError as exc:
        out.update(type=type(exc).__name__, message=str(exc))
    out["failed_at"] = time.time()
    try:
        dist.destroy_process_group()
    except SmddpBackendError as exc:  # the failed group's teardown may say so: fine here
        out["destroy"] = repr(exc)
    # The daemon's fake runtime marks an allocation's file once it unmapped it.
    paths = [a.path for a in fake.allocations]
    deadline = time.monotonic() + 2 * BOUND_S
    while not all(os.path.exists(p + ".closed") for p in paths):
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    out["still_mapped"] = [p for p in paths if not os.path.exists(p + ".closed")]
    out["allocations"] = len(paths)
    return out


def after_rank(rank: int, world: int, init_file: str) -> list[str]:
    """A fresh job on the same daemon after the kill: its GPU all_reduce is right."""
    import torch
    import torch.distributed as dist

    from smddp.v1 import smddp_pb2 as pb

    cuda_ranks, fake = _setup(rank, world, init_file)
    ins = [cuda_ranks.host_values(r, N, torch.float32, salt=3) for r in range(world)]
    x = cuda_ranks.to_torch(ins[rank], torch.device("cpu"))
    dist.all_reduce(x)
    fake.current_stream(0).synchronize(30.0)
    check = cuda_ranks.Checker(rank)
    check.same(
        "all_reduce after another job's rank was killed", x, cuda_ranks.host_reduce(ins, pb.SUM)
    )
    dist.destroy_process_group()
    return check.failures


def _ledger(path: Path) -> list[list[str]]:
    return [line.split(" ", 2) for line in path.read_text().splitlines()] if path.exists() else []


def _unclosed(ledger: list[list[str]]) -> dict[str, str]:
    """Mappings the daemon opened and has not closed: address -> the allocation's file."""
    mapped: dict[str, str] = {}
    for what, *rest in ledger:
        if what == "open":
            mapped[rest[0]] = rest[1]
        elif what == "close":
            mapped.pop(rest[0], None)
    return mapped


@pytest.mark.timeout(300)
def test_a_rank_killed_mid_op_on_the_fake_gpu(start_daemon, spawn_ranks, tmp_path) -> None:
    """SIGKILL a rank whose ready event of a queued op never fires: each survivor's host wait
    on the op ends and its next op raises SmddpRankFailedError naming the victim within
    BOUND_S; the daemon's drain synchronizes and destroys the communicator's work stream,
    every mapping it opened (survivors' and victim's) is closed, a new job's GPU op on the
    same daemon is right, and SIGTERM then stops it with status 0."""
    ledger = tmp_path / "ledger"
    daemon = start_daemon(
        command=(sys.executable, str(HERE / "fake_smddpd.py"), QUEUED_RUNTIME),
        env=dict(os.environ, **{LEDGER_ENV: str(ledger)}),
    )
    env = dict(
        os.environ,
        SMDDP_SOCKET=daemon.socket,
        SMDDP_EMBEDDED="0",
    )
    ranks = spawn_ranks(
        stalled_world_rank, WORLD, WORLD, str(tmp_path / "init"), VICTIM, env=env, timeout_s=120
    )
    ranks.wait_for("stuck")
    victim = ranks.ranks[VICTIM]
    pid = victim.printed_pid()
    assert not _ledger(ledger) or all(line[0] != "synchronize" for line in _ledger(ledger))
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    victim.proc.wait()
    results = []
    for r in ranks.ranks:
        if r.rank == VICTIM:
            continue
        r.proc.wait(timeout=60)
        assert r.proc.returncode == 0, r.failure()
        with open(r.folder / "result", "rb") as f:
            results.append(pickle.load(f))
    for got in results:
        assert not got["failures"], got["failures"]
        assert got["synced_s"] is not None, got.get("sync_error")
        assert got["synced_at"] - killed_at < BOUND_S, got
        assert got["type"] == "SmddpRankFailedError", got
        assert f"rank {VICTIM} (pid {pid}" in got["message"], got["message"]
        assert got["failed_at"] - killed_at < BOUND_S, got
        assert got["allocations"] >= 2 and not got["still_mapped"], got

    # The drain: every stream the daemon synchronized finished, the work and gate streams
    # were destroyed, and no mapping of the job is left (the victim's included).
    deadline = time.monotonic() + BOUND_S
    while _unclosed(_ledger(ledger)) or not any(
        line[0] == "destroy_stream" for line in _ledger(ledger)
    ):
        assert time.monotonic() < deadline, (
            f"smddpd's drain did not finish: {_unclosed(_ledger(ledger))}\n"
            f"{ledger.read_text()}\n{daemon.log()}"
        )
        time.sleep(0.05)
    lines = _ledger(ledger)
    synced = [line for line in lines if line[0] == "synchronize"]
    assert synced and all(line[2] == "ok" for line in synced), synced
    assert len([line for line in lines if line[0] == "destroy_stream"]) == 2, lines
    opened = {line[2] for line in lines if line[0] == "open"}
    victim_folder = f"/sfg{pid}-"
    assert any(victim_folder in p for p in opened), opened  # the victim's were mapped too
    assert daemon.proc.poll() is None, f"smddpd died:\n{daemon.log()}"
    assert "releasing a CUDA resource failed" not in daemon.log(), daemon.log()

    failures = spawn_ranks(after_rank, 2, 2, str(tmp_path / "init2"), env=env, timeout_s=120).join()
    assert not [f for result in failures for f in result], failures
    assert daemon.stop(signal.SIGTERM, timeout_s=10.0) == 0, daemon.log()
    assert "Traceback" not in daemon.log(), daemon.log()
