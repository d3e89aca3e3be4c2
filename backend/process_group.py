"""The torch ProcessGroup of backend "smddp": each collective is one call into the client.

Every method checks its tensors, turns them into numpy views, calls the client's
collective (which returns at once with a Handle) and wraps the handle in an SmddpWork.
Outputs that are not contiguous go through a contiguous copy written back on completion.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from smddp.backend.cuda import CudaCollectives, on_cuda
from smddp.backend.tensors import as_numpy, check, reduce_op
from smddp.backend.work import SmddpWork
from smddp.client import Communicator
from smddp.client.errors import UnsupportedError

BACKEND_NAME = "smddp"


def _one(tensors: list[torch.Tensor], what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise UnsupportedError(f"{what}: smddp takes one tensor per rank, got {len(tensors)}")
    return tensors[0]


class _Staging:
    """Contiguous stand-ins for output tensors that are not, copied back at the end."""

    def __init__(self) -> None:
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def out(self, t: torch.Tensor, what: str) -> torch.Tensor:
        check(t, what)
        if t.is_contiguous():
            return t
        tmp = t.contiguous()
        self._pairs.append((t, tmp))
        return tmp

    def finish(self) -> Callable[[], None] | None:
        if not self._pairs:
            return None
        pairs = self._pairs

        def copy_back() -> None:
            for dst, src in pairs:
                dst.copy_(src)

        return copy_back


class SmddpProcessGroup(dist.ProcessGroup):
    """A process group whose collectives the node daemon carries out."""

    def __init__(self, comm: Communicator, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.comm = comm
        self._cuda: CudaCollectives | None = None
        self._group_name = ""
        self._group_desc = ""

    # -- identity -----------------------------------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def group_name(self) -> str:
        return self._group_name

    def shutdown(self) -> None:
        """Waits for ops in flight, then leaves the daemon (destroy_process_group)."""
        self.comm.close()

    def abort(self) -> None:
        self.comm.close()

    # -- collectives --------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: c10d.AllreduceOptions | None = None) -> SmddpWork:
        opts = opts if opts is not None else c10d.AllreduceOptions()
        if on_cuda(tensors):
            return self._gpu().allreduce([_one(tensors, "all_reduce")], opts)
        t = _one(tensors, "all_reduce")
        op = reduce_op(opts.reduceOp, "all_reduce")
        stage = _Staging()
        buf = stage.out(t, "all_reduce")
        handle = self.comm.all_reduce(as_numpy(buf, "all_reduce"), op)
        return SmddpWork([handle], [t], stage.finish())

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: c10d.AllreduceCoalescedOptions | None = None) -> SmddpWork:
        opts = opts if opts is not None else c10d.AllreduceCoalescedOptions()
        if on_cuda(tensors):
            return self._gpu().allreduce(list(tensors), opts, "all_reduce_coalesced")  # type: ignore[arg-type]
        op = reduce_op(opts.reduceOp, "all_reduce_coalesced")
        stage = _Staging()
        bufs = [stage.out(t, "all_reduce_coalesced") for t in tensors]
        handles = [self.comm.all_reduce(as_numpy(b, "all_reduce_coalesced"), op) for b in bufs]
        return SmddpWork(handles, list(tensors), stage.finish())

    def broadcast(self, tensors: list[torch.Tensor], opts: c10d.BroadcastOptions | None = None) -> SmddpWork:
        opts = opts if opts is not None else c10d.BroadcastOptions()
        t = _one(tensors, "broadcast")
        if on_cuda(t):
            return self._gpu().broadcast([t], opts)
        stage = _Staging()
        buf = stage.out(t, "broadcast")
        handle = self.comm.broadcast(as_numpy(buf, "broadcast"), opts.rootRank)
        return SmddpWork([handle], [t], stage.finish())

    def reduce(self, tensors: list[torch.Tensor], opts: c10d.ReduceOptions | None = None) -> SmddpWork:
        opts = opts if opts is not None else c10d.ReduceOptions()
        t = _one(tensors, "reduce")
        if on_cuda(t):
            return self._gpu().reduce([t], opts)
        op = reduce_op(opts.reduceOp, "reduce")
        stage = _Staging()
        buf = stage.out(t, "reduce")
        handle = self.comm.reduce(as_numpy(buf, "reduce"), opts.rootRank, op)
        return SmddpWork([handle], [t], stage.finish())

    def allgather(
        self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: c10d.AllgatherOptions
    ) -> SmddpWork:
        src = _one(input_list, "all_gather")
        outs = _one(output_lists, "all_gather")  # type: ignore[arg-type]
        if on_cuda(src, outs):
            return self._gpu().allgather(list(outs), src)
        stage = _Staging()
        bufs = [stage.out(o, "all_gather") for o in outs]
        self._same(src, bufs, "all_gather")
        handle = self.comm.all_gather([as_numpy(b, "all_gather") for b in bufs], as_numpy(src, "all_gather"))
        return SmddpWork([handle], list(outs), stage.finish())

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: c10d.AllgatherOptions | None = None) -> SmddpWork:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        what = "all_gather_into_tensor"
        if on_cuda(output, input):
            return self._gpu().all_gather_single(output, input)
        check(input, what)
        stage = _Staging()
        buf = stage.out(output, what)
        if buf.numel() != input.numel() * self.size() or buf.dtype != input.dtype:
            raise UnsupportedError(
                f"{what}: output has {buf.numel()} x {buf.dtype} but {self.size()} ranks x "
                f"{input.numel()} x {input.dtype} are gathered"
            )
        pieces = buf.reshape(self.size(), -1)  # concatenated [W*n] and stacked [W, n] alike
        handle = self.comm.all_gather([as_numpy(p, what) for p in pieces], as_numpy(input, what))
        return SmddpWork([handle], [output], stage.finish())

    _allgather_base = all_gather_single

    def reduce_scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: c10d.ReduceScatterOptions
    ) -> SmddpWork:
        out = _one(outputs, "reduce_scatter")
        ins = _one(input_lists, "reduce_scatter")  # type: ignore[arg-type]
        if on_cuda(out, ins):
            return self._gpu().reduce_scatter(out, list(ins), opts)
        op = reduce_op(opts.reduceOp, "reduce_scatter")
        stage = _Staging()
        buf = stage.out(out, "reduce_scatter")
        self._same(buf, ins, "reduce_scatter")
        handle = self.comm.reduce_scatter(as_numpy(buf, "reduce_scatter"), [as_numpy(x, "reduce_scatter") for x in ins], op)
        return SmddpWork([handle], [out], stage.finish())

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: c10d.ReduceScatterOptions
    ) -> SmddpWork:
        what = "reduce_scatter_tensor"
        if on_cuda(output, input):
            return self._gpu().reduce_scatter_single(output, input, opts)
        op = reduce_op(opts.reduceOp, what)
        check(input, what)
        stage = _Staging()
        buf = stage.out(output, what)
        if input.numel() != buf.numel() * self.size() or buf.dtype != input.dtype:
            raise UnsupportedError(
                f"{what}: input has {input.numel()} x {input.dtype} but {self.size()} ranks x "
                f"{buf.numel()} x {buf.dtype} are expected"
            )
        pieces = input.contiguous().reshape(self.size(), -1)
        handle = self.comm.reduce_scatter(as_numpy(buf, what), [as_numpy(p, what) for p in pieces], op)
        return SmddpWork([handle], [output], stage.finish())

    _reduce_scatter_base = reduce_scatter_single

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: c10d.AllToAllOptions | None = None) -> SmddpWork:
        opts = opts if opts is not None else c10d.AllToAllOptions()
        if on_cuda(outputs, inputs):
            return self._gpu().alltoall(list(outputs), list(inputs))
        stage = _Staging()
        bufs = [stage.out(o, "all_to_all") for o in outputs]
        handle = self.comm.all_to_all([as_numpy(b, "all_to_all") for b in bufs], [as_numpy(x, "all_to_all") for x in inputs])
        return SmddpWork([handle], list(outputs), stage.finish())

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: c10d.AllToAllOptions | None = None,
    ) -> SmddpWork:
        opts = opts if opts is not None else c10d.AllToAllOptions()
        what = "all_to_all_single"
        if on_cuda(output, input):
            return self._gpu().all_to_all_single(output, input, output_split_sizes, input_split_sizes, self._split)
        check(input, what)
        stage = _Staging()
        buf = stage.out(output, what)
        outs = self._split(buf, output_split_sizes, what, "output")
        ins = self._split(input.contiguous(), input_split_sizes, what, "input")
        handle = self.comm.all_to_all([as_numpy(o, what) for o in outs], [as_numpy(x, what) for x in ins])
        return SmddpWork([handle], [output], stage.finish())

    alltoall_base = all_to_all_single

    def _split(self, t: torch.Tensor, sizes: list[int], what: str, which: str) -> list[torch.Tensor]:
        w = self.size()
        if not sizes:
            if t.shape[0] % w if t.dim() else True:
                raise UnsupportedError(f"{what}: {which} dim 0 ({tuple(t.shape)}) is not divisible by {w} ranks")
            sizes = [t.shape[0] // w] * w
        if len(sizes) != w or sum(sizes) != t.shape[0]:
            raise UnsupportedError(f"{what}: {which} split sizes {list(sizes)} do not split dim 0 of {tuple(t.shape)} into {w} parts")
        return list(torch.split(t, sizes, dim=0))

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: c10d.GatherOptions | None = None) -> SmddpWork:
        opts = opts if opts is not None else c10d.GatherOptions()
        src = _one(inputs, "gather")
        root = opts.rootRank
        if on_cuda(src, output_lists if self.rank() == root else []):
            return self._gpu().gather(list(_one(output_lists, "gather")) if self.rank() == root else None, src, root)  # type: ignore[arg-type]
        stage = _Staging()
        outs = None
        result = [src]
        if self.rank() == root:
            targets = _one(output_lists, "gather")  # type: ignore[arg-type]
            outs = [stage.out(o, "gather") for o in targets]
            self._same(src, outs, "gather")
            result = list(targets)
        handle = self.comm.gather([as_numpy(o, "gather") for o in outs] if outs is not None else None, as_numpy(src, "gather"), root)
        return SmddpWork([handle], result, stage.finish())

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: c10d.ScatterOptions | None = None) -> SmddpWork:
        opts = opts if opts is not None else c10d.ScatterOptions()
        out = _one(outputs, "scatter")
        root = opts.rootRank
        if on_cuda(out, input_lists if self.rank() == root else []):
            return self._gpu().scatter(out, list(_one(input_lists, "scatter")) if self.rank() == root else None, root)  # type: ignore[arg-type]
        stage = _Staging()
        buf = stage.out(out, "scatter")
        ins = None
        if self.rank() == root:
            ins = _one(input_lists, "scatter")  # type: ignore[arg-type]
            self._same(buf, ins, "scatter")
        handle = self.comm.scatter(as_numpy(buf, "scatter"), [as_numpy(x, "scatter") for x in ins] if ins is not None else None, root)
        return SmddpWork([handle], [out], stage.finish())

    def barrier(self, opts: c10d.BarrierOptions | None = None) -> SmddpWork:
        opts = opts if opts is not None else c10d.BarrierOptions()
        return SmddpWork([self.comm.barrier()], [])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> SmddpWork:
        t = _one(tensors, "send")
        if on_cuda(t):
            return self._gpu().send(t, dst, tag)
        handle = self.comm.send(as_numpy(t.contiguous(), "send"), dst, tag)
        return SmddpWork([handle], [t])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> SmddpWork:
        t = _one(tensors, "recv")
        if on_cuda(t):
            return self._gpu().recv(t, src, tag)
        stage = _Staging()
        buf = stage.out(t, "recv")
        handle = self.comm.recv(as_numpy(buf, "recv"), src, tag)
        return SmddpWork([handle], [t], stage.finish())

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> SmddpWork:
        raise UnsupportedError("recv: smddp needs the source rank (recv from any source is not supported)")

    def _gpu(self) -> CudaCollectives:
        """The GPU path (backend/cuda.py), for collectives on CUDA tensors."""
        if self._cuda is None:
            self._cuda = CudaCollectives(self.comm, self.rank(), self.size())
        return self._cuda

    @staticmethod
    def _same(ref: torch.Tensor, others: list[torch.Tensor], what: str) -> None:
        for i, o in enumerate(others):
            check(o, what)
            if o.numel() != ref.numel() or o.dtype != ref.dtype:
                raise UnsupportedError(
                    f"{what}: tensor {i} has {o.numel()} x {o.dtype} but {ref.numel()} x {ref.dtype} was expected"
                )
