"""What a batch holds: one dtype per field whatever the input file, keys that never share
memory, densify honoured with a collate_fn, to_device dtypes, validated options."""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch

import annbatch_torch as abt
from annbatch_torch import A
from annbatch_torch.convert import batch_dict_converter, to_device


@pytest.fixture(scope="module")
def mixed_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], ad.AnnData]:
    """Two h5ad files whose layer 'l' is int32 in one and fractional float32 in the other,
    and whose nullable Int64 obs column has missing values in the second only."""
    d = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(0)
    parts = []
    for i, n in enumerate((90, 70)):
        x = sp.random(n, 6, density=0.5, format="csr", random_state=rng, dtype=np.float32)
        layer = (x * 10).astype(np.int32) if i == 0 else (x * 10 + x / 2).astype(np.float32)
        a = ad.AnnData(x, obs=pd.DataFrame(index=[f"f{i}_{k}" for k in range(n)]),
                       var=pd.DataFrame(index=[f"g{k}" for k in range(6)]))
        a.layers["l"] = sp.csr_matrix(layer)
        ids = pd.array(np.arange(n) + 1000 * i, dtype="Int64")
        if i == 1:
            ids[::7] = pd.NA
        a.obs["id"] = ids
        parts.append(a)
    paths = [d / f"p{i}.h5ad" for i in range(2)]
    for p, a in zip(paths, parts):
        a.write_h5ad(p)
    ref = ad.concat(parts)
    return paths, ref


@pytest.mark.parametrize("densify", [False, True])
def test_in_place_fields_have_one_dtype_and_exact_values(
        mixed_files: tuple[list[Path], ad.AnnData], densify: bool) -> None:
    paths, ref = mixed_files
    ds = abt.AnnBatchDataset(paths, selector={"l": A.layers["l"], "id": A.obs["id"]},
                             batch_size=32, chunk_size=16, preload_nchunks=2, densify=densify,
                             return_index=True, seed=1)
    assert ds.source.fields["layers/l"].dtype == "float64"
    assert ds.source.fields["obs/id"].dtype == "float64"
    want_l = ref.layers["l"].toarray().astype(np.float64)
    want_id = ref.obs["id"].to_numpy(dtype=np.float64, na_value=np.nan)
    dtypes = set()
    n = 0
    for b in ds:
        rows = b["index"].numpy()
        got = b["l"].to_dense() if b["l"].layout == torch.sparse_csr else b["l"]
        dtypes.add((str(b["l"].dtype), str(b["id"].dtype)))
        np.testing.assert_allclose(got.double().numpy(), want_l[rows], rtol=1e-6)
        np.testing.assert_array_equal(b["id"].double().numpy(), want_id[rows].astype(np.float32))
        n += len(rows)
    assert n == ref.n_obs
    assert len(dtypes) == 1  # every batch, whichever files its pool came from


def test_one_field_under_two_keys_never_shares_memory(
        mixed_files: tuple[list[Path], ad.AnnData]) -> None:
    paths, ref = mixed_files

    def double_in_place(m: object) -> object:
        if sp.issparse(m):
            m.data *= 2
        else:
            m *= 2
        return m

    for densify in (False, True):
        ds = abt.AnnBatchDataset(paths, selector={
            "plain": A.X, "doubled": A.X.with_transform(double_in_place)},
            batch_size=40, densify=densify, return_index=True, shuffle=False)
        for b in ds:
            rows = b["index"].numpy()
            plain = b["plain"].to_dense() if b["plain"].layout == torch.sparse_csr else b["plain"]
            np.testing.assert_array_equal(plain.numpy(), ref.X[rows].toarray())


def test_a_collate_fn_gets_dense_batches_from_workers(
        mixed_files: tuple[list[Path], ad.AnnData]) -> None:
    paths, _ = mixed_files
    ds = abt.AnnBatchDataset(paths, selector={"x": A.X}, batch_size=40, densify=True)
    loader = abt.AnnBatchDataLoader(ds, num_workers=2, collate_fn=lambda b: (b["x"],))
    for (x,) in loader:
        assert x.layout == torch.strided
        assert x.dtype == torch.float32


def test_to_device_densifies_to_float32_on_every_device() -> None:
    m = sp.random(7, 5, density=0.5, format="csr", random_state=0)
    batch = batch_dict_converter({"x": m.astype(np.float64), "c": m.astype(np.int32)})
    cpu = to_device(batch, "cpu")
    meta = to_device(batch, "meta")  # the non-CPU branch (as on CUDA), without a GPU
    for k in ("x", "c"):
        assert cpu[k].dtype == torch.float32
        assert meta[k].dtype == torch.float32
        assert meta[k].layout == torch.strided


