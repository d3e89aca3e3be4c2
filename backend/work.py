"""The Work object torch gets back from every smddp collective, and its Future.

``get_future()`` returns at once. Its Future is typed ``Future[List[Tensor]]`` (DDP's built-in
C++ hooks need ``isTensorList()``; a Future made in Python holds a PyObject): a TorchScript
``fork`` of a function that waits on a plain "signal" Future and returns the Work's tensors.
The communicator's completer thread (one per communicator, FIFO) waits for the op, runs the
copy-backs, then sets the signal; the forked function resumes on torch's inter-op thread pool
and completes the typed Future, whose ``then`` callbacks (comm hooks) run there. So DDP's
backward goes on computing while buckets reduce on the progress thread.

Errors never leave as a failed Future. torch's C++ (DDP's reducer, the built-in comm hooks)
reads a Future that Python completed with ``set_exception`` as a successful one whose value is
the exception object, finds no tensors in it and crashes the process (SIGSEGV in
``loss.backward()``, measured). So the typed Future always completes with the tensors, and the
error reaches the caller by other ways, with its SmddpBackendError type and the daemon's
message:

- in a backward pass (DDP, comm hooks), the first ``get_future()`` of the pass queues an
  autograd final callback (``Variable._execution_engine.queue_callback``). DDP queues its
  ``finalize_backward`` only once the last bucket is launched, so ours runs first: it waits
  for every Work whose Future was handed out in the pass and raises the first error, which
  reaches ``backward()``'s caller unchanged (measured: default reducer, ``allreduce_hook``,
  ``fp16_compress_hook``, built-in FP16_COMPRESS), before anything reads the tensors;
- from Python, ``fut.wait()`` / ``fut.value()`` (and a ``then`` callback's ``fut.value()``)
  raise the error through the Future's unwrap function;
- ``Work.wait()`` raises it, and so do the next collectives where the group is broken.

No ``from __future__ import annotations`` here: TorchScript compiles functions below and
needs real annotations.
"""

import functools
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from smddp.backend.errors import translate
from smddp.backend.exit_gate import GATE
from smddp.client import Communicator, Handle
from smddp.client.errors import SmddpError, UnsupportedError
from smddp.client.progress import ProgressThread


