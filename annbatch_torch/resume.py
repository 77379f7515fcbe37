"""What a saved state means: per-copy progress, the state's JSON, the glue to torchdata's
``StatefulDataLoader`` and the loader's restore decision.

* :class:`Progress`: what one dataset copy (one per DataLoader worker) yielded of an
  epoch. :class:`Resumer` owns it for :class:`~annbatch_torch.AnnBatchDataset`: its
  ``state_dict()`` is that progress as JSON; ``load_state_dict()`` makes the next
  ``__iter__`` of the same epoch skip the batches done. A state applies to its own epoch
  only.
* The replay of what each worker of each rank consumed (pure) is part of the plan:
  :mod:`annbatch_torch.sampling.replay` (:class:`~annbatch_torch.sampling.Segment`,
  ``dataloader_order``, ``consumed_per_worker``, ``remaining_batches``). A state is
  O(segments): which batches were consumed follows from ``(seed, epoch)``, the plan and
  the steps. :func:`same_topology` is the one test of whether a state runs where it was
  saved.
* The torchdata glue: :func:`loader_progress` reads ``(epoch, step, workers)`` out of a
  ``StatefulDataLoader`` state, :func:`for_rank` rewrites its worker snapshots for this
  rank's plan, :func:`is_mid_epoch` says whether a state was taken inside an epoch.
* :func:`restore`: what :class:`~annbatch_torch.AnnBatchDataLoader` does with a loaded
  state, one pure decision (:class:`Restore`) that the loader applies.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from .errors import check_int
from .sampling import EpochPlan, Segment, consumed_per_worker, dataloader_order
from .world import World

__all__ = [
    "Progress",
    "Resumer",
    "same_topology",
    "segment_from_json",
    "LoadedState",
    "parse_state",
    "LoaderProgress",
    "loader_progress",
    "for_rank",
    "is_mid_epoch",
    "torchdata_problem",
    "state_ints",
    "Restore",
    "restore",
    "EPOCH_KEY",
    "STATE_VERSION",
    "MAX_EPOCH",
]

logger = logging.getLogger(__name__)

#: Key under which :class:`~annbatch_torch.AnnBatchDataLoader` records the dataset's epoch
#: in its state (the worker snapshots predate a ``set_epoch`` between epochs).
EPOCH_KEY = "annbatch_torch_epoch"


#: The newest state format :meth:`Resumer.state_dict` writes (1: before elastic resume;
#: states of 0.1.0 carry no version).
STATE_VERSION = 2
#: Where a valid dataset state comes from, as messages say it.
DATASET_STATE = "AnnBatchDataset.state_dict()"
#: The largest epoch (the dataset keeps it in an int64).
MAX_EPOCH = 2**63 - 1


def state_ints(state: Mapping[str, Any], keys: Sequence[str], saved_by: str, *,
               minimum: Mapping[str, int] | None = None,
               maximum: Mapping[str, int] | None = None) -> dict[str, int]:
    """``{key: state[key]}`` of a saved resume state, each an integer ``>= minimum[key]``
    (default 0) and ``<= maximum[key]`` (default unbounded), or a ``ValueError`` naming the
    key that is missing or wrong and where a valid state comes from (``saved_by``)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"load_state_dict: the state must be a dict saved by {saved_by}, "
                         f"got {type(state).__name__} {state!r}.")
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(
            f"load_state_dict: state {dict(state)!r} lacks {missing[0]!r}; pass a state saved "
            f"by {saved_by}."
        )
    return {k: check_int(f"load_state_dict: state key {k!r}", state[k],
                         (minimum or {}).get(k, 0), maximum=(maximum or {}).get(k),
                         note=f" (pass a state saved by {saved_by})")
            for k in keys}


def _optional_int(state: Mapping[str, Any], key: str, minimum: int,
                  saved_by: str = DATASET_STATE) -> int | None:
    """``state[key]`` checked as by :func:`state_ints`, ``None`` when absent or null."""
    if state.get(key) is None:
        return None
    return state_ints(state, (key,), saved_by, minimum={key: minimum})[key]