@pytest.mark.parametrize(("kw", "match"), [
    ({"mask_key": ""}, "mask_key must be a non-empty string"),
    ({"mask_key": 3}, "mask_key must be a non-empty string"),
    ({"even_batches": "pad", "return_index": True, "mask_key": "index"},
     "mask_key='index' clashes"),
    ({"chunk_ids": [1.5]}, "chunk_ids must be a 1-D list of integers"),
])
def test_options_are_validated(kw: dict[str, object], match: str) -> None:
    a = ad.AnnData(np.ones((50, 3), np.float32))
    with pytest.raises(ValueError, match=match):
        abt.AnnBatchDataset(a, chunk_size=16, **kw)
    assert abt.AnnBatchDataset(a, chunk_size=16, chunk_ids=[0, 1.0]).chunk_ids.tolist() == [0, 1]


def _double_in_place(m: object) -> object:
    if sp.issparse(m):
        m.data *= 2
    elif isinstance(m, torch.Tensor):
        m.mul_(2)
    else:
        m *= 2
    return m


def _dense(t: torch.Tensor) -> np.ndarray:
    return (t.to_dense() if t.layout == torch.sparse_csr else t).numpy()


@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("densify", [False, True])
@pytest.mark.parametrize("field", ["X", "obsm/X_pca"])
@pytest.mark.parametrize("first", ["plain", "doubled"])
def test_an_in_place_transform_never_reaches_another_key(
        small_collection: abt.Collection, first: str, field: str, densify: bool,
        device: str | None) -> None:
    """One field under two keys, whichever comes first: the transformed key's in-place
    change must not show in the plain key (host and device pools, dense or CSR)."""
    f = abt.Field.parse(field)
    kw = dict(batch_size=64, chunk_size=64, preload_nchunks=2, densify=densify, seed=1,
              device=device)
    want = [_dense(b["plain"]) for b in abt.AnnBatchDataset(
        small_collection, selector={"plain": f}, **kw)]
    keys = {"plain": f, "doubled": f.with_transform(_double_in_place)}
    order = [first, *(k for k in keys if k != first)]
    ds = abt.AnnBatchDataset(small_collection, selector={k: keys[k] for k in order}, **kw)
    got = list(ds)
    assert len(got) == len(want)
    for b, ref in zip(got, want):
        np.testing.assert_array_equal(_dense(b["plain"]), ref)
        np.testing.assert_array_equal(_dense(b["doubled"]), 2 * ref)


def _boom(x: object) -> object:
    raise RuntimeError("boom")


def _drop_last_row(x: object) -> object:
    return x[:-1]  # type: ignore[index]


def _one_value(x: object) -> object:
    return np.float32(1.0)


@pytest.mark.parametrize("transform", [_drop_last_row, _one_value], ids=["fewer", "scalar"])
@pytest.mark.parametrize("densify", [False, True])
def test_a_transform_that_changes_the_row_count_is_refused(
        small_collection: abt.Collection, transform: object, densify: bool) -> None:
    """A transform returning another number of rows would leave the batch's keys out of
    line (x of 99 rows beside 100 labels and ids): refused, naming the key and the rows."""
    ds = abt.AnnBatchDataset(small_collection, batch_size=100, return_index=True,
                             densify=densify, selector={
                                 "x": A.X.with_transform(transform),  # type: ignore[arg-type]
                                 "y": A.obs["cell_type"]})
    with pytest.raises(abt.BatchError, match=r"the transform of selector key 'x' \(field "
                       r"'X'\) returned \(.*\) for a batch of 100 rows\. Fix: return one "
                       r"row per row"):
        next(iter(ds))


@pytest.mark.parametrize("pools", ["one pool", "many pools"])
def test_a_failing_transform_frees_the_prefetch_thread(small_collection: abt.Collection,
                                                       pools: str) -> None:
    """While the caller keeps the exception (pytest, pdb, notebooks keep tracebacks), the
    prefetch thread, the pool it read and a pool read ahead for the next epoch are gone."""
    import threading

    kw = {"chunk_size": 64, "preload_nchunks": 2} if pools == "many pools" else {}
    ds = abt.AnnBatchDataset(small_collection, selector={"x": A.X.with_transform(_boom)},
                             batch_size=100, **kw)
    before = set(threading.enumerate())  # other tests' datasets may still hold theirs
    with pytest.raises(abt.BatchError, match="boom") as info:
        list(ds)
    assert info.value is not None  # the traceback is still alive here
    alive = [t.name for t in set(threading.enumerate()) - before
             if t.name.startswith("annbatch-prefetch")]
    assert alive == []
    assert ds._stream is not None
    assert ds._stream.ahead is None
