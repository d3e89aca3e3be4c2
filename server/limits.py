"""Bounds on what clients can make the daemon hold: counts and bytes, per uid and in all.

The kernel names a client's uid on the data socket (SO_PEERCRED), so what a rank holds once
it has connected there is counted against its uid: connections, handshakes, attached ranks,
jobs, and the bytes of its sends that wait for their receives. gRPC on a unix socket does
not tell the caller, so what happens before (Register, Rendezvous) is bounded in all and
expires instead (``DaemonConfig.attach_timeout_s``, ``max_rendezvous_wait_s``).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator

from smddp.server.errors import LimitExceeded

ALL = -1  # the key of a Counts' total
UNATTACHED = -2  # the uid charged for a job none of whose ranks has attached yet


class Counts:
    """Held things of one kind per uid, with a per-uid and a total limit.

    ``take`` raises LimitExceeded naming the flag of the limit that would be passed.
    """

    def __init__(
        self,
        what: str,
        per_uid: int,
        flag_per_uid: str,
        total: int | None = None,
        flag_total: str = "",
    ) -> None:
        self.what = what
        self.per_uid = per_uid
        self.total = total
        self._flags = (flag_per_uid, flag_total)
        self._held: Counter[int] = Counter()
        self._lock = threading.Lock()

    def take(self, uid: int, n: int = 1, where: str = "") -> None:
        """Counts ``n`` more for ``uid``.

        Args:
            where: what the refusal's message starts with (``job J comm C``, say).

        Raises:
            LimitExceeded: the uid's or the daemon's limit would be passed.
        """
        prefix = f"{where}: " if where else ""
        with self._lock:
            if self._held[uid] + n > self.per_uid:
                raise LimitExceeded(
                    f"{prefix}uid {uid} already holds {self._held[uid]} {self.what} ({self._flags[0]} {self.per_uid})"  # noqa: E501
                )
            if self.total is not None and self._held[ALL] + n > self.total:
                raise LimitExceeded(
                    f"{prefix}the daemon already holds {self._held[ALL]} {self.what} ({self._flags[1]} {self.total})"  # noqa: E501
                )
            self._held[uid] += n
            self._held[ALL] += n

    def give(self, uid: int, n: int = 1) -> None:
        """Returns ``n`` that ``uid`` took."""
        with self._lock:
            self._held[uid] -= n
            self._held[ALL] -= n
            if self._held[uid] <= 0:
                del self._held[uid]

    def held(self, uid: int = ALL) -> int:
        """What ``uid`` holds (everyone, by default)."""
        with self._lock:
            return self._held[uid]


class ByteBudget:
    """Bytes the daemon holds for clients (sends waiting for their receives), per uid and in all.

    Unlike ``Counts`` it never raises: a caller that gets no bytes applies back-pressure.
    """

    def __init__(self, per_uid: int, total: int) -> None:
        self._counts = Counts(
            "buffered bytes", per_uid, "--max-buffered-bytes-per-uid", total, "--max-buffered-bytes"
        )

    def try_take(self, uid: int, nbytes: int) -> bool:
        """True (and counted) if ``uid`` may have ``nbytes`` more held."""
        try:
            self._counts.take(uid, nbytes)
        except LimitExceeded:
            return False
        return True

    def give(self, uid: int, nbytes: int) -> None:
        """Returns bytes that ``try_take`` granted."""
        if nbytes:
            self._counts.give(uid, nbytes)

    def held(self, uid: int = ALL) -> int:
        """Bytes held for ``uid`` (everyone, by default)."""
        return self._counts.held(uid)

    def limit_text(self, uid: int, nbytes: int) -> str:
        """Which limit a refused ``try_take(uid, nbytes)`` hit, for messages."""
        c = self._counts
        if self.held(uid) + nbytes > c.per_uid:
            return f"uid {uid} holds {self.held(uid)} bytes of sends waiting for their receives (--max-buffered-bytes-per-uid {c.per_uid})"  # noqa: E501
        return f"the daemon holds {self.held()} bytes of sends waiting for their receives (--max-buffered-bytes {c.total})"  # noqa: E501


class BufferAccount:
    """One job's share of a ByteBudget, charged to its owner's uid once a rank attached.

    Bytes that arrive before (a peer's send to a rank still attaching) are charged to
    ``UNATTACHED``, a uid of their own, until the account drains.
    """

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self.uid: int | None = None
        self._key = UNATTACHED
        self._held = 0
        self._lock = threading.Lock()

    def try_take(self, nbytes: int) -> bool:
        """True (and counted) if the job may have ``nbytes`` more held."""
        with self._lock:
            if not self._held:
                self._key = self.uid if self.uid is not None else UNATTACHED
            if not self.budget.try_take(self._key, nbytes):
                return False
            self._held += nbytes
            return True

    def give(self, nbytes: int) -> None:
        """Returns bytes ``try_take`` granted."""
        with self._lock:
            nbytes = min(nbytes, self._held)
            self._held -= nbytes
            self.budget.give(self._key, nbytes)

    def limit_text(self, nbytes: int) -> str:
        """The limit a refused ``try_take(nbytes)`` hit."""
        return self.budget.limit_text(self._key, nbytes)


class Slots:
    """A count of things held in all (calls waiting, say), with a limit:
    ``with slots.held(where):``."""

    def __init__(self, what: str, limit: int, flag: str) -> None:
        self.what = what
        self.limit = limit
        self.flag = flag
        self._held = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def held(self, where: str) -> Iterator[None]:
        """Holds one slot for the ``with`` block.

        Raises:
            LimitExceeded: all ``limit`` slots are held.
        """
        with self._lock:
            if self._held >= self.limit:
                raise LimitExceeded(
                    f"{where}: "
                    f"the daemon already has {self._held} {self.what} ({self.flag} {self.limit})"
                )
            self._held += 1
        try:
            yield
        finally:
            with self._lock:
                self._held -= 1

    def count(self) -> int:
        """Slots held now."""
        with self._lock:
            return self._held
