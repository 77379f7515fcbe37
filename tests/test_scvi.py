"""SCVIDataModule with the real scvi-tools: the registry against scvi-tools' own
``setup_anndata``, batch values against the source, training against scvi-tools' own loader,
inference in row order, SCANVI, real data, 2 DDP ranks and bad input."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import scvi
import torch
from conftest import run_ranks

import annbatch_torch as abt
from annbatch_torch.integrations.scvi import SCVIDataModule
from annbatch_torch.integrations.scvi.batches import SCVI_KEYS, to_model
from annbatch_torch.integrations.scvi.setup import label_mapping

ROOT = Path(__file__).resolve().parent.parent
#: scvi-tools' Trainer arguments for quiet CPU runs
QUIET = {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False}
# two covariates of each kind, in an order other than the columns' and than batch_key's
KEYS = {"layer": "counts", "batch_key": "batch", "labels_key": "cell_type",
        "categorical_covariate_keys": ["cell_type", "batch"],
        "continuous_covariate_keys": ["n_genes", "n_counts"]}


@pytest.fixture(autouse=True)
def _quiet_scvi() -> Any:
    logging.getLogger("scvi").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def in_row_order(coll: abt.Collection) -> ad.AnnData:
    """The collection as one AnnData in row order, read by anndata from the shard stores,
    its categoricals in the collection's global category order."""
    parts = [ad.read_zarr(coll.shard_path(i)) for i in range(len(coll.shards))]
    out = ad.concat(parts, merge="same")
    for col in ("cell_type", "batch"):
        out.obs[col] = pd.Categorical(np.asarray(out.obs[col], dtype=object),
                                      categories=coll.categories(col))
    return out


@pytest.fixture(scope="module")
def ref(small_collection: abt.Collection) -> ad.AnnData:
    return in_row_order(small_collection)


def chunk_rows(chunks: np.ndarray, chunk_size: int, n_obs: int) -> np.ndarray:
    return np.concatenate([np.arange(c * chunk_size, min((c + 1) * chunk_size, n_obs))
                           for c in np.asarray(chunks)] or [np.zeros(0, np.int64)])


def epoch_batches(dm: SCVIDataModule, loader: Any) -> list[dict[str, Any]]:
    out = []
    for b in loader:
        moved = dm.transfer_batch_to_device(b, torch.device("cpu"), 0)
        assert isinstance(moved, dict)
        out.append(moved)
    return out


def _no_ambiguous_batch_size(train: Any) -> None:
    """Run ``train()``; Lightning must find one batch size in every batch a step logs (it
    warns of an ambiguous collection otherwise, once per message and process: its memory
    of warnings given is cleared first)."""
    from lightning.pytorch.utilities import data as pl_data

    pl_data.warning_cache.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train()
    ambiguous = [str(w.message) for w in seen if "ambiguous collection" in str(w.message)]
    assert not ambiguous, ambiguous


def train_scvi(dm_or_adata: Any, epochs: int, seed: int, **kwargs: Any) -> Any:
    scvi.settings.seed = seed
    if isinstance(dm_or_adata, SCVIDataModule):
        model = scvi.model.SCVI(registry=dm_or_adata.registry, n_latent=8)
        _no_ambiguous_batch_size(
            lambda: model.train(max_epochs=epochs, datamodule=dm_or_adata, **QUIET))
    else:
        model = scvi.model.SCVI(dm_or_adata, n_latent=8)
        model.train(max_epochs=epochs, train_size=1.0, batch_size=128, **QUIET, **kwargs)
    return model


