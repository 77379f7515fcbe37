"""AnnBatchDataset in sampling mode: real reads, workers, ranks and resume, on real data."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anndata as ad
import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.multiprocessing as tmp
from torchdata.stateful_dataloader import StatefulDataLoader

from annbatch_torch import (
    A,
    AnnBatchDataLoader,
    AnnBatchDataset,
    ClassBalancedSampler,
    Collection,
    SamplerError,
    SubsetSampler,
    WeightedSampler,
    sampling,
)
from annbatch_torch.lightning import AnnBatchDataModule

sys.path.insert(0, str(Path(__file__).parent))
import sampling_ddp
from conftest import IMBALANCED
from test_ddp import free_port

N_OBS, N_VARS, N_CLASSES = IMBALANCED


@pytest.fixture(scope="module")
def adata(imbalanced_h5ad: Path) -> ad.AnnData:
    return ad.read_h5ad(imbalanced_h5ad)


def _sources(request: pytest.FixtureRequest, where: str) -> Any:
    if where == "collection":
        return request.getfixturevalue("imbalanced_collection")
    return request.getfixturevalue("imbalanced_h5ad")


def _source_rows(source: Any, adata: ad.AnnData, index: np.ndarray) -> np.ndarray:
    """Rows of ``adata`` that rows ``index`` of the dataset's source are."""
    if isinstance(source, Collection):
        return adata.obs_names.get_indexer(source.obs_names_at(index))
    return index  # read in place: rows of the file


def _labels(source: Any, codes: np.ndarray) -> np.ndarray:
    cats = (source.categories("cell_type") if isinstance(source, Collection)
            else [f"t{i}" for i in range(N_CLASSES)])
    return np.asarray(cats, dtype=object)[codes]


def _stream(ds: AnnBatchDataset, epoch: int, rank: int = 0, world_size: int = 1
            ) -> list[np.ndarray]:
    """The plan's batches of ``rank`` (one worker), as row ids."""
    items = sampling.sample_rank_items(ds.sampler, ds.batch_size, ds.epoch_plan.pool,
                                       seed=ds.seed, epoch=epoch, rank=rank,
                                       world_size=world_size)
    return [it.rows[slice(*it.bounds(b))] for it in items
            for b in range(it.batch_start, it.batch_stop)]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("where", ["collection", "in_place"])
def test_every_sampled_row_equals_its_source_cell(request: pytest.FixtureRequest,
                                                  adata: ad.AnnData, where: str,
                                                  num_workers: int) -> None:
    source = _sources(request, where)
    # rare classes weigh more: most rows are drawn several times in an epoch
    sampler = WeightedSampler.from_column("cell_type", {"t0": 0.2, "t7": 50.0}, default=1.0,
                                          num_samples=5000)
    ds = AnnBatchDataset(source, selector={"x": A.X, "y": A.obs["cell_type"]},
                         batch_size=256, chunk_size=256, preload_nchunks=4, densify=True,
                         return_index=True, sampler=sampler, seed=1)
    ds.set_epoch(2)
    seen = []
    for batch in AnnBatchDataLoader(ds, num_workers=num_workers):
        index = batch["index"].numpy()
        rows = _source_rows(source, adata, index)
        np.testing.assert_array_equal(batch["x"].numpy(), adata.X[rows].toarray())
        assert list(_labels(source, batch["y"].numpy())) == list(
            adata.obs["cell_type"].iloc[rows].astype(str))
        seen.append(index)
    assert len(seen) == len(ds) == 5000 // 256 + 1
    got = np.concatenate(seen)
    assert len(np.unique(got)) < len(got)  # rows drawn twice were read (and yielded) twice
    want = np.concatenate(_stream(ds, 2))
    assert sorted(got.tolist()) == sorted(want.tolist())
    if num_workers == 0:  # in the plan's order
        np.testing.assert_array_equal(got, want)


