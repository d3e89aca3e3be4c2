"""A test run that leaves files in /tmp or /dev/shm fails, naming each leftover and its test.

Tests, their daemons and their ranks make folders in /tmp (``smddp-test-*``, ``smddp-barrier-*``,
an embedded daemon's ``smddp-job-*``, torchrun's ``torchelastic_*``, multiprocessing's ``pymp-*``)
and in /dev/shm (the fake GPU's ``sfg<pid>-*``). Every one must be gone when the run ends: a user
who runs the suite should not find two dozen folders in /tmp afterwards.

How it is judged:

- At session start, the watched entries (names that start with a prefix of ``WATCHED``) of /tmp,
  the temporary folder Python uses if that is another, and /dev/shm are noted. Only what appears
  later can be blamed on this run: whatever other programs left there before is not.
- Around each test, the watched entries are listed before and after, so a new entry is
  attributed to the test during which it appeared.
- At session end, each entry that is new and still there is a leftover, and the run exits with
  status 1 (``session.exitstatus``) unless it already failed. The terminal summary's "leftovers"
  section names each one, the test it appeared during, what it holds, and the pid of a process of
  this run that still holds it open, if one does (a process that outlived its test).
- An entry that a live process outside this run holds open (another run of the suite by the
  same user, a job) is not blamed: a process is part of this run when it descends from the
  pytest process or carries ``ENV_RUN`` (set at session start, inherited by every process the
  tests start with the run's environment).

Before judging, the fake GPU's folders of processes that have died are removed (tests that
kill a rank on purpose: a SIGKILLed process runs no exit handler, and /dev/shm is memory).

Loaded by ``tests/conftest.py``; ``tests/test_leftovers.py`` runs it against a scratch suite.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# Set in the pytest process at session start (kept if already set: a nested run of pytest, as
# benchmarks/gpu_check.py starts, belongs to the run that started it).
ENV_RUN = "SMDDP_TEST_RUN"
# Folder -> the name prefixes watched there: what smddp, its tests and the launchers they use
# create. "smddp" covers smddp-test-, smddp-barrier-, smddp-torch-suite-, smddp-sup-,
# smddp-job- (the embedded daemon) and the rest.
WATCHED: dict[str, tuple[str, ...]] = {
    "/tmp": ("smddp", "torchelastic_", "pymp-"),
    "/dev/shm": ("smddp", "sfg"),
}
# The fake GPU's folders (tests/gpu/fake_device.py): /dev/shm/sfg<pid>-<random>.
FAKE_GPU_PREFIX = "sfg"


@dataclass
class _State:
    """What the run noted: the entries at its start and the test each later one appeared in."""

    token: str
    at_start: set[str]
    appeared_in: dict[str, str] = field(default_factory=dict)
    found: list[str] = field(default_factory=list)


_KEY = pytest.StashKey[_State]()


@dataclass
class _Leftover:
    """One leftover, as an entry of the terminal reporter's stats."""

    line: str


def watched_folders() -> dict[str, tuple[str, ...]]:
    """``WATCHED``, plus Python's temporary folder (``TMPDIR``) where it is not /tmp."""
    folders = dict(WATCHED)
    tmp = os.path.realpath(tempfile.gettempdir())
    folders.setdefault(tmp, WATCHED["/tmp"])
    return {folder: prefixes for folder, prefixes in folders.items() if os.path.isdir(folder)}


def listing() -> set[str]:
    """The full paths of the watched entries present now."""
    found = set()
    for folder, prefixes in watched_folders().items():
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        found.update(os.path.join(folder, n) for n in names if n.startswith(prefixes))
    return found


