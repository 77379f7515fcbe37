"""Damage met by the metadata reads of a collection (issue 29 item 12e).

``obs_names_at``, ``obs_at``, ``category_counts`` and ``var`` read the shards' ``obs`` and
``var`` groups without the matrices; they must refuse what field reads refuse (a truncated
``zarr.json``, a deleted chunk file, a deleted member array) with an error naming the shard,
the element and the fix, never answer with empty names or a bare ``JSONDecodeError``.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from annbatch_torch import AnnBatchDataset
from annbatch_torch.errors import CollectionError, InputError, ReadError
from annbatch_torch.store.collection import Collection, open_collection
from annbatch_torch.write.writer import create_anndata_collection

SHARD = 1  # the shard damaged; its rows start at 1024 in small_collection
ROW = 1024 + 5  # a row of it
FIX = r"rewrite it with create_anndata_collection\(\.\.\., overwrite=True\)"


@pytest.fixture
def copy(small_collection: Collection, tmp_path: Path) -> Path:
    """A private copy of the shared collection, to damage."""
    out = tmp_path / "store"
    shutil.copytree(small_collection.path, out)
    return out


def _shard(coll_path: Path, shard: int = SHARD) -> Path:
    return coll_path / open_collection(coll_path).shards[shard].path


def _names(coll: Collection, element: str, shard: int = SHARD) -> str:
    """A pattern: the message names the shard, then the element."""
    return re.escape(coll.shard_name(shard)) + r".*" + re.escape(repr(element))


def _truncate(path: Path) -> None:
    path.write_text(path.read_text()[:40])


# -- a truncated zarr.json --------------------------------------------------------------
@pytest.mark.parametrize(("meta", "element", "call"), [
    ("obs/cell_type/zarr.json", "obs/cell_type", "obs_at"),
    ("obs/cell_type/zarr.json", "obs/cell_type", "category_counts"),
    ("obs/cell_type/codes/zarr.json", "obs/cell_type/codes", "obs_at"),
    ("obs/cell_type/codes/zarr.json", "obs/cell_type/codes", "category_counts"),
    ("obs/cell_type/categories/zarr.json", "obs/cell_type/categories", "category_counts"),
    ("obs/n_counts/zarr.json", "obs/n_counts", "obs_at"),
    ("obs/_index/zarr.json", "obs/_index", "obs_names_at"),
    ("obs/zarr.json", "obs", "obs_names_at"),
])
def test_truncated_zarr_json_names_the_shard_and_the_element(
        copy: Path, meta: str, element: str, call: str) -> None:
    _truncate(_shard(copy) / meta)
    coll = open_collection(copy)
    read = {"obs_at": lambda: coll.obs_at([ROW], [element.split("/")[1]]),
            "category_counts": lambda: coll.category_counts("cell_type"),
            "obs_names_at": lambda: coll.obs_names_at([ROW])}[call]
    with pytest.raises(CollectionError) as info:
        read()
    msg = str(info.value)
    assert re.search(_names(coll, element), msg), msg
    assert f"{element}/zarr.json" in msg
    assert "not valid JSON" in msg
    assert "truncated or corrupted" in msg
    assert re.search(FIX, msg), msg
    assert isinstance(info.value.__cause__, json.JSONDecodeError)


def test_truncated_zarr_json_of_a_field_fails_a_batch_read_likewise(copy: Path) -> None:
    """The reader meets the same error (as a ReadError naming field and rows)."""
    _truncate(_shard(copy) / "obsm/X_pca/zarr.json")
    coll = open_collection(copy)
    ds = AnnBatchDataset(coll, batch_size=256, chunk_size=64, preload_nchunks=4,
                         selector={"pca": "obsm/X_pca"}, shuffle=False)
    with pytest.raises(ReadError, match=_names(coll, "obsm/X_pca") + ".*not valid JSON") as info:
        for _ in ds:
            pass
    assert str(info.value).count("create_anndata_collection") == 1  # one fix, not two


# -- deleted chunk files ----------------------------------------------------------------
def test_deleted_obs_index_chunk_is_refused_not_read_as_empty_names(copy: Path) -> None:
    (_shard(copy) / "obs/_index/c/0").unlink()
    coll = open_collection(copy)
    pattern = _names(coll, "obs/_index") + r".*0 of its 1 chunk files.*" + FIX
    with pytest.raises(CollectionError, match=pattern):
        coll.obs_names_at([ROW])
    with pytest.raises(CollectionError, match=pattern):
        coll.obs_at([ROW], ["n_counts"])  # indexed by the names
    assert coll.obs_names_at([5])[0] != ""  # the other shards are intact


def test_deleted_codes_chunk_is_refused(copy: Path) -> None:
    (_shard(copy) / "obs/cell_type/codes/c/0").unlink()
    coll = open_collection(copy)
    pattern = _names(coll, "obs/cell_type/codes") + r".*0 of its 1 chunk files.*" + FIX
    with pytest.raises(CollectionError, match=pattern):
        coll.obs_at([ROW], ["cell_type"])
    with pytest.raises(CollectionError, match=pattern):
        coll.category_counts("cell_type")


def test_deleted_categories_array_is_refused(copy: Path) -> None:
    shutil.rmtree(_shard(copy) / "obs/cell_type/categories")
    coll = open_collection(copy)
    pattern = (_names(coll, "obs/cell_type") + r".*lacks categories.*"
               r"create_anndata_collection\(\.\.\., overwrite=True\)")
    with pytest.raises(InputError, match=pattern):
        coll.obs_at([ROW], ["cell_type"])
    with pytest.raises(InputError, match=pattern):
        coll.category_counts("cell_type")


def test_deleted_categories_chunk_is_refused(copy: Path) -> None:
    (_shard(copy) / "obs/cell_type/categories/c/0").unlink()
    coll = open_collection(copy)
    with pytest.raises(CollectionError,
                       match=_names(coll, "obs/cell_type/categories") + ".*chunk files"):
        coll.category_counts("cell_type")


# -- var --------------------------------------------------------------------------------
def _with_var_columns(copy: Path) -> pd.DataFrame:
    """Var columns written into every shard of ``copy`` (as the writer keeps them)."""
    import zarr
    from anndata.io import write_elem

    coll = open_collection(copy)
    n = coll.n_vars
    rng = np.random.default_rng(3)
    want = pd.DataFrame({
        "gene_symbol": [f"SYM{k}" for k in range(n)],
        "feature_type": pd.Categorical(rng.choice(["Gene Expression", "Peaks"], n)),
        "mean": rng.random(n).astype(np.float32) + 1,
    }, index=coll.var_names)
    with zarr.config.set({"array.write_empty_chunks": True}):
        for s in coll.shards:
            write_elem(zarr.open_group(str(copy / s.path), mode="r+"), "var", want)
    return want


def test_var_columns_of_an_intact_copy_are_read(copy: Path) -> None:
    want = _with_var_columns(copy)
    var = open_collection(copy).var
    assert list(var["gene_symbol"]) == list(want["gene_symbol"])
    assert list(var["feature_type"].astype(str)) == list(want["feature_type"].astype(str))
    np.testing.assert_array_equal(var["mean"].to_numpy(), want["mean"].to_numpy())


@pytest.mark.parametrize(("chunk", "element"), [
    ("var/gene_symbol/c/0", "var/gene_symbol"),
    ("var/mean/c/0", "var/mean"),
    ("var/feature_type/codes/c/0", "var/feature_type/codes"),
    ("var/var_names/c/0", "var/var_names"),  # the index (named as the frame's index)
])
def test_deleted_var_chunk_is_refused_not_read_as_empty_values(
        copy: Path, chunk: str, element: str) -> None:
    _with_var_columns(copy)
    (_shard(copy, 0) / chunk).unlink()
    coll = open_collection(copy)
    with pytest.raises(CollectionError,
                       match=_names(coll, element, 0) + r".*0 of its 1 chunk files.*" + FIX):
        coll.var  # noqa: B018


def test_deleted_var_categories_array_is_refused_not_left_out(copy: Path) -> None:
    _with_var_columns(copy)
    shutil.rmtree(_shard(copy, 0) / "var/feature_type/categories")
    coll = open_collection(copy)
    with pytest.raises(CollectionError,
                       match=_names(coll, "var/feature_type", 0) + r".*lacks categories"):
        coll.var  # noqa: B018


def test_truncated_var_column_zarr_json_is_refused(copy: Path) -> None:
    _with_var_columns(copy)
    _truncate(_shard(copy, 0) / "var/gene_symbol/zarr.json")
    coll = open_collection(copy)
    with pytest.raises(CollectionError,
                       match=_names(coll, "var/gene_symbol", 0) + ".*not valid JSON.*" + FIX):
        coll.var  # noqa: B018


def test_var_column_in_an_unreadable_encoding_is_still_left_out(
        copy: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Not damage: a column in an encoding this package does not read (here a nested
    dataframe) is left out with a warning, as before."""
    import zarr
    from anndata.io import write_elem

    want = _with_var_columns(copy)
    g = zarr.open_group(str(_shard(copy, 0) / "var"), mode="r+")
    write_elem(g, "nested", pd.DataFrame({"a": np.arange(len(want))},
                                         index=want.index.astype(str)))
    order = list(g.attrs["column-order"])
    g.attrs["column-order"] = [*order, "nested"]
    with caplog.at_level(logging.WARNING):
        var = open_collection(copy).var
    assert list(var.columns) == list(want.columns)
    assert "'nested' is left out" in caplog.text


