"""Projects smddp's algorithms between nodes to 64, 256 and 1024 nodes.

    .venv/bin/python -m benchmarks.projection [--nodes 64,256,1024] [--alpha-us 100]
        [--gbit 10] [--gamma-ns 0.5]

For each node count: the latency of a 4-byte all_reduce and the bus bandwidth of a 256 MiB one
(nccl-tests' busbw: 2 (N-1)/N S / t), as the cost model predicts for the algorithm it would
choose (``server/algo_cost``), as the simulator measures when it runs the same step generators
the daemon runs over the modelled link (``server/algo_simulate``: no bytes move, so the real
256 MiB runs at any N), and beside NCCL's ring and tree formulas on the same alpha and beta.
Today's direct exchange is shown too. One rank per node: the phase between nodes only.
"""

from __future__ import annotations

import argparse
import time

from smddp.server.algo_cost import (
    CostModel,
    choose,
    nccl_ring_all_reduce,
    nccl_tree_all_reduce,
    predict,
)
from smddp.server.algo_simulate import simulate

SMALL_BYTES = 4
LARGE_BYTES = 256 << 20


def busbw_gbs(n: int, nbytes: int, seconds: float) -> float:
    """nccl-tests' all_reduce bus bandwidth in GB/s."""
    return 2 * (n - 1) / n * nbytes / seconds / 1e9


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _bw(n: int, seconds: float) -> str:
    return f"{busbw_gbs(n, LARGE_BYTES, seconds):.3f} GB/s"


def rows(model: CostModel, nodes: list[int]) -> list[str]:
    """The table's lines."""
    out = [
        "| N | 4 B all_reduce: algorithm | model | simulated | NCCL ring | NCCL tree "
        "| direct (today) | 256 MiB all_reduce: algorithm | model busbw | simulated busbw "
        "| NCCL ring busbw | NCCL tree busbw | direct busbw | simulation took |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: "
        "| ---: |",
    ]
    for n in nodes:
        began = time.monotonic()
        small, _, t_small = choose(model, "all_reduce", n, SMALL_BYTES)
        sim_small = simulate(model, "all_reduce", small, n, SMALL_BYTES // 4)
        large, segs, t_large = choose(model, "all_reduce", n, LARGE_BYTES)
        sim_large = simulate(model, "all_reduce", large, n, LARGE_BYTES // 4, 4, segs)
        direct_small = predict(model, "all_reduce", "direct", n, SMALL_BYTES)[0]
        direct_large = predict(model, "all_reduce", "direct", n, LARGE_BYTES)[0]
        out.append(
            f"| {n} | {small} | {_ms(t_small)} | {_ms(sim_small)} "
            f"| {_ms(nccl_ring_all_reduce(model, n, SMALL_BYTES))} "
            f"| {_ms(nccl_tree_all_reduce(model, n, SMALL_BYTES))} | {_ms(direct_small)} "
            f"| {large} x{segs} | {_bw(n, t_large)} | {_bw(n, sim_large)} "
            f"| {_bw(n, nccl_ring_all_reduce(model, n, LARGE_BYTES))} "
            f"| {_bw(n, nccl_tree_all_reduce(model, n, LARGE_BYTES))} | {_bw(n, direct_large)} "
            f"| {time.monotonic() - began:.0f} s |"
        )
    return out


def main(argv: list[str] | None = None) -> None:
    """Prints the projection table (markdown)."""
    parser = argparse.ArgumentParser(prog="benchmarks.projection", description=__doc__)
    parser.add_argument("--nodes", default="64,256,1024", help="node counts, comma-separated")
    parser.add_argument("--alpha-us", type=float, default=CostModel().alpha * 1e6,
                        help="per-message cost in microseconds")  # fmt: skip
    parser.add_argument("--gbit", type=float, default=8 / CostModel().beta / 1e9,
                        help="each node's link in Gbit/s")  # fmt: skip
    parser.add_argument("--gamma-ns", type=float, default=CostModel().gamma * 1e9,
                        help="reduction cost in ns per byte")  # fmt: skip
    args = parser.parse_args(argv)
    model = CostModel(args.alpha_us * 1e-6, 8 / (args.gbit * 1e9), args.gamma_ns * 1e-9)
    print(
        f"alpha {model.alpha * 1e6:.1f} us per message, link {args.gbit:g} Gbit/s per node "
        f"(beta {model.beta * 1e9:.3f} ns/B), gamma {model.gamma * 1e9:.2f} ns/B"
    )
    for line in rows(model, [int(x) for x in args.nodes.split(",")]):
        print(line)


if __name__ == "__main__":
    main()
