"""Arguments and resume states checked where they are given (issue 29 items 9, 12c, 12d,
12f): out-of-range ``chunk_ids``, malformed or foreign ``load_state_dict`` states, a state
of another collection of as many rows, and sizes beyond what the plan can hold are refused
at the call, naming the argument or key, instead of failing at iteration (in a worker, or
with torchdata's ``AssertionError``)."""

from __future__ import annotations

import copy
import functools
import json
import re
import sys
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from annbatch_torch import AnnBatchDataLoader, AnnBatchDataset
from annbatch_torch.store.collection import Collection
from annbatch_torch.write.append import append_to_collection
from annbatch_torch.write.writer import create_anndata_collection

BATCH = 64
SETTINGS = dict(selector={"n": "obs/n_counts"}, batch_size=BATCH, chunk_size=32,
                preload_nchunks=4, return_index=True, seed=3)


def _ds(source: Any, **kw: Any) -> AnnBatchDataset:
    return AnnBatchDataset(source, **{**SETTINGS, **kw})


def _rows(batches: Any) -> list[np.ndarray]:
    return [b["index"].numpy().copy() for b in batches]


def _state_after(source: Any, k: int, **kw: Any) -> dict[str, Any]:
    ds = _ds(source, **kw)
    it = iter(ds)
    for _ in range(k):
        next(it)
    return ds.state_dict()


# ----------------------------------------------------------------- item 9: chunk_ids


