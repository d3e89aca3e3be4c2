"""torchft on smddp: ProcessGroupSmddp under torchft's Manager, with torchft's own lighthouse.

Two replica groups (one process each, ``torchft_replica.py``) train a small model with
torchft's Manager, DistributedDataParallel and Optimizer wrapper; one is SIGKILLed mid-training
and started again. The survivor must go on committing steps alone, the returning one must be
healed (its parameters bitwise equal to the survivor's at every step both commit, from its
first), and both must then train on together. The same scenario runs on torchft's
ProcessGroupGloo, and both recovery times are printed (``-s`` shows them):

- kill -> the survivor's first step committed alone;
- restart -> the returning replica's first committed step (its process start included), and
  from its Manager's start (torch and torchft imported) to that step.

Skips only where torchft is not installed (scripts/setup_dev.sh installs it; under CI a skip
fails, tests/ci_skips.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (scripts/setup_dev.sh)")

from torchft.coordination import LighthouseServer

SCRIPT = Path(__file__).with_name("torchft_replica.py")
# Generous for a loaded 2-core machine: a replica's start alone (torch, torchft) takes seconds.
WAIT_S = 180.0
TEST_TIMEOUT_S = 900
# The lighthouse: a replica whose heartbeats stop for this long leaves the quorum.
HEARTBEAT_TIMEOUT_MS = 2000
JOIN_TIMEOUT_MS = 2000
# Steps the survivor must commit alone, and both together after the return, before the end.
ALONE_STEPS = 3
TOGETHER_STEPS = 5


@dataclass(frozen=True)
class Commit:
    """One ``commit`` line of a replica: the step reached, who took part, when, and the
    parameters' digest."""

    step: int
    participants: int
    at: float
    digest: str


@dataclass
class Replica:
    """One replica group's process and the steps it committed."""

    number: int
    proc: subprocess.Popen[str]
    log: Path
    commits: list[Commit] = field(default_factory=list)
    manager_at: float = 0.0  # when it began to make its Manager (imports done)
    done: bool = False
    changed: threading.Condition = field(default_factory=threading.Condition)

    def pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            word, *rest = line.split()
            with self.changed:
                if word == "commit":
                    step, participants, at, digest = rest
                    self.commits.append(Commit(int(step), int(participants), float(at), digest))
                elif word == "manager":
                    self.manager_at = float(rest[0])
                elif word == "done":
                    self.done = True
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_until(self, what: str, ok: Callable[[Replica], bool]) -> None:
        """Waits until ``ok(self)``; fails naming ``what`` if the process ends first or time
        runs out."""
        deadline = time.monotonic() + WAIT_S
        with self.changed:
            while not ok(self):
                if self.proc.poll() is not None and not ok(self):
                    pytest.fail(f"replica {self.number} ended before {what}:\n{self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"replica {self.number}: no {what} in {WAIT_S} s:\n{self.tail()}")
                self.changed.wait(min(left, 1.0))

    def first(self, ok: Callable[[Commit], bool]) -> Commit | None:
        with self.changed:
            return next((c for c in self.commits if ok(c)), None)

    def last_step(self) -> int:
        with self.changed:
            return self.commits[-1].step if self.commits else 0

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


class Replicas:
    """Starts replica processes of one scenario; kills what is left at the end."""

    def __init__(self, backend: str, lighthouse: str, env: dict[str, str], folder: Path):
        self.backend, self.lighthouse, self.env, self.folder = backend, lighthouse, env, folder
        self.started: list[Replica] = []

    def start(self, number: int) -> Replica:
        log = self.folder / f"{self.backend}-replica{number}-{len(self.started)}.log"
        with open(log, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), self.backend, self.lighthouse, str(number)],
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        replica = Replica(number, proc, log)
        threading.Thread(target=replica.pump, daemon=True).start()
        self.started.append(replica)
        return replica

    def close(self) -> None:
        for r in self.started:
            if r.proc.poll() is None:
                r.proc.kill()
            r.proc.wait()
            for stream in (r.proc.stdin, r.proc.stdout):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass


@pytest.fixture
def lighthouse() -> Iterator[str]:
    """torchft's lighthouse, in this process: quorums of at least one replica."""
    server = LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=JOIN_TIMEOUT_MS,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
    )
    yield server.address()
    server.shutdown()


