"""``dist.recv`` / ``dist.irecv`` with no source when the senders are on other nodes.

Two loopback daemons (``loopback_nodes``): ranks 0 and 1 on node0, rank 2 on node1. The
ranks' side is ``rank_main.recv_any``; a message's values say who sent it and which it
was, so the test checks that every message was received once, in its sender's order, and
that the sender ``recv`` reported is the true one, for senders on the receiver's node and
on the other, with the send before or after the receive was posted.
"""

from __future__ import annotations

import pytest

RACE = 4
# Over 512 KiB of float32: with SMDDP_ARENA_BYTES=1048576 it travels in several chunks.
BIG = 300_000


@pytest.mark.timeout(300)
def test_recv_from_any_source_across_nodes(peer_transport, loopback_nodes, launch_world):
    nodes = loopback_nodes(2, peer_transport.args, peer_transport.env)
    spec = {"race": RACE, "big": BIG}
    env = {"SMDDP_ARENA_BYTES": str(1 << 20)}
    got = launch_world("recv_any", nodes, [0, 0, 1], spec, env=env, timeout_s=240).join()
    race = got[0]["race"]
    for reported, (sender, _) in race:
        assert reported == sender, f"recv said rank {reported} for rank {sender}'s message: {race}"
    for s in (1, 2):
        assert [k for _, (r, k) in race if r == s] == list(range(RACE)), race
    assert got[0]["tags"] == [(1, (1, 10)), (2, (2, 10))], got[0]["tags"]
    assert got[0]["posted"] == [(2, (2, 20))], got[0]["posted"]
    assert sorted(got[2]["remote_receiver"]) == [(0, (0, 30)), (1, (1, 30))], got[2]
    # Both ranks named, as the group [0, 2] numbers them: world rank 2 is its rank 1.
    mismatch = got[0]["mismatch"]
    assert "send of 5 x float32 (tag 0) from rank 1" in mismatch, mismatch
    assert "recv(src=any, 7 x float32) (tag 0) on rank 0 (" in mismatch, mismatch
