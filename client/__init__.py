"""smddp's framework-neutral client: numpy collectives through the node daemon.

Example (every process of the job runs this with its own rank)::

    from smddp.client import ReduceOp, connect
    comm = connect(job_id="demo", job_token=token, rank=r, world_size=2)
    comm.all_reduce(array, ReduceOp.MAX).wait()

Reduce ops and dtypes are named by ``ReduceOp`` and ``DType`` (IntEnums whose values are the
wire's, so the raw protobuf ints an older script passes still work).
"""

from smddp.client.communicator import Communicator, Handle, connect, rendezvous
from smddp.client.config import ClientConfig
from smddp.client.errors import (
    DaemonLostError,
    MismatchError,
    OpError,
    OpTimeoutError,
    RankFailedError,
    SmddpError,
    UnsupportedError,
)
from smddp.core.op import DType, OpKind, OpSpec, ReduceOp

__all__ = [
    "ClientConfig",
    "Communicator",
    "DType",
    "DaemonLostError",
    "Handle",
    "MismatchError",
    "OpError",
    "OpKind",
    "OpSpec",
    "OpTimeoutError",
    "RankFailedError",
    "ReduceOp",
    "SmddpError",
    "UnsupportedError",
    "connect",
    "rendezvous",
]