# --------------------------------------------------------------------------- per copy


@dataclass
class Progress:
    """Batches one dataset copy (``worker`` of ``num_workers``) yielded of ``epoch``."""

    epoch: int = 0
    worker: int = 0
    num_workers: int = 1
    batches: int = 0


def segment_from_json(value: Any) -> Segment:
    """A :class:`~annbatch_torch.sampling.Segment` of a saved state (an item of its
    ``segments``), or a ``ValueError`` naming what is wrong."""
    if not isinstance(value, Mapping):
        raise ValueError(f"load_state_dict: state key 'segments' holds {value!r}, not a "
                         "segment {world_size, num_workers, steps}; pass a state saved by "
                         f"{DATASET_STATE}.")
    try:
        got = state_ints(value, ("world_size", "num_workers", "steps"), DATASET_STATE,
                         minimum={"world_size": 1, "num_workers": 1})
    except ValueError as e:
        raise ValueError(f"load_state_dict: state key 'segments', segment {dict(value)!r}: "
                         f"{str(e).removeprefix('load_state_dict: ')}") from None
    return Segment(**got)


def same_topology(saved_world: int | None, saved_workers: int, world_size: int,
                  num_workers: int) -> bool:
    """Whether a state saved on ``saved_world`` ranks of ``saved_workers`` DataLoader
    workers each runs on ``world_size`` ranks of ``num_workers`` as it was saved (0 workers
    count as 1; ``saved_world=None``, a state of 0.1.0: the same world assumed). Otherwise
    the rest of its epoch is dealt anew (:func:`~annbatch_torch.sampling.rank_items_after`).
    """
    return saved_world in (None, world_size) and max(1, saved_workers) == max(1, num_workers)


@dataclass(frozen=True)
class LoadedState:
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
        return same_topology(self.world_size, self.num_workers, world_size, num_workers)

    def as_segment(self) -> Segment:
        """This state's own part of the epoch, as a segment to resume elsewhere."""
        if self.world_size is None or self.steps is None:
            raise ValueError(
                "load_state_dict: a state without world_size or the loader's step cannot "
                "resume on another topology; load AnnBatchDataLoader.state_dict() into an "
                "AnnBatchDataLoader (or resume on the same ranks and workers).")
        return Segment(self.world_size, self.num_workers, self.steps)


def parse_state(state: Mapping[str, Any], *, plan: EpochPlan, world_size: int
                ) -> LoadedState:
    """A dataset copy's saved state, every key checked, and checked against ``plan`` (the
    dataset's: its seed, fingerprint and batches per rank) and ``world_size``, or a
    ``ValueError`` that names the key and says what differs and how to resume (pure:
    :meth:`Resumer.load` keeps what it returns)."""
    got = state_ints(state, ("seed", "epoch", "worker", "num_workers", "batches"),
                     DATASET_STATE, minimum={"num_workers": 1},
                     maximum={"epoch": MAX_EPOCH})
    version = state.get("version")  # absent from states of 0.1.0
    if version is not None:
        check_int("load_state_dict: state key 'version'", version, 1, maximum=STATE_VERSION,
                  note=f" (the state formats this annbatch_torch reads; pass a state saved by "
                       f"{DATASET_STATE} of this version)")
    if got["seed"] != plan.seed:
        raise ValueError(
            f"load_state_dict: the state was saved with seed={got['seed']} (state key "
            f"'seed') but this dataset has seed={plan.seed}; construct the dataset with "
            f"seed={got['seed']} to resume."
        )
    if got["worker"] >= got["num_workers"]:
        raise ValueError(
            f"load_state_dict: state key 'worker' must be < num_workers (= "
            f"{got['num_workers']}), got {got['worker']}; pass a state saved by "
            f"{DATASET_STATE}.")
    _check_plan(state, plan)
    saved_world = _optional_int(state, "world_size", 1)  # absent from states of 0.1.0
    segments = state.get("segments") or []  # absent before elastic resume (version 1)
    if not isinstance(segments, Sequence) or isinstance(segments, str):
        raise ValueError(f"load_state_dict: state key 'segments' must be a list, got "
                         f"{segments!r}; pass a state saved by {DATASET_STATE}.")
    steps = _optional_int(state, "steps", 0, "AnnBatchDataLoader")
    loaded = LoadedState(got["epoch"], saved_world, got["worker"], got["num_workers"],
                         got["batches"], tuple(segment_from_json(seg) for seg in segments),
                         steps)
    _check_counts(loaded, state, plan, world_size)
    if loaded.steps is None and loaded.num_workers == 1:  # the copy's count is the rank's
        loaded = replace(loaded, steps=loaded.batches)
    if (loaded.world_size is not None and loaded.world_size != world_size
            and loaded.steps is None):
        raise ValueError(
            f"load_state_dict: this is the state of DataLoader worker {loaded.worker} of "
            f"{loaded.num_workers} on {loaded.world_size} ranks; to resume on "
            f"{world_size} ranks the whole loader's progress is needed: save and load "
            "AnnBatchDataLoader.state_dict() (or resume on the same number of ranks).")
    return loaded


