"""What every side of smddp shares: the daemon, the client and the backend.

- ``op``: ``OpSpec``, one op as a rank called it, and the ``OpKind``/``DType``/``ReduceOp`` enums.
- ``region``: the control region's layout and protocol (the daemon creates it, ranks map it).
- ``wire``: the data socket's messages and the daemon's socket path.
- ``reduce``: reductions in a fixed order, so that every rank and rerun gets the same bits.
- ``cuda_driver``: the CUDA driver calls the client and the daemon make through ctypes.
- ``launch_env``: torchrun's variables from an MPI or Slurm launcher's (the backend's).
- ``_fastregion``: the region path's per-op bookkeeping in C, optional.

Nothing here imports torch, or any part of smddp but the wire's generated messages (smddp.v1).
"""