# -- the registry ------------------------------------------------------------------------------
@pytest.mark.parametrize("unlabeled", ["NK cell", "Unknown"])
@pytest.mark.parametrize("model_name", ["SCVI", "SCANVI"])
def test_registry_matches_setup_anndata(small_collection: abt.Collection, ref: ad.AnnData,
                                        model_name: str, unlabeled: str) -> None:
    a = ref.copy()
    cls = getattr(scvi.model, model_name)
    kwargs: dict[str, Any] = dict(KEYS)
    if model_name == "SCANVI":
        kwargs["unlabeled_category"] = unlabeled
    cls.setup_anndata(a, **kwargs)
    theirs = cls(a).registry
    dm = SCVIDataModule(small_collection, model_name=model_name, **{
        **KEYS, "unlabeled_category": unlabeled})
    ours = dm.registry
    assert ours["setup_method_name"] == "setup_datamodule"
    assert ours["model_name"] == model_name
    for k, v in theirs["setup_args"].items():
        if k != "use_minified":
            assert ours["setup_args"][k] == v, k
    for name in ("X", "batch", "labels", "extra_categorical_covs", "extra_continuous_covs"):
        t, o = theirs["field_registries"][name], ours["field_registries"][name]
        assert o["summary_stats"] == t["summary_stats"], name
        for key, value in t["state_registry"].items():
            got = o["state_registry"][key]
            if isinstance(value, dict):
                assert {k: list(v) for k, v in got.items()} == {
                    k: list(v) for k, v in value.items()}, (name, key)
            elif isinstance(value, np.ndarray | list):
                assert list(np.asarray(got)) == list(np.asarray(value)), (name, key)
            else:
                assert got == value, (name, key)
    assert dm.n_batch == 2
    assert dm.n_cats_per_cov == [8, 2]
    assert dm.n_continuous_cov == 2
    assert list(dm.var_names) == list(ref.var_names)
    assert not torch.is_tensor(dm.registry)  # sanity: a plain dict for scvi-tools


def test_label_mapping_follows_scvi_fields() -> None:
    m = label_mapping(["a", "u", "b"], "SCANVI", "u")  # swapped with the last, as scvi does
    assert list(m.mapping) == ["a", "b", "u"]
    assert m.unlabeled_code == 2
    assert m.lut.tolist() == [2, 0, 2, 1]  # missing -> unlabeled; a, u, b
    m = label_mapping(["a", "u", "b"], "SCANVI", "u", unlabeled_present=False)  # kept
    assert list(m.mapping) == ["a", "u", "b"]
    assert m.lut.tolist() == [1, 0, 1, 2]
    m = label_mapping(["a", "b"], "SCANVI", "Unknown")  # appended
    assert list(m.mapping) == ["a", "b", "Unknown"]
    assert m.lut.tolist() == [2, 0, 1]
    m = label_mapping(["a", "b"], "SCVI", "Unknown")  # as they are; missing refused
    assert list(m.mapping) == ["a", "b"]
    assert m.lut.tolist() == [-1, 0, 1]
    assert m.unlabeled_code is None