def _check_plan(state: Mapping[str, Any], plan: EpochPlan) -> None:
    """Refuse a state whose recorded plan (key ``plan``) deals other batches than
    ``plan``; states saved before the plan (or its ``source``) was recorded are not
    checked for it."""
    saved_plan = state.get("plan")  # absent from states saved before it was recorded
    if saved_plan is None:
        return
    if not isinstance(saved_plan, Mapping):
        raise ValueError(f"load_state_dict: state key 'plan' must be a dict (the plan's "
                         f"fingerprint), got {saved_plan!r}; pass a state saved by "
                         f"{DATASET_STATE}.")
    now = plan.fingerprint()
    if "source" in saved_plan and saved_plan["source"] != now.get("source"):
        saved_name = state.get("source_name") or "another source"
        where = (f"{saved_name} holds other rows than when the state was saved"
                 if saved_name == plan.source_name else
                 f"the state was saved reading {saved_name}, but this dataset reads "
                 f"{plan.source_name or 'another source'}")
        raise ValueError(
            f"load_state_dict: {where} (collection {saved_plan['source']!r} then, "
            f"{now.get('source')!r} now: state key 'plan', its 'source'): other rows in "
            "another order (rewritten from other inputs, or written with another seed), so "
            "the batches done cannot be skipped. Resume on the collection the state was "
            "saved on (or start the epoch afresh without the state).")
    differ = [k for k in sorted((set(saved_plan) | set(now)) - {"source"})
              if saved_plan.get(k) != now.get(k)]
    if differ:
        what = ", ".join(f"{k}={saved_plan.get(k)!r} (now {now.get(k)!r})" for k in differ)
        raise ValueError(
            f"load_state_dict: the state (key 'plan') was saved by a dataset with {what}: "
            "its epochs hold other batches, so the batches done cannot be skipped. "
            "Construct the dataset as it was saved (or start the epoch afresh without the "
            "state).")


def _check_counts(loaded: LoadedState, state: Mapping[str, Any], plan: EpochPlan,
                  world_size: int) -> None:
    """Refuse counts beyond the epoch: the segments must fit the plan's epoch, and this
    copy's ``batches`` (and the loader's ``steps``) what a rank still yields after them."""
    world = world_size if loaded.world_size is None else loaded.world_size
    try:
        total = plan.batches_per_rank(loaded.epoch, world, loaded.segments)
    except ValueError as e:
        raise ValueError(
            f"load_state_dict: state key 'segments' ({list(state.get('segments') or [])!r}) "
            f"does not fit epoch {loaded.epoch} of this dataset: "
            f"{str(e).removeprefix('load_state_dict: ')}") from None
    own_before = sum(seg.steps for seg in loaded.segments)
    own = total - own_before
    for key in ("batches", "steps"):
        value = getattr(loaded, key)
        if value is not None and value > own:
            raise ValueError(
                f"load_state_dict: state key {key!r} must be <= {own} (the batches a rank "
                f"yields of epoch {loaded.epoch} on {world} ranks, its 'world_size'"
                + (f" after the {own_before} batches of its 'segments'"
                   if loaded.segments else "")
                + f"), got {value}: the state is not one of this dataset's epoch; pass a "
                f"state saved by {DATASET_STATE} of this dataset.")