def remove_dead_fake_gpu_folders() -> None:
    """Removes /dev/shm/sfg<pid>-* folders whose process has died (it was killed before its
    exit handler ran: /dev/shm is memory, and nothing else frees it)."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return
    for folder in shm.glob(f"{FAKE_GPU_PREFIX}*-*"):
        pid = folder.name[len(FAKE_GPU_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        shutil.rmtree(folder, ignore_errors=True)


# -- who holds an entry -----------------------------------------------------------------------


def _pids() -> Iterator[int]:
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: read after the last ")".
    return int(stat.rpartition(")")[2].split()[1])


def _paths_held(pid: int) -> Iterator[str]:
    """The files a process has open, its working folder, and the files it has mapped."""
    proc = f"/proc/{pid}"
    try:
        yield os.readlink(f"{proc}/cwd")
        for fd in os.listdir(f"{proc}/fd"):
            try:
                yield os.readlink(f"{proc}/fd/{fd}")
            except OSError:
                pass
        with open(f"{proc}/maps") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    yield parts[5].rstrip("\n")
    except OSError:  # gone, or not ours to read
        return


def _in_run(pid: int, token: str, descendants: set[int]) -> bool:
    if pid in descendants:
        return True
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{ENV_RUN}={token}".encode() in environ.split(b"\0")


def holders(entries: set[str]) -> dict[str, set[int]]:
    """For each entry, the live processes that hold it (or a file under it) open, have it as
    their working folder or map a file under it; a fake GPU folder's pid is its holder too."""
    held: dict[str, set[int]] = {e: set() for e in entries}
    for entry in entries:
        name = os.path.basename(entry)
        if entry.startswith("/dev/shm/") and name.startswith(FAKE_GPU_PREFIX):
            pid = name[len(FAKE_GPU_PREFIX) :].split("-", 1)[0]
            if pid.isdigit() and Path(f"/proc/{pid}").exists():
                held[entry].add(int(pid))
    for pid in _pids():
        for path in _paths_held(pid):
            for entry in entries:
                if path == entry or path.startswith(entry + "/"):
                    held[entry].add(pid)
    return held


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in _pids():
        parent = _parent(pid)
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _command(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return " ".join(raw.decode(errors="replace").split("\0")).strip()[:120]


def _contents(entry: str) -> str:
    if not os.path.isdir(entry) or os.path.islink(entry):
        return "a file"
    try:
        names = sorted(os.listdir(entry))
    except OSError:
        return "a folder"
    if not names:
        return "an empty folder"
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"a folder holding {shown}"


def leftovers(state: _State) -> list[str]:
    """One line for each entry that appeared during the run and is still there."""
    remove_dead_fake_gpu_folders()
    new = listing() - state.at_start
    if not new:
        return []
    held = holders(new)
    # The pytest process too: /proc shows the environment it started with, without ENV_RUN.
    ours = _descendants(os.getpid()) | {os.getpid()}
    lines = []
    for entry in sorted(new):
        in_run = {p for p in held[entry] if _in_run(p, state.token, ours)}
        if held[entry] and not in_run:
            continue  # in use by a process of another run: not this run's to judge
        test = state.appeared_in.get(entry)
        where = f"appeared during {test}" if test else "appeared outside any test"
        line = f"{entry}: {_contents(entry)}, {where}"
        if in_run:
            pids = ", ".join(f"pid {p} ({_command(p)})" for p in sorted(in_run))
            line += f"; still held by {pids}"
        lines.append(line)
    return lines


# -- the hooks --------------------------------------------------------------------------------


def pytest_sessionstart(session: pytest.Session) -> None:
    """Notes the watched entries already there, which this run is not blamed for."""
    token = os.environ.setdefault(ENV_RUN, f"{os.getpid()}-{secrets.token_hex(4)}")
    session.config.stash[_KEY] = _State(token=token, at_start=listing())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Attributes the entries that appear while a test runs (setup to teardown) to that test."""
    state = item.config.stash.get(_KEY, None)
    before = listing()
    try:
        return (yield)
    finally:
        remove_dead_fake_gpu_folders()
        if state is not None:
            for entry in listing() - before:
                state.appeared_in.setdefault(entry, item.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fails the run (exit status 1, unless it already failed) when it left entries behind."""
    state = session.config.stash.get(_KEY, None)
    if state is None:  # the session never started (a usage error)
        remove_dead_fake_gpu_folders()
        return
    state.found = leftovers(state)
    if not state.found:
        return
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:  # no terminal summary to print it in (-p no:terminal)
        sys.stderr.write(_report(state.found) + "\n")
    else:
        # The summary line then ends in "N left behind". Plugins read every entry of stats as
        # a report (hypothesis reads its __dict__): objects, not strings.
        reporter.stats.setdefault("left behind", []).extend(_Leftover(x) for x in state.found)


def _report(found: list[str]) -> str:
    entries = "1 entry" if len(found) == 1 else f"{len(found)} entries"
    head = (
        f"This run left {entries} in /tmp or /dev/shm that it did not find there when it started: "
        f"a test must remove what it creates (try/finally, tmp_path)."
    )
    return "\n".join([head, *(f"  {line}" for line in found)])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Prints the leftovers, one a line, in a "leftovers" section of the summary."""
    state = terminalreporter.config.stash.get(_KEY, None)
    if state is None or not state.found:
        return
    terminalreporter.section("leftovers", sep="=", red=True, bold=True)
    terminalreporter.line(_report(state.found))
