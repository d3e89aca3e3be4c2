"""The rule of ``leftovers``: a run that leaves entries in /tmp or /dev/shm fails, naming them.

A scratch suite in tmp_path makes entries under the watched prefixes in the real /tmp and
/dev/shm, each with this test's own probe name: one test leaves a folder, one a file in
/dev/shm, one a folder that a process it started still holds, one cleans up after itself. Around
that run, an entry made before it started and one that a process outside the run makes (and
holds) while it runs must not be blamed. A real pytest run of it, with the plugin, must exit 1
and name exactly the three leftovers, each with its test; the clean test alone must exit 0.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from leftovers import ENV_RUN

HERE = Path(__file__).resolve().parent

SCRATCH = """
import os, shutil, subprocess, sys, tempfile, time
from pathlib import Path

PROBE = os.environ["PROBE"]
PIDS = Path(os.environ["PIDS"])

def test_leaves_a_folder():
    Path(tempfile.mkdtemp(prefix=PROBE + "-folder-", dir="/tmp"), "smddpd.log").write_text("x")

def test_leaves_a_file_in_dev_shm():
    Path("/dev/shm", PROBE + "-shm").write_text("x")

def test_leaves_a_process_holding_a_folder():
    folder = tempfile.mkdtemp(prefix=PROBE + "-held-", dir="/tmp")
    proc = subprocess.Popen(["sleep", "300"], cwd=folder)
    with open(PIDS, "a") as f:
        f.write(f"{proc.pid}\\n")

def test_cleans_up():
    folder = tempfile.mkdtemp(prefix=PROBE + "-clean-", dir="/tmp")
    try:
        Path(folder, "smddpd.log").write_text("x")
    finally:
        shutil.rmtree(folder)

def test_while_another_run_makes_a_folder():
    # The process outside this run (started by the outer test) makes its folder now.
    Path(os.environ["TRIGGER"]).write_text("go")
    deadline = time.monotonic() + 60
    while not Path(os.environ["FOREIGN"], "held").exists():
        assert time.monotonic() < deadline, "the other process made no folder"
        time.sleep(0.05)
"""

# Outside the scratch run: waits for the trigger, makes its folder and holds a file open in it.
FOREIGN = """
import os, sys, time
from pathlib import Path
trigger, folder = sys.argv[1:3]
while not os.path.exists(trigger):
    time.sleep(0.05)
os.mkdir(folder)
held = open(os.path.join(folder, "held.tmp"), "w")
os.rename(os.path.join(folder, "held.tmp"), os.path.join(folder, "held"))
time.sleep(300)
"""


@pytest.fixture
def probe(tmp_path: Path) -> Iterator[str]:
    """A name prefix of this test's own; every entry under it, and every process the scratch
    run left, is gone afterwards."""
    name = f"smddp-probe-{secrets.token_hex(4)}"
    pids = tmp_path / "pids"
    pids.touch()
    yield name
    for line in pids.read_text().split():
        try:
            os.kill(int(line), signal.SIGKILL)
        except ProcessLookupError:
            pass
    for folder in ("/tmp", "/dev/shm"):
        for entry in Path(folder).glob(name + "*"):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _run(tmp_path: Path, probe: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "tests").mkdir(exist_ok=True)
    (tmp_path / "tests" / "test_scratch.py").write_text(SCRATCH)
    # Without ENV_RUN, the scratch run is a run of its own, not a part of this one.
    env = {k: v for k, v in os.environ.items() if k not in (ENV_RUN, "PYTEST_ADDOPTS", "CI")}
    env.update(
        PYTHONPATH=str(HERE),
        PROBE=probe,
        PIDS=str(tmp_path / "pids"),
        TRIGGER=str(tmp_path / "trigger"),
        FOREIGN=f"/tmp/{probe}-foreign",
    )
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "leftovers", "-p", "no:cacheprovider", "-q",
         "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "basetemp"), *args,
         str(tmp_path / "tests")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip


@pytest.mark.timeout(300)
def test_a_run_that_leaves_entries_fails_and_names_each_with_its_test(
    tmp_path: Path, probe: str
) -> None:
    # There before the run: not its doing.
    before = Path(f"/tmp/{probe}-before")
    before.mkdir()
    # A process outside the run, which makes its folder while the run goes on.
    env = {k: v for k, v in os.environ.items() if k != ENV_RUN}
    foreign = subprocess.Popen(
        [sys.executable, "-c", FOREIGN, str(tmp_path / "trigger"), f"/tmp/{probe}-foreign"],
        env=env,
    )
    (tmp_path / "pids").write_text(f"{foreign.pid}\n")
    try:
        proc = _run(tmp_path, probe)
    finally:
        foreign.kill()
        foreign.wait()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert re.search(r"5 passed, 3 left behind", out), out
    section = out.partition("leftovers")[2]
    named = sorted(re.findall(rf"/(?:tmp|dev/shm)/{probe}[^:]*", section))
    assert [re.sub(r"-(folder|held)-\w+$", r"-\1-", n) for n in named] == [
        f"/dev/shm/{probe}-shm",
        f"/tmp/{probe}-folder-",
        f"/tmp/{probe}-held-",
    ], out
    scratch = "tests/test_scratch.py"
    assert re.search(
        rf"/tmp/{probe}-folder-\w+: a folder holding smddpd\.log, appeared during "
        rf"{scratch}::test_leaves_a_folder\n",
        section,
    ), out
    assert re.search(
        rf"/dev/shm/{probe}-shm: a file, appeared during {scratch}::"
        rf"test_leaves_a_file_in_dev_shm\n",
        section,
    ), out
    sleeper = int((tmp_path / "pids").read_text().split()[-1])
    assert re.search(
        rf"/tmp/{probe}-held-\w+: an empty folder, appeared during {scratch}::"
        rf"test_leaves_a_process_holding_a_folder; still held by pid {sleeper} \(sleep 300\)",
        section,
    ), out
    # What was there before, what the other process holds, what was removed: not named.
    assert before.exists() and f"{probe}-before" not in out, out
    assert f"{probe}-foreign" not in out and f"{probe}-clean" not in out, out


@pytest.mark.timeout(300)
def test_a_run_that_cleans_up_passes(tmp_path: Path, probe: str) -> None:
    proc = _run(tmp_path, probe, "-k", "test_cleans_up")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "1 passed" in out, out
    assert "leftovers" not in out and "left behind" not in out, out
    assert not list(Path("/tmp").glob(probe + "*")), out