def smddp_status(daemon: Any) -> dict[str, object]:
    """``smddpctl --json status`` of ``daemon``."""
    out = subprocess.run(
        [sys.executable, "-m", "smddp.server.ctl", "--socket", daemon.socket, "--json", "status"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    status: dict[str, object] = json.loads(out)
    return status


def kill_and_return(
    backend: str, lighthouse: str, env: dict[str, str], folder: Path, while_both: Callable[[], None]
) -> tuple[float, float, float]:
    """The scenario; returns (kill -> survivor's first step alone, restart -> the returning
    replica's first committed step, its Manager's start -> that step), in seconds.
    ``while_both`` runs once both train again."""
    replicas = Replicas(backend, lighthouse, env, folder)
    try:
        a, b = replicas.start(0), replicas.start(1)
        for r in (a, b):
            r.wait_until("step 5 with both", lambda r: r.first(lambda c: c.step >= 5) is not None)

        killed_at = time.time()
        b.proc.send_signal(signal.SIGKILL)
        b.proc.wait()
        a.wait_until(
            f"{ALONE_STEPS} steps alone after the kill",
            lambda r: (
                sum(c.participants == 1 and c.at > killed_at for c in r.commits) >= ALONE_STEPS
            ),
        )
        alone = a.first(lambda c: c.participants == 1 and c.at > killed_at)
        assert alone is not None
        steps_during_outage = sorted(c.step for c in a.commits if c.at > killed_at)
        assert steps_during_outage == list(
            range(steps_during_outage[0], steps_during_outage[0] + len(steps_during_outage))
        ), f"the survivor's steps after the kill do not go up one by one: {steps_during_outage}"

        restarted_at = time.time()
        back = replicas.start(1)
        back.wait_until("a committed step after its return", lambda r: bool(r.commits))
        returned = back.commits[0]
        goal = returned.step + TOGETHER_STEPS
        for r in (a, back):
            r.wait_until(
                f"step {goal} with both",
                lambda r: r.first(lambda c: c.step >= goal and c.participants == 2) is not None,
            )
        while_both()
        stop = max(a.last_step(), back.last_step()) + 2
        for r in (a, back):
            r.send(f"stop {stop}")
        for r in (a, back):
            r.wait_until("its end", lambda r: r.done)
            assert r.proc.wait(timeout=WAIT_S) == 0, f"replica {r.number} failed:\n{r.tail()}"

        # Healed: from its first committed step on, the returning replica's parameters are
        # the survivor's, bit for bit, at every step both committed.
        mine = {c.step: c.digest for c in back.commits}
        theirs = {c.step: c.digest for c in a.commits}
        common = sorted(set(mine) & set(theirs))
        assert common and common[0] == returned.step, (
            f"the survivor committed no step {returned.step} (its steps: {sorted(theirs)})"
        )
        assert len(common) >= TOGETHER_STEPS
        differ = [s for s in common if mine[s] != theirs[s]]
        assert not differ, f"{backend}: parameters differ at steps {differ} after healing"
        return alone.at - killed_at, returned.at - restarted_at, returned.at - back.manager_at
    finally:
        replicas.close()


def replica_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_kill_one_replica_then_heal_on_smddp_and_gloo(
    daemon: Any, lighthouse: str, tmp_path: Path
) -> None:
    """A replica SIGKILLed mid-training: the other goes on, the returning one is healed."""
    live: list[int] = []

    def one_live_group() -> None:
        # The groups of the quorums before were left: the daemon holds the live one only.
        deadline = time.monotonic() + WAIT_S
        while True:
            comms = smddp_status(daemon).get("comms", [])
            assert isinstance(comms, list)
            if len(comms) == 1:
                live.append(len(comms[0].get("ranks", [])))
                return
            assert time.monotonic() < deadline, f"smddpd holds {len(comms)} groups: {comms}"
            time.sleep(0.5)

    smddp = kill_and_return(
        "smddp", lighthouse, replica_env(SMDDP_SOCKET=daemon.socket), tmp_path, one_live_group
    )
    assert live == [2]
    # And once both replicas ended, nothing of theirs is left in the daemon.
    deadline = time.monotonic() + WAIT_S
    while smddp_status(daemon).get("comms"):
        assert time.monotonic() < deadline, f"smddpd still holds {smddp_status(daemon)}"
        time.sleep(0.5)

    gloo = kill_and_return("gloo", lighthouse, replica_env(), tmp_path, lambda: None)
    print(
        f"\ntorchft recovery (lighthouse heartbeat timeout {HEARTBEAT_TIMEOUT_MS} ms): "
        f"kill -> survivor's first step alone: smddp {smddp[0]:.2f} s, gloo {gloo[0]:.2f} s; "
        f"restart -> returning replica's first step: smddp {smddp[1]:.2f} s, gloo {gloo[1]:.2f} s "
        f"(from its Manager's start: smddp {smddp[2]:.2f} s, gloo {gloo[2]:.2f} s)"
    )


# -- abort with a peer that hangs -------------------------------------------------------------

# The op timeout in the abort test: far longer than the test waits, so only abort can end the op.
HUNG_OP_TIMEOUT_S = 600.0
ABORT_AFTER_S = 1.0
ABORT_BOUND_S = 60.0


def _abort_rank(rank: int, store_port: int) -> dict[str, object]:
    """A rank of a 2-replica ProcessGroupSmddp. Rank 0, once told ``go`` (rank 1 is then
    stopped), starts an all_reduce, aborts from another thread and measures how long the op
    took to fail; then it configures a group of its own for the next quorum and reduces in it."""
    from datetime import timedelta

    import torch
    from torch.distributed import AllreduceOptions

    from smddp.torchft import ProcessGroupSmddp

    pg = ProcessGroupSmddp(timeout=timedelta(seconds=HUNG_OP_TIMEOUT_S))
    pg.configure(f"127.0.0.1:{store_port}/quorum/1", f"replica_{rank}", rank, 2, quorum_id=1)
    t = torch.full((4,), float(rank + 1))
    pg.allreduce([t], AllreduceOptions()).wait()
    assert t.tolist() == [3.0] * 4
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    if rank == 1:
        # After SIGCONT: its group failed when rank 0 left it, and the daemon says why.
        try:
            pg.allreduce([torch.ones(4)], AllreduceOptions()).wait()
            told = ""
        except Exception as exc:
            told = str(exc)
        pg.shutdown()
        return {"told": told}
    work = pg.allreduce([torch.ones(4)], AllreduceOptions())
    threading.Timer(ABORT_AFTER_S, pg.abort).start()
    started = time.monotonic()
    try:
        work.wait()
        error = ""
    except Exception as exc:
        error = str(exc)
    failed_after = time.monotonic() - started
    errored = str(pg.errored())
    pg.configure(f"127.0.0.1:{store_port}/quorum/2", "replica_0", 0, 1, quorum_id=2)
    alone = torch.full((4,), 5.0)
    pg.allreduce([alone], AllreduceOptions()).wait()
    after_abort = str(pg.errored())
    pg.shutdown()
    return {
        "failed_after": failed_after,
        "error": error,
        "errored": errored,
        "after_abort": after_abort,
        "alone": alone.tolist(),
    }


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_abort_ends_an_op_that_waits_on_a_hung_peer(daemon: Any, spawn_ranks: Any) -> None:
    """abort() fails an op blocked on a stopped peer at once (not after the op's timeout), and
    the group of the next quorum works."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ranks = spawn_ranks(
        _abort_rank, 2, store.port, env=replica_env(SMDDP_SOCKET=daemon.socket), timeout_s=WAIT_S
    )
    ranks.wait_for("ready")
    hung = ranks.ranks[1].proc
    hung.send_signal(signal.SIGSTOP)
    try:
        ranks.send("go")
        try:
            ranks.ranks[0].proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"rank 0 did not finish in {WAIT_S} s: abort did not end its op on the hung peer"
            )
    finally:
        hung.send_signal(signal.SIGCONT)
    result, peer = ranks.join()
    assert result["error"], "the all_reduce with a hung peer did not fail after abort"
    # The daemon's reason: this rank's own leaving failed the op.
    assert "has left the communicator" in result["error"], result["error"]
    # ... and it says torchft aborted the group, here and on the peer (not destroy_process_group).
    why = "torchft aborted the process group of replica replica_0 (quorum 1) after an error"
    assert why in result["error"], result["error"]
    assert why in peer["told"] and "rank 0" in peer["told"], peer
    failed_after = result["failed_after"]
    print(f"\nan op on a hung peer failed {failed_after:.2f} s after it started (abort: 1 s)")
    assert result["failed_after"] < ABORT_BOUND_S, (
        f"the op failed {result['failed_after']:.1f} s after it started, not at the abort "
        f"({ABORT_AFTER_S} s): abort waited for the hung peer"
    )
    assert "aborted" in result["errored"], result["errored"]
    assert result["after_abort"] == "None", "configure must clear errored()"
    assert result["alone"] == [5.0] * 4
