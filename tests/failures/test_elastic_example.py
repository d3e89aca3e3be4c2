"""examples/train_elastic.py as docs/failures.md runs it: a rank SIGKILLed, the others go on.

Four workers train DDP; one is killed (by itself at a given step, as the demo does, or by the
test at no particular point, rank 0 included). The three survivors must shrink, redo the step
that failed and finish every step; their parameters and optimizer state must end bitwise equal
to a run that trains the same steps on three ranks from the state they shrank with (the same
reduction order: smddp both times). Also measured, for the note: the time from the kill to the
survivors' first step on the shrunk group, and torchrun's full restart of the same job.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_elastic.py"
RUN_TIMEOUT_S = 240
# Generous for a loaded 2-core CI machine; the target is 1 s.
KILL_TO_STEP_BOUND_S = 10.0
KILL_TO_STEP = re.compile(r"^launcher: kill -> first step on the shrunk group: ([\d.]+) s", re.M)
FIRST_SHRUNK = re.compile(
    r"^rank \d+ -> \d+: first step on the shrunk group done at ([\d.]+)", re.M
)


def _env(tmp_path: Path) -> dict[str, str]:
    # No daemon answers here: the launcher starts the job's embedded one.
    env = dict(os.environ, SMDDP_SOCKET=str(tmp_path / "none.sock"))
    env.pop("SMDDP_EMBEDDED", None)
    return env


def _run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        env=env or _env(tmp_path),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, (
        f"train_elastic.py {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-8000:]}"
    )
    return proc.stdout


def _load(path: Path) -> dict[str, Any]:
    import torch

    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state


def _assert_bitwise_equal(got: Any, want: Any, where: str) -> None:
    import torch

    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got, key=str) == sorted(want, key=str), where
        for k in want:
            _assert_bitwise_equal(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_bitwise_equal(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _check_against_reference(
    tmp_path: Path, dumps: Path, steps: int, min_after: int, world: int = 3
) -> int:
    """Trains ``world`` ranks from the survivors' state at the shrink to ``steps``; the result
    must be bitwise what the survivors reached. Returns the step the survivors shrank at."""
    shrink = _load(dumps / "shrink.pt")
    assert steps - shrink["step"] >= min_after, shrink["step"]
    ref = tmp_path / "reference"
    out = _run(
        tmp_path,
        f"--nproc={world}",
        f"--resume={dumps / 'shrink.pt'}",
        f"--steps={steps}",
        f"--dump-dir={ref}",
    )
    assert "launcher: ranks [] were killed; ranks [] failed" in out, out
    survivors, reference = _load(dumps / "final.pt"), _load(ref / "final.pt")
    assert survivors["step"] == reference["step"] == steps
    # Not trivially equal: training went on after the shrink.
    assert any(not survivors["model"][k].equal(shrink["model"][k]) for k in shrink["model"]), (
        "the parameters did not change after the shrink"
    )
    _assert_bitwise_equal(survivors["model"], reference["model"], "model")
    _assert_bitwise_equal(survivors["optimizer"], reference["optimizer"], "optimizer")
    return int(shrink["step"])


def _check_survivors(out: str, steps: int, killed: list[int], world: int = 3) -> list[float]:
    """Every survivor trained every step on ``world`` ranks; returns when each one completed
    its first step on the shrunk group (seconds since the epoch)."""
    ended = f"launcher: ranks {killed} were killed; ranks [] failed; the others finished"
    assert ended in out, out
    for r in range(world):
        assert f"rank {r}: trained {steps} steps on {world} ranks" in out, out
    firsts = [float(t) for t in FIRST_SHRUNK.findall(out)]
    assert len(firsts) == world, out
    return firsts


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_demo_goes_on_after_a_kill(tmp_path: Path) -> None:
    """The demo command: rank 2 SIGKILLs itself at step 20; 20 more steps on three ranks."""
    dumps = tmp_path / "dumps"
    out = _run(
        tmp_path,
        "--nproc=4",
        "--kill-rank=2",
        "--kill-at-step=20",
        "--steps=40",
        f"--dump-dir={dumps}",
    )
    _check_survivors(out, 40, killed=[2])
    found = KILL_TO_STEP.findall(out)
    assert len(found) == 1, out
    took = float(found[0])
    print(f"kill -> first step on the shrunk group: {took:.3f} s (slowest of 3 survivors)")
    assert took < KILL_TO_STEP_BOUND_S, out
    # The step the kill interrupted is redone, not skipped.
    assert _check_against_reference(tmp_path, dumps, 40, min_after=20) == 20


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_rank_0_killed_anywhere(tmp_path: Path) -> None:
    """The test SIGKILLs rank 0 (whatever it is doing) once training runs; the three others
    go on, from a state that is the same on all of them."""
    steps = 300
    dumps = tmp_path / "dumps"
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--nproc=4", f"--steps={steps}", f"--dump-dir={dumps}"],
        env=_env(tmp_path),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    stepping = threading.Event()
    pid: list[int] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if m := re.match(r"rank 0 pid (\d+)$", line):
                pid.append(int(m[1]))
            if line.startswith("rank 0: step 20 loss"):
                stepping.set()
        stepping.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        assert stepping.wait(RUN_TIMEOUT_S) and proc.poll() is None and pid, "".join(lines)
        killed_at = time.time()
        os.kill(pid[0], signal.SIGKILL)
        rc = proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=30)
    out = "".join(lines)
    assert rc == 0, out[-8000:]
    took = max(_check_survivors(out, steps, killed=[0])) - killed_at
    print(f"kill (rank 0, anywhere) -> first step on the shrunk group: {took:.3f} s")
    assert took < KILL_TO_STEP_BOUND_S, out
    _check_against_reference(tmp_path, dumps, steps, min_after=20)


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_torchrun_restart_for_comparison(tmp_path: Path) -> None:
    """The same job under torchrun --max-restarts 1: the kill ends every worker, and the
    restarted job starts again from step 0. Measured from the kill to the restarted workers'
    first step, beside the shrink's figure."""
    logs = tmp_path / "torchrun-logs"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=4",
            "--max-restarts=1",
            f"--log-dir={logs}",
            "--tee=3",
            str(EXAMPLE),
            "--kill-rank=2",
            "--kill-at-step=20",
            "--steps=40",
        ],
        env=_env(tmp_path),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-8000:]

    def printed(attempt: int, rank: int) -> str:
        files = sorted(logs.glob(f"*/attempt_{attempt}/{rank}/stdout.log"))
        assert len(files) == 1, files
        return files[0].read_text()

    kills = re.findall(r"^rank 2: SIGKILL to itself at step 20, at ([\d.]+)$", printed(0, 2), re.M)
    assert len(kills) == 1, printed(0, 2)
    firsts = []
    for r in range(4):
        text = printed(1, r)
        assert f"rank {r}: trained 40 steps on 4 ranks" in text, text
        firsts += [
            float(t)
            for t in re.findall(
                r"^rank \d+: first step done at ([\d.]+) \(attempt 1\)$", text, re.M
            )
        ]
    assert len(firsts) == 4, firsts
    took = max(firsts) - float(kills[0])
    print(
        f"torchrun --max-restarts 1: kill -> the restarted job's first step: {took:.3f} s (from step 0)"  # noqa: E501
    )
    assert took < 120.0


