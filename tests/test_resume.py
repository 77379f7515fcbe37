"""Exact mid-epoch resume through torchdata's StatefulDataLoader."""

from __future__ import annotations

import json
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from torchdata.stateful_dataloader import StatefulDataLoader

from annbatch_torch import A, AnnBatchDataLoader, AnnBatchDataset


@pytest.fixture(scope="module")
def h5ad(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(5)
    n = 1000
    x = sp.random(n, 30, density=0.2, format="csr", dtype=np.float32, random_state=rng)
    obs = pd.DataFrame(index=[f"c{i}" for i in range(n)])
    p = tmp_path_factory.mktemp("resume") / "a.h5ad"
    ad.AnnData(x, obs=obs, var=pd.DataFrame(index=[f"g{i}" for i in range(30)])).write_h5ad(p)
    return p


def _ds(path: Path) -> AnnBatchDataset:
    return AnnBatchDataset(path, selector={"x": A.X}, batch_size=32, chunk_size=16,
                           preload_nchunks=4, return_index=True, seed=9)


def _run(loader: StatefulDataLoader) -> list[np.ndarray]:
    return [b["index"].numpy().copy() for b in loader]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("where", ["start", "one", "mid", "end"])
def test_resume_yields_exactly_the_rest(h5ad: Path, num_workers: int, where: str) -> None:
    ds = _ds(h5ad)
    ds.set_epoch(3)
    full = _run(StatefulDataLoader(ds, batch_size=None, num_workers=num_workers))
    k = {"start": 0, "one": 1, "mid": len(full) // 2, "end": len(full)}[where]

    ds = _ds(h5ad)
    ds.set_epoch(3)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=num_workers)
    it = iter(loader)
    head = [next(it)["index"].numpy().copy() for _ in range(k)]
    state = loader.state_dict()
    del it, loader
    json.dumps(ds.state_dict())  # the dataset's own state is JSON

    fresh = _ds(h5ad)
    resumed_loader = StatefulDataLoader(fresh, batch_size=None, num_workers=num_workers)
    resumed_loader.load_state_dict(state)
    tail = _run(resumed_loader)
    assert len(head) + len(tail) == len(full)
    for a, b in zip(head + tail, full):
        np.testing.assert_array_equal(a, b)

    # the next epoch is identical to an uninterrupted run's next epoch
    fresh.set_epoch(4)
    ref = _ds(h5ad)
    ref.set_epoch(4)
    nxt = _run(resumed_loader)
    want = _run(StatefulDataLoader(ref, batch_size=None, num_workers=num_workers))
    assert len(nxt) == len(want)
    assert all(np.array_equal(a, b) for a, b in zip(nxt, want))


def test_a_workers_own_state_cannot_change_the_topology(h5ad: Path) -> None:
    """One worker's state says nothing of its peers: only a loader state (or a state of a
    copy that ran alone) resumes on another number of ranks or workers."""
    ds = _ds(h5ad)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=0)
    it = iter(loader)
    next(it)
    state = ds.state_dict()
    other = _ds(h5ad)
    other.load_state_dict({**state, "num_workers": 2})
    with pytest.raises(ValueError, match=r"worker 0 of 2.*num_workers=1.*"
                       r"AnnBatchDataLoader.state_dict\(\)"):
        list(other)
    with pytest.raises(ValueError, match="seed=9"):
        AnnBatchDataset(h5ad, seed=1).load_state_dict(state)
    assert state["world_size"] == 1
    two = AnnBatchDataset(h5ad, selector={"x": A.X}, batch_size=32, chunk_size=16,
                          preload_nchunks=4, seed=9, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"worker 0 of 2 on 1 ranks; to resume on 2 ranks"):
        two.load_state_dict({**state, "num_workers": 2})
    two.load_state_dict(state)  # a copy that ran alone: its count is its rank's
    old = {k: v for k, v in state.items() if k != "world_size"}  # a 0.1.0 state: accepted
    _ds(h5ad).load_state_dict(old)


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def _epoch(h5ad: Path, epoch: int, num_workers: int) -> list[np.ndarray]:
    ds = _ds(h5ad)
    ds.set_epoch(epoch)
    return _run(AnnBatchDataLoader(ds, num_workers=num_workers))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_checkpoint_between_epochs_resumes_the_next_epoch(h5ad: Path, num_workers: int) -> None:
    """Epoch 2 done, set_epoch(3), checkpoint: the resumed run is epoch 3, whole. With
    workers the dataset states inside the loader's state are snapshots from epoch 2."""
    ds = _ds(h5ad)
    loader = AnnBatchDataLoader(ds, num_workers=num_workers)
    ds.set_epoch(2)
    _run(loader)
    ds.set_epoch(3)
    state = loader.state_dict()
    assert ds.state_dict()["epoch"] == 3
    assert ds.state_dict()["batches"] == 0
    fresh = _ds(h5ad)
    resumed = AnnBatchDataLoader(fresh, num_workers=num_workers)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert _same(_run(resumed), _epoch(h5ad, 3, num_workers))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("k", ["mid", "all"])