def test_set_epoch_changes_the_stream_and_the_same_epoch_repeats_it(
        imbalanced_collection: Collection) -> None:
    ds = AnnBatchDataset(imbalanced_collection, selector={"y": A.obs["cell_type"]},
                         batch_size=500, return_index=True,
                         sampler=ClassBalancedSampler("cell_type"))
    runs = []
    for epoch in (0, 1, 0):
        ds.set_epoch(epoch)
        runs.append(np.concatenate([b["index"].numpy() for b in ds]))
    np.testing.assert_array_equal(runs[0], runs[2])
    assert not np.array_equal(runs[0], runs[1])
    assert len(ds) == N_OBS // 500


def test_a_subset_in_order_keeps_its_order_with_workers(imbalanced_collection: Collection
                                                        ) -> None:
    rows = np.random.default_rng(0).choice(N_OBS, 1000, replace=False)
    ds = AnnBatchDataset(imbalanced_collection, batch_size=64, chunk_size=64,
                         preload_nchunks=4, return_index=True, shuffle=False,
                         sampler=SubsetSampler(rows, shuffle=False))
    got = np.concatenate([b["index"].numpy() for b in AnnBatchDataLoader(ds, num_workers=2)])
    np.testing.assert_array_equal(got, rows)


#: (collection fixture, sampler chunk_size, tolerance of the per-rank class shares)
GLOO_CASES = [
    ("imbalanced_collection", "auto", 0.1),  # single rows
    ("grouped_collection", 8, 0.2),  # runs of 8 rows of one class, mixed in the pools
]