class Resumer:
    """The resume state of one dataset copy: its :class:`Progress`, the segments of its
    epoch that ran under other topologies before it, and a loaded state waiting for the
    next ``__iter__``."""

    def __init__(self) -> None:
        self.progress = Progress()
        #: the parts of ``progress.epoch`` run before this one under other topologies
        self.segments: tuple[Segment, ...] = ()
        self._pending: LoadedState | None = None

    def state_dict(self, *, plan: EpochPlan, world_size: int, epoch: int
                   ) -> dict[str, Any]:
        """``{version, seed, world_size, epoch, worker, num_workers, batches, segments,
        plan, source_name}``; after ``set_epoch`` moved to another epoch (``epoch``) than
        the last one iterated, the start of that epoch. ``plan``: the dataset's; its
        fingerprint (what the epoch's batches depend on besides the seed, JSON scalars) is
        checked by :meth:`load`, ``source_name`` names the source in that message."""
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
        state = {"version": STATE_VERSION, "seed": plan.seed, "world_size": world_size,
                 **asdict(progress), "segments": [asdict(seg) for seg in segments]}
        if steps is not None and steps != progress.batches:
            state["steps"] = steps
        state["plan"] = plan.fingerprint()
        if plan.source_name:
            state["source_name"] = plan.source_name
        return state

    def load(self, state: Mapping[str, Any], *, plan: EpochPlan, world_size: int,
             epoch: int) -> int | None:
        """Check a saved state (:func:`parse_state`) and keep it for the next :meth:`start`.

        Returns the epoch to set, or ``None`` when a later epoch (``epoch``) is set already:
        then the state is stale and that epoch runs from its start. A state of another
        ``world_size`` or ``num_workers`` resumes elastically at :meth:`start`.
        """
        loaded = parse_state(state, plan=plan, world_size=world_size)
        self._pending = None
        if epoch > loaded.epoch:
            logger.info("AnnBatchDataset: epoch %d is set, later than the loaded state's "
                        "(%d); it runs from its start.", epoch, loaded.epoch)
            return None
        self._pending = loaded
        return loaded.epoch

    def planned(self, epoch: int, world_size: int) -> tuple[Segment, ...]:
        """The segments of ``epoch`` on ``world_size`` ranks that the next :meth:`start`
        replays (a loaded state's; else this copy's own when it runs that epoch). Another
        ``num_workers`` on as many ranks leaves the rank's batches unchanged, so it is not
        needed here."""
        p = self._pending
        if p is not None and p.epoch == epoch:
            segments = p.segments
            if not p.same_topology(world_size, p.num_workers):
                segments += (p.as_segment(),)
            return segments
        return self.segments if self.progress.epoch == epoch else ()

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


