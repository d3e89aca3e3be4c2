"""Daemons of one job that would cut or route an op differently refuse each other at once,
naming both settings, instead of meeting in a confusing mismatch or a timeout mid-op."""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

import numpy as np
import pytest

from smddp.client import SmddpError, connect
from smddp.client.communicator import daemon_info
from smddp.server.config import DaemonConfig
from smddp.v1 import smddp_pb2 as pb

MIB = 1 << 20


def test_the_settings_text_is_canonical() -> None:
    """The same choices written differently are the same text; different choices differ."""
    texts = {
        DaemonConfig(algo=a, socket="s", node_id="n").exchange_settings()
        for a in ("direct", ",".join(f"{op}=direct" for op in ("barrier", "all_reduce")))
    }
    # "direct" names every op that has it: not only the two above.
    assert len(texts) == 2, texts
    same = {
        DaemonConfig(algo=a, socket="s", node_id="n").exchange_settings()
        for a in ("all_reduce=ring,broadcast=tree", " broadcast=tree , all_reduce=ring")
    }
    assert same == {"--algo all_reduce=ring,broadcast=tree --chunk-bytes 4194304"}
    assert DaemonConfig(socket="s", node_id="n", chunk_bytes=MIB).exchange_settings() == (
        "--algo unset --chunk-bytes 1048576"
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "settings, texts",
    [
        (
            (("--algo", "all_reduce=ring"), ("--algo", "all_reduce=direct")),
            (
                "--algo all_reduce=ring --chunk-bytes 4194304",
                "--algo all_reduce=direct --chunk-bytes 4194304",
            ),
        ),
        (
            (("--chunk-bytes", "1MiB"), ()),
            ("--algo unset --chunk-bytes 1048576", "--algo unset --chunk-bytes 4194304"),
        ),
    ],
    ids=["algo", "chunk-bytes"],
)
def test_daemons_that_differ_refuse_each_other_naming_both(
    start_daemon, settings: tuple[tuple[str, ...], ...], texts: tuple[str, str]
) -> None:
    daemons = [
        start_daemon(args=("--node-id", f"node{i}", *settings[i]), name=f"node{i}")
        for i in range(2)
    ]
    nodes = [
        pb.NodeSpec(node_id=f"node{i}", peer_address=daemon_info(d.socket).peer_address, ranks=[i])
        for i, d in enumerate(daemons)
    ]
    name, token = f"exchange-{secrets.token_hex(4)}", secrets.token_bytes(16)
    comms = [
        connect(
            name,
            token,
            r,
            2,
            socket_path=daemons[r].socket,
            nodes=nodes,
            arena_bytes=16 * MIB,
            timeout_s=60,
        )  # fmt: skip
        for r in range(2)
    ]
    outcome: list[Any] = [None, None]

    def run(rank: int) -> None:
        x = np.ones(3 * MIB, np.float32)  # several chunks: where the settings would matter
        start = time.monotonic()
        try:
            comms[rank].all_reduce(x).wait()
            outcome[rank] = "completed"
        except SmddpError as exc:
            outcome[rank] = (str(exc), time.monotonic() - start)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    refusal = (
        f"refused to join: node node0 runs {texts[0]} and node node1 runs {texts[1]}: "
        "every daemon of a job must run the same --algo and --chunk-bytes (SMDDP_ALGO, SMDDP_CHUNK_BYTES)"  # noqa: E501
    )
    for rank, got in enumerate(outcome):
        assert isinstance(got, tuple), f"rank {rank}: {got}"
        message, took = got
        assert f"job {name} comm 0: lost node " in message, message
        # Named at once, well before the op's 60 s timeout.
        assert took < 30, (rank, took, message)
        # Every rank hears the refusal in full (the joining node's daemon tells the other).
        assert refusal in message, message
    for c in comms:
        c.close()
