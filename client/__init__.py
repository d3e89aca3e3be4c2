"""smddp's framework-neutral client: numpy collectives through the node daemon.

Example (every process of the job runs this with its own rank)::

    from smddp.client import connect
    comm = connect(job_id="demo", job_token=token, rank=r, world_size=2)
    comm.all_reduce(array).wait()
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

__all__ = [
    "ClientConfig",
    "Communicator",
    "DaemonLostError",
    "Handle",
    "MismatchError",
    "OpError",
    "OpTimeoutError",
    "RankFailedError",
    "SmddpError",
    "UnsupportedError",
    "connect",
    "rendezvous",
]
