"""Collective-communication benchmark: smddp against gloo on one node.

Run ``python -m benchmarks.collectives --help`` from the repository root. The layers are:

* ``cli``     -- flags, the run plan, and the top-level loop over backends and world sizes;
* ``launch``  -- starting the ranks of one process group on this node and collecting results;
* ``worker``  -- what each rank does: initialise the group, time every op and size;
* ``ops``     -- the collectives themselves, their buffers, checks and bus-bandwidth factors;
* ``sizes``   -- message-size parsing, the size ladder and iteration scaling;
* ``memcpy``  -- the single-process memory-bandwidth reference;
* ``results`` -- turning per-rank samples into rows with statistics and smddp/gloo ratios;
* ``report``  -- the human table; ``plot`` -- the optional PNG.
"""
