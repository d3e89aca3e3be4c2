"""The one compiled piece of smddp: smddp.core._fastregion (the region path's per-op bookkeeping).

Everything else is in pyproject.toml. The extension is optional: where it does not build (no
C compiler or Python headers) smddp installs without it and client/shm.py runs the same
protocol in Python. SMDDP_PURE=1 leaves it out on purpose (a pure-Python wheel).
"""

import os

from setuptools import Extension, setup

ext_modules = []
if os.environ.get("SMDDP_PURE", "") != "1":
    ext_modules.append(
        Extension(
            "smddp.core._fastregion",
            ["core/_fastregion.c"],
            optional=True,
            # Results must be bitwise numpy's: IEEE arithmetic as written, no -ffast-math and
            # no fused multiply-adds; -O3 vectorises the reductions.
            extra_compile_args=["-O3", "-fno-fast-math", "-ffp-contract=off"],
        )
    )

setup(ext_modules=ext_modules)