def torchdata_problem(state: Mapping[str, Any], num_workers: int) -> str | None:
    """What keeps torchdata's ``StatefulDataLoader`` with ``num_workers`` from restoring
    ``state`` (the key missing or wrong), or ``None`` (also for ``{}``, which restores
    nothing). torchdata itself checks only when the next iterator starts, with an
    ``AssertionError``."""
    if not state:
        return None

    def count(where: Mapping[str, Any], key: str, name: str) -> str | None:
        value = where.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{name} must be an integer >= 0, got {value!r}"
        return None

    if num_workers == 0:
        if "_num_yielded" not in state:
            return ("the state lacks '_num_yielded' (the key of a loader without workers"
                    + (", but it holds '_snapshot', a loader's with workers)" if "_snapshot"
                       in state else ")"))
        return count(state, "_num_yielded", "'_num_yielded'")
    snap = state.get("_snapshot")
    if snap is None:
        return ("the state lacks '_snapshot' (the key of a loader with workers"
                + (", but it holds '_num_yielded', a loader's without workers)"
                   if "_num_yielded" in state else ")"))
    if not isinstance(snap, Mapping):
        return f"'_snapshot' must be a dict, got {snap!r}"
    for key in ("_main_snapshot", "_worker_snapshots"):
        if not isinstance(snap.get(key), Mapping):
            return f"'_snapshot' key {key!r} must be a dict, got {snap.get(key)!r}"
    return (count(snap, "_snapshot_step", "'_snapshot' key '_snapshot_step'")
            or count(snap, "_last_yielded_worker_id",
                     "'_snapshot' key '_last_yielded_worker_id'")
            or count(state, "_steps_since_snapshot", "'_steps_since_snapshot'"))


def is_mid_epoch(state: Mapping[str, Any], n_batches: int) -> bool:
    """Whether a ``StatefulDataLoader`` state was taken inside an epoch of ``n_batches``
    (neither before its first batch nor after its last)."""
    saved = loader_progress(state)
    done = saved.epoch_steps if saved is not None else 0
    return not state.get("_iterator_finished", False) and 0 < done < n_batches


# --------------------------------------------------------------------------- restore

#: What :class:`~annbatch_torch.AnnBatchDataLoader` does with a loaded state.
RestoreKind = Literal["torchdata", "fresh", "ended", "next epoch", "dataset only", "same"]


@dataclass(frozen=True)
class Restore:
    """The decision :func:`restore` makes, which the loader applies in this order.

    Attributes
    ----------
    kind
        ``"torchdata"``: not a state of this dataset, torchdata loads it (and says why
        not); ``"fresh"``: a later epoch is set, it runs from its start; ``"ended"``: the
        saved iterator had run to its end, the dataset's epoch runs whole; ``"next epoch"``:
        the state's epoch was finished, the next one starts afresh; ``"dataset only"``: the
        dataset resumes from ``dataset_state`` and torchdata's iterator starts afresh
        (a state taken between epochs without workers, or an epoch resumed on another
        topology); ``"same"``: the same topology, torchdata restores every worker's copy.
    loader_state
        What the ``StatefulDataLoader`` loads (``{}``: nothing carries over).
    epoch
        The epoch to set on the dataset first (``None``: keep its own).
    dataset_state
        The state to load into the dataset (``None``: none).
    resumed_elsewhere
        The epoch resumes on another number of ranks or workers (its ``len`` differs).
    saved_epoch
        The epoch of the state (``None`` under ``"torchdata"``).
    """

    kind: RestoreKind
    loader_state: dict[str, Any]
    epoch: int | None = None
    dataset_state: Mapping[str, Any] | None = None
    resumed_elsewhere: bool = False
    saved_epoch: int | None = None