@pytest.mark.parametrize(("ids", "named"), [
    ([0, 999], "999"), ([-1, 3], "-1"), ([2, 5, 5], "5"), ([1.5], "1.5"),
])
def test_bad_chunk_ids_are_refused_at_construction(small_collection: Collection,
                                                   ids: list[Any], named: str) -> None:
    n_chunks = -(-small_collection.n_obs // 32)
    with pytest.raises(ValueError, match="chunk_ids") as e:
        _ds(small_collection, chunk_ids=ids)
    msg = str(e.value)
    assert named in msg, msg
    if named in ("999", "-1"):
        assert f"[0, {n_chunks})" in msg, msg
        assert str(small_collection.path) in msg, msg


# ----------------------------------------------------------------- item 12d: the keys


@pytest.mark.parametrize(("key", "value"), [
    ("batches", 10**6), ("batches", 2.5), ("batches", True), ("batches", -1),
    ("world_size", 0), ("world_size", "2"), ("epoch", -1), ("epoch", 1.0), ("worker", 5),
    ("num_workers", -2), ("num_workers", 0), ("seed", "x"), ("plan", 3), ("steps", -1),
    ("steps", 10**6), ("segments", "x"), ("segments", [3]), ("version", 99),
    ("segments", [{"world_size": 0, "num_workers": 1, "steps": 1}]),
    ("segments", [{"world_size": 2, "num_workers": 1, "steps": 10**6}]),
])
def test_a_malformed_state_is_refused_at_load_naming_the_key(
        small_collection: Collection, key: str, value: Any) -> None:
    state = _state_after(small_collection, 3)
    ds = _ds(small_collection)
    with pytest.raises((ValueError, TypeError), match=re.escape(repr(key))):
        ds.load_state_dict({**state, key: value})


def test_batches_beyond_the_epoch_name_the_bound(small_collection: Collection) -> None:
    state = _state_after(small_collection, 3)
    ds = _ds(small_collection)
    n = len(ds)
    with pytest.raises(ValueError, match=rf"'batches'.*{n}"):
        ds.load_state_dict({**state, "batches": n + 1})
    ds.load_state_dict({**state, "batches": n})  # after the last batch: nothing left
    assert list(ds) == []


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_loader_refuses_a_malformed_state_at_load(small_collection: Collection,
                                                      num_workers: int) -> None:
    loader = AnnBatchDataLoader(_ds(small_collection), num_workers=num_workers)
    it = iter(loader)
    next(it)
    good = loader.state_dict()
    del it
    key = "_snapshot" if num_workers else "_num_yielded"
    for bad in ({"foo": 1}, {**good, key: -1 if key == "_num_yielded" else 3}):
        fresh = AnnBatchDataLoader(_ds(small_collection), num_workers=num_workers)
        with pytest.raises(ValueError, match=re.escape(repr(key))):
            fresh.load_state_dict(bad)
    fresh = AnnBatchDataLoader(_ds(small_collection), num_workers=num_workers)
    fresh.load_state_dict({})  # nothing to restore: the epoch runs from its start
    assert len(_rows(fresh)) == len(fresh.dataset)


def test_a_loaded_state_resumes_in_a_plain_dataloader_with_workers(
        small_collection: Collection) -> None:
    full = _rows(_ds(small_collection))
    k = 5
    ds = _ds(small_collection)
    ds.load_state_dict(_state_after(small_collection, k))
    rest = _rows(DataLoader(ds, batch_size=None, num_workers=2))
    assert len(rest) == len(full) - k
    got = np.concatenate(full[:k] + rest)
    assert np.array_equal(np.sort(got), np.arange(small_collection.n_obs))


# ----------------------------------------------------------------- item 12c: the collection


@pytest.fixture(scope="module")
def other_seed(synthetic_h5ads: list[Path], tmp_path_factory: pytest.TempPathFactory
               ) -> Collection:
    """``small_collection``'s inputs written with another writer seed: as many rows."""
    out = tmp_path_factory.mktemp("other_seed") / "store"
    return create_anndata_collection(synthetic_h5ads, out, seed=1, n_obs_per_shard=1024,
                                     progress=False)


def test_a_state_of_another_collection_is_refused_naming_both(
        small_collection: Collection, other_seed: Collection) -> None:
    assert other_seed.n_obs == small_collection.n_obs
    state = _state_after(small_collection, 3)
    json.dumps(state)
    with pytest.raises(ValueError, match="collection") as e:
        _ds(other_seed).load_state_dict(state)
    assert str(small_collection.path) in str(e.value), e.value
    assert str(other_seed.path) in str(e.value), e.value
    # the loader's state too, with and without workers
    for nw in (0, 2):
        loader = AnnBatchDataLoader(_ds(small_collection), num_workers=nw)
        it = iter(loader)
        next(it)
        saved = loader.state_dict()
        if nw:  # now: the loader keeps the iterator, and a collection would wait 5 s a worker
            it._shutdown_workers()
        del it
        with pytest.raises(ValueError, match=re.escape(str(other_seed.path))):
            AnnBatchDataLoader(_ds(other_seed), num_workers=nw).load_state_dict(saved)


def test_a_state_saved_before_the_collection_was_recorded_loads(
        small_collection: Collection) -> None:
    full = _rows(_ds(small_collection))
    state = _state_after(small_collection, 4)
    old = {**state, "plan": {k: v for k, v in state["plan"].items() if k != "source"}}
    old.pop("source_name", None)
    ds = _ds(small_collection)
    ds.load_state_dict(old)
    assert all(np.array_equal(a, b) for a, b in zip(_rows(ds), full[4:], strict=True))


def test_the_same_collection_opened_again_resumes(small_collection: Collection) -> None:
    full = _rows(_ds(small_collection))
    state = _state_after(small_collection, 4)
    ds = _ds(str(small_collection.path))
    ds.load_state_dict(state)
    assert all(np.array_equal(a, b) for a, b in zip(_rows(ds), full[4:], strict=True))


def test_the_same_rows_rewritten_resume_and_a_rewrite_with_another_seed_is_named(
        synthetic_h5ads: list[Path], small_collection: Collection, tmp_path: Path) -> None:
    """The digest covers what decides which cell is at which row id, nothing else: the
    same inputs and seed in other shard sizes (or after appending no cells) resume; the
    same folder rewritten with another seed is refused as rewritten."""
    full = _rows(_ds(small_collection))
    state = _state_after(small_collection, 4)
    same = create_anndata_collection(synthetic_h5ads, tmp_path / "same", seed=0,
                                     n_obs_per_shard=700, progress=False)
    empty = tmp_path / "empty.h5ad"
    ad.AnnData(np.zeros((0, same.n_vars), np.float32),
               var=ad.read_h5ad(synthetic_h5ads[0], backed="r").var).write_h5ad(empty)
    same = append_to_collection(same, [empty], progress=False)
    ds = _ds(same)
    ds.load_state_dict(state)
    assert all(np.array_equal(a, b) for a, b in zip(_rows(ds), full[4:], strict=True))
    saved_there = _state_after(same, 2)
    create_anndata_collection(synthetic_h5ads, tmp_path / "same", seed=5, overwrite=True,
                              progress=False)
    with pytest.raises(ValueError, match="holds other rows than when the state was saved"):
        _ds(str(tmp_path / "same")).load_state_dict(saved_there)


# ----------------------------------------------------------------- item 12f: sizes


@pytest.mark.parametrize("kw", [
    dict(batch_size=sys.maxsize), dict(batch_size=sys.maxsize - 1),
    dict(chunk_size=sys.maxsize), dict(chunk_size=2**40, preload_nchunks=2**40),
])
def test_sizes_beyond_the_plan_are_refused_with_the_bound(small_collection: Collection,
                                                          kw: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=r"2\*\*62") as e:
        _ds(small_collection, **kw)
    assert next(iter(kw)) in str(e.value)


def test_a_batch_within_the_bound_holds_every_row(small_collection: Collection) -> None:
    (batch,) = _rows(_ds(small_collection, batch_size=2**62, shuffle=False))
    assert np.array_equal(batch, np.arange(small_collection.n_obs))


# ----------------------------------------------------------------- item 12d: fuzzed states

#: keys of a dataset state and values to put there
_VALUES = st.one_of(
    st.integers(0, 4), st.integers(0, 4), st.integers(0, 4), st.integers(-3, 60),
    st.integers(2**40, 2**70), st.floats(allow_nan=True),
    st.booleans(), st.none(), st.text(max_size=3), st.just([]), st.just({}),
    st.lists(st.integers(-1, 3), max_size=2),
)
_SEGMENT = st.fixed_dictionaries({
    "world_size": st.one_of(st.integers(-1, 4), st.just(2.5)),
    # (one worker: the oracle replays a segment's ranks in this process)
    "num_workers": st.sampled_from([0, 1, "1"]),
    "steps": st.one_of(st.integers(-1, 30), st.just(10**9)),
})
_NEAR_VALID = st.tuples(st.just("set"), st.sampled_from(
    ["epoch", "world_size", "batches", "steps", "num_workers", "worker"]), st.integers(0, 6))
_MUTATION = st.one_of(
    _NEAR_VALID, _NEAR_VALID,
    st.tuples(st.just("set"), st.sampled_from(
        ["version", "seed", "world_size", "epoch", "worker", "num_workers", "batches",
         "steps", "plan", "segments", "junk"]), _VALUES),
    st.tuples(st.just("set"), st.just("segments"), st.lists(_SEGMENT, min_size=1,
                                                            max_size=1)),
    st.tuples(st.just("plan"), st.sampled_from(
        ["n_obs", "batch_size", "chunk_size", "shuffle", "drop_last", "even_batches",
         "chunk_ids", "sampler", "source"]), _VALUES),
    st.tuples(st.just("del"), st.sampled_from(
        ["version", "seed", "world_size", "epoch", "worker", "num_workers", "batches",
         "segments", "plan"]), st.none()),
)


@functools.cache
def _run(coll: Collection, epoch: int, rank: int = 0, world_size: int = 1
         ) -> tuple[np.ndarray, ...]:
    ds = _ds(coll, rank=rank, world_size=world_size)
    ds.set_epoch(epoch)
    return tuple(_rows(ds))


def _consumed(coll: Collection, epoch: int, world_size: int, steps: int) -> np.ndarray:
    """The rows every rank of ``world_size`` yielded in its first ``steps`` batches."""
    if steps == 0:
        return np.zeros(0, np.int64)
    parts = [np.concatenate(_run(coll, epoch, r, world_size)[:steps] or (np.zeros(0, int),))
             for r in range(world_size)]
    return np.concatenate(parts)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(0, 20), mutation=_MUTATION)
