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
* The torchdata glue: :func:`loader_progress` reads ``(epoch, step, workers)`` out of a
  ``StatefulDataLoader`` state, :func:`for_rank` rewrites its worker snapshots for this
  rank's plan, :func:`is_mid_epoch` says whether a state was taken inside an epoch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .world import World

__all__ = [
    "Progress",
    "Resumer",
    "dataloader_order",
    "consumed_per_worker",
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


class Resumer:
    """The resume state of one dataset copy: its :class:`Progress`, and a loaded state
    waiting for the next ``__iter__``."""

    def __init__(self) -> None:
        self.progress = Progress()
        self._pending: Progress | None = None

    def state_dict(self, *, seed: int, world_size: int, epoch: int,
                   plan: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``{version, seed, world_size, epoch, worker, num_workers, batches, plan}``; after
        ``set_epoch`` moved to another epoch (``epoch``) than the last one iterated, the
        start of that epoch. ``plan``: what the epoch's batches depend on besides the seed
        (JSON scalars), checked by :meth:`load`."""
        progress = asdict(self.progress)
        if progress["epoch"] != epoch:
            progress.update(epoch=epoch, batches=0)
        state = {"version": 1, "seed": seed, "world_size": world_size, **progress}
        if plan is not None:
            state["plan"] = dict(plan)
        return state

    def load(self, state: Mapping[str, Any], *, seed: int, world_size: int,
             epoch: int, plan: Mapping[str, Any] | None = None) -> int | None:
        """Check a saved state and keep it for the next :meth:`start`.

        Returns the epoch to set, or ``None`` when a later epoch (``epoch``) is set already:
        then the state is stale and that epoch runs from its start.
        """
        got = state_ints(state, ("seed", "epoch", "worker", "num_workers", "batches"),
                         "AnnBatchDataset.state_dict()")
        if got["seed"] != seed:
            raise ValueError(
                f"load_state_dict: the state was saved with seed={got['seed']} but this "
                f"dataset has seed={seed}; construct the dataset with seed={got['seed']} to "
                "resume."
            )
        saved_world = state.get("world_size")  # absent from states of 0.1.0
        if saved_world is not None and int(saved_world) != world_size:
            raise ValueError(
                f"load_state_dict: the state was saved with world_size={int(saved_world)} "
                f"but this dataset runs with world_size={world_size}: every rank's share of "
                "the epoch differs, so the batches done cannot be skipped. Resume with the "
                "same number of ranks (or start the epoch afresh without the state)."
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
        self._pending = None
        if epoch > got["epoch"]:
            logger.info("AnnBatchDataset: epoch %d is set, later than the loaded state's "
                        "(%d); it runs from its start.", epoch, got["epoch"])
            return None
        self._pending = Progress(got["epoch"], got["worker"], got["num_workers"],
                                 got["batches"])
        return got["epoch"]

    def start(self, epoch: int, world: World) -> int:
        """Begin iterating ``epoch`` in ``world``: the batches to skip (those a loaded state
        says this copy yielded already; 0 without one, or for another epoch). A loaded
        state is used once."""
        pending, self._pending = self._pending, None
        skip = 0
        if pending is not None and pending.epoch != epoch:
            logger.warning(
                "AnnBatchDataset: the loaded state resumes epoch %d, but epoch %d was set "
                "since; epoch %d starts from its first batch.", pending.epoch, epoch, epoch)
        elif pending is not None:
            if pending.num_workers != world.num_workers or pending.worker != world.worker:
                raise ValueError(
                    f"Cannot resume: the saved state comes from worker {pending.worker} of "
                    f"{pending.num_workers} DataLoader workers, this is worker {world.worker} "
                    f"of {world.num_workers}. Resume with the same num_workers."
                )
            skip = pending.batches
        self.progress = Progress(epoch, world.worker, world.num_workers, skip)
        return skip

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


# --------------------------------------------------------------------------- torchdata glue


def loader_progress(state: Mapping[str, Any]) -> tuple[int | None, int | None, int]:
    """``(epoch, batches yielded, workers)`` of a ``StatefulDataLoader`` state of an
    :class:`~annbatch_torch.AnnBatchDataset` (``None`` where the state does not say)."""
    snap = state.get("_snapshot")
    if isinstance(snap, dict) and snap.get("_worker_snapshots"):
        ds_states = [w.get("dataset_state") for w in snap["_worker_snapshots"].values()
                     if isinstance(w, dict)]
        step, workers = snap.get("_snapshot_step"), len(snap["_worker_snapshots"])
    else:
        ds_states, step, workers = [state.get("dataset_state")], state.get("_num_yielded"), 1
    epoch = next((d["epoch"] for d in ds_states
                  if isinstance(d, dict) and isinstance(d.get("epoch"), int)), None)
    return epoch, step if isinstance(step, int) else None, workers


def for_rank(snap: dict[str, Any], counts: Sequence[int]) -> dict[str, Any]:
    """A ``StatefulDataLoader`` multi-worker snapshot with every worker's batch count (and
    the worker that yielded last) recomputed from the loader's step, for a rank whose
    workers yield ``counts`` batches in the snapshot's epoch."""
    _, step, _ = loader_progress({"_snapshot": snap})
    if step is None or not 0 <= step <= sum(counts):
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
    """Whether a ``StatefulDataLoader`` state was taken inside an epoch (neither before
    its first batch nor after its last)."""
    snap = state.get("_snapshot")
    done = snap["_snapshot_step"] if snap is not None else state.get("_num_yielded", 0)
    return not state.get("_iterator_finished", False) and 0 < int(done) < n_batches
