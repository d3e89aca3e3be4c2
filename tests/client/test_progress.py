"""The progress thread's order and its claims (``client/progress.py``).

A blocking call claims its op to run it in its own thread, saving two thread handoffs; that
must never let it run before an op submitted earlier has finished, and an op claimed this
way must count as finished at once, not when the thread catches up with its stale entry.
"""

from __future__ import annotations

import threading

import pytest

from smddp.client.progress import ProgressThread


def test_a_claim_runs_the_op_in_the_caller_and_it_counts_as_finished_at_once() -> None:
    p = ProgressThread("test-progress")
    ran_in: list[str] = []
    for _ in range(50):
        p.drain()
        ev = threading.Event()
        claim = p.submit_claimable(lambda: ran_in.append(threading.current_thread().name), ev)
        if claim():
            assert ev.is_set()
            # Finished now, though the thread may not have reached its entry yet: a small op
            # started next need not queue behind it (what busy() tells the communicator).
            assert not p.busy()
        else:
            ev.wait(5)
        assert ev.is_set()
    p.stop()
    assert len(ran_in) == 50
    assert ran_in.count(threading.main_thread().name) > 0


def test_no_claim_while_an_earlier_op_is_unfinished_and_order_holds() -> None:
    p = ProgressThread("test-progress")
    order: list[str] = []
    release = threading.Event()
    started = threading.Event()

    def first() -> None:
        started.set()
        release.wait(10)
        order.append("first")

    p.submit(first)
    ev = threading.Event()
    claim = p.submit_claimable(lambda: order.append("second"), ev)
    assert started.wait(5)
    assert claim() is False  # "first" is still running: the caller must wait
    assert not ev.is_set() and p.busy()
    release.set()
    assert ev.wait(5)
    assert order == ["first", "second"]
    assert claim() is False  # run once only
    p.drain()
    assert not p.busy()
    p.stop()


def test_a_claimed_op_holds_back_what_was_queued_after_it() -> None:
    p = ProgressThread("test-progress")
    order: list[str] = []
    in_first = threading.Event()
    release = threading.Event()

    def first() -> None:
        in_first.set()
        release.wait(10)
        order.append("first")

    ev = threading.Event()
    claim = p.submit_claimable(first, ev)
    p.submit(lambda: order.append("later"))
    claimer = threading.Thread(target=claim)
    # Either the caller or the thread runs "first"; "later" must wait for it in both cases.
    claimer.start()
    assert in_first.wait(5)
    assert order == []
    release.set()
    claimer.join(5)
    p.drain()
    assert order == ["first", "later"]
    p.stop()


def test_an_op_that_raises_releases_its_waiter_and_the_ops_behind_it_still_run(
    capfd: pytest.CaptureFixture[str],
) -> None:
    p = ProgressThread("test-progress")

    def broken() -> None:
        raise RuntimeError("a bug in an op")

    ev = threading.Event()
    p.submit_claimable(broken, ev)
    after = threading.Event()
    p.submit(after.set)
    assert ev.wait(5) and after.wait(5)
    p.drain()
    assert not p.busy()
    p.stop()
    assert "a bug in an op" in capfd.readouterr().err
