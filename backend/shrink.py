"""``smddp.shrink_group``: the surviving ranks of a group go on as a group of their own.

torch 2.13's ``dist.shrink_group`` cannot reach a Python backend, in two places of
torch/distributed/distributed_c10d.py:

- ``_validate_shrink_backend_requirements`` asks ``target_pg._get_backend(device)``. A creator
  registered with ``extended_api=True`` that returns a ``ProcessGroup`` subclass becomes the
  group itself (``_new_process_group_helper``: ``if issubclass(type(backend_class),
  ProcessGroup): pg = backend_class``), with no per-device backend registered, so
  ``_get_backend`` raises "No backend type associated with device type cpu" and shrink_group
  says "Cannot access device backend".
- Even past that, ``_create_shrunk_process_group`` hands what ``backend.shrink(...)`` returned
  to ``new_pg._register_backend(device, backend_type, new_backend)``, whose binding takes a C++
  ``c10d::Backend`` only; Python cannot make one (``torch._C._distributed_c10d.Backend`` has no
  constructor bound: "No constructor defined!").

So smddp offers the same call with the same signature: it returns a real ProcessGroup of the
survivors (same order, group ranks renumbered) and, when the default group was shrunk,
makes it the default group, as torch's does (every other group is destroyed then, since the
ranks are renumbered). The daemons give the new group a fresh communicator, one generation on
from the old one's, and refuse survivors that disagree on whom they exclude.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from smddp.backend.errors import translate
from smddp.backend.process_group import SmddpProcessGroup
from smddp.client.communicator import Communicator
from smddp.client.errors import SmddpError

__all__ = ["SHRINK_ABORT", "SHRINK_DEFAULT", "failed_ranks", "shrink_group"]

# torch's values (distributed_c10d.SHRINK_DEFAULT / SHRINK_ABORT, torch 2.13).
SHRINK_DEFAULT = 0x00
SHRINK_ABORT = 0x01


def _check_excluded(ranks_to_exclude: Any, size: int, rank: int) -> list[int]:
    """The excluded ranks, sorted, after torch's checks (same errors as dist.shrink_group)."""
    if not isinstance(ranks_to_exclude, list):
        raise TypeError(
            f"ranks_to_exclude must be a list, but got {type(ranks_to_exclude).__name__}"
        )
    if not ranks_to_exclude:
        raise ValueError("ranks_to_exclude cannot be empty: name at least one rank to exclude")
    seen: set[int] = set()
    for i, r in enumerate(ranks_to_exclude):
        if not isinstance(r, int) or isinstance(r, bool):
            raise TypeError(f"ranks_to_exclude[{i}] is {type(r).__name__} {r!r}, not a rank")
        if not 0 <= r < size:
            raise ValueError(f"rank {r} at index {i} is outside the group of {size} ranks")
        if r in seen:
            raise ValueError(f"rank {r} appears twice in ranks_to_exclude")
        seen.add(r)
    if len(seen) >= size:
        raise ValueError(f"cannot exclude all {size} ranks of the group")
    if rank in seen:
        raise RuntimeError(
            f"rank {rank} is in ranks_to_exclude and must not call shrink_group: only the ranks that stay call it"  # noqa: E501
        )
    return sorted(seen)


def _shrunk_id(parent_id: str, generation: int) -> str:
    """The new communicator's id: the family's first id and the generation, the same on
    every survivor (``0#1``, then ``0#2``, ...)."""
    return f"{parent_id.split('#', 1)[0]}#{generation}"


def failed_ranks(group: dist.ProcessGroup | None = None) -> frozenset[int]:
    """The ranks of ``group`` that its daemons agreed have failed: what a
    ``SmddpRankFailedError`` carries, for an error that reached the script without it (DDP's
    reducer hands a backend error on as a plain ``DistBackendError``).

    Args:
        group: an smddp group; None: the default group.

    Returns:
        The failed ranks in ``group``'s numbering, the same on every survivor; empty while the
        group has not failed, or when its failure named no rank (a timeout, a mismatch).

    Raises:
        TypeError: ``group`` is not an smddp group.
        SmddpDaemonLostError: this node's daemon did not answer.
    """
    pg = group if group is not None else c10d._get_default_group()
    if not isinstance(pg, SmddpProcessGroup):
        raise TypeError(
            f"smddp.failed_ranks asks smddp groups; this group's backend is {dist.get_backend(pg)}"
        )
    try:
        failure = pg.comm.failure()
    except SmddpError as exc:
        raise translate(exc, pg.comm) from None
    return failure.failed_ranks if failure is not None else frozenset()


