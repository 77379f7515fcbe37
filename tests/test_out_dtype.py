"""``AnnBatchDataset(out_dtype=...)`` (issue 30): sparse fields reach the user in the dtype
asked for (integer counts for a count model), filled into the pools as they are read, and a
dtype that cannot hold what a shard stores is refused before anything is read."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp
import torch

import annbatch_torch as abt
from annbatch_torch import create_anndata_collection

SEL = {"counts": "layers/counts", "ct": "obs/cell_type"}


@pytest.fixture(scope="module")
def narrow(synthetic_h5ads: list[Path], tmp_path_factory: pytest.TempPathFactory
           ) -> abt.Collection:
    """The synthetic inputs written with the default (narrow) dtypes: ``layers/counts``
    stores integers, ``X`` (log1p) float32."""
    out = tmp_path_factory.mktemp("out_dtype") / "c"
    return create_anndata_collection(synthetic_h5ads, out, seed=5, n_obs_per_shard=1024,
                                     progress=False)


def _source_counts(paths: list[Path]) -> dict[str, np.ndarray]:
    out = {}
    for p in paths:
        a = ad.read_h5ad(p)
        for name, row in zip(a.obs_names, a.layers["counts"].toarray()):
            out[name] = row
    return out


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.layout == torch.sparse_csr else t


def test_batches_hold_the_asked_dtype_and_the_same_values_on_every_host_path(
        narrow: abt.Collection) -> None:
    """Chunked, densified, sampling and a gene subset: the same batches as float32, with
    the values in ``out_dtype``; obs keys and transformed keys are converted as before."""
    assert narrow.manifest.shards[0].stored["layers/counts/data"] in ("uint8", "uint16")
    genes = list(narrow.var_names[::-3])
    configs: list[dict[str, Any]] = [
        {"seed": 1}, {"seed": 2, "densify": True}, {"seed": 3, "var_names": genes},
        {"seed": 4, "sampler": abt.ClassBalancedSampler("cell_type")},
        {"seed": 5, "densify": True, "var_names": genes,
         "sampler": abt.SubsetSampler(np.arange(0, narrow.n_obs, 3))},
    ]
    for kw in configs:
        sel = {**SEL, "t": abt.A.layers["counts"].with_transform(lambda m: m)}
        common = dict(selector=sel, batch_size=96, chunk_size=32, preload_nchunks=4, **kw)
        asked = list(abt.AnnBatchDataset(narrow, out_dtype="int32", **common))
        plain = list(abt.AnnBatchDataset(narrow, **common))
        assert len(asked) == len(plain) > 0
        for a, p in zip(asked, plain):
            assert a["counts"].dtype == torch.int32, kw
            assert a["counts"].layout == p["counts"].layout
            assert torch.equal(_dense(a["counts"]), _dense(p["counts"]).to(torch.int32)), kw
            assert a["ct"].dtype == p["ct"].dtype == torch.int64
            assert torch.equal(a["ct"], p["ct"])
            # a transform sees out_dtype values; its result follows the default rules
            # (CSR values float32, integer arrays int64)
            want = torch.int64 if a["t"].layout == torch.strided else torch.float32
            assert a["t"].dtype == want, kw
            assert torch.equal(_dense(a["t"]).to(torch.float32), _dense(p["t"]))


@pytest.mark.parametrize("densify", [False, True])
@pytest.mark.parametrize("plain_loader", [False, True])
def test_workers_deliver_the_dtype_and_every_row_once(
        narrow: abt.Collection, synthetic_h5ads: list[Path], densify: bool,
        plain_loader: bool) -> None:
    """Two workers (``AnnBatchDataLoader`` densifies in the main process; the plain
    ``DataLoader`` in the workers): int16 batches equal to the inputs' counts, each row
    once."""
    ds = abt.AnnBatchDataset(narrow, selector=SEL, batch_size=128, chunk_size=32,
                             preload_nchunks=4, out_dtype=np.int16, densify=densify,
                             return_index=True, seed=7)
    loader = (torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2) if plain_loader
              else abt.AnnBatchDataLoader(ds, num_workers=2))
    source = _source_counts(synthetic_h5ads)
    seen: list[int] = []
    for b in loader:
        x = b["counts"]
        assert x.dtype == torch.int16
        assert x.layout == (torch.strided if densify else torch.sparse_csr)
        rows = b["index"].numpy()
        seen.extend(rows.tolist())
        want = np.stack([source[n] for n in narrow.obs_names_at(rows)]).astype(np.int16)
        np.testing.assert_array_equal(_dense(x).numpy(), want)
    assert sorted(seen) == list(range(narrow.n_obs))


def test_a_custom_converter_sees_the_dtype_and_float64_is_kept(narrow: abt.Collection
                                                                ) -> None:
    got: list[Any] = []

    def keep(batch: dict[str, Any]) -> dict[str, Any]:
        got.append(batch["counts"])
        return batch

    ds = abt.AnnBatchDataset(narrow, selector=SEL, batch_size=256, out_dtype="int32",
                             batch_converter=keep)
    next(iter(ds))
    assert sp.issparse(got[0])
    assert got[0].dtype == np.int32
    # the default converter named explicitly is the default; composed, it is told the keys
    ds = abt.AnnBatchDataset(narrow, selector=SEL, batch_size=256, out_dtype="int32",
                             batch_converter=abt.batch_dict_converter)
    assert next(iter(ds))["counts"].dtype == torch.int32
    ds = abt.AnnBatchDataset(narrow, selector=SEL, batch_size=256, out_dtype="int32",
                             densify=True, batch_converter=functools.partial(
                                 abt.batch_dict_converter, keep_dtype={"counts"}))
    assert next(iter(ds))["counts"].dtype == torch.int32
    ds = abt.AnnBatchDataset(narrow, selector={"x": "X"}, batch_size=256,
                             out_dtype=torch.float64, densify=True, seed=3)
    wide = abt.AnnBatchDataset(narrow, selector={"x": "X"}, batch_size=256, densify=True,
                               seed=3)
    for a, b in zip(ds, wide):
        assert a["x"].dtype == torch.float64
        assert torch.equal(a["x"], b["x"].to(torch.float64))


def _counts_input(values: np.ndarray, name: str) -> ad.AnnData:
    x = sp.csr_matrix(values.reshape(-1, 4).astype(np.float32))
    a = ad.AnnData(X=x)
    a.obs_names = [f"{name}{i}" for i in range(a.n_obs)]
    a.var_names = [f"g{j}" for j in range(4)]
    return a


def test_a_dtype_that_cannot_hold_a_stored_value_is_refused_naming_the_shard(
        tmp_path: Path) -> None:
    """Shard 0 stores uint8, an appended shard uint16: uint8 is refused naming the second
    shard and the narrowest dtype that fits; int32 reads both."""
    small = _counts_input(np.arange(40) % 7, "a")
    big = _counts_input(np.arange(40) * 10, "b")  # up to 390: uint16
    small.write_h5ad(tmp_path / "a.h5ad")
    big.write_h5ad(tmp_path / "b.h5ad")
    coll = create_anndata_collection([tmp_path / "a.h5ad"], tmp_path / "c", progress=False)
    abt.append_to_collection(coll, [tmp_path / "b.h5ad"], progress=False)
    coll = abt.open_collection(tmp_path / "c")
    assert [s.stored["X/data"] for s in coll.manifest.shards] == ["uint8", "uint16"]
    for asked in ("uint8", "int8"):  # int8 fails both shards: uint16's is named
        with pytest.raises(ValueError, match="cannot hold exactly") as e:
            abt.AnnBatchDataset(coll, out_dtype=asked)
        msg = str(e.value)
        assert f"field 'X' of shard {coll.shard_name(1)} stores uint16 values" in msg
        assert "use out_dtype='int32' (or a wider one), which holds what every shard" in msg
    abt.AnnBatchDataset(coll, out_dtype="int32")  # what it suggests is accepted
    batches = list(abt.AnnBatchDataset(coll, out_dtype="int32", batch_size=7,
                                       return_index=True))
    rows = np.concatenate([b["X"].to_dense().numpy() for b in batches])
    assert rows.dtype == np.int32
    source = ad.concat([small, big])
    names = coll.obs_names_at(np.concatenate([b["index"].numpy() for b in batches]))
    np.testing.assert_array_equal(rows, source[names].X.toarray())


def test_float_values_old_layouts_devices_and_unknown_dtypes_are_refused(
        narrow: abt.Collection, synthetic_h5ads: list[Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"field 'X' of shard .* stores float32 values"):
        abt.AnnBatchDataset(narrow, selector={"x": "X"}, out_dtype="int32")
    wide = create_anndata_collection(synthetic_h5ads, tmp_path / "w", progress=False,
                                     data_dtype="float32", index_dtype="int32")
    with pytest.raises(ValueError, match="data_dtype='auto'"):
        abt.AnnBatchDataset(wide, selector=SEL, out_dtype="int32")
    with pytest.raises(ValueError, match=r"of input .*part0\.h5ad stores float32"):
        abt.AnnBatchDataset(synthetic_h5ads, selector=SEL, out_dtype="int64")
    with pytest.raises(ValueError, match="cannot be combined with device='cpu'"):
        abt.AnnBatchDataset(narrow, selector=SEL, out_dtype="int32", device="cpu")
    for bad in ("uint16", "float16", "counts", torch.bfloat16, object):
        with pytest.raises(ValueError, match="out_dtype must be one of"):
            abt.AnnBatchDataset(narrow, selector=SEL, out_dtype=bad)  # type: ignore[arg-type]
    # float32 is the default: accepted everywhere, also with a device pool
    abt.AnnBatchDataset(narrow, selector={"x": "X"}, out_dtype="float32", device="cpu")


def test_inputs_read_in_place_keep_integers_and_no_handle_stays_open(tmp_path: Path) -> None:
    """An in-place h5ad of int32 counts (CSR) and one of uint8 (CSC): int32 batches equal to
    the inputs; building the dataset leaves no file open; int64 counts fit no float."""
    rng = np.random.default_rng(3)
    dense = (rng.random((60, 9)) < 0.4) * rng.integers(1, 200, (60, 9))
    a = ad.AnnData(X=sp.csr_matrix(dense[:40].astype(np.int32)))
    b = ad.AnnData(X=sp.csc_matrix(dense[40:].astype(np.uint8)))
    for i, x in enumerate((a, b)):
        x.obs_names = [f"{'ab'[i]}{j}" for j in range(x.n_obs)]
        x.var_names = [f"g{j}" for j in range(9)]
        x.write_h5ad(tmp_path / f"{'ab'[i]}.h5ad")
    paths = [tmp_path / "a.h5ad", tmp_path / "b.h5ad"]
    ds = abt.AnnBatchDataset(paths, out_dtype="int32", batch_size=16, shuffle=False,
                             densify=True)
    assert not ds.source.has_open_handles
    rows = np.concatenate([bt["X"].numpy() for bt in ds])
    assert rows.dtype == np.int32
    np.testing.assert_array_equal(rows, dense)
    with pytest.raises(ValueError, match=r"input .*a\.h5ad stores int32 values"):
        abt.AnnBatchDataset(paths, out_dtype="int16")
    c = ad.AnnData(X=sp.csr_matrix(dense.astype(np.int64)))
    c.write_h5ad(tmp_path / "c.h5ad")
    with pytest.raises(ValueError, match=r"stores int64 values .*: use out_dtype='int64'"):
        abt.AnnBatchDataset(tmp_path / "c.h5ad", out_dtype="float64")
    assert abt.AnnBatchDataset(tmp_path / "c.h5ad", out_dtype="int64").out_dtype == np.int64