def test_fuzzed_states_are_refused_naming_the_key_or_resume_exactly(
        small_collection: Collection, k: int, mutation: tuple[str, str, Any]) -> None:
    coll = small_collection
    state = _state_after(coll, k)
    what, key, value = mutation
    if what == "set":
        state[key] = value
    elif what == "plan":
        state["plan"] = {**state["plan"], key: value}
    else:
        state.pop(key)
    ds = _ds(coll)
    refused = _error(ds.load_state_dict, state)
    if refused is not None:
        named = repr(key) in refused or (what == "plan" and f"{key}=" in refused)
        assert named, (mutation, refused)
        event("refused at load")
        return
    resumed: list[np.ndarray] = []
    failed = _error(lambda: resumed.extend(_rows(ds)))
    if failed is not None:  # a worker's state, resumed without its peers: named at start
        assert key == "num_workers", (mutation, failed)
        assert "num_workers" in failed, (mutation, failed)
        event("refused at iteration")
        return
    event(f"resumed ({what} {key})")
    epoch = state["epoch"]
    # the loader's step, when a state has one, is the copy's count (one worker per rank)
    done = state["batches"] if state.get("steps") is None else state["steps"]
    world = state.get("world_size") or 1
    segments = state.get("segments") or []
    rows = np.concatenate(resumed) if resumed else np.zeros(0, np.int64)
    assert len(np.unique(rows)) == len(rows), mutation  # no row twice
    if segments:  # a segment on other ranks, then `done` batches on this one
        seg = segments[0]
        before = _consumed(coll, epoch, seg["world_size"], seg["steps"])
        assert not np.isin(rows, before).any(), mutation
        assert coll.n_obs - done * BATCH <= len(rows) + len(before) <= coll.n_obs, mutation
    elif world == 1:  # the rest of the state's epoch
        assert _same(resumed, _run(coll, epoch)[done:]), mutation
    else:  # saved on `world` ranks, each `done` batches in: the rest, every row once
        before = _consumed(coll, epoch, world, done)
        assert np.array_equal(np.sort(np.concatenate([before, rows])),
                              np.arange(coll.n_obs)), mutation


