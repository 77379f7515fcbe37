"""create_anndata_collection: content, shuffle, categories, errors, atomicity, memory."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

from annbatch_torch.datasets import synthetic, write_synthetic_h5ads
from annbatch_torch.errors import InputError
from annbatch_torch.store.collection import open_collection
from annbatch_torch.store.manifest import MANIFEST_NAME, read_manifest
from annbatch_torch.write import budget as _writer_budget
from annbatch_torch.write.append import append_to_collection
from annbatch_torch.write.writer import create_anndata_collection, parse_memory

REPO = Path(__file__).resolve().parents[1]


# -- helpers -------------------------------------------------------------------------------
def load_all(path: Path) -> ad.AnnData:
    """Every shard of a collection, concatenated in order, via anndata.read_zarr."""
    coll = open_collection(path)
    parts = [ad.read_zarr(coll.shard_path(i)) for i in range(len(coll.shards))]
    obs = pd.concat([p.obs for p in parts])
    for c in parts[0].obs.columns:
        if isinstance(parts[0].obs[c].dtype, pd.CategoricalDtype):
            cats = parts[0].obs[c].cat.categories
            obs[c] = pd.Categorical(obs[c].astype(object), categories=cats)
    return ad.AnnData(
        X=sp.vstack([p.X for p in parts]).tocsr(),
        obs=obs,
        var=parts[0].var,
        layers={k: sp.vstack([p.layers[k] for p in parts]).tocsr() for k in parts[0].layers},
        obsm={k: np.concatenate([p.obsm[k] for p in parts]) for k in parts[0].obsm},
    )


def dense(m: object) -> np.ndarray:
    return m.toarray() if sp.issparse(m) else np.asarray(m)


def aligned(a: ad.AnnData, var_names: pd.Index, layer: str | None = None) -> np.ndarray:
    """``a``'s X (or layer) as a dense matrix over ``var_names`` (absent genes are 0)."""
    m = dense(a.X if layer is None else a.layers[layer])
    out = np.zeros((a.n_obs, len(var_names)), dtype=m.dtype)
    idx = var_names.get_indexer(a.var_names)
    ok = idx >= 0
    out[:, idx[ok]] = m[:, ok]
    return out


def no_temp_left(parent: Path) -> None:
    leftovers = [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert leftovers == []


@pytest.fixture(scope="module")
def mixed_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[object], list[ad.AnnData]]:
    """3 inputs with overlapping gene sets: h5ad (CSR X), zarr (CSC X), AnnData (dense X).

    Returns the inputs as passed to the writer and the same data as in-memory AnnData.
    """
    d = tmp_path_factory.mktemp("mixed")
    paths = write_synthetic_h5ads(d, 3, [1000, 1500, 700], 300, overlapping_genes=True,
                                  layers=("counts",), obsm_pca=6, x="log1p", seed=5)
    a0 = ad.read_h5ad(paths[0])
    a1 = ad.read_h5ad(paths[1])
    # the zarr input has an extra category and stores X as CSC
    cats = [*list(a1.obs["cell_type"].cat.categories), "doublet"]
    ct = a1.obs["cell_type"].astype(pd.CategoricalDtype(cats))
    ct.iloc[:50] = "doublet"
    a1.obs["cell_type"] = ct
    a1.X = sp.csc_matrix(a1.X)
    with ad.settings.override(zarr_write_format=3), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anndata's notes on zarr v3 (sharding, metadata)
        a1.write_zarr(d / "part1.zarr")  # a zarr v3 input
    # the in-memory input: dense X, cell_type and batch as plain strings
    a2 = ad.read_h5ad(paths[2])
    a2.X = a2.X.toarray()
    a2.obs["cell_type"] = a2.obs["cell_type"].astype(str)
    a2.obs["batch"] = a2.obs["batch"].astype(str)
    return [paths[0], d / "part1.zarr", a2], [a0, a1, a2]


