"""``dist.recv`` and ``dist.irecv`` with no source (torch's ``recv_anysource``), on one node.

Each test runs a world of real ranks on the job's embedded smddpd (``smddp_world``); the
ranks' side is in recv_any_checks.py. Messages say in their values who sent them and which
they were (``origin``), so the tests check that every message was received exactly once,
by the receive it belongs to, and that ``recv`` returned (and ``_source_rank()`` said) its
true sender.
"""

from __future__ import annotations

import os

import pytest
import recv_any_checks as checks
import torch
from smddp_world import run_world

# Bounds a hang only: a world of 3 takes 10-30 s to start on a loaded 2-core machine.
WORLD_TIMEOUT_S = 240


@pytest.mark.timeout(300)
def test_recv_from_any_source_from_each_sender_in_turn() -> None:
    results = run_world(3, checks.in_turn_main, timeout_s=WORLD_TIMEOUT_S)
    for receiver, seen in enumerate(results):
        others = [(receiver + i) % 3 for i in (1, 2)]
        assert seen["turns"] == [[(s, (s, receiver)) for s in others]], seen
    # Sent before the receive was posted: matched when it came.
    assert results[0]["early"] == (2, (2, 50))


@pytest.mark.timeout(300)
def test_irecv_from_any_source_reports_its_sender() -> None:
    results = run_world(3, checks.irecv_main, timeout_s=WORLD_TIMEOUT_S)
    assert results[0]["irecv"] == (2, (2, 1))
    assert results[0]["strided"] == (2, (2, 2))


@pytest.mark.timeout(300)
def test_tags_select_and_each_sender_keeps_its_order() -> None:
    results = run_world(3, checks.tags_main, timeout_s=WORLD_TIMEOUT_S)
    seen = results[0]
    assert seen["tag7"] == (2, (2, 0)), "the tag-7 receive must skip rank 1's tag-5 send"
    assert seen["tag5"] == (1, (1, 0))
    assert seen["order"] == [(1, (1, k)) for k in range(1, 5)]


@pytest.mark.timeout(300)
def test_racing_senders_each_message_received_once() -> None:
    results = run_world(3, checks.race_main, timeout_s=WORLD_TIMEOUT_S)
    got = results[0]["got"]
    for reported, (sender, _) in got:
        assert reported == sender, f"recv said rank {reported} for rank {sender}'s message: {got}"
    expected = {(s, k) for s in (1, 2) for k in range(checks.RACE_MESSAGES)}
    assert sorted(o for _, o in got) == sorted(expected), got
    for s in (1, 2):
        assert [k for _, (r, k) in got if r == s] == list(range(checks.RACE_MESSAGES)), got


@pytest.mark.timeout(300)
def test_messages_of_several_chunks_and_a_named_receive_behind() -> None:
    results = run_world(3, checks.chunked_main, timeout_s=WORLD_TIMEOUT_S)
    assert results[0]["got"] == [(1, (1, 0)), (1, (1, 1)), (2, (2, 0))], results[0]


@pytest.mark.timeout(300)
def test_size_mismatch_names_both_ranks() -> None:
    results = run_world(2, checks.mismatch_main, timeout_s=WORLD_TIMEOUT_S)
    for rank, seen in enumerate(results):
        error = seen["error"]
        assert error is not None, f"rank {rank} saw no error"
        assert "rank 1" in error and "rank 0" in error, error
        assert "recv(src=any, 7 x float32)" in error, error
        assert "send(dst=0, 5 x float32)" in error, error


@pytest.mark.timeout(300)
def test_timeout_says_no_rank_sent_with_that_tag() -> None:
    results = run_world(2, checks.timeout_main, timeout_s=WORLD_TIMEOUT_S, pg_timeout_s=4)
    for rank, seen in enumerate(results):
        error = seen["error"]
        assert error is not None, f"rank {rank} saw no error"
        assert "timed out: no rank sent it a message with tag 3" in error, error
        assert "rank 1's has tag 4" in error, error


def cuda_recv_any_refused(rank: int, world: int, init_file: str) -> str:
    """A receive from any source into a (fake) CUDA tensor; returns its error."""
    import torch.distributed as dist
    from test_cuda_cpu_only import fake_cuda

    import smddp  # noqa: F401

    dist.init_process_group("smddp", init_method=f"file://{init_file}", rank=rank, world_size=world)
    message = "no error"
    if rank == 0:
        try:
            dist.group.WORLD.recv_anysource([fake_cuda(8)], 0)
        except ValueError as exc:  # UnsupportedError
            message = str(exc)
    x = torch.ones(4)
    dist.all_reduce(x)  # nothing was sent: the group is healthy
    assert x.tolist() == [float(world)] * 4
    dist.destroy_process_group()
    return message


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/gpu covers real CUDA tensors")
@pytest.mark.timeout(120)
def test_cuda_tensor_from_any_source_is_refused(daemon, spawn_ranks, tmp_path) -> None:
    env = dict(os.environ, SMDDP_SOCKET=daemon.socket, SMDDP_EMBEDDED="0")
    results = spawn_ranks(cuda_recv_any_refused, 2, 2, str(tmp_path / "init"), env=env).join()
    assert "smddp supports for CPU tensors only" in results[0], results[0]