# -- batches -------------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_hold_the_source_values(small_collection: abt.Collection, ref: ad.AnnData,
                                        num_workers: int) -> None:
    dm = SCVIDataModule(small_collection, **KEYS, size_factor_key="n_counts", batch_size=100,
                        num_workers=num_workers, train_size=0.8, check_counts=True,
                        drop_last=False)
    dm.setup("fit")
    n, cs = dm.n_obs, dm.chunk_size
    for loader, chunks in ((dm.train_dataloader(), dm.train_chunks),
                           (dm.val_dataloader(), dm.val_chunks)):
        batches = epoch_batches(dm, loader)
        assert batches
        ids = np.concatenate([b["ind_x"].numpy().ravel() for b in batches])
        assert np.array_equal(np.sort(ids), chunk_rows(chunks, cs, n))  # each row once
        counts = ref.layers["counts"]
        cell_type = np.asarray(ref.obs["cell_type"], dtype=object)
        batch_of = np.asarray(ref.obs["batch"], dtype=object)
        for b in batches:
            assert tuple(b)[:5] == SCVI_KEYS
            rows = b["ind_x"].numpy().ravel()
            assert b["X"].layout == torch.strided
            assert b["X"].dtype == torch.float32
            np.testing.assert_array_equal(b["X"].numpy(), counts[rows].toarray())
            assert b["batch"].shape == (len(rows), 1)
            assert b["batch"].dtype == torch.int64
            assert list(dm.batch_labels[b["batch"].numpy().ravel()]) == list(batch_of[rows])
            assert list(dm.label_keys[b["labels"].numpy().ravel()]) == list(cell_type[rows])
            cats = b["extra_categorical_covs"].numpy()
            assert cats.shape == (len(rows), 2)
            assert list(np.asarray(small_collection.categories("cell_type"))[cats[:, 0]]) == list(
                cell_type[rows])
            assert list(dm.batch_labels[cats[:, 1]]) == list(batch_of[rows])
            conts = b["extra_continuous_covs"].numpy()
            np.testing.assert_allclose(conts[:, 0], ref.obs["n_genes"].to_numpy()[rows])
            np.testing.assert_allclose(conts[:, 1], ref.obs["n_counts"].to_numpy()[rows],
                                       rtol=1e-6)
            np.testing.assert_allclose(b["size_factor"].numpy()[:, 0],
                                       ref.obs["n_counts"].to_numpy()[rows], rtol=1e-6)
    assert dm.n_train + dm.n_val == n
    assert dm.n_train == len(chunk_rows(dm.train_chunks, cs, n))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_inference_dataloader_reads_every_cell_in_row_order(
        small_collection: abt.Collection, num_workers: int) -> None:
    dm = SCVIDataModule(small_collection, layer="counts", batch_key="batch", batch_size=256,
                        num_workers=num_workers, train_size=0.7)
    loader = dm.inference_dataloader(device="cpu")
    batches = list(loader)
    assert len(batches) == len(loader) == -(-dm.n_obs // 256)  # the last one partial
    ids = np.concatenate([b["ind_x"].numpy().ravel() for b in batches])
    assert np.array_equal(ids, np.arange(dm.n_obs))  # every cell, in the collection's order
    assert all(b["X"].layout == torch.strided for b in batches)


def test_semi_supervised_pairs() -> None:
    x = torch.sparse_csr_tensor(torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 0]),
                                torch.tensor([1.0, 2.0, 3.0]), size=(3, 2))
    batch = {"X": x, "batch": torch.zeros(3, 1, dtype=torch.int64),
             "labels": torch.tensor([[0], [2], [1]]), "extra_categorical_covs": None,
             "extra_continuous_covs": None, "ind_x": torch.tensor([[5], [6], [7]])}
    full, labelled = to_model(batch, "cpu", unlabeled_code=2)
    assert full["X"].layout == torch.strided
    assert labelled["ind_x"].ravel().tolist() == [5, 7]
    assert labelled["X"].tolist() == [[1.0, 0.0], [3.0, 0.0]]
    assert to_model(batch, "cpu", unlabeled_code=9)[1]["ind_x"].ravel().tolist() == [5, 6, 7]
    none = to_model({**batch, "labels": torch.full((3, 1), 2)}, "cpu", unlabeled_code=2)
    assert isinstance(none, dict)  # no labelled rows: no classification loss from it
    assert tuple(none)[:5] != SCVI_KEYS
    assert isinstance(to_model(batch, "cpu"), dict)


def test_a_gene_subset_reaches_the_registry_and_the_batches(small_collection: abt.Collection,
                                                            ref: ad.AnnData) -> None:
    genes = list(ref.var_names[::3][::-1])  # a subset, reordered
    dm = SCVIDataModule(small_collection, layer="counts", batch_size=500, var_names=genes)
    assert dm.n_vars == len(genes)
    assert list(dm.registry["field_registries"]["X"]["state_registry"]["column_names"]) == genes
    batch = next(iter(dm.inference_dataloader(device="cpu")))
    rows = batch["ind_x"].numpy().ravel()
    want = ref[rows, genes].layers["counts"].toarray()
    np.testing.assert_array_equal(batch["X"].numpy(), want)


