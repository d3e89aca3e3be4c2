"""The torch ProcessGroup of backend "smddp": each collective is one call into the client.

Every method checks its tensors, turns them into numpy views, calls the client's
collective (which returns at once with a Handle) and wraps the handle in an SmddpWork.
Outputs that are not contiguous go through a contiguous copy written back on completion.

all_reduce and broadcast of one dense, contiguous CPU tensor (nearly every call: DDP's
buckets, a loss, a flag) take a lean path: one check of the tensor, a cached numpy view
(``ViewCache``), no staging; a small op's cost is mostly this layer's Python. A group of
one rank calls ``SoloOps`` instead of the communicator: its collectives run in place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from smddp.backend.cuda import CudaCollectives, TorchCuda, device_api, on_cuda
from smddp.backend.errors import translate
from smddp.backend.solo import SoloOps
from smddp.backend.tensors import SUPPORTED, ViewCache, as_numpy, check, reduce_op
from smddp.backend.work import SmddpWork, stop_completer
from smddp.client import Communicator, Handle, ReduceOp
from smddp.client.errors import SmddpError, UnsupportedError

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

    from smddp.backend.job import Job

BACKEND_NAME = "smddp"
_CARRIED = frozenset(SUPPORTED)
_SUM = dist.ReduceOp.SUM


_T = TypeVar("_T")


def _one(tensors: Sequence[_T], what: str) -> _T:
    """The one tensor (or one list of tensors) a rank passes; smddp takes no more."""
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


def joined(works: list[SmddpWork], result: list[torch.Tensor]) -> SmddpWork:
    """One Work over several ops (the coalesced collectives), complete when all of them are."""
    if len(works) == 1 and [id(t) for t in works[0]._result] == [id(t) for t in result]:
        return works[0]
    handles = [h for w in works for h in w._handles]
    finishes = [w._finish for w in works if w._finish is not None]

    def finish() -> None:
        for f in finishes:
            f()

    return SmddpWork(handles, result, finish if finishes else None)


def _tracked(method: Callable[..., SmddpWork]) -> Callable[..., SmddpWork]:
    """Records the op's Work while a device coalescing block is open (``_start_coalescing``),
    so that ``_end_coalescing`` can return one Work that waits for all of them; and turns a
    client error raised at the call (a destroyed or failed group) into its DistBackendError
    subclass, as torch's callers expect of a backend. Bad arguments stay UnsupportedError
    (a ValueError)."""

    @functools.wraps(method)
    def run(self: SmddpProcessGroup, *args: Any, **kwargs: Any) -> SmddpWork:
        try:
            work = method(self, *args, **kwargs)
        except UnsupportedError:
            raise
        except SmddpError as exc:
            raise translate(exc, self.comm) from None
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    return run


class SmddpProcessGroup(dist.ProcessGroup):
    """A process group whose collectives the node daemon carries out."""

    # Set by the creator: the job the group belongs to and each group rank's node, which
    # shrink_group lays the survivors' new communicator out from.
    job: Job | None = None
    rank_nodes: tuple[str, ...] = ()

    def __init__(self, comm: Communicator, rank: int, size: int) -> None:
        # torch's stub lists only ProcessGroup(store, rank, size); (rank, size) is the one
        # a Python backend calls (torch/csrc/distributed/c10d/init.cpp binds both).
        super().__init__(rank, size)  # type: ignore[call-arg, arg-type]
        self.comm = comm
        # The numpy collectives: the communicator's, or done in place in a group of one.
        self._ops: Communicator | SoloOps = SoloOps(comm) if size == 1 else comm
        self._views = ViewCache()
        # Whether torch.cuda is the device API (a test device may claim CPU memory as a
        # GPU's, which only on_cuda asks it about); decided at the first op.
        self._plain_device: bool | None = None
        self._cuda: CudaCollectives | None = None
        self._group_name = ""
        self._group_desc = ""
        self._coalesced: list[SmddpWork] | None = None

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
    def group_name(self) -> GroupName:
        return self._group_name  # type: ignore[return-value]  # set from torch's own name (a str)

    def shutdown(self) -> None:
        """Waits for ops in flight, then leaves the daemon (destroy_process_group)."""
        self.comm.close()
        stop_completer(self.comm)  # after close: the Futures still due complete with it

    def abort(self) -> None:
        self.comm.close()
        stop_completer(self.comm)

    # -- collectives --------------------------------------------------------------------------

    @_tracked
    def allreduce(
        self, tensors: list[torch.Tensor], opts: c10d.AllreduceOptions | None = None
    ) -> SmddpWork:
        opts = opts if opts is not None else c10d.AllreduceOptions()
        t = self._lean(tensors)
        if t is not None:
            rop = opts.reduceOp
            # ReduceOp == RedOpType is a C++ comparison; going through .op costs twice as much.
            # (torch's stub types the two as unrelated; C++ compares them by value)
            op = ReduceOp.SUM if rop == _SUM else reduce_op(rop, "all_reduce")  # type: ignore[comparison-overlap]
            return SmddpWork([self._ops.all_reduce(self._views.flat(t, "all_reduce"), op)], [t])
        if (
            len(tensors) == 1
            and isinstance(tensors[0], torch.Tensor)
            and tensors[0].layout == torch.sparse_coo
        ):
            return self._sparse_allreduce(tensors[0], opts)
        if on_cuda(tensors):
            return self._gpu().allreduce([_one(tensors, "all_reduce")], opts)
        t = _one(tensors, "all_reduce")
        op = reduce_op(opts.reduceOp, "all_reduce")
        stage = _Staging()
        buf = stage.out(t, "all_reduce")
        handle = self._ops.all_reduce(as_numpy(buf, "all_reduce"), op)
        return SmddpWork([handle], [t], stage.finish())

    def _lean(self, tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """The tensor of the common case, or None: one dense, contiguous CPU tensor of a
        dtype smddp carries (what check() and on_cuda() would find, asked once)."""
        if len(tensors) != 1:
            return None
        t = tensors[0]
        if not (
            isinstance(t, torch.Tensor)
            and t.layout is torch.strided
            and t.is_cpu
            and t.dtype in _CARRIED
            and t.is_contiguous()
        ):
            return None
        plain = self._plain_device
        if plain is None:
            plain = self._plain_device = type(device_api()) is TorchCuda
        return t if plain else None

    def _sparse_allreduce(self, t: torch.Tensor, opts: c10d.AllreduceOptions) -> SmddpWork:
        """SUM of sparse COO tensors, as gloo does it: every rank gathers every rank's indices
        and values (padded to the largest count), and sums them in rank order, so that all
        ranks get the same result; written into ``t`` in place. Blocks until done."""
        what = "all_reduce (sparse)"
        if reduce_op(opts.reduceOp, what) != reduce_op(dist.ReduceOp.SUM, what):
            raise UnsupportedError(f"{what}: only SUM is supported for sparse tensors")
        src = t.detach().to("cpu").coalesce()
        indices, values = src.indices().contiguous(), src.values().contiguous()
        check(values, what)
        w = self.size()
        counts = torch.zeros(w, dtype=torch.int64)
        mine = torch.tensor([indices.shape[1]], dtype=torch.int64)
        self._ops.all_gather(
            [as_numpy(c, what) for c in torch.split(counts, 1)], as_numpy(mine, what)
        ).wait()
        most = int(counts.max())
        pad_i = torch.zeros((indices.shape[0], most), dtype=indices.dtype)
        pad_i[:, : indices.shape[1]] = indices
        pad_v = torch.zeros((most, *values.shape[1:]), dtype=values.dtype)
        pad_v[: values.shape[0]] = values
        all_i = torch.empty((w, *pad_i.shape), dtype=pad_i.dtype)
        all_v = torch.empty((w, *pad_v.shape), dtype=pad_v.dtype)
        hi = self._ops.all_gather([as_numpy(x, what) for x in all_i], as_numpy(pad_i, what))
        hv = self._ops.all_gather([as_numpy(x, what) for x in all_v], as_numpy(pad_v, what))
        hi.wait()
        hv.wait()
        n = [int(c) for c in counts]
        summed = torch.sparse_coo_tensor(
            torch.cat([all_i[r, :, : n[r]] for r in range(w)], dim=1),
            torch.cat([all_v[r, : n[r]] for r in range(w)]),
            src.shape,
        ).coalesce()
        with torch.no_grad():
            t.copy_(summed.to(t.device))
        return SmddpWork([], [t])

    @_tracked
    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: c10d.AllreduceCoalescedOptions | None = None
    ) -> SmddpWork:
        opts = opts if opts is not None else c10d.AllreduceCoalescedOptions()
        if on_cuda(tensors):
            return self._gpu().allreduce(list(tensors), opts, "all_reduce_coalesced")
        op = reduce_op(opts.reduceOp, "all_reduce_coalesced")
        stage = _Staging()
        bufs = [stage.out(t, "all_reduce_coalesced") for t in tensors]
        handles = [self._ops.all_reduce(as_numpy(b, "all_reduce_coalesced"), op) for b in bufs]
        return SmddpWork(handles, list(tensors), stage.finish())

    @_tracked
    def broadcast(
        self, tensors: list[torch.Tensor], opts: c10d.BroadcastOptions | None = None
    ) -> SmddpWork:
        opts = opts if opts is not None else c10d.BroadcastOptions()
        lean = self._lean(tensors)
        if lean is not None:
            flat = self._views.flat(lean, "broadcast")
            return SmddpWork([self._ops.broadcast(flat, opts.rootRank)], [lean])
        t = _one(tensors, "broadcast")
        if on_cuda(t):
            return self._gpu().broadcast([t], opts)
        stage = _Staging()
        buf = stage.out(t, "broadcast")
        handle = self._ops.broadcast(as_numpy(buf, "broadcast"), opts.rootRank)
        return SmddpWork([handle], [t], stage.finish())

    @_tracked
    def reduce(
        self, tensors: list[torch.Tensor], opts: c10d.ReduceOptions | None = None
    ) -> SmddpWork:
        opts = opts if opts is not None else c10d.ReduceOptions()
        t = _one(tensors, "reduce")
        if on_cuda(t):
            return self._gpu().reduce([t], opts)
        op = reduce_op(opts.reduceOp, "reduce")
        stage = _Staging()
        buf = stage.out(t, "reduce")
        handle = self._ops.reduce(as_numpy(buf, "reduce"), opts.rootRank, op)
        return SmddpWork([handle], [t], stage.finish())

    @_tracked
    def allgather(
        self,
        output_lists: list[list[torch.Tensor]],
        input_list: list[torch.Tensor],
        opts: c10d.AllgatherOptions,
    ) -> SmddpWork:
        src = _one(input_list, "all_gather")
        outs = _one(output_lists, "all_gather")
        if on_cuda(src, outs):
            return self._gpu().allgather(list(outs), src)
        stage = _Staging()
        bufs = [stage.out(o, "all_gather") for o in outs]
        self._same(src, bufs, "all_gather")
        handle = self._ops.all_gather(
            [as_numpy(b, "all_gather") for b in bufs], as_numpy(src, "all_gather")
        )
        return SmddpWork([handle], list(outs), stage.finish())

    @_tracked
    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: c10d.AllgatherOptions | None = None
    ) -> SmddpWork:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        if on_cuda(output, input):
            return self._gpu().all_gather_single(output, input)
        stage = _Staging()
        handle = self._gather_into(output, input, stage, "all_gather_into_tensor")
        return SmddpWork([handle], [output], stage.finish())

    _allgather_base = all_gather_single

    def _gather_into(
        self, output: torch.Tensor, input: torch.Tensor, stage: _Staging, what: str
    ) -> Handle:
        check(input, what)
        buf = stage.out(output, what)
        if buf.numel() != input.numel() * self.size() or buf.dtype != input.dtype:
            raise UnsupportedError(
                f"{what}: "
                f"output has {buf.numel()} x {buf.dtype} but {self.size()} ranks x {input.numel()} x {input.dtype} are gathered"  # noqa: E501
            )
        pieces = buf.reshape(self.size(), -1)  # concatenated [W*n] and stacked [W, n] alike
        return self._ops.all_gather([as_numpy(p, what) for p in pieces], as_numpy(input, what))

    @_tracked
    def all_gather_single_coalesced(
        self,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: c10d.AllgatherOptions | None = None,
    ) -> SmddpWork:
        """all_gather_into_tensor of each pair: functional collectives (DTensor, FSDP2,
        torch.compile) and the coalescing manager call this."""
        what = "all_gather_into_tensor_coalesced"
        self._pairs(outputs, inputs, what)
        if on_cuda(outputs, inputs):
            gpu = self._gpu()
            return joined(
                [gpu.all_gather_single(o, i) for o, i in zip(outputs, inputs)], list(outputs)
            )
        stage = _Staging()
        handles = [self._gather_into(o, i, stage, what) for o, i in zip(outputs, inputs)]
        return SmddpWork(handles, list(outputs), stage.finish())

    # The name torch used before 2.12; C++ still falls back to it.
    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @_tracked
    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_list: list[torch.Tensor],
        opts: c10d.AllgatherOptions | None = None,
    ) -> SmddpWork:
        """all_gather of each input: ``output_lists[r][i]`` receives rank r's ``input_list[i]``."""
        what = "all_gather_coalesced"
        if len(output_lists) != self.size() or any(
            len(lst) != len(input_list) for lst in output_lists
        ):
            raise UnsupportedError(
                f"{what}: "
                f"expected {self.size()} output lists (one per rank) of {len(input_list)} tensors each, got {[len(lst) for lst in output_lists]}"  # noqa: E501
            )
        for i, src in enumerate(input_list):
            check(src, what)
            for r in range(self.size()):
                o = output_lists[r][i]
                check(o, what)
                if o.numel() != src.numel() or o.dtype != src.dtype:
                    raise UnsupportedError(
                        f"{what}: "
                        f"output [{r}][{i}] has {o.numel()} x {o.dtype} but input {i} has {src.numel()} x {src.dtype}"  # noqa: E501
                    )
        result = [o for lst in output_lists for o in lst]
        if on_cuda(output_lists, input_list):
            gpu = self._gpu()
            return joined(
                [
                    gpu.allgather([lst[i] for lst in output_lists], src)
                    for i, src in enumerate(input_list)
                ],
                result,
            )
        stage = _Staging()
        handles = []
        for i, src in enumerate(input_list):
            bufs = [stage.out(lst[i], what) for lst in output_lists]
            handles.append(
                self._ops.all_gather([as_numpy(b, what) for b in bufs], as_numpy(src, what))
            )
        return SmddpWork(handles, result, stage.finish())

    @_tracked
    def reduce_scatter(
        self,
        outputs: list[torch.Tensor],
        input_lists: list[list[torch.Tensor]],
        opts: c10d.ReduceScatterOptions,
    ) -> SmddpWork:
        out = _one(outputs, "reduce_scatter")
        ins = _one(input_lists, "reduce_scatter")
        if on_cuda(out, ins):
            return self._gpu().reduce_scatter(out, list(ins), opts)
        op = reduce_op(opts.reduceOp, "reduce_scatter")
        stage = _Staging()
        buf = stage.out(out, "reduce_scatter")
        self._same(buf, ins, "reduce_scatter")
        handle = self._ops.reduce_scatter(
            as_numpy(buf, "reduce_scatter"), [as_numpy(x, "reduce_scatter") for x in ins], op
        )
        return SmddpWork([handle], [out], stage.finish())

    @_tracked
    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: c10d.ReduceScatterOptions
    ) -> SmddpWork:
        what = "reduce_scatter_tensor"
        if on_cuda(output, input):
            return self._gpu().reduce_scatter_single(output, input, opts)
        op = reduce_op(opts.reduceOp, what)
        stage = _Staging()
        handle = self._scatter_from(output, input, op, stage, what)
        return SmddpWork([handle], [output], stage.finish())

    _reduce_scatter_base = reduce_scatter_single

    def _scatter_from(
        self, output: torch.Tensor, input: torch.Tensor, op: int, stage: _Staging, what: str
    ) -> Handle:
        check(input, what)
        buf = stage.out(output, what)
        if input.numel() != buf.numel() * self.size() or buf.dtype != input.dtype:
            raise UnsupportedError(
                f"{what}: "
                f"input has {input.numel()} x {input.dtype} but {self.size()} ranks x {buf.numel()} x {buf.dtype} are expected"  # noqa: E501
            )
        pieces = input.contiguous().reshape(self.size(), -1)
        return self._ops.reduce_scatter(
            as_numpy(buf, what), [as_numpy(p, what) for p in pieces], op
        )

    @_tracked
    def reduce_scatter_single_coalesced(
        self,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: c10d.ReduceScatterOptions | None = None,
    ) -> SmddpWork:
        """reduce_scatter_tensor of each pair (functional collectives, coalescing manager)."""
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        what = "reduce_scatter_tensor_coalesced"
        self._pairs(outputs, inputs, what)
        if on_cuda(outputs, inputs):
            gpu = self._gpu()
            return joined(
                [gpu.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)],
                list(outputs),
            )
        op = reduce_op(opts.reduceOp, what)
        stage = _Staging()
        handles = [self._scatter_from(o, i, op, stage, what) for o, i in zip(outputs, inputs)]
        return SmddpWork(handles, list(outputs), stage.finish())

    # The name torch used before 2.12; C++ still falls back to it.
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    @staticmethod
    def _pairs(outputs: list[torch.Tensor], inputs: list[torch.Tensor], what: str) -> None:
        if len(outputs) != len(inputs):
            raise UnsupportedError(f"{what}: {len(outputs)} outputs for {len(inputs)} inputs")

    # -- the coalescing manager with a device (NCCL-style): ops run as they come, and
    # _end_coalescing's Work waits for all of them.

    def _start_coalescing(self, device: torch.device) -> None:
        if self._coalesced is not None:
            raise UnsupportedError("coalescing: a coalescing block is already open on this group")
        self._coalesced = []

    def _end_coalescing(self, device: torch.device) -> SmddpWork:
        if self._coalesced is None:
            raise UnsupportedError("coalescing: _end_coalescing without _start_coalescing")
        works, self._coalesced = self._coalesced, None
        return joined(works, [t for w in works for t in w._result])

    start_coalescing = _start_coalescing
    end_coalescing = _end_coalescing

    @_tracked
    def alltoall(
        self,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: c10d.AllToAllOptions | None = None,
    ) -> SmddpWork:
        opts = opts if opts is not None else c10d.AllToAllOptions()
        if on_cuda(outputs, inputs):
            return self._gpu().alltoall(list(outputs), list(inputs))
        stage = _Staging()
        bufs = [stage.out(o, "all_to_all") for o in outputs]
        handle = self._ops.all_to_all(
            [as_numpy(b, "all_to_all") for b in bufs], [as_numpy(x, "all_to_all") for x in inputs]
        )
        return SmddpWork([handle], list(outputs), stage.finish())

    @_tracked
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
            return self._gpu().all_to_all_single(
                output, input, output_split_sizes, input_split_sizes, self._split
            )
        check(input, what)
        stage = _Staging()
        buf = stage.out(output, what)
        outs = self._split(buf, output_split_sizes, what, "output")
        ins = self._split(input.contiguous(), input_split_sizes, what, "input")
        handle = self._ops.all_to_all(
            [as_numpy(o, what) for o in outs], [as_numpy(x, what) for x in ins]
        )
        return SmddpWork([handle], [output], stage.finish())

    alltoall_base = all_to_all_single

    def _split(
        self, t: torch.Tensor, sizes: list[int], what: str, which: str
    ) -> list[torch.Tensor]:
        w = self.size()
        if not sizes:
            if t.shape[0] % w if t.dim() else True:
                raise UnsupportedError(
                    f"{what}: {which} dim 0 ({tuple(t.shape)}) is not divisible by {w} ranks"
                )
            sizes = [t.shape[0] // w] * w
        if len(sizes) != w or sum(sizes) != t.shape[0]:
            raise UnsupportedError(
                f"{what}: "
                f"{which} split sizes {list(sizes)} do not split dim 0 of {tuple(t.shape)} into {w} parts"  # noqa: E501
            )
        return list(torch.split(t, sizes, dim=0))

    @_tracked
    def gather(
        self,
        output_lists: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        opts: c10d.GatherOptions | None = None,
    ) -> SmddpWork:
        opts = opts if opts is not None else c10d.GatherOptions()
        src = _one(inputs, "gather")
        root = opts.rootRank
        if on_cuda(src, output_lists if self.rank() == root else []):
            return self._gpu().gather(
                list(_one(output_lists, "gather")) if self.rank() == root else None,
                src,
                root,
            )
        stage = _Staging()
        outs = None
        result = [src]
        if self.rank() == root:
            targets = _one(output_lists, "gather")
            outs = [stage.out(o, "gather") for o in targets]
            self._same(src, outs, "gather")
            result = list(targets)
        handle = self._ops.gather(
            [as_numpy(o, "gather") for o in outs] if outs is not None else None,
            as_numpy(src, "gather"),
            root,
        )
        return SmddpWork([handle], result, stage.finish())

    @_tracked
    def scatter(
        self,
        outputs: list[torch.Tensor],
        input_lists: list[list[torch.Tensor]],
        opts: c10d.ScatterOptions | None = None,
    ) -> SmddpWork:
        opts = opts if opts is not None else c10d.ScatterOptions()
        out = _one(outputs, "scatter")
        root = opts.rootRank
        if on_cuda(out, input_lists if self.rank() == root else []):
            return self._gpu().scatter(
                out,
                list(_one(input_lists, "scatter")) if self.rank() == root else None,
                root,
            )
        stage = _Staging()
        buf = stage.out(out, "scatter")
        ins = None
        if self.rank() == root:
            ins = _one(input_lists, "scatter")
            self._same(buf, ins, "scatter")
        handle = self._ops.scatter(
            as_numpy(buf, "scatter"),
            [as_numpy(x, "scatter") for x in ins] if ins is not None else None,
            root,
        )
        return SmddpWork([handle], [out], stage.finish())

    @_tracked
    def barrier(self, opts: c10d.BarrierOptions | None = None) -> SmddpWork:
        opts = opts if opts is not None else c10d.BarrierOptions()
        return SmddpWork([self._ops.barrier()], [])

    @_tracked
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> SmddpWork:
        t = _one(tensors, "send")
        if on_cuda(t):
            return self._gpu().send(t, dst, tag)
        handle = self._ops.send(as_numpy(t.contiguous(), "send"), dst, tag)
        return SmddpWork([handle], [t])

    @_tracked
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> SmddpWork:
        t = _one(tensors, "recv")
        if on_cuda(t):
            return self._gpu().recv(t, src, tag)
        stage = _Staging()
        buf = stage.out(t, "recv")
        handle = self._ops.recv(as_numpy(buf, "recv"), src, tag)
        return SmddpWork([handle], [t], stage.finish())

    @_tracked
    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> SmddpWork:
        """recv with ``src=None``: the first message sent to this rank with ``tag``, from any
        rank; the Work's ``_source_rank()`` names the sender (``dist.recv`` returns it)."""
        t = _one(tensors, "recv")
        if on_cuda(t):
            raise UnsupportedError(
                "recv: "
                f"rank {self.rank()} received from any source into a CUDA tensor, which smddp supports for CPU tensors only (the GPU path matches a send and a recv by their ranks); "  # noqa: E501
                "name the source (src=...) or receive into a CPU tensor"
            )
        stage = _Staging()
        buf = stage.out(t, "recv")
        handle = self._ops.recv_any(as_numpy(buf, "recv"), tag)
        return SmddpWork([handle], [t], stage.finish())

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
                    f"{what}: "
                    f"tensor {i} has {o.numel()} x {o.dtype} but {ref.numel()} x {ref.dtype} was expected"  # noqa: E501
                )