def _follow(proc: subprocess.Popen[str], lines: list[str], marker: str) -> threading.Event:
    """Collects ``proc``'s output lines; the event is set at the first line that starts with
    ``marker``, or when the output ends."""
    seen = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(marker):
                seen.set()
        seen.set()

    threading.Thread(target=pump, daemon=True).start()
    return seen


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
@pytest.mark.parametrize("where", ["loopback", "netns"])
def test_a_lost_node(where: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Two nodes (two daemons) x 2 ranks, one launcher per node as docs/failures.md says;
    node1's daemon is SIGKILLed: node0's ranks go on as a world of two, bitwise as a two-rank
    run from their state at the shrink; node1's ranks fail (their daemon is gone).
    ``netns``: each node a network namespace of its own, its launcher and ranks in it, the
    store on node0's address across the bridge."""
    from ports import free_port

    nodes = request.getfixturevalue(f"{where}_nodes")(2)
    port = free_port()
    steps = 300
    dumps = tmp_path / "dumps"
    launchers = []
    outputs: list[list[str]] = [[], []]
    stepping = []
    for i, node in enumerate(nodes):
        env = dict(
            os.environ,
            SMDDP_SOCKET=node.daemon.socket,
            SMDDP_NODE_ID=node.node_id,
            SMDDP_EMBEDDED="0",
        )
        cmd = [
            *node.prefix,
            sys.executable,
            str(EXAMPLE),
            "--nnodes=2",
            f"--node-rank={i}",
            "--nproc=2",
            f"--master-addr={nodes[0].address}",
            f"--master-port={port}",
            f"--steps={steps}",
            *([f"--dump-dir={dumps}"] if i == 0 else []),
        ]
        proc = subprocess.Popen(
            cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        launchers.append(proc)
        stepping.append(_follow(proc, outputs[i], "rank 0: step 20 loss"))
    try:
        assert stepping[0].wait(RUN_TIMEOUT_S) and launchers[0].poll() is None, outputs
        killed_at = time.time()
        nodes[1].daemon.proc.kill()
        nodes[1].daemon.proc.wait()
        codes = [p.wait(timeout=RUN_TIMEOUT_S) for p in launchers]
    finally:
        for p in launchers:
            if p.poll() is None:
                p.kill()
                p.wait()
    time.sleep(0.5)  # the pumps' last lines
    out0, out1 = "".join(outputs[0]), "".join(outputs[1])
    assert codes == [0, 1], f"{codes}\n--- node0:\n{out0[-6000:]}\n--- node1:\n{out1[-6000:]}"
    assert "launcher: ranks [] were killed; ranks [2, 3] failed" in out1, out1[-6000:]
    assert "SmddpDaemonLostError" in out1, out1[-6000:]
    assert "ranks [2, 3] failed; 2 ranks go on from step" in out0, out0[-6000:]
    took = max(_check_survivors(out0, steps, killed=[], world=2)) - killed_at
    print(f"node1's daemon killed -> node0's first step on the shrunk group: {took:.3f} s")
    assert took < KILL_TO_STEP_BOUND_S, out0
    _check_against_reference(tmp_path, dumps, steps, min_after=20, world=2)


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_two_ranks_lost_one_after_the_other(tmp_path: Path) -> None:
    """Rank 3 is killed after step 20, then (on the shrunk group) old rank 1 after step 60:
    the survivors shrink twice, to two ranks, and finish."""
    steps = 200
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--nproc=4", f"--steps={steps}"],
        env=_env(tmp_path),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    after_20 = _follow(proc, lines, "rank 0: step 20 loss")
    try:
        assert after_20.wait(RUN_TIMEOUT_S) and proc.poll() is None, "".join(lines)
        found = re.finditer(r"^rank (\d) pid (\d+)$", "".join(lines), re.M)
        pids = {int(m[1]): int(m[2]) for m in found}
        os.kill(pids[3], signal.SIGKILL)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not any(re.match(r"rank 0: step 60 loss [\d.]+ on 3 ranks", x) for x in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.05)
        os.kill(pids[1], signal.SIGKILL)
        rc = proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.5)  # the reader's last lines
    out = "".join(lines)
    assert rc == 0, out[-8000:]
    assert "ranks [3] failed; 3 ranks go on from step" in out, out[-8000:]
    assert "ranks [1] failed; 2 ranks go on from step" in out, out[-8000:]
    assert "launcher: ranks [1, 3] were killed; ranks [] failed; the others finished" in out, out
    for r in range(2):
        assert f"rank {r}: trained {steps} steps on 2 ranks" in out, out[-8000:]
