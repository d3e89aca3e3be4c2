"""Exceptions raised by the collectives benchmark."""


class BenchmarkError(Exception):
    """Base class for every error the benchmark reports instead of a traceback."""


class BackendUnavailable(BenchmarkError):
    """A torch.distributed backend cannot be used in this environment (e.g. ``import smddp``
    fails)."""


class CheckFailed(BenchmarkError):
    """A collective produced a wrong result, so its timings would be meaningless."""


class RunFailed(BenchmarkError):
    """One backend run (one process group) failed: a rank raised, died or timed out."""
