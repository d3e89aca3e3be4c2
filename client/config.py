"""The client's configuration: one frozen ``ClientConfig``, read once from the environment.

Every ``SMDDP_*`` variable the client and the torch backend honour is named here, and read
only here (``ClientConfig.from_env``; tests/client/test_client_config.py checks that no other
module of client/ or backend/ reads one). The backend builds one ``ClientConfig`` when torch
creates a process group and hands it to the rendezvous, the embedded daemon and ``connect``;
a numpy user's entry points (``connect``, ``rendezvous``, ``find_or_start_daemon``,
``start_embedded_daemon``) take one or build it there, once, and pass it down. The modules
below take their settings from it, never from ``os.environ``. Values that every rank of a
communicator must share (the direct path's thresholds) say so. There is no exception: the
fake device of the tests is given to ``backend.cuda.use_device()``, not named by a variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from socket import gethostname

ENV_SOCKET = "SMDDP_SOCKET"
ENV_ARENA_BYTES = "SMDDP_ARENA_BYTES"
ENV_DIRECT_MIN_BYTES = "SMDDP_DIRECT_MIN_BYTES"
ENV_DIRECT_CHUNK_BYTES = "SMDDP_DIRECT_CHUNK_BYTES"
ENV_REGION = "SMDDP_REGION"
ENV_SINGLE_COPY = "SMDDP_SINGLE_COPY"
ENV_OP_CHANNEL = "SMDDP_OP_CHANNEL"
ENV_NODE_ID = "SMDDP_NODE_ID"
ENV_EMBEDDED = "SMDDP_EMBEDDED"
ENV_EMBEDDED_LOG_LEVEL = "SMDDP_EMBEDDED_LOG_LEVEL"
ENV_NATIVE = "SMDDP_NATIVE"
ENV_ADVERTISE = "SMDDP_ADVERTISE"
ENV_FREE_HOOK = "SMDDP_FREE_HOOK"
ENV_FREE_WAIT_MS = "SMDDP_FREE_WAIT_MS"

DEFAULT_ARENA_BYTES = 64 << 20
# all_reduce (and broadcast, all_gather) of at least this many bytes on a single-node
# communicator runs "direct": every rank reduces its own segment straight from the others'
# arenas. Must be equal on all ranks.
DEFAULT_DIRECT_MIN_BYTES = 256 << 10
# Direct ops move their data in chunks of this many bytes (per rank): small enough that a
# chunk's buffers and its part of the user's tensor stay in the caches through its steps,
# large enough that a chunk's Python work and synchronisation stay small beside its copies.
# Measured with a chunk's steps run one after the other (client/direct.py), in-process A/B
# on 2 cores: 2 ranks, 16 MiB all_reduce, 1 MiB best (256 KiB-2 MiB within 7%, 2 MiB 30%
# slower); 4 ranks on 2 cores, 1 MiB 25% faster than 2 MiB at 16 and 64 MiB (broadcast 10%
# slower, all_gather even). Must be equal on all ranks.
DEFAULT_DIRECT_CHUNK_BYTES = 1 << 20
# ...and of this many when the node has fewer CPUs than the communicator has ranks there: every
# synchronisation then waits for ranks to be scheduled in, so fewer of them pay. Measured
# 2026-12-03, paired benchmark, 4 ranks on 2 cores, two runs each, gloo time / smddp time:
# 16 MiB broadcast 2.23/2.58 with 1 MiB chunks, 3.29/3.11 with 4 MiB, 3.02/3.37 with 8 MiB;
# 16 MiB all_reduce 2.61/2.75, 2.81/2.86, 2.74/2.64; 64 MiB 2.66/2.53, 2.80/2.67, 2.61/2.68;
# all_gather even.
SHARED_CORES_DIRECT_CHUNK_BYTES = 4 << 20
OP_CHANNELS = ("socket", "grpc")
# The longest a GPU free waits for smddpd to unmap the segment (backend/cuda_free_hook.py).
DEFAULT_FREE_WAIT_MS = 2000


@dataclass(frozen=True)
class ClientConfig:
    """What a rank's client is told: where its daemon is, how it moves data.

    Attributes:
        socket: the daemon's socket (``SMDDP_SOCKET``); None looks at the standard paths.
        arena_bytes: the size of a rank's shared-memory arena (``SMDDP_ARENA_BYTES``).
        direct_min_bytes: ops at least this large run direct on one node
            (``SMDDP_DIRECT_MIN_BYTES``); the same on every rank.
        direct_chunk_bytes: the direct path's chunk (``SMDDP_DIRECT_CHUNK_BYTES``); None
            takes ``DEFAULT_DIRECT_CHUNK_BYTES``; the same on every rank.
        region: False sends every op through the daemon (``SMDDP_REGION=0``).
        single_copy: False stops the ops on one node that read the other ranks' inputs in
            place (all_gather, all_to_all, reduce_scatter, gather, scatter, broadcast; see
            ``client/peer_memory.py``) from doing so (``SMDDP_SINGLE_COPY=0``; one rank's
            False is enough: the ranks decide together).
        op_channel: ``socket`` (the data socket) or ``grpc`` (the Ops stream)
            (``SMDDP_OP_CHANNEL``); checked when the session opens.
        node_id: this node's name in registrations (``SMDDP_NODE_ID``, else the host name).
        embedded: False forbids starting a private daemon (``SMDDP_EMBEDDED=0``).
        embedded_log_level: a private daemon's log level (``SMDDP_EMBEDDED_LOG_LEVEL``).
        native: False keeps the region protocol and the rank-order reductions in Python
            even where the C part (``smddp.core._fastregion``) is built (``SMDDP_NATIVE=0``).
        advertise: where other nodes reach this node's embedded daemon (``SMDDP_ADVERTISE``);
            None: the address of the route toward ``MASTER_ADDR`` (the torch backend's).
        free_hook: False leaves torch's allocator without the close-before-free hook, so
            GPU frees are reported to smddpd after the fact (``SMDDP_FREE_HOOK=0``).
        free_wait_ms: the longest a GPU free waits for smddpd to unmap its segment
            (``SMDDP_FREE_WAIT_MS``).
    """

    socket: str | None = None
    arena_bytes: int = DEFAULT_ARENA_BYTES
    direct_min_bytes: int = DEFAULT_DIRECT_MIN_BYTES
    direct_chunk_bytes: int | None = None
    region: bool = True
    single_copy: bool = True
    op_channel: str = "socket"
    node_id: str = field(default_factory=gethostname)
    embedded: bool = True
    embedded_log_level: str = "WARNING"
    native: bool = True
    advertise: str | None = None
    free_hook: bool = True
    free_wait_ms: int = DEFAULT_FREE_WAIT_MS

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientConfig:
        """The configuration the environment describes (a caller's arguments go on top with
        ``dataclasses.replace``).

        Args:
            env: the variables to read (default ``os.environ``).

        Raises:
            ValueError: a numeric variable is not an integer (``SMDDP_FREE_WAIT_MS`` excepted:
                a bad value there has always meant the default, and still does).
        """
        env = os.environ if env is None else env
        chunk = env.get(ENV_DIRECT_CHUNK_BYTES)
        try:
            free_wait_ms = int(env.get(ENV_FREE_WAIT_MS, DEFAULT_FREE_WAIT_MS))
        except ValueError:
            free_wait_ms = DEFAULT_FREE_WAIT_MS
        return cls(
            socket=env.get(ENV_SOCKET) or None,
            arena_bytes=int(env.get(ENV_ARENA_BYTES, DEFAULT_ARENA_BYTES)),
            direct_min_bytes=int(env.get(ENV_DIRECT_MIN_BYTES, DEFAULT_DIRECT_MIN_BYTES)),
            direct_chunk_bytes=int(chunk) if chunk is not None else None,
            region=env.get(ENV_REGION, "1") != "0",
            single_copy=env.get(ENV_SINGLE_COPY, "1") != "0",
            op_channel=env.get(ENV_OP_CHANNEL, "socket"),
            node_id=env.get(ENV_NODE_ID) or gethostname(),
            embedded=env.get(ENV_EMBEDDED) != "0",
            embedded_log_level=env.get(ENV_EMBEDDED_LOG_LEVEL, "WARNING"),
            native=env.get(ENV_NATIVE, "1") != "0",
            advertise=env.get(ENV_ADVERTISE) or None,
            free_hook=env.get(ENV_FREE_HOOK, "1") != "0",
            free_wait_ms=max(1, free_wait_ms),
        )

    def direct_chunk(self, align: int, ranks: int = 1, cpus: int | None = None) -> int:
        """The direct path's chunk in bytes, a multiple of ``align``, for ``ranks`` ranks on
        a node of ``cpus`` CPUs (default: the host's count, which every rank on it reads
        alike, unlike its affinity: the chunk must be equal on all ranks)."""
        chunk = self.direct_chunk_bytes
        if not chunk:
            cpus = cpus if cpus is not None else os.cpu_count() or 1
            shared = cpus < ranks
            chunk = SHARED_CORES_DIRECT_CHUNK_BYTES if shared else DEFAULT_DIRECT_CHUNK_BYTES
        return max(align, chunk // align * align)