def test_a_later_set_epoch_wins_over_a_loaded_state(h5ad: Path, num_workers: int,
                                                    k: str) -> None:
    """State saved in (or at the end of) epoch 1, then the loop moves on: set_epoch(2)
    after load_state_dict runs epoch 2 from its start, not the rest of epoch 1."""
    full = _epoch(h5ad, 1, num_workers)
    ds = _ds(h5ad)
    ds.set_epoch(1)
    loader = AnnBatchDataLoader(ds, num_workers=num_workers)
    it = iter(loader)
    for _ in range(len(full) // 2 if k == "mid" else len(full)):
        next(it)
    state = loader.state_dict()
    del it
    fresh = _ds(h5ad)
    resumed = AnnBatchDataLoader(fresh, num_workers=num_workers)
    resumed.load_state_dict(state)
    fresh.set_epoch(2)
    assert _same(_run(resumed), _epoch(h5ad, 2, num_workers))
    assert fresh.epoch == 2
    # the same state resumed in its own epoch still yields exactly the rest
    again = _ds(h5ad)
    loader2 = AnnBatchDataLoader(again, num_workers=num_workers)
    loader2.load_state_dict(state)
    again.set_epoch(1)
    rest = _run(loader2)
    assert _same(rest, full[len(full) - len(rest):])
    assert len(rest) == (len(full) - len(full) // 2 if k == "mid" else 0)


@pytest.mark.parametrize("k", [3, 20, 24, 30])
def test_rank_zeros_state_resumes_every_rank_with_workers(h5ad: Path, k: int) -> None:
    """Lightning checkpoints rank 0's loader state only. Ranks yield the same number of
    batches but their workers need not (here rank 0's two workers make 16 + 15 batches,
    rank 1's 22 + 9): each rank recomputes its workers' progress from the batch count."""
    def ds(rank: int) -> AnnBatchDataset:
        return AnnBatchDataset(h5ad, selector={"x": A.X}, batch_size=16, chunk_size=32,
                               preload_nchunks=4, return_index=True, seed=9, rank=rank,
                               world_size=2)

    from annbatch_torch import sampling

    counts = [[sampling.total_batches(ds(r).plan(0, w, 2)) for w in range(2)] for r in (0, 1)]
    assert sum(counts[0]) == sum(counts[1])
    assert counts[0] != counts[1]
    rank0 = AnnBatchDataLoader(ds(0), num_workers=2)
    it = iter(rank0)
    for _ in range(k):
        next(it)
    state = json.loads(json.dumps(rank0.state_dict()))
    del it
    for rank in (0, 1):
        full = _run(AnnBatchDataLoader(ds(rank), num_workers=2))
        resumed = AnnBatchDataLoader(ds(rank), num_workers=2)
        resumed.load_state_dict(state)
        assert _same(_run(resumed), full[k:]), rank


def test_a_state_of_another_plan_is_refused_and_an_old_state_loads(h5ad: Path) -> None:
    """A state records what the epoch's batches depend on: resumed by a dataset that would
    deal other batches, it would skip the wrong ones."""
    from annbatch_torch import SubsetSampler

    ds = _ds(h5ad)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    json.dumps(state)
    other = AnnBatchDataset(h5ad, selector={"x": A.X}, batch_size=32, chunk_size=8,
                            preload_nchunks=4, return_index=True, seed=9)
    with pytest.raises(ValueError, match=r"chunk_size=16 \(now 8\)"):
        other.load_state_dict(state)
    sampled = AnnBatchDataset(h5ad, selector={"x": A.X}, batch_size=32, chunk_size=16,
                              preload_nchunks=4, return_index=True, seed=9,
                              sampler=SubsetSampler(range(500)))
    with pytest.raises(ValueError, match=r"sampler=None \(now 'SubsetSampler"):
        sampled.load_state_dict(state)
    old = {k: v for k, v in state.items() if k != "plan"}  # saved before plans were kept
    fresh = _ds(h5ad)
    fresh.load_state_dict(old)
    assert len(list(fresh)) == len(ds) - 1


@pytest.mark.parametrize(("before", "after"), [(0, 1), (1, 0), (2, 0), (0, 2)])
def test_worker_count_changes_resume_exactly(h5ad: Path, before: int, after: int) -> None:
    """0 <-> 1 workers (torchdata's two state formats, one plan: the very rest, in order)
    and 2 <-> 0 (the rest dealt anew): every batch of the epoch once."""
    full = _epoch(h5ad, 0, before)
    loader = AnnBatchDataLoader(_ds(h5ad), num_workers=before)
    it = iter(loader)
    head = [next(it)["index"].numpy().copy() for _ in range(10)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    resumed = AnnBatchDataLoader(_ds(h5ad), num_workers=after)
    resumed.load_state_dict(state)
    rest = _run(resumed)
    assert len(head) + len(rest) == len(full)
    rows = np.concatenate(head + rest)
    assert sorted(rows.tolist()) == sorted(np.concatenate(full).tolist())
    if {before, after} == {0, 1}:
        assert _same(head + rest, full)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stale_state_carries_nothing_into_the_later_epoch(h5ad: Path, num_workers: int
                                                           ) -> None:
    """A mid-epoch-0 state loaded after set_epoch(1): epoch 1 runs whole and in order, and
    a state saved in it counts only its own batches."""
    loader = AnnBatchDataLoader(_ds(h5ad), num_workers=num_workers)
    it = iter(loader)
    for _ in range(10):
        next(it)
    state = loader.state_dict()
    del it
    fresh = _ds(h5ad)
    fresh.set_epoch(1)
    resumed = AnnBatchDataLoader(fresh, num_workers=num_workers)
    resumed.load_state_dict(state)
    it = iter(resumed)
    head = [next(it)["index"].numpy().copy() for _ in range(5)]
    mid = resumed.state_dict()
    from annbatch_torch import resume

    saved = resume.loader_progress(mid)
    assert saved is not None
    assert (saved.epoch, saved.steps) == (1, 5)
    rest = [b["index"].numpy().copy() for b in it]
    assert _same(head + rest, _epoch(h5ad, 1, num_workers))


def test_a_sampler_with_other_weights_is_another_plan(h5ad: Path) -> None:
    from annbatch_torch import WeightedSampler

    def ds(weights: list[float]) -> AnnBatchDataset:
        return AnnBatchDataset(h5ad, selector={"x": A.X}, batch_size=32, seed=9,
                               sampler=WeightedSampler(weights, num_samples=500))
    a = ds([1.0] * 500 + [2.0] * 500)
    next(iter(a))
    with pytest.raises(ValueError, match="sampler="):
        ds([2.0] * 500 + [1.0] * 500).load_state_dict(a.state_dict())
    ds([1.0] * 500 + [2.0] * 500).load_state_dict(a.state_dict())  # the same: loads
