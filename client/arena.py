"""The rank's side of its shared-memory arena: a sealed memfd and a FIFO allocator over it."""

from __future__ import annotations

import collections
import mmap
import os

import numpy as np

from smddp.core.memfd import sealed_memfd

ALIGN = 64


class ClientArena:
    """A memfd of ``nbytes`` mapped into this process; the daemon maps the same pages."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        # Sealed so that nobody can shrink it under the daemon (which would SIGBUS it).
        self.fd = sealed_memfd("smddp-arena", nbytes)
        self._mm = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._buf = np.frombuffer(self._mm, dtype=np.uint8)

    def view(self, offset: int, count: int, dtype: np.dtype) -> np.ndarray:
        """``count`` items of ``dtype`` starting ``offset`` bytes into the arena."""
        return self._buf[offset : offset + count * dtype.itemsize].view(dtype)

    def close(self) -> None:
        """Unmaps and closes the memfd."""
        self._buf = np.empty(0, dtype=np.uint8)
        try:
            self._mm.close()
        except BufferError:
            pass
        os.close(self.fd)


class RingAllocator:
    """Allocates blocks in FIFO order over ``[0, size)``; blocks are freed oldest first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._blocks: collections.deque[tuple[int, int]] = collections.deque()

    def alloc(self, nbytes: int) -> int | None:
        """Returns the offset of a free block of ``nbytes``, or None until older blocks go."""
        n = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        if n > self.size:
            raise ValueError(f"a chunk of {nbytes} bytes cannot fit an arena of {self.size} bytes")
        if not self._blocks:
            off = 0
        else:
            first = self._blocks[0][0]
            last_off, last_n = self._blocks[-1]
            end = last_off + last_n
            if last_off >= first:  # not wrapped: room after the last block, or before the first
                if self.size - end >= n:
                    off = end
                elif first >= n:
                    off = 0
                else:
                    return None
            elif first - end >= n:
                off = end
            else:
                return None
        self._blocks.append((off, n))
        return off

    def free_oldest(self) -> None:
        """Releases the oldest block."""
        self._blocks.popleft()

    def empty(self) -> bool:
        """True when nothing is allocated."""
        return not self._blocks