@torch.jit.script
def _identity(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    return tensors


def typed_future(tensors: List[torch.Tensor]) -> torch.futures.Future[List[torch.Tensor]]:
    """A completed Future whose TorchScript type is List[Tensor].

    DDP's built-in C++ comm hooks (FP16_COMPRESS) require ``isTensorList()`` of the value; a
    Future completed from Python holds a PyObject, one made by ``torch.jit._fork`` does not.
    """
    return torch.jit._fork(_identity, tensors)


@torch.jit.script
def _after(signal: torch.futures.Future[int], tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    # The signal's value (a PyObject) is never read: it only says that the op has finished.
    torch.jit.wait(signal)
    return tensors


@torch.jit.script
def _pending(
    signal: torch.futures.Future[int], tensors: List[torch.Tensor]
) -> torch.futures.Future[List[torch.Tensor]]:
    # In TorchScript, fork runs _after until it blocks on the signal and returns its Future
    # (typed); once the signal is set, _after resumes on the inter-op pool and completes it.
    return torch.jit._fork(_after, signal, tensors)


# One completer thread per communicator: waits for each Work whose Future was handed out, in
# order, then completes the Future. Not the progress thread: a completion may need the
# communicator's lock (an op that completes lazily), which a caller holding it may be waiting
# on the progress thread for.
_completers: "weakref.WeakKeyDictionary[Communicator, ProgressThread]" = weakref.WeakKeyDictionary()
_completers_lock = threading.Lock()


def _completer(comm: Communicator) -> ProgressThread:
    with _completers_lock:
        thread = _completers.get(comm)
        if thread is None:
            thread = _completers[comm] = ProgressThread(f"smddp-complete-{comm.session.comm_id}")
        return thread


def stop_completer(comm: Communicator) -> None:
    """Completes the Futures still due on ``comm`` and ends its completer thread."""
    with _completers_lock:
        thread = _completers.pop(comm, None)
    if thread is not None:
        thread.stop()


# The error of an op that a Future's ``then`` callback started and waited for on torch's
# inter-op pool (PowerSGD's P and Q all_reduces), by communicator, for the backward pass
# whose Futures' callbacks started it. Raised there, it fails only the callback, which torch
# turns into a RuntimeError "Got the following error when running the callback: ..." that
# DDP's finalize_backward raises: no DistBackendError, no SmddpBackendError type.
_chain_errors: "weakref.WeakKeyDictionary[Communicator, BaseException]" = (
    weakref.WeakKeyDictionary()
)


# Works whose Futures were handed out during a backward pass, by graph task id; the pass's
# final callback takes them out. A pass that fails before its final callbacks leaves its
# entry behind, so only the newest few are kept.
_backward_works: Dict[int, List[Tuple["SmddpWork", torch.futures.Future[List[torch.Tensor]]]]] = {}
_backward_lock = threading.Lock()
_BACKWARD_KEEP = 64


def _guard_backward(work: "SmddpWork", fut: torch.futures.Future[List[torch.Tensor]]) -> None:
    """In a backward pass, makes the pass raise ``work``'s error (if it fails), or that of an
    op which the callbacks of ``work``'s Future ``fut`` start, from a final callback, before
    DDP's own final callback reads the Future's tensors."""
    task = torch._C._current_graph_task_id()
    if task < 0:
        return
    with _backward_lock:
        works = _backward_works.get(task)
        first = works is None
        if works is None:
            works = _backward_works[task] = []
            while len(_backward_works) > _BACKWARD_KEEP:
                del _backward_works[next(iter(_backward_works))]
            _chain_errors.pop(work._handles[0].comm, None)  # an earlier pass's
        # The Future is kept here, not on the Work: its unwrap function holds the Work, and
        # a cycle through torch's C++ is never collected.
        works.append((work, fut))
    if first:
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(_backward_done, task)
        )


# How many ops ``then`` callbacks are waiting for on foreign threads right now (get_future
# there waits in place), under _chain_waits' lock: a backward pass's final callback waits
# for them to end, since a Future that has already completed may still be running its
# callbacks, so a callback added then runs at once and says nothing of the others.
_chain_waits = threading.Condition()
_chain_waiting = 0


def _ignore(fut: torch.futures.Future[List[torch.Tensor]]) -> None:
    return None


def _backward_done(task: int) -> None:
    with _backward_lock:
        works = _backward_works.pop(task, [])
    error: Optional[BaseException] = None
    for w, _ in works:
        w._complete()
        error = error or w._error
    if error is None:
        # Before DDP's final callback (next) reads the hooks' Futures, which a failed op of
        # their chains fails with a RuntimeError: the chains' errors, with their types.
        # Callbacks run in the order they were added and a chained Future's callbacks run
        # inside its parent's, so once one added now has run, a chain that had not started
        # has ended; one that had may still wait for an op (_chain_waits). Left open: a chain
        # whose callback has not yet begun to wait for its op (PowerSGD's P, or Q after P)
        # can still fail after this, with torch's RuntimeError around the error.
        for _, fut in works:
            fut.then(_ignore).wait()
        with _chain_waits:
            _chain_waits.wait_for(lambda: _chain_waiting == 0)
        for comm in {w._handles[0].comm for w, _ in works}:
            error = error or _chain_errors.pop(comm, None)
    if error is not None:
        raise error


def _foreign_thread() -> bool:
    """True in a thread that Python's threading did not start (torch's inter-op pool)."""
    return isinstance(threading.current_thread(), threading._DummyThread)


class SmddpWork(dist.Work):
    """Completes when the op's chunks are retired and copy-backs have run."""

    # Class defaults: an instance sets only what differs (one is made per op, so its
    # construction is part of every small op's cost).
    _finish: Optional[Callable[[], None]] = None
    _error: Optional[BaseException] = None
    _completed = False

    def __init__(
        self,
        handles: List[Handle],
        result: List[torch.Tensor],
        finish: Optional[Callable[[], None]] = None,
    ) -> None:
        super().__init__()
        self._handles = handles
        self._result = result
        if finish is not None:
            self._finish = finish
        self._lock = threading.Lock()

    def _complete(self) -> None:
        with self._lock:
            self._complete_locked()

    def _complete_locked(self) -> None:
        if self._completed:
            return
        try:
            for h in self._handles:
                h.wait()
            if self._finish is not None:
                self._finish()
        except SmddpError as exc:
            # The handles' communicator (they share one) says which ranks a failure names.
            self._error = translate(exc, self._handles[0].comm if self._handles else None)
        self._completed = True

    def _await_ops(self) -> None:
        """Waits until the op's handles are done, recording nothing: ``_complete`` meets
        their errors again and records them."""
        for h in self._handles:
            try:
                h.wait()
            except Exception:
                pass

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if not self._completed:
            self._complete()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        # Polling makes progress; copy-backs run before True, so outputs are ready when it is.
        # Never blocks: while the completer thread finishes the op this says False.
        if (
            not self._completed
            and all(h.poll() for h in self._handles)
            and self._lock.acquire(blocking=False)
        ):
            try:
                self._complete_locked()
            finally:
                self._lock.release()
        return self._completed

    def is_success(self) -> bool:
        self._complete()
        return self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def result(self) -> List[torch.Tensor]:
        self.wait()
        return self._result

    def _source_rank(self) -> int:
        """The rank that sent what a recv received (``dist.recv`` returns it for a receive
        from any source); waits for the recv first."""
        self.wait()
        source = self._handles[0].source if len(self._handles) == 1 else -1
        if source < 0:
            raise UnsupportedError("source_rank: only the Work of a recv has a source rank")
        return source

    source_rank = _source_rank  # torch's older public name

    def _unwrap(self, value: Any) -> None:
        if self._error is not None:
            raise self._chained_error()

    def _chained_error(self) -> BaseException:
        """The error, noted for the backward pass under way: raised here, in a comm hook's
        ``then`` callback (PowerSGD's P and Q all_reduces, on the inter-op pool or inline),
        it would reach ``backward()``'s caller only as a RuntimeError (see _chain_errors)."""
        assert self._error is not None
        _chain_errors[self._handles[0].comm] = self._error
        return self._error

    def get_future(self) -> torch.futures.Future[List[torch.Tensor]]:
        """A Future of the output tensors, returned at once; it completes once the op has
        (outputs written). A failed op never fails it (see the module docstring): its error
        is raised by a backward pass's final callback, by ``wait()``/``value()`` from Python,
        and by ``Work.wait()``; an error already known is raised here."""
        if not self.is_completed() and _foreign_thread() and torch._C._current_graph_task_id() < 0:
            # A thread torch started, outside backward: a comm hook's ``then`` callback on the
            # inter-op pool (PowerSGD waits there for the Future of a further all_reduce). The
            # pending Future would complete on that pool, which such waits can fill up: wait here.
            global _chain_waiting
            with _chain_waits:
                _chain_waiting += 1
            try:
                self._complete()
            finally:
                with _chain_waits:
                    _chain_waiting -= 1
                    _chain_waits.notify_all()
        if self.is_completed():
            if self._error is not None:
                raise self._chained_error()
            done = typed_future(self._result)
            _guard_backward(self, done)  # for the ops that its callbacks may start
            return done
        signal: torch.futures.Future[Any] = torch.futures.Future()
        fut = _pending(signal, self._result)
        fut._set_unwrap_func(self._unwrap)
        _guard_backward(self, fut)

        def complete() -> None:
            # Waiting for the op touches no torch, so the interpreter's exit may cut it short;
            # the copy-backs and the Future's completion release the GIL inside torch, where
            # being cut short aborts the process (see exit_gate).
            self._await_ops()
            with GATE.passage() as admitted:
                if not admitted:
                    return  # the interpreter is exiting: nothing will read this Future
                try:
                    self._complete()
                except BaseException as exc:  # a bug must not leave the Future pending forever
                    self._error = self._error or exc
                finally:
                    signal.set_result(None)

        _completer(self._handles[0].comm).submit(complete)
        return fut