def test_splits_and_samplers_keep_to_the_training_chunks(small_collection: abt.Collection
                                                        ) -> None:
    """train_size + validation_size < 1 leaves a test split; a sampler draws from the
    training chunks only (never test rows, also without a validation split); validation
    over 3 ranks drops its remainder (no padding rows reach scvi-tools)."""
    dm = SCVIDataModule(small_collection, layer="counts", batch_size=64, train_size=0.7,
                        validation_size=0.0, sampler=abt.ClassBalancedSampler("cell_type"),
                        chunk_size=128)
    dm.setup("fit")
    n, cs = dm.n_obs, dm.chunk_size
    assert dm.test_chunks is not None
    assert len(dm.test_chunks) > 0
    assert dm.n_val == 0
    assert dm.n_train < n
    train = set(chunk_rows(dm.train_chunks, cs, n).tolist())
    drawn = np.concatenate([b["ind_x"].numpy().ravel()
                            for b in epoch_batches(dm, dm.train_dataloader())])
    assert set(drawn.tolist()) <= train
    per_rank_val = []
    for rank in range(3):
        dm = SCVIDataModule(small_collection, layer="counts", batch_size=64, train_size=0.6,
                            validation_size=0.2, chunk_size=128)
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=3, lightning_module=None,
                                     strategy=SimpleNamespace(root_device=None))
        dm.setup("fit")
        assert dm.n_train + dm.n_val < n  # a test split too
        per_rank_val.append([b["ind_x"].numpy().ravel()
                             for b in epoch_batches(dm, dm.val_dataloader())])
    assert len({len(v) for v in per_rank_val}) == 1  # equal counts
    seen = np.concatenate([x for v in per_rank_val for x in v])
    assert len(np.unique(seen)) == len(seen)  # no padding rows repeat cells
    assert len(chunk_rows(dm.val_chunks, cs, n)) - len(seen) < 3 * 64


def test_a_last_batch_of_one_row_is_not_trained_on(ref: ad.AnnData) -> None:
    """257 cells at batch_size 128: a 1-row batch would break BatchNorm in training."""
    a = ref[:257].copy()
    dm = SCVIDataModule(a, layer="counts", batch_key="batch", batch_size=128)
    model = train_scvi(dm, 1, 0)
    z = model.get_latent_representation(dataloader=dm.inference_dataloader(device="cpu"))
    assert z.shape == (257, 8)  # inference still reads every cell

# -- training ----------------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_scvi_trains_as_with_scvi_tools_own_loader(small_collection: abt.Collection,
                                                   ref: ad.AnnData, num_workers: int) -> None:
    epochs, seed = 2, 0
    dm = SCVIDataModule(small_collection, layer="counts", batch_key="batch", batch_size=128,
                        num_workers=num_workers, train_size=0.8, seed=seed)
    dm.setup("fit")
    n, cs = dm.n_obs, dm.chunk_size
    train_rows, held_rows = (chunk_rows(dm.train_chunks, cs, n),
                             chunk_rows(dm.val_chunks, cs, n))
    ours = train_scvi(dm, epochs, seed)
    a = ref[train_rows].copy()
    scvi.model.SCVI.setup_anndata(a, layer="counts", batch_key="batch")
    theirs = train_scvi(a, epochs, seed)

    held = ref[held_rows].copy()
    def evaluate(model: Any) -> tuple[float, float]:
        dl = SCVIDataModule(held, layer="counts", batch_key="batch", batch_size=256)
        torch.manual_seed(0)
        elbo = float(model.get_elbo(dataloader=dl.inference_dataloader(device="cpu")))
        torch.manual_seed(0)
        rec = model.get_reconstruction_error(dataloader=dl.inference_dataloader(device="cpu"))
        return elbo, float(rec["reconstruction_loss"])

    (e_ours, r_ours), (e_theirs, r_theirs) = evaluate(ours), evaluate(theirs)
    assert abs(e_ours - e_theirs) <= 0.05 * abs(e_theirs), (e_ours, e_theirs)
    assert abs(r_ours - r_theirs) <= 0.05 * abs(r_theirs), (r_ours, r_theirs)
    # one latent row per cell, in the collection's order: scvi-tools' own loader over the
    # rows in order gives the same posterior means as ours
    z = ours.get_latent_representation(dataloader=dm.inference_dataloader(device="cpu"))
    assert z.shape == (n, 8)
    b = ref.copy()
    scvi.model.SCVI.setup_anndata(b, layer="counts", batch_key="batch")
    want = theirs.get_latent_representation(adata=b)
    got = theirs.get_latent_representation(dataloader=dm.inference_dataloader(device="cpu"))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _with_unlabeled(adata: ad.AnnData, fraction: float, seed: int) -> ad.AnnData:
    out = adata.copy()
    hide = np.random.default_rng(seed).random(out.n_obs) < fraction
    labels = np.asarray(out.obs["cell_type"], dtype=object)
    out.obs["truth"] = pd.Categorical(labels)
    labels[hide] = "Unknown"
    out.obs["cell_type"] = pd.Categorical(labels)
    return out


