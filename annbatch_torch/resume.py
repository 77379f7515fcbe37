"""Exact resume, in one place: per-copy progress, the replay of what workers consumed, and
the glue to torchdata's ``StatefulDataLoader``.

* :class:`Progress`: what one dataset copy (one per DataLoader worker) yielded of an
  epoch. :class:`Resumer` owns it for :class:`~annbatch_torch.AnnBatchDataset`: its
  ``state_dict()`` is that progress as JSON; ``load_state_dict()`` makes the next
  ``__iter__`` of the same epoch skip the batches done. A state applies to its own epoch
  only.
* The replay (pure): :func:`dataloader_order` is the order torch's ``DataLoader`` takes
  batches from its workers (round-robin, skipping exhausted ones), and
  :func:`consumed_per_worker` what each worker had yielded when the loader had yielded
  ``n``. That is how a state saved on one rank resumes another: ranks yield the same
  number of batches but their workers need not, and Lightning checkpoints rank 0 only.
* Elastic resume (pure): a :class:`Segment` is a part of an epoch run under one topology
  (``world_size`` ranks of ``num_workers`` workers) until every rank's loader had yielded
  ``steps`` batches. :func:`remaining_batches` replays an epoch's segments, every rank and
  worker of each, and gives the epoch's batches not yet yielded; :func:`rank_items` deals
  them to a new topology (``sampling.EpochDeal.rest``). A state is O(segments): which
  batches were consumed follows from ``(seed, epoch)``, the plan and the steps.
* The torchdata glue: :func:`loader_progress` reads ``(epoch, step, workers)`` out of a
  ``StatefulDataLoader`` state, :func:`for_rank` rewrites its worker snapshots for this
  rank's plan, :func:`is_mid_epoch` says whether a state was taken inside an epoch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from . import sampling
from .world import World

__all__ = [
    "Progress",
    "Resumer",
    "Segment",
    "dataloader_order",
    "consumed_per_worker",
    "remaining_batches",
    "rank_items",
    "LoaderProgress",
    "loader_progress",
    "for_rank",
    "is_mid_epoch",
    "state_ints",
    "EPOCH_KEY",
]

logger = logging.getLogger(__name__)

#: Key under which :class:`~annbatch_torch.AnnBatchDataLoader` records the dataset's epoch
#: in its state (the worker snapshots predate a ``set_epoch`` between epochs).
EPOCH_KEY = "annbatch_torch_epoch"


def state_ints(state: Mapping[str, Any], keys: Sequence[str], saved_by: str) -> dict[str, int]:
    """``{key: int(state[key])}`` of a saved resume state, or a ``ValueError`` naming what is
    missing and where a valid state comes from (``saved_by``)."""
    try:
        return {k: int(state[k]) for k in keys}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"load_state_dict: state {dict(state)!r} lacks {e}; pass a state saved by "
            f"{saved_by}."
        ) from e


# --------------------------------------------------------------------------- per copy


@dataclass
class Progress:
    """Batches one dataset copy (``worker`` of ``num_workers``) yielded of ``epoch``."""

    epoch: int = 0
    worker: int = 0
    num_workers: int = 1
    batches: int = 0


@dataclass(frozen=True)
class Segment:
    """A part of an epoch run on ``world_size`` ranks of ``num_workers`` DataLoader workers
    each (0 workers count as 1), until every rank's loader had yielded ``steps`` batches."""

    world_size: int
    num_workers: int
    steps: int

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> Segment:
        """A segment of a saved state, or a ``ValueError`` naming what is wrong."""
        got = state_ints(value if isinstance(value, Mapping) else {},
                         ("world_size", "num_workers", "steps"), "AnnBatchDataset.state_dict()")
        if got["world_size"] < 1 or got["num_workers"] < 1 or got["steps"] < 0:
            raise ValueError(f"load_state_dict: segment {dict(value)!r} needs world_size >= 1, "
                             "num_workers >= 1 and steps >= 0; pass a state saved by "
                             "AnnBatchDataset.state_dict().")
        return cls(**got)


