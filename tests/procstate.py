"""Stopping a process for a test, for real: ``kill(pid, SIGSTOP)`` returns before the process
has stopped. The kernel stops a thread group in two steps (the thread chosen to take the signal
must run first, then it stops the others), and on a loaded machine the other threads can go on
for milliseconds: long enough for a daemon to answer one more request. ``stop`` returns once
every thread of the process is in the stopped state."""

from __future__ import annotations

import os
import signal
import time


def thread_states(pid: int) -> list[str]:
    """The scheduler state letter of each of ``pid``'s threads (``/proc/PID/task/*/stat``)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:
            continue  # the thread ended in between
        states.append(stat[stat.rindex(")") + 2])  # the field after "(comm)"
    return states


def stop(pid: int, timeout_s: float = 30.0) -> None:
    """Sends SIGSTOP to ``pid`` and returns once all its threads are stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = thread_states(pid)
        if states and all(s in "Tt" for s in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {pid} not stopped {timeout_s} s after SIGSTOP: {states}")
        time.sleep(0.001)