def test_scanvi_learns_labels_from_a_collection(synthetic_h5ads: list[Path], tmp_path: Path,
                                                write_h5ads: Any) -> None:
    inputs = [_with_unlabeled(ad.read_h5ad(p), 0.6, i) for i, p in enumerate(synthetic_h5ads)]
    coll = abt.create_anndata_collection(write_h5ads(inputs, tmp_path / "in"),
                                         tmp_path / "store", progress=False)
    dm = SCVIDataModule(coll, layer="counts", batch_key="batch", labels_key="cell_type",
                        model_name="SCANVI", batch_size=128, train_size=0.9)
    assert dm.label_keys[-1] == "Unknown"
    scvi.settings.seed = 0
    model = scvi.model.SCANVI(registry=dm.registry, datamodule=dm, n_latent=8)
    assert model.module.n_labels == 8  # the unlabeled category is not a class
    _no_ambiguous_batch_size(lambda: model.train(max_epochs=6, datamodule=dm,
                                                 check_val_every_n_epoch=1, **QUIET))
    assert "train_classification_loss" in model.history
    pred = model.predict(dataloader=dm.inference_dataloader(device="cpu"))
    assert len(pred) == coll.n_obs
    truth = coll.obs_at(np.arange(coll.n_obs), ["truth", "cell_type"])
    hidden = truth["cell_type"].to_numpy() == "Unknown"
    accuracy = float(np.mean(np.asarray(pred)[hidden] == truth["truth"].to_numpy()[hidden]))
    assert accuracy > 0.4, accuracy  # 8 types: chance is ~0.125


def test_scanvi_with_few_labels_saves_and_loads(ref: ad.AnnData, tmp_path: Path) -> None:
    """1% of the cells labelled: most batches hold 0-2 labelled cells (a classifier over
    one row breaks BatchNorm); save and load give the same predictions."""
    a = _with_unlabeled(ref, 0.99, 0)
    dm = SCVIDataModule(a, layer="counts", batch_key="batch", labels_key="cell_type",
                        model_name="SCANVI", batch_size=128)
    scvi.settings.seed = 0
    model = scvi.model.SCANVI(registry=dm.registry, datamodule=dm, n_latent=8)
    model.train(max_epochs=2, datamodule=dm, **QUIET)
    pred = model.predict(dataloader=dm.inference_dataloader(device="cpu"))
    model.save(str(tmp_path / "model"), datamodule=dm)
    again = scvi.model.SCANVI.load(str(tmp_path / "model"), datamodule=dm)
    assert list(again.predict(dataloader=dm.inference_dataloader(device="cpu"))) == list(pred)


