"""Algorithms between node daemons, chosen per op and size by a cost model.

One module per algorithm of one shape (``algo_direct``, ``algo_ring``, ``algo_doubling``,
``algo_tree``, ``algo_chain``, ``algo_dissemination``), each a generator of
``algo_schedule.Step``s; ``ALGORITHMS`` names them per op; ``algo_cost`` predicts their times
and ``algo_simulate`` runs them over a modelled link; ``Selector`` (one per communicator) picks
one per op and chunk size, or what ``SMDDP_ALGO`` pins, and remembers what it picked for
``smddpctl status``.

Ops not listed here (reduce, gather, scatter, reduce_scatter, all_to_all) run the direct
exchange in ``hierarchical``: each is bound by its root's link (reduce, gather, scatter: the
root must move (N-1)/N of the data whatever the algorithm) or is a pairwise exchange already
(all_to_all, reduce_scatter).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

from smddp.server import (
    algo_chain,
    algo_direct,
    algo_dissemination,
    algo_doubling,
    algo_ring,
    algo_tree,
)
from smddp.server.algo_cost import CostModel, choose, predict
from smddp.server.algo_schedule import Shape, Step

log = logging.getLogger("smddp.server.algorithms")

Schedule = Callable[[Shape], Iterator[Step]]

ALGORITHMS: dict[str, dict[str, Schedule]] = {
    "all_reduce": {
        "direct": algo_direct.all_reduce,
        "ring": algo_ring.all_reduce,
        "halving_doubling": algo_doubling.halving_doubling,
        "recursive_doubling": algo_doubling.recursive_doubling,
    },
    "broadcast": {
        "direct": algo_direct.broadcast,
        "tree": algo_tree.broadcast,
        "chain": algo_chain.broadcast,
    },
    "all_gather": {"direct": algo_direct.all_gather, "ring": algo_ring.all_gather},
    "barrier": {"direct": algo_direct.barrier, "dissemination": algo_dissemination.barrier},
}


def parse_pins(text: str) -> dict[str, str]:
    """Reads ``SMDDP_ALGO``: ``op=name,op=name`` or one name for every op that has it.

    Returns:
        The pinned algorithm per op ({} for "").

    Raises:
        ValueError: an unknown op or algorithm, naming the valid choices.
    """
    pins: dict[str, str] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        if "=" not in item:
            ops = [op for op, algos in ALGORITHMS.items() if item in algos]
            if not ops:
                names = sorted({a for algos in ALGORITHMS.values() for a in algos})
                raise ValueError(
                    "SMDDP_ALGO: "
                    f"{item!r} is no algorithm; "
                    f"choose one of {', '.join(names)}, or op=name with op one of {', '.join(ALGORITHMS)}"  # noqa: E501
                )
            for op in ops:
                pins[op] = item
            continue
        op, name = (x.strip() for x in item.split("=", 1))
        if op not in ALGORITHMS:
            raise ValueError(
                "SMDDP_ALGO: "
                f"{op!r} is not an op with a choice of algorithm; "
                f"choose one of {', '.join(ALGORITHMS)}"
            )
        if name not in ALGORITHMS[op]:
            raise ValueError(
                "SMDDP_ALGO: "
                f"{op} has no algorithm {name!r}; "
                f"choose one of {', '.join(ALGORITHMS[op])}"
            )
        pins[op] = name
    return pins


def size_class(nbytes: int) -> int:
    """The power of two at or above ``nbytes`` (0 for an empty op): the choice is logged once
    per op and class."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def pins_text(pins: dict[str, str]) -> str:
    """``pins`` as one canonical ``op=name,...`` (ops in order), or "unset" when empty (the
    cost model chooses): two daemons make the same choices exactly when their texts are equal."""
    return ",".join(f"{op}={pins[op]}" for op in sorted(pins)) or "unset"


class Selector:
    """One communicator's choice of algorithm per op and chunk size.

    The choice depends only on the op, the node count, the chunk's bytes, the pins and the
    model, so every node of the communicator makes the same one and a rerun too.
    """

    def __init__(self, name: str = "", pins: str = "", model: CostModel | None = None) -> None:
        """``name``: the communicator, for the log; ``pins``: ``SMDDP_ALGO``'s value.

        Raises:
            ValueError: a bad ``pins`` (see ``parse_pins``).
        """
        self.name = name
        self.pins = parse_pins(pins)
        self.model = model or CostModel()
        self._lock = threading.Lock()
        self._chosen: dict[tuple[str, int], tuple[str, int]] = {}

    def choose(self, op: str, nodes: int, nbytes: int) -> tuple[str, int]:
        """The algorithm for ``op`` on ``nodes`` nodes with a working buffer of ``nbytes``,
        and its piece count; logged the first time per op and size class."""
        pinned = self.pins.get(op)
        if pinned is not None:
            predicted, segs = predict(self.model, op, pinned, nodes, nbytes)
            name, why = pinned, "pinned by SMDDP_ALGO"
        else:
            name, segs, predicted = choose(self.model, op, nodes, nbytes)
            why = "least predicted time"
        key = (op, size_class(nbytes))
        with self._lock:
            first = key not in self._chosen
            self._chosen[key] = (name, segs)
        if first:
            log.info(
                "%s: %s of up to %d bytes over %d nodes runs %s in %d pieces (%s, %.3g ms)",
                self.name, op, key[1], nodes, name, segs, why, predicted * 1e3,
            )  # fmt: skip
        return name, segs

    def choices(self) -> list[str]:
        """What was chosen so far, one line per op and size class, for ``smddpctl status``."""
        with self._lock:
            items = sorted(self._chosen.items())
        return [f"{op} <= {size} B: {name} x{segs}" for (op, size), (name, segs) in items]