def _error(fn: Any, *args: Any) -> str | None:
    """The message of the ``ValueError`` / ``TypeError`` ``fn(*args)`` raises, or ``None``."""
    try:
        fn(*args)
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def _same(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_plan_settings_are_read_only_once_built(small_collection: Any) -> None:
    """A change after construction would not reach the plan, len() or the resume
    fingerprint: refused, naming the setting and the fix."""
    ds = AnnBatchDataset(small_collection, batch_size=64, seed=3)
    n = len(ds)
    for name, value in [("shuffle", False), ("batch_size", 50), ("seed", 4),
                        ("drop_last", True), ("chunk_ids", [0]), ("even_batches", "pad")]:
        with pytest.raises(AttributeError, match=rf"AnnBatchDataset\.{name} is fixed"):
            setattr(ds, name, value)
    assert len(ds) == n
    assert ds.batch_size == 64
    assert ds.shuffle
    ds.densify_policy = ds.densify_policy  # other attributes stay settable
    assert copy.deepcopy(ds).batch_size == 64  # copies and pickles still build


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("set_next", [False, True])
def test_a_state_taken_after_the_epochs_end_resumes_a_whole_epoch(
        small_collection: Collection, num_workers: int, set_next: bool) -> None:
    """A loader state saved after the last batch (the iterator ended), loaded into a fresh
    loader: the dataset's epoch runs whole, every worker from its own start (worker 0's
    progress reached worker 1 and failed it: "the saved state comes from worker 0")."""
    ds = _ds(small_collection)
    loader = AnnBatchDataLoader(ds, num_workers=num_workers)
    assert sum(1 for _ in loader) == len(ds)
    if set_next:
        ds.set_epoch(1)
    state = loader.state_dict()
    fresh = _ds(small_collection)
    resumed = AnnBatchDataLoader(fresh, num_workers=num_workers)
    resumed.load_state_dict(state)
    got = _rows(resumed)
    want_ds = _ds(small_collection)
    want_ds.set_epoch(1 if set_next else 0)
    want = _rows(AnnBatchDataLoader(want_ds, num_workers=num_workers))
    assert len(got) == len(want) == len(ds)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