def test_pbmc68k_reduced_through_the_writer(pbmc68k_reduced: Path, tmp_path: Path) -> None:
    a = ad.read_h5ad(pbmc68k_reduced)
    # counts, as docs/scvi.md describes: raw.X is log1p of counts scaled per cell, so a
    # count of 1 is each cell's smallest non-zero expm1 value
    norm = np.expm1(a.raw.X.toarray() if sp.issparse(a.raw.X) else np.asarray(a.raw.X))
    unit = np.where(norm > 0, norm, np.inf).min(axis=1, keepdims=True)
    counts = np.rint(norm / unit).astype(np.float32)
    # they are counts (raw.X keeps 3 decimals: large counts come back within 0.25)
    assert np.abs(norm / unit - counts).max() < 0.25
    b = ad.AnnData(sp.csr_matrix(counts), obs=a.obs[["bulk_labels", "phase"]].copy(),
                   var=pd.DataFrame(index=a.raw.var_names))
    b.layers["counts"] = b.X.copy()
    labels = np.asarray(b.obs["bulk_labels"], dtype=object)
    labels[np.random.default_rng(0).random(b.n_obs) < 0.5] = "Unknown"
    b.obs["partial"] = pd.Categorical(labels)
    path = tmp_path / "pbmc_counts.h5ad"
    b.write_h5ad(path)
    coll = abt.create_anndata_collection([path], tmp_path / "store", layers=["counts"],
                                         progress=False)
    dm = SCVIDataModule(coll, layer="counts", batch_key="phase", batch_size=128,
                        train_size=0.9)
    vae = train_scvi(dm, 2, 0)
    z = vae.get_latent_representation(dataloader=dm.inference_dataloader(device="cpu"))
    assert z.shape == (700, 8)
    assert np.isfinite(z).all()
    dm2 = SCVIDataModule(coll, layer="counts", batch_key="phase", labels_key="partial",
                         model_name="SCANVI", batch_size=128)
    scanvi = scvi.model.SCANVI(registry=dm2.registry, datamodule=dm2, n_latent=8)
    scanvi.train(max_epochs=2, datamodule=dm2, **QUIET)
    pred = scanvi.predict(dataloader=dm2.inference_dataloader(device="cpu"))
    assert len(pred) == 700
    assert set(pred) <= set(a.obs["bulk_labels"].cat.categories)


@pytest.mark.slow
def test_ddp_two_ranks_train_disjoint_cells(small_collection: abt.Collection,
                                            tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = run_ranks(
        [sys.executable, str(ROOT / "tests" / "scvi_ddp.py"), str(small_collection.path),
         str(tmp_path)], timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [np.load(tmp_path / f"rank{r}.npy") for r in range(2)]
    steps = [int((tmp_path / f"done{r}").read_text()) for r in range(2)]
    assert steps[0] == steps[1] > 0  # equal steps: no rank waits for the other
    assert len(np.intersect1d(rows[0], rows[1])) == 0  # disjoint cells
    seen = np.concatenate(rows)
    assert len(np.unique(seen)) == len(seen)
    # left out: the epoch's partial batch (drop_last) and fewer than 2 batches (even counts)
    assert small_collection.n_obs - len(seen) < 3 * 128


# -- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"batch_key": "nope"}, abt.SchemaError, r"batch_key='nope'.*does not exist.*obs_columns"),
    ({"batch_key": "n_counts"}, abt.SchemaError, r"batch_key='n_counts' must name a "
                                                 r"categorical obs column.*numeric"),
    ({"labels_key": "is_doublet"}, abt.SchemaError, r"labels_key='is_doublet' must name a "
                                                    r"categorical"),
    ({"continuous_covariate_keys": ["cell_type"]}, abt.SchemaError,
     r"continuous_covariate_keys='cell_type' must name a numeric obs column"),
    ({"size_factor_key": "batch"}, abt.SchemaError, r"size_factor_key='batch' must name a "
                                                    r"numeric"),
    ({"layer": "spliced"}, abt.SchemaError, r"layer='spliced'.*layers/spliced.*does not "
                                            r"exist.*layers=\["),
    ({"model_name": "SCANVI"}, ValueError, r"model_name='SCANVI' needs labels_key"),
    ({"model_name": "TOTALVI"}, ValueError, r"model_name must be one of \['SCVI', 'SCANVI'\]"),
    ({"selector": {"x": "X"}}, ValueError, r"SCVIDataModule sets \['selector'\] itself"),
    ({"out_dtype": "int32"}, ValueError, r"SCVIDataModule sets \['out_dtype'\] itself"),
    ({"train_size": 0}, ValueError, r"train_size must be in \(0, 1\]"),
    ({"train_size": 0.8, "validation_size": 0.3}, ValueError,
     r"train_size \+ validation_size must be <= 1"),
])
def test_bad_input_names_the_key_and_the_fix(small_collection: abt.Collection,
                                             kwargs: dict[str, Any], error: type,
                                             match: str) -> None:
    base = {"layer": "counts"}
    with pytest.raises(error, match=match):
        SCVIDataModule(small_collection, **{**base, **kwargs})