# -- content -------------------------------------------------------------------------------
@pytest.mark.parametrize("var_join", ["inner", "outer"])
def test_every_row_once_with_identical_values(
    mixed_inputs: tuple[list[object], list[ad.AnnData]], tmp_path: Path, var_join: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    inputs, refs = mixed_inputs
    caplog.set_level(logging.INFO, logger="annbatch_torch")
    coll = create_anndata_collection(inputs, tmp_path / "store", var_join=var_join,
                                     n_obs_per_shard=1024, progress=False)
    # genes: one order, first seen
    sets = [list(a.var_names) for a in refs]
    if var_join == "inner":
        want = [g for g in sets[0] if all(g in s for s in sets[1:])]
    else:
        want = list(dict.fromkeys(g for s in sets for g in s))
    assert list(coll.var_names) == want
    assert 0 < len(want) < 375
    assert (var_join == "outer") == (len(want) > 300)
    out = load_all(tmp_path / "store")
    assert list(out.var_names) == want
    # every input row exactly once
    names = np.concatenate([np.asarray(a.obs_names) for a in refs])
    assert out.n_obs == coll.n_obs == len(names) == 3200
    assert out.obs_names.is_unique
    assert set(out.obs_names) == set(names)
    # identical values after gene alignment
    var = pd.Index(want)
    ref_x = np.concatenate([aligned(a, var) for a in refs])
    ref_counts = np.concatenate([aligned(a, var, "counts") for a in refs])
    order = pd.Index(names).get_indexer(out.obs_names)
    np.testing.assert_array_equal(dense(out.X), ref_x[order])
    np.testing.assert_array_equal(dense(out.layers["counts"]), ref_counts[order])
    ref_pca = np.concatenate([a.obsm["X_pca"] for a in refs])
    np.testing.assert_array_equal(out.obsm["X_pca"], ref_pca[order])
    for col in ("cell_type", "batch", "n_counts", "n_genes", "is_doublet"):
        ref = np.concatenate([np.asarray(a.obs[col].astype(object)) for a in refs])
        assert list(out.obs[col].astype(object)) == list(ref[order]), col
    assert out.obs["n_genes"].dtype == np.int32
    assert out.obs["is_doublet"].dtype == bool
    # X and layers are CSR with sorted column indices; shards mix all inputs
    assert out.X.has_sorted_indices
    assert out.layers["counts"].has_sorted_indices
    for i in range(len(coll.shards)):
        shard_names = ad.read_zarr(coll.shard_path(i)).obs_names
        assert {n.split("_")[0] for n in shard_names} == {"part0", "part1", "part2"}
    # the strings of the in-memory input became categorical, with a logged note
    assert any("holds strings" in r.getMessage() for r in caplog.records)


def test_categories_unioned_and_codes_global(
    mixed_inputs: tuple[list[object], list[ad.AnnData]], tmp_path: Path
) -> None:
    inputs, refs = mixed_inputs
    coll = create_anndata_collection(inputs, tmp_path / "store", n_obs_per_shard=1000,
                                     progress=False)
    cats = coll.categories("cell_type")
    first = list(refs[0].obs["cell_type"].cat.categories)
    assert cats[: len(first)] == first
    assert "doublet" in cats
    assert set(cats) == set().union(*[set(a.obs["cell_type"].astype(str)) for a in refs])
    assert coll.categories("batch") == ["batch_0", "batch_1"]
    manifest = json.loads((tmp_path / "store" / MANIFEST_NAME).read_text())
    assert manifest["fields"]["obs/cell_type"]["categories"] == cats
    for i in range(len(coll.shards)):
        g = zarr.open_group(str(coll.shard_path(i)), mode="r")
        codes = np.asarray(g["obs/cell_type/codes"][...])
        assert str(codes.dtype) == coll.fields["obs/cell_type"].dtype
        stored = [str(c) for c in g["obs/cell_type/categories"][...]]
        assert stored == cats  # every shard stores the global categories: codes are global
        labels = ad.read_zarr(coll.shard_path(i)).obs["cell_type"].astype(str).to_numpy()
        np.testing.assert_array_equal(np.asarray(cats, dtype=object)[codes], labels)


def test_seeds(synthetic_h5ads: list[Path], tmp_path: Path) -> None:
    kw = {"n_obs_per_shard": 1000, "progress": False}
    a = create_anndata_collection(synthetic_h5ads, tmp_path / "a", seed=3, **kw)
    b = create_anndata_collection(synthetic_h5ads, tmp_path / "b", seed=3, **kw)
    c = create_anndata_collection(synthetic_h5ads, tmp_path / "c", seed=4, **kw)
    xa, xb, xc = (load_all(x.path) for x in (a, b, c))
    assert list(xa.obs_names) == list(xb.obs_names)
    np.testing.assert_array_equal(xa.X.data, xb.X.data)
    np.testing.assert_array_equal(xa.X.indices, xb.X.indices)
    assert list(xa.obs_names) != list(xc.obs_names)
    assert set(xa.obs_names) == set(xc.obs_names)
    # shuffle=False keeps input order
    d = create_anndata_collection(synthetic_h5ads, tmp_path / "d", shuffle=False, **kw)
    want = np.concatenate([ad.read_h5ad(p, backed="r").obs_names for p in synthetic_h5ads])
    assert list(load_all(d.path).obs_names) == list(want)
    m = read_manifest(tmp_path / "a")
    assert (m.seed, m.shuffle, m.var_join) == (3, True, "inner")
    assert read_manifest(tmp_path / "d").shuffle is False


def test_fixture_collection_is_a_valid_store(
    small_collection: object, synthetic_h5ads: list[Path]
) -> None:
    coll = small_collection
    assert coll.n_obs == 2700
    assert coll.n_vars == 200
    assert len(coll.shards) == 3
    assert set(coll.fields) == {"X", "layers/counts", "obsm/X_pca", "obs/cell_type",
                                "obs/batch", "obs/n_counts", "obs/n_genes", "obs/is_doublet"}
    m = coll.manifest
    assert m.all_chunks_written
    assert [i["path"] for i in m.inputs] == [str(p.resolve()) for p in synthetic_h5ads]
    for rec, p in zip(m.inputs, synthetic_h5ads):
        assert rec["size"] == p.stat().st_size
        assert rec["mtime"] == p.stat().st_mtime
        assert rec["n_obs"] == ad.read_h5ad(p, backed="r").n_obs
    shard = ad.read_zarr(coll.shard_path(0))
    assert shard.n_obs == 1024
    assert list(shard.var_names) == list(coll.var_names)
    assert isinstance(shard.X, sp.csr_matrix)
    assert shard.X.dtype == np.float32


def test_layers_obsm_selection_and_unavailable(tmp_path: Path) -> None:
    a = synthetic(300, 50, layers=("counts", "log1p"), obsm_pca=4, seed=1)
    b = synthetic(200, 50, layers=("counts",), obsm_pca=4, seed=2, obs_prefix="b_")
    coll = create_anndata_collection([a, b], tmp_path / "auto", progress=False)
    assert "layers/counts" in coll.fields
    assert "layers/log1p" not in coll.fields
    assert "layers/log1p" in coll.manifest.extra["unavailable"]
    inputs = [r["name"] for r in coll.manifest.inputs]
    assert inputs == ["<AnnData #0>", "<AnnData #1>"]
    assert all(r["path"] is None for r in coll.manifest.inputs)
    sel = create_anndata_collection([a, b], tmp_path / "sel", layers=[], obsm=[],
                                    obs_columns=["cell_type"], progress=False)
    assert set(sel.fields) == {"X", "obs/cell_type"}
    with pytest.raises(InputError, match=r"<AnnData #1>.*no layer 'log1p'"):
        create_anndata_collection([a, b], tmp_path / "bad", layers=["log1p"], progress=False)
    assert not (tmp_path / "bad").exists()


def test_obs_kinds_nullable_and_bool(tmp_path: Path) -> None:
    a = synthetic(100, 20, seed=1)
    b = synthetic(80, 20, seed=2, obs_prefix="b_")
    a.obs["score"] = pd.array([1, None] * 50, dtype="Int64")
    b.obs["score"] = np.arange(80, dtype=np.int16)
    a.obs["flag"] = True
    b.obs["flag"] = pd.array([True, False] * 40, dtype="boolean")
    coll = create_anndata_collection([a, b], tmp_path / "s", progress=False)
    assert coll.fields["obs/score"].kind == "numeric"
    assert coll.fields["obs/flag"].kind == "bool"
    out = load_all(tmp_path / "s")
    score = out.obs["score"].reindex(list(a.obs_names) + list(b.obs_names)).to_numpy()
    assert np.isnan(score[1])
    assert score[0] == 1
    assert score[100 + 7] == 7


def test_zarr_v2_uncompressed_and_small_memory(synthetic_h5ads: list[Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    coll = create_anndata_collection(synthetic_h5ads, tmp_path / "v2", zarr_format=2,
                                     compressor="none", progress=False)
    assert zarr.open_group(str(coll.shard_path(0)), mode="r").metadata.zarr_format == 2
    assert len(coll.shards) == 1  # default shard size from 1GB holds all 2,700 cells
    # 1 MB of working memory (what max_memory leaves once the process' RSS is subtracted):
    # small pass-1 blocks, a shard written in several small pass-2 blocks
    monkeypatch.setattr(_writer_budget, "working_memory", lambda max_memory, n_cells: 10**6)
    small = create_anndata_collection(synthetic_h5ads, tmp_path / "small", progress=False)
    per_block = small.manifest.extra["writer"]["n_obs_per_block"]
    assert per_block < 1_000_000 // 400
    assert per_block < max(small.shard_sizes)
    ref = load_all(coll.path)
    got = load_all(small.path)
    assert set(ref.obs_names) == set(got.obs_names)
    np.testing.assert_array_equal(dense(ref.X), dense(got[ref.obs_names].X))


def test_max_memory_below_the_baseline_is_refused(synthetic_h5ads: list[Path],
                                                  tmp_path: Path) -> None:
    """This process already uses more than 64 MB (numpy, torch, zarr): nothing is left."""
    out = tmp_path / "store"
    with pytest.raises(InputError, match=r"max_memory='64MB' is too small") as info:
        create_anndata_collection(synthetic_h5ads, out, max_memory="64MB", progress=False)
    msg = str(info.value)
    rss = _writer_budget.current_rss()
    assert rss is not None
    assert rss > 64 * 10**6
    assert "already uses" in msg
    assert "Pass at least max_memory='" in msg
    need = int(msg.split("at least max_memory='")[1].split("MB'")[0]) * 10**6
    assert need > rss + _writer_budget.MIN_WORK_MEMORY
    assert not out.exists()
    no_temp_left(tmp_path)


def test_budget_subtracts_the_baseline_rss(synthetic_h5ads: list[Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """Buffers are sized from max_memory minus the measured RSS, permutation and reserve."""
    n = sum(ad.read_h5ad(p, backed="r").n_obs for p in synthetic_h5ads)
    seen: list[int] = []
    sized: list[int] = []  # rows per pass-2 block the budget allows
    real = _writer_budget.block_size

    def spy(sources: object, schema: object, work: int, shuffle: bool, shard_obs: int,
            opts: dict[str, object]) -> int:
        seen.append(work)
        sized.append(real(sources, schema, work, shuffle, shard_obs, opts))  # type: ignore[arg-type]
        return sized[-1]

    monkeypatch.setattr(_writer_budget, "block_size", spy)
    for i, rss in enumerate((0, 80 * 10**6)):
        monkeypatch.setattr(_writer_budget, "current_rss", lambda rss=rss: rss)
        coll = create_anndata_collection(synthetic_h5ads, tmp_path / f"s{i}",
                                         max_memory="200MB", progress=False)
        assert seen[-1] == 200 * 10**6 - rss - 4 * n - _writer_budget.RESERVE
        assert coll.manifest.extra["writer"]["n_obs_per_block"] == sized[-1]
    assert sized[1] <= sized[0]
    # a baseline above the budget leaves nothing: refused, naming the measured RSS
    monkeypatch.setattr(_writer_budget, "current_rss", lambda: 190 * 10**6)
    with pytest.raises(InputError, match=r"already uses 190 MB.*max_memory='303MB'"):
        create_anndata_collection(synthetic_h5ads, tmp_path / "s2", max_memory="200MB",
                                  progress=False)
    # no way to measure RSS (no /proc, no psutil): the baseline counts as zero, with a warning
    monkeypatch.setattr(_writer_budget, "current_rss", lambda: None)
    caplog.set_level(logging.WARNING, logger="annbatch_torch")
    create_anndata_collection(synthetic_h5ads, tmp_path / "s3", max_memory="200MB",
                              progress=False)
    assert seen[-1] == 200 * 10**6 - 4 * n - _writer_budget.RESERVE
    assert "Cannot measure this process' memory" in caplog.text
    # the default (max_memory=None) never refuses, whatever the process already uses
    monkeypatch.setattr(_writer_budget, "current_rss", lambda: 50 * 10**9)
    create_anndata_collection(synthetic_h5ads, tmp_path / "s4", progress=False)
    assert seen[-1] == _writer_budget.DEFAULT_WORK_MEMORY


def test_progress_bar_and_no_print(synthetic_h5ads: list[Path], tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    create_anndata_collection(synthetic_h5ads[:1], tmp_path / "p", progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "cells/s" in captured.err
    create_anndata_collection(synthetic_h5ads[:1], tmp_path / "q", progress=False)
    assert capsys.readouterr() == ("", "")


def test_parse_memory() -> None:
    assert parse_memory("1GB") == 10**9
    assert parse_memory("512MiB") == 512 * 2**20
    assert parse_memory(" 1.5 g ") == 1_500_000_000
    assert parse_memory(4096) == 4096
    for bad in ("lots", "-1GB", 0, "1XB"):
        with pytest.raises(InputError, match="max_memory"):
            parse_memory(bad)


# -- bad input: clear error, nothing written ----------------------------------------------
def _assert_refused(inputs: object, out: Path, match: str, **kw: object) -> None:
    with pytest.raises(InputError, match=match):
        create_anndata_collection(inputs, out, progress=False, **kw)
    assert not out.exists()
    no_temp_left(out.parent)


def test_bad_inputs(synthetic_h5ads: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    good = synthetic_h5ads[0]
    missing = tmp_path / "missing.h5ad"
    _assert_refused([good, missing], out, f"{missing}: no such file")
    text = tmp_path / "notes.txt"
    text.write_text("not anndata")
    _assert_refused([good, text], out, f"{text}: is neither an HDF5")
    plain = tmp_path / "plain.h5"
    with h5py.File(plain, "w") as f:
        f["data"] = np.arange(3)
    _assert_refused([plain], out, rf"{plain}: not an AnnData store \(no \['X', 'obs', 'var'\]")
    folder = tmp_path / "folder"
    folder.mkdir()
    _assert_refused([folder], out, f"{folder}: is a folder but not a zarr store")
    _assert_refused([good, 42], out, "input #1: got a int")
    _assert_refused([], out, "adata_paths is empty")
    _assert_refused([good], out, "var_join='left' is unknown", var_join="left")
    _assert_refused([good], out,
                    r"zarr_chunk_elems must be an integer >= 1 \(default \d+\), got 0",
                    zarr_chunk_elems=0)
    for seed in (-1, 1.5):
        _assert_refused([good], out, rf"seed must be an integer >= 0 \(or None.*got {seed}",
                        seed=seed)
    _assert_refused([good], out, "n_obs_per_shard=True must be a positive integer",
                    n_obs_per_shard=True)


def test_duplicate_var_names(tmp_path: Path) -> None:
    a = synthetic(50, 10, seed=1)
    a.var_names = ["g0", "g0"] + [f"g{i}" for i in range(2, 10)]
    path = tmp_path / "dup.h5ad"
    a.write_h5ad(path)
    _assert_refused([path], tmp_path / "out", rf"{path}: var_names are not unique.*'g0'")
    _assert_refused([a], tmp_path / "out", r"<AnnData #0>: var_names.*var_names_make_unique")


def test_inner_join_without_genes(tmp_path: Path) -> None:
    a = synthetic(50, 10, seed=1, var_prefix="ENSG")
    b = synthetic(50, 10, seed=2, var_prefix="sym", obs_prefix="b_")
    path = tmp_path / "b.h5ad"
    b.write_h5ad(path)
    _assert_refused([a, path], tmp_path / "out",
                    rf"<AnnData #0> and {path}: var_join='inner' leaves no genes.*var_names=")
    # an outer join of inputs sharing no gene would be a block matrix: refused, unless meant
    with pytest.raises(InputError, match="share no genes"):
        create_anndata_collection([a, path], tmp_path / "outer", var_join="outer",
                                  progress=False)
    coll = create_anndata_collection([a, path], tmp_path / "outer",
                                     var_names=[*a.var_names, *b.var_names], progress=False)
    assert coll.n_vars == 20


def test_obs_kind_conflict(tmp_path: Path) -> None:
    a = synthetic(50, 10, seed=1)
    b = synthetic(50, 10, seed=2, obs_prefix="b_")
    b.obs["cell_type"] = np.linspace(0, 1, 50)
    path = tmp_path / "b.h5ad"
    b.write_h5ad(path)
    _assert_refused([a, path], tmp_path / "out",
                    rf"<AnnData #0>: obs column 'cell_type' is categorical there but numeric "
                    rf"\(float64\) in {path}.*obs_columns",
                    obs_columns=["cell_type"])  # named: unasked fields are left out (A4)
    coll = create_anndata_collection([a, path], tmp_path / "ok", obs_columns=["batch"],
                                     progress=False)
    assert "obs/cell_type" not in coll.fields


def test_obsm_width_conflict(tmp_path: Path) -> None:
    a = synthetic(50, 10, seed=1, obsm_pca=3)
    b = synthetic(50, 10, seed=2, obsm_pca=4, obs_prefix="b_")
    _assert_refused([a, b], tmp_path / "out", "obsm/X_pca has .* columns across inputs",
                    obsm=["X_pca"])  # named: unasked fields are now left out with a warning (A4)


def test_existing_output(synthetic_h5ads: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "store"
    first = create_anndata_collection(synthetic_h5ads[:1], out, seed=0, progress=False)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(InputError, match=f"{out}: the output already exists.*overwrite=True"):
        create_anndata_collection(synthetic_h5ads[:1], out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == before
    # overwrite: replaced, old one gone, nothing left beside it
    again = create_anndata_collection(synthetic_h5ads[1:], out, seed=1, overwrite=True,
                                      progress=False)
    assert again.n_obs == 1500 != first.n_obs
    assert read_manifest(out).seed == 1
    no_temp_left(tmp_path)
    # a folder that is not a collection is never deleted, nor a file
    other = tmp_path / "mine"
    other.mkdir()
    (other / "precious.txt").write_text("keep")
    with pytest.raises(InputError, match="is not an annbatch_torch collection"):
        create_anndata_collection(synthetic_h5ads[:1], other, overwrite=True, progress=False)
    assert (other / "precious.txt").read_text() == "keep"
    with pytest.raises(InputError, match="overlaps the input"):
        create_anndata_collection(synthetic_h5ads[:1], synthetic_h5ads[0], overwrite=True,
                                  progress=False)
    # through a symbolic link to the input's folder too (it wrote inside a zarr input)
    zarr_in = tmp_path / "data" / "in.zarr"
    zarr_in.parent.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ad.read_h5ad(synthetic_h5ads[2]).write_zarr(zarr_in)
    (tmp_path / "link").symlink_to(tmp_path / "data")
    with pytest.raises(InputError, match="overlaps the input"):
        create_anndata_collection([zarr_in], tmp_path / "link" / "in.zarr" / "coll",
                                  progress=False)
    assert not (zarr_in / "coll").exists()


# -- atomicity -----------------------------------------------------------------------------
def test_manifest_written_last_and_no_temp_folder(synthetic_h5ads: list[Path],
                                                  tmp_path: Path) -> None:
    out = tmp_path / "store"
    create_anndata_collection(synthetic_h5ads, out, n_obs_per_shard=1000, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    names = sorted(p.name for p in out.iterdir())
    assert names == [MANIFEST_NAME, "shard_00000.zarr", "shard_00001.zarr", "shard_00002.zarr",
                     "var_names.json"]
    manifest_mtime = (out / MANIFEST_NAME).stat().st_mtime_ns
    for root, _, files in os.walk(out):
        for f in files:
            assert os.stat(os.path.join(root, f)).st_mtime_ns <= manifest_mtime


def test_failure_leaves_nothing_and_keeps_old_store(synthetic_h5ads: list[Path],
                                                    tmp_path: Path) -> None:
    def reject_second(label: str, field: str, block: object) -> None:
        if label.endswith("part1.h5ad"):
            raise InputError(f"{label}: {field} has negative counts")

    out = tmp_path / "store"
    with pytest.raises(InputError, match=r"part1\.h5ad: X has negative counts"):
        create_anndata_collection(synthetic_h5ads, out, value_check=reject_second,
                                  progress=False)
    assert list(tmp_path.iterdir()) == []
    create_anndata_collection(synthetic_h5ads[:1], out, seed=5, progress=False)
    with pytest.raises(InputError):
        create_anndata_collection(synthetic_h5ads, out, value_check=reject_second,
                                  overwrite=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    kept = open_collection(out)
    assert kept.manifest.seed == 5
    assert kept.n_obs == 1200


def test_an_input_deleted_during_the_write_is_named_and_nothing_is_written(
        synthetic_h5ads: list[Path], tmp_path: Path) -> None:
    """An input deleted while the serial writer runs (after its rows were read): an
    InputError naming it, as the parallel writer's, and no output nor temporary folder."""
    inputs = [shutil.copy(p, tmp_path / p.name) for p in synthetic_h5ads]
    victim = Path(inputs[1])

    def delete_part1(label: str, field: str, block: object) -> None:
        if victim.exists():
            victim.unlink()

    out = tmp_path / "out" / "store"
    out.parent.mkdir()
    with pytest.raises(InputError, match=rf"{re.escape(str(victim))}: vanished while the "
                       r"collection was written \(deleted or moved\).*nothing was written"):
        create_anndata_collection([Path(p) for p in inputs], out, value_check=delete_part1,
                                  progress=False)
    assert list(out.parent.iterdir()) == []
    # appended: refused before any new shard is moved into the collection
    shutil.copy(synthetic_h5ads[1], victim)
    create_anndata_collection([Path(inputs[0])], out, progress=False)
    before = sorted(os.listdir(out))
    with pytest.raises(InputError, match=rf"{re.escape(str(victim))}: vanished while"):
        append_to_collection(out, [victim], value_check=delete_part1, progress=False)
    assert sorted(os.listdir(out)) == before
    assert open_collection(out).n_obs == 1200


def test_overwrite_waits_for_a_writer_holding_the_collection(synthetic_h5ads: list[Path],
                                                             tmp_path: Path) -> None:
    """A collection being appended to (another process holds ``<store>.lock``) is not
    swapped away under it: the overwrite puts its collection in place only after the lock
    is let go. And prepare_collection, which holds the lock while it writes through
    create_anndata_collection, takes it again without waiting on itself."""
    from annbatch_torch.write.prepare import prepare_collection

    out = tmp_path / "store"
    create_anndata_collection(synthetic_h5ads[:1], out, seed=1, progress=False)
    released = tmp_path / "released"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from filelock import FileLock
        with FileLock({str(tmp_path / 'store.lock')!r}):
            print("held", flush=True)
            time.sleep(3)
            open({str(released)!r}, "w").write(repr(time.time()))
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        create_anndata_collection(synthetic_h5ads, out, seed=2, overwrite=True,
                                  progress=False)
        done = time.time()
    finally:
        holder.wait(30)
    # the collection was put in place after the holder let go (its write takes ~1 s of the
    # 3 s the lock is held)
    assert done >= float(released.read_text()), (done, released.read_text())
    assert open_collection(out).manifest.seed == 2
    prepare_collection(synthetic_h5ads[:1], out, seed=3, progress=False)  # no self-wait
    assert open_collection(out).manifest.seed == 3


def test_non_finite_refused_negative_allowed(tmp_path: Path) -> None:
    a = synthetic(60, 20, seed=1, layers=("counts",))
    a.layers["counts"] = a.layers["counts"].copy()
    a.layers["counts"].data[0] = np.nan
    row = int(np.searchsorted(a.layers["counts"].indptr, 0, side="right") - 1)
    _assert_refused([a], tmp_path / "out",
                    rf"<AnnData #0>: field 'layers/counts' .*non-finite.* at row {row}",
                    layers=["counts"])  # named: unasked fields are now left out with a warning (A4)
    b = synthetic(60, 20, seed=1)
    b.X.data *= -1
    coll = create_anndata_collection([b], tmp_path / "neg", progress=False)
    assert load_all(coll.path).X.max() <= 0 < -load_all(coll.path).X.min()


def test_stale_temporaries_of_dead_writers_are_removed(
    synthetic_h5ads: list[Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from annbatch_torch.write.publish import _HOST

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "store"
    stale = tmp_path / f"store.tmp-{_HOST}-{dead.pid}-0a1b2c3d"
    stale_old = tmp_path / f"store.old-{_HOST}-{dead.pid}-0a1b2c3e"
    running = tmp_path / f"store.tmp-{_HOST}-{os.getppid()}-0a1b2c3f"
    foreign = tmp_path / f"store.tmp-othernode-{dead.pid}-0a1b2c40"
    for p in (stale, stale_old, running, foreign):
        (p / ".buckets").mkdir(parents=True)
    caplog.set_level(logging.INFO, logger="annbatch_torch")
    create_anndata_collection(synthetic_h5ads[:1], out, progress=False)
    assert not stale.exists()
    # the output was missing: a dead overwrite's backup may be the only copy of the old
    # collection, so it is kept (and named in a warning)
    assert stale_old.exists()
    assert "holds the previous collection" in caplog.text
    assert running.exists()
    assert foreign.exists()
    assert "may still run" in caplog.text
    assert "interrupted write" in caplog.text


# -- bounded memory ------------------------------------------------------------------------
_CHILD = textwrap.dedent("""
    import json, logging, sys
    import anndata  # what it imports depends on what is installed (dask, numba, xarray...)
    from annbatch_torch.write.writer import create_anndata_collection

    work = []  # the writer's working memory, from its log record (MB)

    class Grab(logging.Handler):
        def emit(self, record):
            if "for the writer's buffers" in record.msg:
                work.append(record.args[-1] * 1e6)

    log = logging.getLogger("annbatch_torch")
    log.setLevel(logging.INFO)
    log.addHandler(Grab())

    def status(key):  # VmHWM: peak RSS of this process image (see the test's docstring)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        return None

    paths, out, extra = json.loads(sys.argv[1])
    # the budget: what this process uses now (interpreter, numpy, torch, ...) plus `extra`;
    # the writer must fit its imports, thread pool and buffers in there
    base = status("VmRSS")
    mem = base + extra
    import resource
    ru_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    coll = create_anndata_collection(paths, out, max_memory=mem, progress=False)
    ru_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"base": base, "mem": mem, "work": work[0], "hwm": status("VmHWM"),
                      "ru_before": ru_before, "ru_after": ru_after, "n_obs": coll.n_obs,
                      "blocks": sum(-(-n // coll.manifest.extra["writer"]["n_obs_per_block"])
                                    for n in coll.shard_sizes)}))
""")


# ru_maxrss of a child starts at its parent's peak (Linux copies it through fork and exec),
# and pytest's process is large: a small intermediate process resets it for the grandchild
_LAUNCH = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_peak_memory_bounded(tmp_path: Path) -> None:
    """Inputs larger than the working memory: the process' peak RSS stays under max_memory.

    The writer runs in a fresh process with ``max_memory`` set 150 MB above the RSS it has
    after importing anndata and annbatch_torch's writer (anndata imports what is installed
    beside it: dask, and with the test extra's scvi-tools also numba, sparse and xarray,
    ~150 MB more); the writer's other imports, zarr's thread pool, the open inputs and its
    buffers must fit in those 150 MB (about 90 MB of working memory once they and the
    48 MB reserve are counted). The peak of the whole
    process (``getrusage().ru_maxrss``, cross-checked with ``VmHWM``) must stay under it.
    """
    extra = 150_000_000
    n_obs = 60_000
    paths = write_synthetic_h5ads(tmp_path / "in", 2, n_obs // 2, 2000, layers=("counts",),
                                  seed=2)
    size = sum(p.stat().st_size for p in paths)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = json.dumps([[str(p) for p in paths], str(tmp_path / "out"), extra])
    r = subprocess.run([sys.executable, "-c", _LAUNCH, sys.executable, "-c", _CHILD, args],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    print(res)
    assert res["n_obs"] == n_obs
    assert res["blocks"] > 2  # pass 2 wrote the cells in several blocks
    assert 64e6 <= res["work"] < size / 1.5  # the inputs do not fit in the working memory
    assert res["ru_before"] < res["base"] + 50e6  # not inherited from pytest's process
    for peak in ("ru_after", "hwm"):
        assert res[peak] <= res["mem"], (
            f"{peak}: peak RSS {res[peak] / 1e6:.0f} MB above max_memory {res['mem'] / 1e6:.0f} "
            f"MB (baseline {res['base'] / 1e6:.0f} MB)")


# -- input shapes and names found by review --------------------------------------------------
def _by_name(out: ad.AnnData, names: list[str]) -> np.ndarray:
    return pd.Index(names).get_indexer(out.obs_names)


def test_dtypes_promote_across_inputs_and_float16_and_one_column_obsm(tmp_path: Path) -> None:
    """float32 + float64 inputs (numpy 2 refused the cast), dense float16 X (scipy has no
    float16) and an n x 1 obsm entry are written with every value equal."""
    rng = np.random.default_rng(3)
    x = sp.random(30, 6, density=0.5, format="csr", random_state=rng) * 10
    a = ad.AnnData(x.astype(np.float32), obs=pd.DataFrame(index=[f"a{i}" for i in range(30)]))
    b = ad.AnnData(x.astype(np.float64), obs=pd.DataFrame(index=[f"b{i}" for i in range(30)]))
    for m in (a, b):
        m.var_names = [f"g{k}" for k in range(6)]
        m.obsm["score"] = rng.random((30, 1)).astype(np.float32)
    coll = create_anndata_collection([a, b], tmp_path / "mixed", progress=False)
    assert coll.fields["X"].dtype == "float64"
    assert tuple(coll.fields["obsm/score"].shape) == (None, 1)
    out = load_all(tmp_path / "mixed")
    order = _by_name(out, [*a.obs_names, *b.obs_names])
    np.testing.assert_array_equal(dense(out.X), np.concatenate([dense(a.X), dense(b.X)])[order])
    ref = np.concatenate([a.obsm["score"], b.obsm["score"]])
    np.testing.assert_array_equal(out.obsm["score"], ref[order])
    half = ad.AnnData(x.toarray().astype(np.float16),
                      obs=pd.DataFrame(index=[f"h{i}" for i in range(30)]))
    coll = create_anndata_collection([half], tmp_path / "half", progress=False)
    assert coll.fields["X"].dtype == "float32"
    out = load_all(tmp_path / "half")
    np.testing.assert_array_equal(dense(out.X), half.X.astype(np.float32)[_by_name(
        out, list(half.obs_names))])


def test_a_foreign_folder_with_a_manifest_json_is_never_replaced(
        synthetic_h5ads: list[Path], tmp_path: Path) -> None:
    from annbatch_torch import CollectionError, prepare_collection

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / MANIFEST_NAME).write_text(json.dumps({"name": "my experiment"}))
    (mine / "results.csv").write_text("keep")
    with pytest.raises(InputError, match="is not an annbatch_torch collection"):
        create_anndata_collection(synthetic_h5ads[:1], mine, overwrite=True, progress=False)
    with pytest.raises(CollectionError, match="is not an annbatch_torch collection"):
        prepare_collection(synthetic_h5ads[:1], mine, progress=False)
    assert (mine / "results.csv").read_text() == "keep"


def test_field_names_that_cannot_be_stored(tmp_path: Path) -> None:
    """Names that would be paths (or not strings) are left out with the reason by default,
    refused with the fix when asked for, and the store always opens afterwards."""
    a = synthetic(40, 8, seed=1)
    a.obs["CD4/CD8"] = 1.0
    a.obs["a\\b"] = 2.0
    a.obs[7] = 3.0
    a.obs["fine"] = 4.0
    coll = create_anndata_collection([a], tmp_path / "s", progress=False)
    unavailable = coll.manifest.extra["unavailable"]
    assert "obs/fine" in coll.fields
    for name in ("obs/CD4/CD8", "obs/a\\b", "obs/7"):
        assert name not in coll.fields
        assert "its name cannot be stored" in unavailable[name]
    assert open_collection(tmp_path / "s").n_obs == 40
    with pytest.raises(InputError, match=r"obs column 'CD4/CD8' cannot be stored: .*'/'.*"
                       r"Fix: rename it"):
        create_anndata_collection([a], tmp_path / "t", obs_columns=["CD4/CD8"],
                                  progress=False)
    assert not (tmp_path / "t").exists()


def test_categories_of_different_types_across_inputs_are_refused(tmp_path: Path) -> None:
    a = synthetic(20, 5, seed=1)
    b = synthetic(20, 5, seed=2, obs_prefix="b_")
    a.obs["batch"] = pd.Categorical([1, 2] * 10)
    b.obs["batch"] = pd.Categorical(["1", "2"] * 10)
    with pytest.raises(InputError, match=r"obs column 'batch' has numeric categories there "
                       r"but string ones in <AnnData #1>.*astype\(str\)"):
        create_anndata_collection([a, b], tmp_path / "s", obs_columns=["batch"],
                                  progress=False)  # named: unasked ones are left out (A4)
    b.obs["batch"] = pd.Categorical([3, 1] * 10)  # one type: unioned as usual
    coll = create_anndata_collection([a, b], tmp_path / "s", progress=False)
    assert list(coll.fields["obs/batch"].categories) == [1, 2, 3]


def test_a_csc_file_too_big_to_load_names_the_writer_fixes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from annbatch_torch.store.inputs import view as inputs_mod

    a = synthetic(60, 12, seed=4)
    a.X = sp.csc_matrix(a.X)
    p = tmp_path / "csc.h5ad"
    a.write_h5ad(p)
    real = inputs_mod.InputSource.matrix_reader

    def tiny_limit(self: object, key: str, csc_limit: int) -> object:
        return real(self, key, 100)  # as if max_memory left room for 100 bytes of CSC

    monkeypatch.setattr(inputs_mod.InputSource, "matrix_reader", tiny_limit)
    with pytest.raises(InputError, match=r"csc\.h5ad: field 'X' is stored as CSC .*tocsr\(\).*"
                       r"or raise max_memory: .*about 4x its size") as e:
        create_anndata_collection([p], tmp_path / "out", progress=False)
    assert "create_anndata_collection" not in str(e.value)  # not the call that failed
    monkeypatch.undo()
    coll = create_anndata_collection([p], tmp_path / "out", progress=False)
    assert coll.n_obs == 60


def test_overwriting_through_a_symlink_leaves_no_link_behind(
        synthetic_h5ads: list[Path], tmp_path: Path) -> None:
    target = tmp_path / "real"
    create_anndata_collection(synthetic_h5ads[:1], target, progress=False)
    link = tmp_path / "link"
    link.symlink_to(target)
    coll = create_anndata_collection(synthetic_h5ads[1:2], link, overwrite=True, seed=2,
                                     progress=False)
    assert coll.n_obs == 900
    assert link.is_dir()
    assert not link.is_symlink()
    assert open_collection(target).n_obs == 1200  # what the link pointed to is untouched
    # (link.lock: the writers' lock, taken to put the new collection in place)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "link.lock", "real"]


def test_ordered_categories_in_different_orders_are_stored_unordered_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a = synthetic(20, 5, seed=1)
    b = synthetic(20, 5, seed=2, obs_prefix="b_")
    a.obs["grade"] = pd.Categorical(["lo", "hi"] * 10, categories=["lo", "hi"], ordered=True)
    b.obs["grade"] = pd.Categorical(["lo", "hi"] * 10, categories=["hi", "lo"], ordered=True)
    caplog.set_level(logging.WARNING, logger="annbatch_torch")
    coll = create_anndata_collection([a, b], tmp_path / "s", progress=False)
    assert coll.fields["obs/grade"].ordered is False
    assert list(coll.fields["obs/grade"].categories) == ["lo", "hi"]
    assert any("ordered categorical whose category order differs" in r.getMessage()
               for r in caplog.records)
    b.obs["grade"] = a.obs["grade"].to_numpy()
    b.obs["grade"] = pd.Categorical(b.obs["grade"], categories=["lo", "hi"], ordered=True)
    same = create_anndata_collection([a, b], tmp_path / "t", progress=False)
    assert same.fields["obs/grade"].ordered is True


def test_every_shard_file_reaches_the_disk_before_the_manifest(
        synthetic_h5ads: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A power loss after the manifest's rename must not leave a valid-looking manifest
    over shard files still in the page cache: every file and folder of the collection is
    fsynced before manifest.json is written, and the folder it is renamed into after."""
    from annbatch_torch.write.writer import create_anndata_collection

    synced: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    out = tmp_path / "store"
    create_anndata_collection(synthetic_h5ads, out, seed=0, n_obs_per_shard=1024,
                              progress=False)
    manifest_at = next(i for i, p in enumerate(synced) if p.endswith(MANIFEST_NAME + ".tmp"))
    tmp_root = Path(synced[manifest_at]).parent
    before = {str(Path(p).relative_to(tmp_root)) for p in synced[:manifest_at]
              if Path(p).is_relative_to(tmp_root)}
    files = {str(p.relative_to(out)) for p in out.rglob("*")
             if p.name not in (MANIFEST_NAME, "var_names.json")}
    assert files, "the collection holds no files?"
    assert files <= before, sorted(files - before)[:5]
    assert str(tmp_path) in synced[manifest_at + 1:]  # the parent, after the rename


@given(lens=st.lists(st.integers(0, 400), min_size=0, max_size=40), seed=st.integers(0, 2**16))
@settings(max_examples=150, deadline=None)
def test_gather_rows_equals_scipy_row_indexing(lens: list[int], seed: int) -> None:
    """Both gathers (slice per row for long rows, an element index for short ones) give the
    rows of a CSR piece in the order asked, as scipy's row indexing does."""
    from annbatch_torch.write.shardstore import gather_rows

    rng = np.random.default_rng(seed)
    n = len(lens)
    ln = np.asarray(lens, dtype=np.int32)
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(ln, out=starts[1:])
    idx = rng.integers(0, 1000, int(starts[-1])).astype(np.int32)
    data = rng.random(int(starts[-1]), dtype=np.float32)
    m = sp.csr_matrix((data, idx, starts), shape=(n, 1000))
    rows = rng.permutation(n)[: rng.integers(0, n + 1)] if n else np.zeros(0, np.int64)
    got_len, got_idx, got_data = gather_rows(ln, starts, idx, data, rows)
    want = m[rows]
    np.testing.assert_array_equal(got_len, np.diff(want.indptr))
    np.testing.assert_array_equal(got_idx, want.indices)
    np.testing.assert_array_equal(got_data, want.data)


def test_long_rows_shuffled_equal_the_source(tmp_path: Path) -> None:
    """Rows of several hundred non-zeros land whole, each under its own name: two inputs put
    two sorted frames in every bucket, which pass 2 merges (gathered slice by slice)."""
    rng = np.random.default_rng(5)
    x = sp.random(700, 900, density=0.4, format="csr", dtype=np.float32, random_state=rng)
    a = ad.AnnData(X=x, obs=pd.DataFrame(index=[f"c{i}" for i in range(700)]),
                   var=pd.DataFrame(index=[f"g{j}" for j in range(900)]))
    create_anndata_collection([a[:350].copy(), a[350:].copy()], tmp_path / "c", seed=3,
                              n_obs_per_shard=256, progress=False)
    out = load_all(tmp_path / "c")
    assert sorted(out.obs_names) == sorted(a.obs_names)
    assert list(out.obs_names) != list(a.obs_names)
    np.testing.assert_array_equal(dense(out.X), dense(a[out.obs_names].X))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
@pytest.mark.parametrize("scheduler", [None, "threads"])
def test_each_shard_is_sent_to_the_disk_as_soon_as_it_is_written(
        synthetic_h5ads: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        scheduler: str | None) -> None:
    """The writer starts the write-out of each shard's files when the shard is done (the
    fsync before the manifest then finds them on the disk, not all in the page cache)."""
    from annbatch_torch.write import publish
    from annbatch_torch.write.writer import create_anndata_collection

    if scheduler is not None:
        pytest.importorskip("distributed")
    real = publish._SYNC_FILE_RANGE
    assert real is not None  # found in libc on Linux
    started: list[tuple[str, int]] = []

    def recording(fd: int, offset: int, nbytes: int, flags: int) -> int:
        started.append((os.readlink(f"/proc/self/fd/{fd}"), flags))
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(publish, "_SYNC_FILE_RANGE", recording)
    out = tmp_path / "store"
    kw = {} if scheduler is None else {"scheduler": scheduler, "n_workers": 2}
    coll = create_anndata_collection(synthetic_h5ads, out, seed=0, n_obs_per_shard=1024,
                                     progress=False, **kw)
    assert {flags for _, flags in started} == {2}  # SYNC_FILE_RANGE_WRITE: no waiting
    sent = set()  # (shard, path within it) of each file started (part folders renamed)
    for path, _ in started:
        parts = Path(path).parts
        at = next(i for i, p in enumerate(parts) if p.startswith("shard_"))
        sent.add((parts[at].split(".part-")[0], *parts[at + 1:]))
    for s in coll.manifest.shards:
        files = {p.relative_to(out / s.path).parts for p in (out / s.path).rglob("*")
                 if p.is_file()}
        assert files, s.path
        missing = [f for f in files if (s.path, *f) not in sent]
        assert not missing, (s.path, missing[:3])