@pytest.mark.slow
def test_class_balanced_on_two_gloo_ranks_with_two_workers_each(
        request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Both cases in one group (one start of the ranks): each rank's batches are balanced,
    equal in number on both ranks, and the plan's rows for the rank."""
    colls = [request.getfixturevalue(store) for store, _, _ in GLOO_CASES]
    world = 2
    cases = [(str(c.path), chunk) for c, (_, chunk, _) in zip(colls, GLOO_CASES)]
    tmp.spawn(sampling_ddp.entry, args=(world, free_port(), cases, str(tmp_path)),
              nprocs=world, join=True)
    for i, (coll, (store, chunk_size, rtol)) in enumerate(zip(colls, GLOO_CASES)):
        ranks = [dict(np.load(tmp_path / f"case{i}_rank{r}.npz")) for r in range(world)]
        ds = sampling_ddp.dataset(str(coll.path), chunk_size)
        assert ds.sampler.run == (1 if chunk_size == "auto" else chunk_size), store
        codes = np.asarray(coll.categories("cell_type"))
        smallest = ds.sampler._table.counts.min() / N_OBS
        assert smallest <= 0.005, store
        for r, res in enumerate(ranks):
            assert int(res["rank"]) == r
            assert res["counts"].tolist() == [int(res["n_batches"])] * world, store
            assert int(res["n_batches"]) == int(res["len"]), store
            share = np.bincount(res["labels"], minlength=len(codes)) / len(res["labels"])
            np.testing.assert_allclose(share, 1 / N_CLASSES, rtol=rtol, err_msg=store)
            # the rows are the plan's for this rank, whatever the workers
            want = np.concatenate(_stream(ds, 0, r, world))
            assert sorted(res["index"].tolist()) == sorted(want.tolist()), store
        both = np.concatenate([res["index"] for res in ranks])
        assert len(both) == sampling_ddp.NUM_SAMPLES // sampling_ddp.BATCH * sampling_ddp.BATCH


def _resume_ds(store: Path) -> AnnBatchDataset:
    return AnnBatchDataset(store, selector={"y": A.obs["cell_type"]}, batch_size=100,
                           chunk_size=100, preload_nchunks=3, return_index=True, seed=4,
                           sampler=WeightedSampler.from_column("cell_type", {"t7": 9.0},
                                                               default=1.0, num_samples=2345))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("where", ["start", "one", "mid", "end"])
def test_resume_yields_exactly_the_rest(imbalanced_collection: Collection, num_workers: int,
                                        where: str) -> None:
    store = imbalanced_collection.path

    def run(loader: StatefulDataLoader) -> list[np.ndarray]:
        return [b["index"].numpy().copy() for b in loader]

    ds = _resume_ds(store)
    ds.set_epoch(1)
    full = run(AnnBatchDataLoader(ds, num_workers=num_workers))
    k = {"start": 0, "one": 1, "mid": len(full) // 2, "end": len(full)}[where]
    ds = _resume_ds(store)
    ds.set_epoch(1)
    loader = AnnBatchDataLoader(ds, num_workers=num_workers)
    it = iter(loader)
    head = [next(it)["index"].numpy().copy() for _ in range(k)]
    state = loader.state_dict()
    del it, loader
    json.dumps(ds.state_dict())
    fresh = _resume_ds(store)
    resumed = AnnBatchDataLoader(fresh, num_workers=num_workers)
    resumed.load_state_dict(state)
    tail = run(resumed)
    assert len(head) + len(tail) == len(full) == len(ds)
    for a, b in zip(head + tail, full):
        np.testing.assert_array_equal(a, b)
    fresh.set_epoch(2)  # the next epoch is a fresh run's
    ref = _resume_ds(store)
    ref.set_epoch(2)
    nxt, want = run(resumed), run(AnnBatchDataLoader(ref, num_workers=num_workers))
    assert len(nxt) == len(want)
    assert all(np.array_equal(a, b) for a, b in zip(nxt, want))


def test_bad_samplers_are_refused_with_the_fix(imbalanced_collection: Collection,
                                               small_collection: Collection) -> None:
    with pytest.raises(SamplerError, match="sampler and chunk_ids cannot be combined"):
        AnnBatchDataset(imbalanced_collection, chunk_ids=[0, 1],
                        sampler=ClassBalancedSampler("cell_type"))
    with pytest.raises(SamplerError, match=r"'tissue' is not a categorical obs column; "
                                           r"categorical columns are \['cell_type', 'donor'\]"):
        AnnBatchDataset(imbalanced_collection, sampler=ClassBalancedSampler("tissue"))
    with pytest.raises(SamplerError, match="'n_counts' is not a categorical obs column"):
        AnnBatchDataset(small_collection, sampler=ClassBalancedSampler("n_counts"))
    with pytest.raises(SamplerError, match="hold 3 numbers but the source has 6000 rows"):
        AnnBatchDataset(imbalanced_collection, sampler=WeightedSampler([1.0, 2.0, 3.0]))
    with pytest.raises(TypeError, match="sampler must be an annbatch_torch Sampler"):
        AnnBatchDataset(imbalanced_collection, sampler=[0, 1, 2])


class _Seen(pl.LightningModule):
    """Records the rows and labels of every training batch and the rows of validation."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(N_VARS, 1)
        self.train_rows: list[np.ndarray] = []
        self.train_labels: list[np.ndarray] = []
        self.val_rows: list[np.ndarray] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.train_rows.append(batch["index"].numpy().copy())
        self.train_labels.append(batch["y"].numpy().copy())
        return self.layer(batch["x"]).pow(2).mean()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        if not self.trainer.sanity_checking:
            self.val_rows.append(batch["index"][batch["mask"]].numpy().copy())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _datamodule(h5ad: Path, store: Path, num_workers: int) -> AnnBatchDataModule:
    return AnnBatchDataModule(
        [h5ad], store, selector={"x": A.X, "y": A.obs["cell_type"]}, batch_size=250,
        chunk_size=100, preload_nchunks=4, num_workers=num_workers, val_fraction=0.2, seed=3,
        densify=True, dataset_kwargs={"return_index": True},
        sampler=ClassBalancedSampler("cell_type", num_samples=16_000))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_datamodule_trains_class_balanced_on_the_training_split_only(
        imbalanced_h5ad: Path, tmp_path: Path, num_workers: int) -> None:
    dm = _datamodule(imbalanced_h5ad, tmp_path / "store", num_workers)
    model = _Seen()
    pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
               enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False).fit(model, datamodule=dm)
    assert dm.val_chunks is not None
    starts = dm.val_chunks * dm.chunk_size
    val = set(sampling.global_rows(np.stack([starts, np.minimum(starts + dm.chunk_size,
                                                                  N_OBS)], axis=1)).tolist())
    train = np.concatenate(model.train_rows)
    assert len(train) == 16_000
    assert not set(train.tolist()) & val  # held-out rows never come up in training
    share = np.bincount(np.concatenate(model.train_labels), minlength=N_CLASSES) / len(train)
    np.testing.assert_allclose(share, 1 / N_CLASSES, rtol=0.15)
    seen_val = np.concatenate(model.val_rows)  # validation: unweighted, each row once
    assert sorted(seen_val.tolist()) == sorted(val)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_datamodules_sampled_epoch_resumes_mid_epoch(imbalanced_h5ad: Path,
                                                         tmp_path: Path, num_workers: int
                                                         ) -> None:
    store = tmp_path / "store"

    def loader_of(dm: AnnBatchDataModule) -> Any:
        dm.prepare_data()
        dm.setup("fit")
        return dm.train_dataloader()

    full = [b["index"].numpy().copy() for b in loader_of(_datamodule(imbalanced_h5ad, store,
                                                                     num_workers))]
    dm = _datamodule(imbalanced_h5ad, store, num_workers)
    loader = loader_of(dm)
    it = iter(loader)
    head = [next(it)["index"].numpy().copy() for _ in range(len(full) // 2)]
    state = dm.state_dict()
    loader_state = loader.state_dict()
    del it, loader
    dm2 = _datamodule(imbalanced_h5ad, store, num_workers)
    dm2.load_state_dict(state)
    resumed = loader_of(dm2)
    resumed.load_state_dict(loader_state)
    tail = [b["index"].numpy().copy() for b in resumed]
    assert len(head) + len(tail) == len(full)
    for a, b in zip(head + tail, full):
        np.testing.assert_array_equal(a, b)


def test_a_torch_sampler_of_indices_is_dealt_like_ours(imbalanced_collection: Collection
                                                       ) -> None:
    from torch.utils.data import WeightedRandomSampler

    weights = torch.ones(N_OBS)
    weights[:100] = 50.0  # the first rows come up far more often

    def run(num_workers: int) -> list[np.ndarray]:
        ds = AnnBatchDataset(imbalanced_collection, selector={"y": A.obs["cell_type"]},
                             batch_size=200, chunk_size=200, preload_nchunks=2,
                             return_index=True, seed=2,
                             sampler=WeightedRandomSampler(weights, 3000))
        ds.set_epoch(1)
        return [b["index"].numpy() for b in AnnBatchDataLoader(ds, num_workers=num_workers)]

    one, two = run(0), run(2)  # every process draws the same stream
    assert sorted(map(tuple, one)) == sorted(map(tuple, two))
    assert len(one) == 15
    rows = np.concatenate(one)
    assert (rows < 100).mean() > 0.3  # the weights are honoured (5000 / 10900 of the mass)


def test_torch_samplers_that_cannot_be_dealt_are_refused(imbalanced_collection: Collection
                                                         ) -> None:
    from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler

    rows = range(N_OBS)
    with pytest.raises(SamplerError, match="gives other indices each time it is iterated"):
        AnnBatchDataset(imbalanced_collection,
                        sampler=RandomSampler(rows, generator=torch.Generator()))
    with pytest.raises(SamplerError, match="the dataset deals batches to ranks itself"):
        AnnBatchDataset(imbalanced_collection,
                        sampler=DistributedSampler(rows, num_replicas=2, rank=0))
    with pytest.raises(SamplerError, match="yields lists, not row indices"):
        AnnBatchDataset(imbalanced_collection,
                        sampler=BatchSampler(RandomSampler(rows), 10, drop_last=False))


def test_a_torch_sampler_that_draws_held_out_rows_is_refused_at_setup(
        imbalanced_h5ad: Path, tmp_path: Path) -> None:
    from torch.utils.data import WeightedRandomSampler

    dm = AnnBatchDataModule([imbalanced_h5ad], tmp_path / "store", batch_size=100,
                            chunk_size=100, val_fraction=0.2,
                            sampler=WeightedRandomSampler(torch.ones(N_OBS), 1000))
    dm.prepare_data()
    with pytest.raises(SamplerError, match=r"which is held out .* use abt\.WeightedSampler"):
        dm.setup("fit")