def test_x_without_counts_warns(small_collection: abt.Collection) -> None:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        SCVIDataModule(small_collection)  # X is log1p-normalised
        SCVIDataModule(small_collection, layer="counts")
    msgs = [str(w.message) for w in got if issubclass(w.category, UserWarning)]
    assert len([m for m in msgs if "does not look like raw counts" in m]) == 1, msgs
    assert any("'X'" in m and "layer=" in m for m in msgs)


def test_missing_batch_values_are_refused(small_collection: abt.Collection) -> None:
    a = ad.AnnData(sp.csr_matrix(np.ones((6, 3), np.float32)),
                   obs=pd.DataFrame({"b": pd.Categorical(["x", None, "y", "x", None, "y"]),
                                     "l": pd.Categorical(["p", "q", None, "p", "q", "p"])},
                                    index=[f"c{i}" for i in range(6)]))
    with pytest.raises(abt.SchemaError, match=r"batch_key='b' has 2 cell\(s\) with a missing "
                                              r"value \(rows \[1, 4\]"):
        SCVIDataModule(a, batch_key="b")
    with pytest.raises(abt.SchemaError, match=r"labels_key='l' has 1 cell.*train SCANVI"):
        SCVIDataModule(a, labels_key="l")
    dm = SCVIDataModule(a, labels_key="l", model_name="SCANVI")  # missing -> unlabeled
    assert list(dm.labels_) == ["p", "q", "Unknown", "p", "q", "p"]


def test_without_scvi_tools_the_error_names_the_extra() -> None:
    code = ("import sys; sys.modules['scvi'] = None\n"
            "try:\n    import annbatch_torch.integrations.scvi\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert "pip install 'annbatch-torch[scvi]'" in out.stdout, out.stdout + out.stderr


def test_core_install_does_not_pull_scvi_tools() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any("scvi" in d for d in meta["dependencies"])
    assert any(d.startswith("scvi-tools>=1.4") for d in meta["optional-dependencies"]["scvi"])
    code = "import annbatch_torch as abt, sys; abt.AnnBatchDataModule; print('scvi' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


def test_a_split_losing_rows_to_drop_last_says_so_and_how_to_keep_them(
        small_collection: abt.Collection, caplog: pytest.LogCaptureFixture) -> None:
    """A training split whose last partial batch is a large share of it: the warning
    names drop_last (what leaves the rows out on one rank), and its fixes work as
    spelled for each DataModule: SCVIDataModule's own keyword, AnnBatchDataModule's
    dataset_kwargs; nothing about even_batches, which drops nothing on one rank."""
    caplog.set_level("WARNING", logger="annbatch_torch")
    dm = SCVIDataModule(small_collection, layer="counts", batch_size=1000)
    dm.setup("fit")
    msgs = [r.getMessage() for r in caplog.records if "an epoch uses only" in r.getMessage()]
    assert len(msgs) == 1, msgs
    assert "drop_last=True leaves out each rank's last partial batch" in msgs[0]
    assert "keep it with drop_last=False" in msgs[0]
    assert "even_batches" not in msgs[0]
    caplog.clear()
    kept = SCVIDataModule(small_collection, layer="counts", batch_size=1000, drop_last=False)
    kept.setup("fit")
    assert not [r for r in caplog.records if "an epoch uses only" in r.getMessage()]
    plain = abt.AnnBatchDataModule(None, small_collection.path, batch_size=1000,
                                   dataset_kwargs={"drop_last": True})
    plain.setup("fit")
    msgs = [r.getMessage() for r in caplog.records if "an epoch uses only" in r.getMessage()]
    assert len(msgs) == 1, msgs
    assert "keep it with dataset_kwargs={'drop_last': False}" in msgs[0]