def shrink_group(
    ranks_to_exclude: list[int],
    group: dist.ProcessGroup | None = None,
    shrink_flags: int = SHRINK_DEFAULT,
    pg_options: Any | None = None,
) -> dist.ProcessGroup:
    """Makes a group of ``group``'s ranks but ``ranks_to_exclude``, on its survivors.

    The call of torch's ``dist.shrink_group`` (see the module's docstring for why torch's own
    cannot serve smddp). Every surviving rank calls it with the same ranks, and the excluded
    ranks do not; after a ``SmddpRankFailedError``, ``sorted(err.failed_ranks)`` are those ranks.

    Args:
        ranks_to_exclude: ranks of ``group`` (its numbering) to leave out.
        group: an smddp group; None: the default group, which the new group then replaces.
        shrink_flags: ``SHRINK_DEFAULT``: ops of ``group`` still in flight are waited for;
            ``SHRINK_ABORT``: they fail first, on every rank of ``group``, with an error that
            names this call.
        pg_options: accepted for torch's signature; smddp takes the parent's settings.

    Returns:
        The new group: the survivors in their old order, ranked 0..n-1, with a fresh
        communicator on the same daemons, of generation ``group``'s plus one.

    Raises:
        TypeError: ``group`` is not an smddp group, or a bad argument type.
        ValueError: the excluded ranks are out of range, repeat, are all the ranks, or leave
            out fewer ranks than the daemons agreed have failed.
        RuntimeError: this rank is excluded.
        SmddpBackendError: the daemon refused (survivors that exclude different ranks, say).
    """
    del pg_options  # the new group takes the parent's settings
    if shrink_flags not in (SHRINK_DEFAULT, SHRINK_ABORT):
        raise ValueError(
            f"shrink_flags {shrink_flags!r}: expected SHRINK_DEFAULT ({SHRINK_DEFAULT}) or SHRINK_ABORT ({SHRINK_ABORT})"  # noqa: E501
        )
    default = c10d._get_default_group()
    pg = group if group is not None else default
    if not isinstance(pg, SmddpProcessGroup):
        raise TypeError(
            f"smddp.shrink_group shrinks smddp groups; this group's backend is {dist.get_backend(pg)}"  # noqa: E501
        )
    size, rank = pg.size(), pg.rank()
    excluded = _check_excluded(ranks_to_exclude, size, rank)
    if pg.job is None or len(pg.rank_nodes) != size:
        raise TypeError(f"group {pg.group_name} was not made by smddp's creator")
    parent: Communicator = pg.comm
    where = f"job {pg.job.job_id} comm {parent.session.comm_id} rank {rank}"
    survivors = [r for r in range(size) if r not in excluded]
    generation = parent.generation + 1
    try:
        failure = parent.failure()
        if failure is not None and not failure.failed_ranks <= set(excluded):
            missing = sorted(failure.failed_ranks - set(excluded))
            raise ValueError(
                f"{where}: "
                f"shrink_group excludes ranks {excluded}, but the daemons agreed that ranks {sorted(failure.failed_ranks)} failed: "  # noqa: E501
                f"ranks {missing} would never join the new group; exclude them too"
            )
        if shrink_flags == SHRINK_ABORT:
            parent.revoke(
                f"called shrink_group(SHRINK_ABORT) excluding ranks {excluded}: the group's ops in flight are aborted, and generation {generation} goes on without them"  # noqa: E501
            )
    except SmddpError as exc:
        raise translate(exc, parent) from None
    job = pg.job
    parent_globals = dist.get_process_group_ranks(pg)
    nodes = [pg.rank_nodes[r] for r in survivors]
    is_default = pg is default
    # The ranks still in the old group (one left out while alive, say) are told why this
    # one leaves, and the daemon does not count it among the failed ranks.
    parent.session.shrink = f"rank {rank} called shrink_group excluding ranks {excluded}; generation {generation} goes on without them"  # noqa: E501
    meta = _retire(pg, is_default)
    new_rank = survivors.index(rank)
    try:
        comm = job.connect(
            rank=new_rank,
            comm_id=_shrunk_id(parent.session.comm_id, generation),
            member_nodes=nodes,
            global_rank=new_rank if is_default else parent_globals[rank],
            timeout_s=parent.timeout_s,
            config=parent.config,  # the group's, built once by the backend
            parent_comm_id=parent.session.comm_id,
            excluded_ranks=excluded,
            generation=generation,
        )
    except SmddpError as exc:
        raise dist.DistBackendError(
            f"smddp: cannot shrink group {pg.group_name} (rank {rank} of {size}, excluding ranks {excluded}): {exc}"  # noqa: E501
        ) from None
    new_pg = SmddpProcessGroup(comm, new_rank, len(survivors))
    new_pg.job = job
    new_pg.rank_nodes = tuple(nodes)
    _register(new_pg, meta, [parent_globals[r] for r in survivors], is_default)
    return new_pg


# -- torch's bookkeeping, as dist.shrink_group keeps it (_finalize_shrunk_group) --------------


def _retire(pg: SmddpProcessGroup, is_default: bool) -> dict[str, Any]:
    """Destroys the parent group (every other group first, when it is the default one: their
    ranks no longer mean anything); returns what the new group inherits from it."""
    if is_default:
        c10d._destroy_all_other_groups(exclude_group=pg)
    meta: dict[str, Any] = c10d._extract_group_metadata(pg)
    c10d._cleanup_original_group(pg, is_default)
    return meta


def _register(
    new_pg: SmddpProcessGroup, meta: dict[str, Any], globals_: list[int], is_default: bool
) -> None:
    """Enters the new group in torch's tables, and as the default group where it replaces it."""
    name = meta["new_group_name"]
    new_pg._set_group_name(name)
    desc = "default:shrunken" if is_default else f"{meta['original_group_name']}:shrunk"
    new_pg._set_group_desc(desc)
    if is_default:
        c10d._update_default_pg(new_pg)
    c10d._register_pg_in_world(
        pg=new_pg,
        backend_name=meta["backend_name"],
        store=meta["store"],
        group_name=name,
        backend_config=meta["backend_config"],
        rank_mapping={g: i for i, g in enumerate(globals_)},
    )
