"""A rank's shared-memory arena as the daemon sees it: a sealed memfd mapped read-write."""

from __future__ import annotations

import fcntl
import mmap
import os

import numpy as np

from smddp.server.errors import InvalidRequest
from smddp.v1 import smddp_pb2 as pb

# The client must seal its memfd against shrinking: a shrunk file would turn the daemon's
# next access into SIGBUS and kill every job on the node.
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK
# Seals that forbid the daemon's writes (F_SEAL_FUTURE_WRITE is 0x10; Python lacks its name).
WRITE_SEALS = fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)


class Arena:
    """The mapping of one rank's arena; ``view`` checks every region against its bounds."""

    def __init__(self, fd: int, expected_bytes: int, owner: str) -> None:
        """Maps ``fd``, which this object owns: it is handed to the communicator's other ranks
        for direct ops, and closed by ``close``.

        Args:
            fd: the memfd received over the data socket.
            expected_bytes: the size the rank announced at registration.
            owner: who the arena belongs to, for messages (e.g. "job j rank 2").

        Raises:
            InvalidRequest: the fd is not a sealed memfd of the announced size.
        """
        self.owner = owner
        try:
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError as exc:
                raise InvalidRequest(
                    f"{owner}: the arena fd is not a sealable memfd ({exc})"
                ) from None
            if seals & REQUIRED_SEALS != REQUIRED_SEALS:
                raise InvalidRequest(f"{owner}: the arena memfd must be sealed with F_SEAL_SHRINK")
            size = os.fstat(fd).st_size
            if size != expected_bytes or size == 0:
                raise InvalidRequest(
                    f"{owner}: the arena has {size} bytes but {expected_bytes} were registered"
                )
            if seals & WRITE_SEALS:
                raise InvalidRequest(
                    f"{owner}: "
                    "the arena memfd is sealed against writing (F_SEAL_WRITE): "
                    "the daemon writes results into it; "
                    "seal it with F_SEAL_SHRINK only"
                )
            self.nbytes = size
            try:
                self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:  # a read-only descriptor, say
                raise InvalidRequest(
                    f"{owner}: the daemon cannot map the arena memfd read-write ({exc})"
                ) from None
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def view(self, region: pb.Region, dtype: np.dtype) -> np.ndarray:
        """Returns the region as a 1-D array of ``dtype``.

        Raises:
            InvalidRequest: the region lies outside the arena or is not a whole number of items.
        """
        off, n = region.offset, region.nbytes
        if off + n > self.nbytes:
            raise InvalidRequest(
                f"{self.owner}: "
                f"region [{off}, {off + n}) lies outside its arena of {self.nbytes} bytes"
            )
        if n % dtype.itemsize:
            raise InvalidRequest(
                f"{self.owner}: "
                f"region of {n} bytes is not a whole number of {dtype.itemsize}-byte items"
            )
        return np.frombuffer(self._mm, dtype=dtype, count=n // dtype.itemsize, offset=off)

    def close(self) -> None:
        """Unmaps the arena; views still alive keep it mapped until they are collected."""
        try:
            self._mm.close()
        except BufferError:
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