# -- field reads: an absent inner chunk of a shard file ---------------------------------
def _drop_inner_chunk(array_dir: Path, shard_file: int, inner: int) -> None:
    """Mark inner chunk ``inner`` of shard file ``shard_file`` absent in its index (the
    index's CRC-32C rewritten to match): what a shard file that lost a chunk looks like."""
    import google_crc32c

    meta = json.loads((array_dir / "zarr.json").read_text())
    conf = meta["codecs"][0]["configuration"]
    assert conf["index_location"] == "end"
    per_shard = (meta["chunk_grid"]["configuration"]["chunk_shape"][0]
                 // conf["chunk_shape"][0])
    path = array_dir / "c" / str(shard_file)
    body = bytearray(path.read_bytes())
    n_index = per_shard * 16
    start = len(body) - n_index - 4
    body[start + inner * 16 : start + inner * 16 + 16] = b"\xff" * 16
    crc = google_crc32c.value(bytes(body[start : start + n_index]))
    body[start + n_index :] = crc.to_bytes(4, "little")
    path.write_bytes(bytes(body))


def test_absent_inner_chunk_of_a_sparse_field_is_refused(synthetic_h5ads: list[Path],
                                                         tmp_path: Path) -> None:
    """A CSR field's ``data`` read through the collection knows that every chunk was
    written: an inner chunk missing from its shard file is damage, not zeros."""
    store = tmp_path / "store"
    create_anndata_collection(synthetic_h5ads, store, seed=1, n_obs_per_shard=900,
                              zarr_chunk_elems=1 << 12, zarr_shard_elems=1 << 14,
                              progress=False)
    shard = _shard(store, 0)
    _drop_inner_chunk(shard / "X/data", 0, 1)
    coll = open_collection(store)
    ds = AnnBatchDataset(coll, batch_size=900, chunk_size=900, preload_nchunks=1,
                         shuffle=False)
    with pytest.raises(ReadError, match=re.escape(str(shard)) + r".*X.*chunk 1 is missing"):
        for _ in ds:
            pass


# -- inputs read in place: var columns stay lenient -------------------------------------
def test_an_inputs_damaged_var_column_is_left_out_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An input's var (read in place, or by the writer) is not a collection: a damaged
    column is left out with a warning as before, the other columns are read."""
    import anndata as ad
    import zarr

    from annbatch_torch.store.metadata import read_dataframe

    n = 6
    var = pd.DataFrame({"kind": pd.Categorical(["a", "b"] * 3), "score": np.arange(n, dtype=float),
                        "absent": np.zeros(n)}, index=[f"g{k}" for k in range(n)])
    ad.AnnData(np.zeros((2, n), np.float32), var=var).write_zarr(tmp_path / "in.zarr")
    shutil.rmtree(tmp_path / "in.zarr/var/kind/categories")
    shutil.rmtree(tmp_path / "in.zarr/var/absent")
    with caplog.at_level(logging.WARNING):
        got = read_dataframe(zarr.open_group(str(tmp_path / "in.zarr/var"), mode="r"), n,
                             "in.zarr", "var")
    assert list(got.columns) == ["score"]
    np.testing.assert_array_equal(got["score"].to_numpy(), var["score"].to_numpy())
    assert "'kind' is left out of var" in caplog.text
    assert "lacks categories" in caplog.text
    assert "'absent' is left out of var" in caplog.text


def test_inputs_read_in_place_still_yield_every_row(synthetic_h5ads: list[Path]) -> None:
    ds = AnnBatchDataset(synthetic_h5ads, batch_size=512, shuffle=False, return_index=True)
    ids = np.concatenate([b["index"].numpy() for b in ds])
    np.testing.assert_array_equal(np.sort(ids), np.arange(2700))