@dataclass(frozen=True)
class _Loaded:
    """A loaded state waiting for the next ``__iter__``: the saved copy's progress, the
    segments of its epoch run before it under other topologies, and (handed over by
    :class:`~annbatch_torch.AnnBatchDataLoader`) the batches its rank's loader had
    yielded."""

    epoch: int
    world_size: int | None  # None: a state of 0.1.0 (same world assumed)
    worker: int
    num_workers: int
    batches: int
    segments: tuple[Segment, ...]
    steps: int | None

    def same_topology(self, world_size: int, num_workers: int) -> bool:
        return (self.world_size in (None, world_size)) and self.num_workers == num_workers

    def as_segment(self) -> Segment:
        """This state's own part of the epoch, as a segment to resume elsewhere."""
        if self.world_size is None or self.steps is None:
            raise ValueError(
                "load_state_dict: a state without world_size or the loader's step cannot "
                "resume on another topology; load AnnBatchDataLoader.state_dict() into an "
                "AnnBatchDataLoader (or resume on the same ranks and workers).")
        return Segment(self.world_size, self.num_workers, self.steps)


class Resumer:
    """The resume state of one dataset copy: its :class:`Progress`, the segments of its
    epoch that ran under other topologies before it, and a loaded state waiting for the
    next ``__iter__``."""

    def __init__(self) -> None:
        self.progress = Progress()
        #: the parts of ``progress.epoch`` run before this one under other topologies
        self.segments: tuple[Segment, ...] = ()
        self._pending: _Loaded | None = None

    def state_dict(self, *, seed: int, world_size: int, epoch: int,
                   plan: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``{version, seed, world_size, epoch, worker, num_workers, batches, segments,
        plan}``; after ``set_epoch`` moved to another epoch (``epoch``) than the last one
        iterated, the start of that epoch. ``plan``: what the epoch's batches depend on
        besides the seed (JSON scalars), checked by :meth:`load`."""
        pending = self._pending
        if pending is not None and pending.epoch == epoch:  # loaded, not yet iterated
            progress = Progress(epoch, pending.worker, pending.num_workers, pending.batches)
            segments, steps = pending.segments, pending.steps
            world_size = world_size if pending.world_size is None else pending.world_size
        elif self.progress.epoch == epoch:
            progress, segments, steps = self.progress, self.segments, None
        else:
            progress = Progress(epoch, self.progress.worker, self.progress.num_workers, 0)
            segments, steps = (), None
        state = {"version": 2, "seed": seed, "world_size": world_size, **asdict(progress),
                 "segments": [seg.to_json() for seg in segments]}
        if steps is not None and steps != progress.batches:
            state["steps"] = steps
        if plan is not None:
            state["plan"] = dict(plan)
        return state

    def load(self, state: Mapping[str, Any], *, seed: int, world_size: int,
             epoch: int, plan: Mapping[str, Any] | None = None) -> int | None:
        """Check a saved state and keep it for the next :meth:`start`.

        Returns the epoch to set, or ``None`` when a later epoch (``epoch``) is set already:
        then the state is stale and that epoch runs from its start. A state of another
        ``world_size`` or ``num_workers`` resumes elastically at :meth:`start`.
        """
        got = state_ints(state, ("seed", "epoch", "worker", "num_workers", "batches"),
                         "AnnBatchDataset.state_dict()")
        if got["seed"] != seed:
            raise ValueError(
                f"load_state_dict: the state was saved with seed={got['seed']} but this "
                f"dataset has seed={seed}; construct the dataset with seed={got['seed']} to "
                "resume."
            )
        saved_plan = state.get("plan")  # absent from states saved before it was recorded
        if isinstance(saved_plan, Mapping) and plan is not None:
            differ = [k for k in sorted(set(saved_plan) | set(plan))
                      if saved_plan.get(k) != plan.get(k)]
            if differ:
                what = ", ".join(f"{k}={saved_plan.get(k)!r} (now {plan.get(k)!r})"
                                 for k in differ)
                raise ValueError(
                    f"load_state_dict: the state was saved by a dataset with {what}: its "
                    "epochs hold other batches, so the batches done cannot be skipped. "
                    "Construct the dataset as it was saved (or start the epoch afresh "
                    "without the state).")
        saved_world = state.get("world_size")  # absent from states of 0.1.0
        segments = state.get("segments") or []  # absent before elastic resume (version 1)
        if not isinstance(segments, Sequence) or isinstance(segments, str):
            raise ValueError(f"load_state_dict: segments must be a list, got {segments!r}.")
        steps = state.get("steps")
        loaded = _Loaded(
            got["epoch"], None if saved_world is None else int(saved_world), got["worker"],
            max(1, got["num_workers"]), got["batches"],
            tuple(Segment.from_json(seg) for seg in segments),
            None if steps is None else state_ints(state, ("steps",), "AnnBatchDataLoader")[
                "steps"])
        if loaded.steps is None and loaded.num_workers == 1:  # the copy's count is the rank's
            loaded = replace(loaded, steps=loaded.batches)
        if (loaded.world_size is not None and loaded.world_size != world_size
                and loaded.steps is None):
            raise ValueError(
                f"load_state_dict: this is the state of DataLoader worker {loaded.worker} of "
                f"{loaded.num_workers} on {loaded.world_size} ranks; to resume on "
                f"{world_size} ranks the whole loader's progress is needed: save and load "
                "AnnBatchDataLoader.state_dict() (or resume on the same number of ranks).")
        self._pending = None
        if epoch > loaded.epoch:
            logger.info("AnnBatchDataset: epoch %d is set, later than the loaded state's "
                        "(%d); it runs from its start.", epoch, loaded.epoch)
            return None
        self._pending = loaded
        return loaded.epoch

    def planned(self, epoch: int, world_size: int) -> tuple[tuple[Segment, ...], int]:
        """``(segments, steps)`` of ``epoch`` on ``world_size`` ranks as the next
        :meth:`start` will run it (a loaded state's; else this copy's own when it runs that
        epoch): the segments its plan replays, and the batches every rank yielded in them.
        Another ``num_workers`` on as many ranks leaves the rank's batch count unchanged,
        so it is not needed here."""
        p = self._pending
        if p is not None and p.epoch == epoch:
            segments = p.segments
            if not p.same_topology(world_size, p.num_workers):
                segments += (p.as_segment(),)
        elif self.progress.epoch == epoch:
            segments = self.segments
        else:
            segments = ()
        return segments, sum(seg.steps for seg in segments)

    def start(self, epoch: int, world: World) -> tuple[tuple[Segment, ...], int]:
        """Begin iterating ``epoch`` in ``world``: ``(segments, skip)``, the segments the
        epoch's plan replays and the batches of this copy's plan to skip (those a loaded
        state says it yielded already; nothing without one, or for another epoch). A
        loaded state is used once."""
        pending, self._pending = self._pending, None
        segments: tuple[Segment, ...] = ()
        skip = 0
        if pending is not None and pending.epoch != epoch:
            logger.warning(
                "AnnBatchDataset: the loaded state resumes epoch %d, but epoch %d was set "
                "since; epoch %d starts from its first batch.", pending.epoch, epoch, epoch)
        elif pending is not None and pending.same_topology(world.world_size,
                                                           world.num_workers):
            if pending.worker != world.worker:
                raise ValueError(
                    f"Cannot resume: the saved state comes from worker {pending.worker} of "
                    f"{pending.num_workers} DataLoader workers, this is worker {world.worker} "
                    f"of {world.num_workers}.")
            segments = pending.segments
            # one worker's count is its rank's: the loader's step, when it handed one over
            skip = (pending.steps if pending.steps is not None and pending.num_workers == 1
                    else pending.batches)
        elif pending is not None:
            if pending.steps is None:
                raise ValueError(
                    f"Cannot resume: the saved state comes from DataLoader worker "
                    f"{pending.worker} of {pending.num_workers}, this copy runs with "
                    f"num_workers={world.num_workers}; to change num_workers the whole "
                    "loader's progress is needed: save and load AnnBatchDataLoader."
                    "state_dict() (or resume with the same num_workers).")
            segments = (*pending.segments, pending.as_segment())
            if world.worker == 0:
                logger.info("AnnBatchDataset: epoch %d resumes on %d ranks x %d workers "
                            "after %s.", epoch, world.world_size, world.num_workers,
                            ", ".join(f"{s.steps} batches on {s.world_size} ranks x "
                                      f"{s.num_workers} workers" for s in segments))
        self.progress = Progress(epoch, world.worker, world.num_workers, skip)
        self.segments = segments
        return segments, skip

    def handed_over(self, world_size: int, num_workers: int) -> None:
        """DataLoader workers (``num_workers`` on a rank of ``world_size``) took their copies
        of the dataset, and a loaded state with them: this copy, which does not iterate,
        forgets it but keeps the segments the workers replay (its ``len``)."""
        p, self._pending = self._pending, None
        if p is None:
            return
        segments = p.segments
        if not p.same_topology(world_size, num_workers) and p.steps is not None:
            segments += (p.as_segment(),)
        self.progress = Progress(p.epoch, 0, num_workers, 0)
        self.segments = segments

    def count(self) -> None:
        """One more batch yielded (counted before the yield: ``state_dict()`` follows the
        fetch)."""
        self.progress.batches += 1


# --------------------------------------------------------------------------- replay (pure)


def dataloader_order(per_worker_counts: Sequence[int]) -> list[tuple[int, int]]:
    """``(worker, local batch index)`` in the order torch's DataLoader yields them: one batch
    per worker in turn, skipping exhausted workers."""
    return [
        (w, j)
        for j in range(max(per_worker_counts, default=0))
        for w, c in enumerate(per_worker_counts)
        if j < c
    ]


def consumed_per_worker(per_worker_counts: Sequence[int], n_consumed: int) -> list[int]:
    """Batches each worker had yielded when the DataLoader had yielded ``n_consumed``."""
    counts = [int(c) for c in per_worker_counts]
    if not 0 <= n_consumed <= sum(counts):
        raise ValueError(f"n_consumed must lie in [0, {sum(counts)}], got {n_consumed}")
    done = [0] * len(counts)
    left = n_consumed
    while left:
        active = [w for w, c in enumerate(counts) if c > done[w]]
        rounds = min(min(counts[w] - done[w] for w in active), left // len(active))
        if rounds == 0:  # a partial round: the first `left` active workers yield one more
            for w in active[:left]:
                done[w] += 1
            break
        for w in active:
            done[w] += rounds
        left -= rounds * len(active)
    return done


# --------------------------------------------------------------------------- elastic (pure)


def _first_batch_ids(items: sampling.WorkList, n: int) -> np.ndarray:
    """Epoch batch ids of the first ``n`` batches of a worker's items (padding left out)."""
    counts = items.batch_counts
    pool = np.repeat(items.pool_index, counts)[:n]
    first = np.repeat(items.batch_start - np.cumsum(counts) + counts, counts)[:n]
    batch = np.arange(len(pool), dtype=np.int64) + first
    return (pool * (items.pool_size // items.batch_size) + batch)[pool >= 0]


def remaining_batches(deal: sampling.EpochDeal, segments: Sequence[Segment]) -> np.ndarray:
    """The epoch batch ids (sorted int64; see :func:`~annbatch_torch.sampling.epoch_batches`)
    not yielded in ``segments``, run one after the other: the first dealt as a fresh epoch,
    each later one the batches left by those before it. Every rank of a segment yielded
    its ``steps`` batches, its workers round-robin (:func:`consumed_per_worker`).

    Raises ``ValueError`` when a segment's steps exceed what its ranks had to yield (a
    state of another plan).
    """
    left = np.arange(deal.n_batches, dtype=np.int64)
    for k, seg in enumerate(segments):
        done = []
        for rank in range(seg.world_size):
            items = (deal.fresh(rank, seg.world_size) if k == 0
                     else deal.rest(left, rank, seg.world_size))
            per_worker = deal.workers(items, seg.num_workers)
            counts = [sampling.total_batches(w) for w in per_worker]
            if seg.steps > sum(counts):
                raise ValueError(
                    f"load_state_dict: the state says {seg.steps} batches were yielded on "
                    f"{seg.world_size} ranks x {seg.num_workers} workers, but a rank had only "
                    f"{sum(counts)} to yield; pass a state saved by this dataset's loader.")
            for wl, n in zip(per_worker, consumed_per_worker(counts, seg.steps)):
                done.append(_first_batch_ids(wl, n))  # type: ignore[arg-type]
        consumed = np.sort(np.concatenate(done)) if done else np.zeros(0, np.int64)
        assert len(np.unique(consumed)) == len(consumed), "a batch consumed twice"
        left = np.setdiff1d(left, consumed, assume_unique=True)
    return left


def rank_items(deal: sampling.EpochDeal, segments: Sequence[Segment], rank: int,
               world_size: int) -> sampling.WorkList:
    """Rank ``rank``'s items of an epoch after ``segments`` (none: the fresh epoch)."""
    if not segments:
        return deal.fresh(rank, world_size)
    return deal.rest(remaining_batches(deal, segments), rank, world_size)


# --------------------------------------------------------------------------- torchdata glue


@dataclass(frozen=True)
class LoaderProgress:
    """What a ``StatefulDataLoader`` state of an :class:`~annbatch_torch.AnnBatchDataset`
    says: its ``epoch``, the batches the loader had yielded of it (``steps``; since the
    epoch started or was last resumed elsewhere), its ``workers`` (1 without any), and one
    dataset copy's state (the copies agree on seed, plan, epoch and segments)."""

    epoch: int
    steps: int
    workers: int
    dataset_state: Mapping[str, Any]
    #: a state of a loader with workers (torchdata's multi-process format)
    multiprocess: bool = False

    @property
    def epoch_steps(self) -> int:
        """Batches every rank yielded of the epoch, counting segments run elsewhere."""
        return self.steps + sum(int(s.get("steps", 0)) for s in
                                self.dataset_state.get("segments") or [] if isinstance(s, Mapping))


def loader_progress(state: Mapping[str, Any]) -> LoaderProgress | None:
    """The :class:`LoaderProgress` of a ``StatefulDataLoader`` state, or ``None`` when it
    is not a state of an :class:`~annbatch_torch.AnnBatchDataset`."""
    snap = state.get("_snapshot")
    if isinstance(snap, dict) and snap.get("_worker_snapshots"):
        ds_states = [w.get("dataset_state") for w in snap["_worker_snapshots"].values()
                     if isinstance(w, dict)]
        step, workers = snap.get("_snapshot_step"), len(snap["_worker_snapshots"])
        since = state.get("_steps_since_snapshot", 0)
        if isinstance(step, int) and isinstance(since, int):
            step += since
    else:
        ds_states, step, workers = [state.get("dataset_state")], state.get("_num_yielded"), 1
    ds = next((d for d in ds_states if isinstance(d, dict) and isinstance(d.get("epoch"), int)),
              None)
    if ds is None or not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None
    return LoaderProgress(ds["epoch"], step, workers, ds, isinstance(snap, dict))


def for_rank(snap: dict[str, Any], counts: Sequence[int]) -> dict[str, Any]:
    """A ``StatefulDataLoader`` multi-worker snapshot with every worker's batch count (and
    the worker that yielded last) recomputed from the loader's step, for a rank whose
    workers yield ``counts`` batches in the snapshot's epoch."""
    step = snap.get("_snapshot_step")
    if not isinstance(step, int) or not 0 <= step <= sum(counts):
        return snap  # not this dataset's state: load_state_dict will say why
    done = consumed_per_worker(counts, step)
    out = dict(snap)
    out["_worker_snapshots"] = {}
    for key, w in snap["_worker_snapshots"].items():
        w = dict(w)
        ds_state = w.get("dataset_state")
        wid = ds_state.get("worker") if isinstance(ds_state, dict) else None
        if isinstance(wid, int) and 0 <= wid < len(done):
            w["dataset_state"] = {**ds_state, "batches": done[wid]}
        out["_worker_snapshots"][key] = w
    if step > 0:
        out["_last_yielded_worker_id"] = dataloader_order(counts)[step - 1][0]
    return out


def is_mid_epoch(state: Mapping[str, Any], n_batches: int) -> bool:
    """Whether a ``StatefulDataLoader`` state was taken inside an epoch of ``n_batches``
    (neither before its first batch nor after its last)."""
    saved = loader_progress(state)
    done = saved.epoch_steps if saved is not None else 0
    return not state.get("_iterator_finished", False) and 0 < done < n_batches
