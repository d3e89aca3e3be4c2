"""Sealed memfds: the shared memory the daemon and the ranks map (arenas, control regions)."""

from __future__ import annotations

import fcntl
import os

# What a memfd is sealed with once sized: nobody who holds the fd (the daemon, every rank of
# the communicator) can shrink it, grow it, or change the seals. A shrunk file would turn the
# next access of a process that maps it into SIGBUS: for the daemon, the death of every job
# on the node.
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sealed_memfd(name: str, nbytes: int) -> int:
    """A new memfd of ``nbytes`` sealed with ``SIZE_SEALS``: a process that holds it and tries
    to shrink it (``ftruncate``) is refused (EPERM).

    Raises:
        OSError: the memfd cannot be made, sized or sealed (closed again).
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd
