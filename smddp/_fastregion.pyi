# Types of smddp/_fastregion.c (the region path's per-op bookkeeping in C).
from typing import Any

LAYOUT: tuple[str, ...]

class Slot:
    def __init__(
        self,
        region: Any,  # a writable buffer: the mapped region, held by the Slot
        rank: int,
        world: int,
        slot_bytes: int,
        data_bytes: int,
        spin_ns: int,
        layout: tuple[int, ...],
        bounds_ns: tuple[int, ...],
        sum_op: int,
        avg_op: int,
    ) -> None: ...
    @property
    def step(self) -> int: ...
    def bump(self) -> int: ...
    def publish(
        self, seq: int, parity: int, kind: int, dtype: int, count: int, root: int, reduce_op: int
    ) -> int: ...
    def spin(self, target: int) -> int: ...
    def agree(self, seq: int, parity: int) -> bool: ...
    def done(self, seq: int, parity: int, kind: int, dtype: int, nbytes: int) -> None: ...
    def fill(self, parity: int, array: Any) -> bool: ...
    def reduce(self, parity: int, out: Any, reduce_op: int) -> bool: ...
