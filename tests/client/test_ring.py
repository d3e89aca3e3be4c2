"""The arena ring's allocator, in process: blocks in FIFO order, freed oldest first."""

from __future__ import annotations

import pytest

from smddp.client.arena import ALIGN, RingAllocator

pytestmark = pytest.mark.timeout(30)


def test_blocks_follow_each_other_aligned() -> None:
    ring = RingAllocator(16 * ALIGN)
    assert ring.empty()
    assert ring.alloc(1) == 0  # rounded up to one ALIGN
    assert ring.alloc(ALIGN) == ALIGN
    assert ring.alloc(ALIGN + 1) == 2 * ALIGN  # two ALIGNs
    assert ring.alloc(0) == 4 * ALIGN  # an empty chunk still takes a block of its own
    assert not ring.empty()


def test_full_until_the_oldest_goes_then_wraps_around() -> None:
    ring = RingAllocator(4 * ALIGN)
    assert [ring.alloc(ALIGN) for _ in range(4)] == [0, ALIGN, 2 * ALIGN, 3 * ALIGN]
    assert ring.alloc(1) is None  # full
    ring.free_oldest()  # [0, ALIGN) is free again: the next block wraps to the start
    assert ring.alloc(ALIGN) == 0
    assert ring.alloc(1) is None
    ring.free_oldest()
    ring.free_oldest()  # ALIGN..3*ALIGN free, but after the wrapped block only
    assert ring.alloc(2 * ALIGN) == ALIGN
    assert ring.alloc(1) is None


def test_a_wrapped_block_needs_room_before_the_oldest() -> None:
    ring = RingAllocator(8 * ALIGN)
    ring.alloc(3 * ALIGN)  # [0, 3)
    ring.alloc(3 * ALIGN)  # [3, 6)
    ring.free_oldest()  # free: [0, 3) and [6, 8)
    assert ring.alloc(3 * ALIGN) == 0  # not at 6: two ALIGNs do not hold it, so it wraps
    assert ring.alloc(1) is None  # wrapped: only up to the oldest block, which is at 3
    ring.free_oldest()  # the oldest is the wrapped one at 0 now
    assert ring.alloc(5 * ALIGN) == 3 * ALIGN  # after it: [3, 8)


def test_sizes_at_the_limits() -> None:
    ring = RingAllocator(4 * ALIGN)
    assert ring.alloc(4 * ALIGN) == 0  # exactly the whole ring
    assert ring.alloc(1) is None
    ring.free_oldest()
    assert ring.empty()
    assert ring.alloc(4 * ALIGN - 1) == 0  # rounds up to the whole ring, still fits
    ring.free_oldest()
    with pytest.raises(ValueError, match="cannot fit"):
        ring.alloc(4 * ALIGN + 1)  # can never fit: an error, not a wait forever
    assert ring.empty()  # the refusal took nothing


def test_freeing_with_nothing_allocated_raises() -> None:
    # There is no out-of-order free: blocks go oldest first (the engine retires chunks in
    # order, GPU chunks hold none), so a free with nothing
    # allocated is a bug that the allocator does not hide.
    ring = RingAllocator(4 * ALIGN)
    with pytest.raises(IndexError):
        ring.free_oldest()


def test_a_long_run_of_mixed_sizes_never_overlaps() -> None:
    size = 32 * ALIGN
    ring = RingAllocator(size)
    live: list[tuple[int, int]] = []
    sizes = [1, ALIGN, 3 * ALIGN + 5, 7 * ALIGN, 2, 11 * ALIGN, 5 * ALIGN, size]
    for step in range(500):
        n = sizes[step % len(sizes)]
        off = ring.alloc(n)
        while off is None:
            live.pop(0)
            ring.free_oldest()
            off = ring.alloc(n)
        block = (off, off + max(ALIGN, -(-n // ALIGN) * ALIGN))
        assert off % ALIGN == 0 and block[1] <= size
        assert all(block[1] <= a or b <= block[0] for a, b in live), (step, block, live)
        live.append(block)
