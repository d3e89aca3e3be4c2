"""Torch's own distributed test suite on backend "smddp", standing in for gloo.

Runs ``DistributedTest._DistTestBase`` from ``torch/testing/_internal/distributed/
distributed_test.py`` (shipped inside the installed torch) the way torch's
``test/distributed/test_distributed_spawn.py`` does: ``BACKEND``, ``WORLD_SIZE`` (3) and
``TEMP_DIR`` in the environment, one process per rank (forked here), each joining
``init_process_group(backend=BACKEND)`` over a file store.

The suite gates many tests on ``BACKEND == "gloo"`` (the CPU backend) and the rest on sets
of backend names. So that smddp runs every test gloo would, the module's ``BACKEND`` is
a string equal to "smddp" that also compares (and hashes) as "gloo"; torch's own code
only ever sees ``dist.Backend(BACKEND)``, the plain "smddp". The suite is loaded from its
source with that one line changed (the change is asserted, so a torch whose line differs
fails loudly instead of silently testing gloo).

Not collected by the default pytest run (it takes minutes); ``scripts/test.sh`` runs it as
its own step:

    .venv/bin/python -m pytest -q -ra tests/frameworks/torch_suite.py

One smddpd serves every test (started once by the parent and found by the ranks through
SMDDP_SOCKET), so no test pays for starting a daemon.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import types
import unittest
from collections.abc import Callable, Iterator

import pytest

WORLD_SIZE = 3
SUITE = "torch.testing._internal.distributed.distributed_test"
BACKEND_LINE = 'BACKEND = os.environ["BACKEND"]'

# Tests that only torch's own gloo backend can pass, by torch's design, with the reason.
ONLY_TORCH_GLOO = {
    name: "torch.distributed.monitored_barrier accepts only the gloo backend, by name"
    for name in (
        "test_monitored_barrier_allreduce_hang",
        "test_monitored_barrier_allreduce_hang_wait_all_ranks",
        "test_monitored_barrier_failure_order",
        "test_monitored_barrier_gloo",
        "test_monitored_barrier_gloo_rank_0_timeout",
        "test_monitored_barrier_gloo_subgroup",
        "test_monitored_barrier_wait_all_ranks",
    )
}


# Tests that need what smddp does not offer, with the reason (gloo passes them).
NOT_IN_SMDDP: dict[str, str] = {}


class GlooStandIn(str):
    """ "smddp" that the suite's gates take for "gloo" (equal to both, hashed as "gloo")."""

    def __eq__(self, other: object) -> bool:
        return str.__eq__(self, other) or other == "gloo"

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash("gloo")


# What the parent made for the whole run, undone when this module's tests are over (before the
# run's check for leftovers, tests/leftovers.py), or at exit if they never ran.
_CLEANUPS: list[Callable[[], object]] = []


def _at_end(cleanup: Callable[[], object]) -> None:
    if not _CLEANUPS:
        atexit.register(_clean_up)
    _CLEANUPS.append(cleanup)


def _clean_up() -> None:
    while _CLEANUPS:
        _CLEANUPS.pop()()


@pytest.fixture(scope="module", autouse=True)
def _made_for_the_run() -> Iterator[None]:
    yield
    _clean_up()


def _environment() -> None:
    os.environ.setdefault("BACKEND", "smddp")
    os.environ.setdefault("WORLD_SIZE", str(WORLD_SIZE))
    if "TEMP_DIR" not in os.environ:
        # Inherited by the spawned ranks, so parent and ranks share it.
        # Made here, in the parent, and removed when it exits (the ranks only use it).
        os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="smddp-torch-suite-")
        _at_end(functools.partial(shutil.rmtree, os.environ["TEMP_DIR"], True))
    os.makedirs(os.path.join(os.environ["TEMP_DIR"], "barrier"), exist_ok=True)


def _accepts(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def _start_daemon() -> None:
    """One smddpd for the whole run (the parent's; the ranks inherit SMDDP_SOCKET)."""
    if os.environ.get("SMDDP_TORCH_SUITE_DAEMON") == os.environ.get("SMDDP_SOCKET", "-"):
        return  # a rank: the parent already started it
    folder = tempfile.mkdtemp(prefix="smddp-suite-daemon-")
    path = os.path.join(folder, "smddpd.sock")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "smddp.server",
            "--socket",
            path,
            "--http-bind",
            "off",
            "--peer-bind",
            "off",
            "--log-level",
            "WARNING",
        ],
        stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    # Readiness by connecting to the socket, not by a gRPC call: the ranks are forked from
    # this process, and gRPC must not have started here before a fork.
    while not _accepts(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"smddpd for the torch suite did not serve on {path}")
        time.sleep(0.05)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)

    _at_end(stop)
    os.environ["SMDDP_SOCKET"] = path
    os.environ["SMDDP_TORCH_SUITE_DAEMON"] = path


def _load_suite() -> types.ModuleType:
    """Imports distributed_test.py with ``BACKEND`` as a GlooStandIn."""
    if SUITE in sys.modules:
        return sys.modules[SUITE]
    spec = importlib.util.find_spec(SUITE)
    assert spec is not None and spec.origin is not None, f"{SUITE} is not in this torch"
    with open(spec.origin) as f:
        source = f.read()
    assert source.count(BACKEND_LINE) == 1, f"{spec.origin} no longer has the line {BACKEND_LINE!r}"
    source = source.replace(BACKEND_LINE, 'BACKEND = _GlooStandIn(os.environ["BACKEND"])')
    module = importlib.util.module_from_spec(spec)
    module._GlooStandIn = GlooStandIn  # type: ignore[attr-defined]
    sys.modules[SUITE] = module
    # dont_inherit: not this module's "from __future__ import annotations", which would turn
    # the suite's annotations into strings (DDP checks a comm hook's annotation's type).
    exec(compile(source, spec.origin, "exec", dont_inherit=True), module.__dict__)
    return module


_environment()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

import smddp  # noqa: E402,F401  (registers the backend in the parent and in every rank)

# require_backend_is_available() accepts a backend listed as a plugin.
DistTestCases.backend_feature["plugin"].add("smddp")
_start_daemon()
_suite = _load_suite()


class TestDistBackendWithSpawnSMDDP(_suite.TestDistBackend, _suite.DistributedTest._DistTestBase):
    """The suite's tests, one forked process per rank, on backend smddp."""

    def setUp(self) -> None:
        super().setUp()
        # Forked, not spawned as test_distributed_spawn.py does: a spawned rank imports
        # torch again, which on a loaded 2-core machine costs more than the test itself.
        self._start_processes(torch.multiprocessing.get_context("fork").Process)


for _name, _reason in {**ONLY_TORCH_GLOO, **NOT_IN_SMDDP}.items():
    if hasattr(TestDistBackendWithSpawnSMDDP, _name):
        setattr(
            TestDistBackendWithSpawnSMDDP,
            _name,
            unittest.skip(_reason)(getattr(TestDistBackendWithSpawnSMDDP, _name)),
        )

assert dist.is_available() and torch.__version__  # the suite needs torch.distributed