def restore(state_dict: Mapping[str, Any], *, plan: EpochPlan, epoch: int, rank: int,
            world_size: int, num_workers: int, finished_starts_next_epoch: bool = False,
            epoch_limit: int | float | None = None) -> Restore:
    """What a loader does with ``state_dict`` (pure; see :class:`Restore`).

    Parameters
    ----------
    state_dict
        A state of :meth:`AnnBatchDataLoader.state_dict` (or a plain ``StatefulDataLoader``
        state).
    plan
        The dataset's :class:`~annbatch_torch.sampling.EpochPlan` (its seed and
        fingerprint check the state).
    epoch
        The epoch the dataset is set to.
    rank, world_size, num_workers
        Where the loader runs (``num_workers=0``: no workers).
    finished_starts_next_epoch, epoch_limit
        As on :class:`~annbatch_torch.AnnBatchDataLoader`.

    Raises
    ------
    ValueError
        The state's dataset part does not fit the dataset (:func:`parse_state`), checked
        before its segments are replayed.
    """
    state = dict(state_dict)
    set_to = None
    saved_epoch = state.pop(EPOCH_KEY, None)
    if saved_epoch is not None and int(saved_epoch) > epoch:
        set_to = epoch = int(saved_epoch)  # a later epoch than the snapshots' wins
    saved = loader_progress(state)
    if saved is None:
        problem = torchdata_problem(state, num_workers)
        if problem is not None:
            raise ValueError(
                f"AnnBatchDataLoader.load_state_dict: {problem}; this is not a state that "
                f"AnnBatchDataLoader.state_dict() (or a StatefulDataLoader with "
                f"num_workers={num_workers}) saved: pass the state the loader saved.")
        return Restore("torchdata", state, set_to)
    ds_state = saved.dataset_state
    workers = max(1, num_workers)
    saved_world = int(ds_state.get("world_size") or world_size)  # None in states of 0.1.0
    if finished_starts_next_epoch and _finished(saved, saved_world, plan, epoch_limit):
        # the epoch was done (Lightning: a checkpoint at its last step, applied to the next
        # epoch's iterator): start the next epoch afresh
        return Restore("next epoch", {}, saved.epoch + 1 if saved.epoch + 1 > epoch
                       else set_to, saved_epoch=saved.epoch)
    if (not saved.multiprocess and saved.steps and not ds_state.get("batches")
            and not ds_state.get("segments")):
        # without workers the dataset's state is taken with the loader's: set_epoch moved on
        # after the last batch (a checkpoint between epochs), the next one is whole
        return Restore("dataset only", {}, set_to, ds_state, saved_epoch=saved.epoch)
    if state.get("_iterator_finished"):
        # the saved iterator had ended (a state taken after the epoch's last batch): nothing
        # of it carries over, in particular no worker's progress into the other workers
        return Restore("ended", {}, set_to, saved_epoch=saved.epoch)
    if saved.epoch < epoch:
        # stale: that epoch runs from its start, nothing of the old epoch's iterator carries
        # over
        return Restore("fresh", {}, set_to, saved_epoch=saved.epoch)
    same = same_topology(saved_world, saved.workers, world_size, workers)
    if not same or saved.multiprocess != (num_workers > 0):
        # another topology (or 0 <-> 1 workers, whose torchdata states differ): the rest of
        # the epoch is dealt anew (with 1 worker as without: the same plan)
        return Restore("dataset only", {}, set_to,
                       {**ds_state, "world_size": saved_world, "num_workers": saved.workers,
                        "steps": saved.steps}, resumed_elsewhere=not same,
                       saved_epoch=saved.epoch)
    # the same topology: torchdata restores each copy, its batch count recomputed for this
    # rank; the dataset (which knows the epoch's segments, its len, until the workers take
    # theirs) checks the state first
    loaded = parse_state(ds_state, plan=plan, world_size=world_size)
    snap = state.get("_snapshot")
    if isinstance(snap, dict) and snap.get("_worker_snapshots"):
        counts = plan.worker_batches(saved.epoch, rank=rank, world_size=world_size,
                                     num_workers=workers, segments=loaded.segments)
        state["_snapshot"] = for_rank(snap, counts)
    return Restore("same", state, set_to, ds_state, saved_epoch=saved.epoch)


def _finished(saved: LoaderProgress, saved_world: int, plan: EpochPlan,
              limit: int | float | None) -> bool:
    """Whether ``saved`` was taken at its epoch's end: after every batch of its topology,
    or at ``limit`` (Lightning's ``limit_train_batches``: an int, or a fraction)."""
    segments = [segment_from_json(s) for s in saved.dataset_state.get("segments") or []]
    total = plan.batches_per_rank(saved.epoch, saved_world, segments)
    if isinstance(limit, float) and limit < 1.0:
        total = max(1, int(total * limit))
    elif isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        total = min(total, limit)
    return saved.epoch_steps >= total
