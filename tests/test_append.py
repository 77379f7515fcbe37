"""append_to_collection: new inputs as new shards; the old shards untouched, every new cell
once with its values, categories that only grow, the schema rules, readers of the old
manifest, prepare_collection appending, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

import annbatch_torch as abt
from annbatch_torch import A, InputError

N_GENES = 30


def _input(folder: Path, k: int, n: int, cats: list[str], genes: range = range(N_GENES),
           seed: int = 0) -> tuple[Path, ad.AnnData]:
    rng = np.random.default_rng(seed + k)
    x = sp.random(n, len(genes), density=0.2, format="csr", dtype=np.float32, random_state=rng)
    a = ad.AnnData(x, obs=pd.DataFrame({"cell_type": pd.Categorical(rng.choice(cats, n)),
                                        "depth": rng.random(n)},
                                       index=[f"i{k}_{i}" for i in range(n)]),
                   var=pd.DataFrame(index=[f"g{g}" for g in genes]))
    a.obsm["X_pca"] = rng.random((n, 4)).astype(np.float32)
    p = folder / f"in{k}.h5ad"
    a.write_h5ad(p)
    return p, a


def _files(root: Path, shards: list[str]) -> dict[str, tuple[int, int, bytes]]:
    """Every file of these shards: size, mtime and bytes."""
    out = {}
    for s in shards:
        for p in sorted((root / s).rglob("*")):
            if p.is_file():
                st = p.stat()
                out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, p.read_bytes())
    return out


def _rows(coll: abt.Collection, adatas: list[ad.AnnData]) -> None:
    """Every cell of ``adatas`` once, with its X, label and obsm."""
    ds = abt.AnnBatchDataset(coll, selector={"x": A.X, "y": A.obs["cell_type"],
                                             "pca": A.obsm["X_pca"]},
                             batch_size=256, densify=True, return_index=True)
    whole = ad.concat(adatas)
    cats = np.asarray(coll.categories("cell_type"), dtype=object)
    seen: list[int] = []
    for b in ds:
        idx = b["index"].numpy()
        names = coll.obs_names_at(idx)
        ref = whole[names]
        np.testing.assert_allclose(b["x"].numpy(), ref.X.toarray())
        assert (cats[b["y"].numpy()] == ref.obs["cell_type"].astype(str).to_numpy()).all()
        np.testing.assert_allclose(b["pca"].numpy(), ref.obsm["X_pca"])
        seen += idx.tolist()
    assert sorted(seen) == list(range(coll.n_obs)) == list(range(whole.n_obs))


def test_append_writes_new_shards_only(tmp_path: Path) -> None:
    p0, a0 = _input(tmp_path, 0, 2500, ["A", "B"])
    p1, a1 = _input(tmp_path, 1, 1700, ["C", "B"])
    store = tmp_path / "store"
    coll = abt.create_anndata_collection([p0], store, seed=0, n_obs_per_shard=1024,
                                         progress=False)
    old = [s.path for s in coll.manifest.shards]
    before = _files(store, old)
    old_codes = coll.obs_at(np.arange(coll.n_obs), "cell_type")["cell_type"]
    reader = abt.AnnBatchDataset(coll, selector={"x": A.X}, batch_size=100, return_index=True,
                                 prefetch=False)
    it = iter(reader)
    first = next(it)

    new = abt.append_to_collection(store, [p1], seed=3, progress=False)
    assert _files(store, old) == before  # bytes and mtimes of every old shard file
    assert [s.path for s in new.manifest.shards][:len(old)] == old
    assert len(new.manifest.shards) == len(old) + 2
    gens = {s.generation for s in new.manifest.shards}
    assert len(gens) == 2
    assert new.categories("cell_type") == ["A", "B", "C"]  # grown at the end
    # a label learned before decodes the same after
    again = new.obs_at(np.arange(coll.n_obs), "cell_type")["cell_type"]
    assert list(again.astype(str)) == list(old_codes.astype(str))
    assert new.manifest.inputs[1]["generation"] != new.manifest.inputs[0]["generation"]
    _rows(new, [a0, a1])
    # the reader opened before the append reads on, the old cells only
    rest = [first, *it]
    idx = np.concatenate([b["index"].numpy() for b in rest])
    assert sorted(idx.tolist()) == list(range(coll.n_obs))


def test_parallel_append_equals_serial(tmp_path: Path) -> None:
    p0, _ = _input(tmp_path, 0, 1500, ["A"])
    p1, _ = _input(tmp_path, 1, 2100, ["B"])
    kw = dict(seed=0, n_obs_per_shard=1024, progress=False)
    a = abt.create_anndata_collection([p0], tmp_path / "a", **kw)
    b = abt.create_anndata_collection([p0], tmp_path / "b", **kw)
    a = abt.append_to_collection(a.path, [p1], seed=5, progress=False)
    b = abt.append_to_collection(b.path, [p1], seed=5, progress=False, scheduler="threads",
                                 n_workers=2)
    for s in a.manifest.shards:
        x, y = ad.read_zarr(a.path / s.path), ad.read_zarr(b.path / s.path)
        assert list(x.obs_names) == list(y.obs_names)
        assert (x.X != y.X).nnz == 0


def test_schema_rules_refuse_with_the_fix_and_write_nothing(tmp_path: Path) -> None:
    p0, _ = _input(tmp_path, 0, 800, ["A"])
    store = tmp_path / "store"
    abt.create_anndata_collection([p0], store, seed=0, progress=False)
    manifest = (store / "manifest.json").read_bytes()
    listing = sorted(os.listdir(store))
    fewer, _ = _input(tmp_path, 1, 300, ["A"], genes=range(5, N_GENES))
    with pytest.raises(InputError, match=r"in1\.h5ad: lacks 5 of the 30 genes.*"
                       r"var_join='inner'.*Fix"):
        abt.append_to_collection(store, [fewer], progress=False)
    with pytest.raises(InputError, match=r"in the collection already|are in .* already"):
        abt.append_to_collection(store, [p0], progress=False)
    no_pca = ad.read_h5ad(p0)
    del no_pca.obsm["X_pca"]
    no_pca.obs_names = [f"x{i}" for i in range(no_pca.n_obs)]
    with pytest.raises(InputError, match=r"no obsm entry 'X_pca'.*Appending to .*every new "
                       r"input must offer"):
        abt.append_to_collection(store, [no_pca], progress=False)
    assert (store / "manifest.json").read_bytes() == manifest
    assert sorted(os.listdir(store)) == listing
    assert not list(tmp_path.glob("store.tmp-*"))


def test_outer_collections_take_missing_genes_as_zeros_and_refuse_new_ones(
        tmp_path: Path) -> None:
    p0, _ = _input(tmp_path, 0, 600, ["A"])
    store = tmp_path / "store"
    abt.create_anndata_collection([p0], store, seed=0, var_join="outer", progress=False)
    fewer, a1 = _input(tmp_path, 1, 400, ["A"], genes=range(0, 20))
    coll = abt.append_to_collection(store, [fewer], progress=False)
    ds = abt.AnnBatchDataset(coll, selector={"x": A.X}, batch_size=1000, densify=True,
                             return_index=True, shuffle=False)
    (batch,) = list(ds)
    x = batch["x"].numpy()[np.argsort(batch["index"].numpy())]
    names = coll.obs_names_at(np.arange(coll.n_obs))
    new = np.flatnonzero(np.char.startswith(np.asarray(names, dtype=str), "i1_"))
    assert len(new) == 400
    assert (x[new][:, 20:] == 0).all()
    ref = a1[[str(n) for n in names[new]]].X.toarray()
    np.testing.assert_allclose(x[new][:, :20], ref)
    wider, _ = _input(tmp_path, 2, 100, ["A"], genes=range(0, 35))
    with pytest.raises(InputError, match=r"has 5 genes .* lacks.*outer.*Fix"):
        abt.append_to_collection(store, [wider], progress=False)


def test_prepare_collection_appends_when_the_inputs_only_grew(tmp_path: Path) -> None:
    p0, a0 = _input(tmp_path, 0, 900, ["A"])
    p1, a1 = _input(tmp_path, 1, 700, ["B"])
    store = tmp_path / "store"
    assert abt.prepare_collection([p0], store, seed=2, progress=False)
    old = [s.path for s in abt.open_collection(store).manifest.shards]
    before = _files(store, old)
    assert abt.prepare_collection([p0, p1], store, seed=2, progress=False)  # appended
    assert _files(store, old) == before
    coll = abt.open_collection(store)
    assert coll.n_obs == 1600
    assert len(coll.manifest.extra["appended"]) == 1
    assert not abt.prepare_collection([p0, p1], store, seed=2, progress=False)  # current
    _rows(coll, [a0, a1])
    # another order is not an append: rewritten
    assert abt.prepare_collection([p1, p0], store, seed=2, progress=False)
    assert "appended" not in abt.open_collection(store).manifest.extra


def test_cli_append(tmp_path: Path) -> None:
    p0, _ = _input(tmp_path, 0, 500, ["A"])
    p1, _ = _input(tmp_path, 1, 300, ["B"])
    store = tmp_path / "store"
    abt.create_anndata_collection([p0], store, seed=0, progress=False)
    r = subprocess.run([sys.executable, "-m", "annbatch_torch", "append", str(store), str(p1),
                        "--no-progress"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "appended 300 cells" in r.stdout
    assert json.loads((store / "manifest.json").read_text())["n_obs"] == 800
    r = subprocess.run([sys.executable, "-m", "annbatch_torch", "append", str(store), str(p1)],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "already" in r.stderr


def test_append_edges(tmp_path: Path) -> None:
    """Values the stored dtype cannot hold, a collection kept in input order, an empty
    input, n_workers without a scheduler, a folder that is not a collection."""
    p0, _ = _input(tmp_path, 0, 400, ["A"])
    store = tmp_path / "store"
    abt.create_anndata_collection([p0], store, seed=0, shuffle=False, progress=False)
    big = ad.read_h5ad(p0)
    big.obs_names = [f"b{i}" for i in range(big.n_obs)]
    big.X = big.X.astype(np.float64)
    big.X.data[0] = 1e39  # beyond float32
    with pytest.raises(InputError, match=r"X holds values in .* beyond the stored float32"):
        abt.append_to_collection(store, [big], progress=False)
    p1, a1 = _input(tmp_path, 1, 300, ["B"])
    coll = abt.append_to_collection(store, [p1], progress=False)
    names = list(coll.obs_names_at(np.arange(400, 700)))
    assert names == list(a1.obs_names)  # shuffle=False: the new rows in input order
    empty = ad.AnnData(sp.csr_matrix((0, N_GENES), dtype=np.float32),
                       var=pd.DataFrame(index=[f"g{g}" for g in range(N_GENES)]))
    coll = abt.append_to_collection(store, [empty], progress=False)
    assert coll.n_obs == 700
    assert len(coll.manifest.inputs) == 3
    with pytest.raises(InputError, match="n_workers=2 needs a scheduler"):
        abt.append_to_collection(store, [p1], n_workers=2, progress=False)
    with pytest.raises(abt.CollectionError):
        abt.append_to_collection(tmp_path / "nodir" / "x", [p1], progress=False)
    assert not (tmp_path / "nodir").exists()  # no lock file made beside a non-collection


def test_prepare_rewrites_when_the_grown_inputs_cannot_be_appended(tmp_path: Path) -> None:
    p0, _ = _input(tmp_path, 0, 500, ["A"])
    fewer, _ = _input(tmp_path, 1, 200, ["B"], genes=range(3, N_GENES))
    store = tmp_path / "store"
    abt.prepare_collection([p0], store, seed=1, progress=False)
    assert abt.prepare_collection([p0, fewer], store, seed=1, progress=False)
    coll = abt.open_collection(store)
    assert coll.n_obs == 700
    assert coll.n_vars == N_GENES - 3  # rewritten: the inner join of both
    assert "appended" not in coll.manifest.extra


def _taken_names(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelname == "WARNING" and "obs_names are in" in r.getMessage()]


def test_names_already_in_the_collection_are_named_from_the_shards_hashes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each shard stores its obs_names' hashes (uns/annbatch_torch_obs_name_hashes): an
    append compares its names with them at any collection size; shards written before
    (without them) have their names read, up to NAME_CHECK_MAX_CELLS cells."""
    import zarr

    from annbatch_torch.store.inputs.plan import name_hashes
    from annbatch_torch.store.metadata import NAME_HASHES
    from annbatch_torch.write import append

    p0, _ = _input(tmp_path, 0, 1500, ["A"])
    store = tmp_path / "store"
    coll = abt.create_anndata_collection([p0], store, seed=0, n_obs_per_shard=512,
                                         progress=False)
    for s in coll.manifest.shards:  # what each shard stores: its own names' hashes
        shard = ad.read_zarr(store / s.path)
        np.testing.assert_array_equal(shard.uns[NAME_HASHES],
                                      np.unique(name_hashes(shard.obs_names)))
    _, a1 = _input(tmp_path, 1, 50, ["B"])
    a1.obs_names = [*a1.obs_names[:47], "i0_5", "i0_700", "i0_1499"]  # 3 stored already
    p1 = tmp_path / "in1.h5ad"
    a1.write_h5ad(p1)
    def no_names(*args: object) -> None:
        raise AssertionError("a shard's obs index was read")

    with monkeypatch.context() as mp, caplog.at_level("INFO", logger="annbatch_torch"):
        mp.setattr(append, "shard_obs_names", no_names)  # the hashes alone
        coll = abt.append_to_collection(store, [p1], progress=False)
    (msg,) = _taken_names(caplog)
    assert ": 3 obs_names are in " in msg
    assert all(f"'{n}'" in msg for n in ("i0_5", "i0_700", "i0_1499")), msg
    new = coll.manifest.shards[-1]  # the appended shard stores them too
    np.testing.assert_array_equal(ad.read_zarr(store / new.path).uns[NAME_HASHES],
                                  np.unique(name_hashes(a1.obs_names)))
    # a collection whose shards predate the hashes: its names are read, within the limit
    old = tmp_path / "old"
    coll = abt.create_anndata_collection([p0], old, seed=0, n_obs_per_shard=512,
                                         progress=False)
    for s in coll.manifest.shards:
        group = zarr.open_group(str(old / s.path / "uns"), mode="a")
        del group[NAME_HASHES]
    caplog.clear()
    monkeypatch.setattr(append, "NAME_CHECK_MAX_CELLS", 0)
    with caplog.at_level("INFO", logger="annbatch_torch"):
        abt.append_to_collection(old, [p1], progress=False)
    assert not _taken_names(caplog)
    assert any("before annbatch_torch stored name hashes" in r.getMessage()
               for r in caplog.records)
    monkeypatch.setattr(append, "NAME_CHECK_MAX_CELLS", 2_000_000)
    _, a2 = _input(tmp_path, 2, 20, ["B"])
    a2.obs_names = [*a2.obs_names[:19], "i0_3"]
    p2 = tmp_path / "in2.h5ad"
    a2.write_h5ad(p2)
    caplog.clear()
    with caplog.at_level("INFO", logger="annbatch_torch"):
        abt.append_to_collection(old, [p2], progress=False)
    (msg,) = _taken_names(caplog)
    assert ": 1 obs_names are in " in msg
    assert "'i0_3'" in msg


def test_damaged_name_hashes_are_an_error_and_nothing_is_appended(tmp_path: Path) -> None:
    import zarr

    from annbatch_torch.store.metadata import NAME_HASHES

    p0, _ = _input(tmp_path, 0, 600, ["A"])
    store = tmp_path / "store"
    coll = abt.create_anndata_collection([p0], store, seed=0, progress=False)
    arr = zarr.open_array(str(store / coll.manifest.shards[0].path / "uns" / NAME_HASHES),
                          mode="r+")
    arr[...] = arr[...][::-1]  # no longer sorted
    manifest = (store / "manifest.json").read_bytes()
    p1, _ = _input(tmp_path, 1, 40, ["B"])
    with pytest.raises(abt.CollectionError, match=rf"shard_00000\.zarr.*uns/{NAME_HASHES} is "
                       r"not the sorted distinct uint64 hashes.*rewrite"):
        abt.append_to_collection(store, [p1], progress=False)
    assert (store / "manifest.json").read_bytes() == manifest
    assert not list(tmp_path.glob("store.tmp-*"))


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 2**64 - 1), max_size=300),
       st.sets(st.integers(0, 2**64 - 1), max_size=300),
       st.sets(st.integers(0, 2**64 - 1), max_size=20), st.booleans())
def test_the_hash_filter_finds_exactly_the_stored_hashes_among_the_new(
        new: set[int], stored: set[int], common: set[int], same_prefix: bool) -> None:
    from annbatch_torch.write.append import _HashFilter

    if same_prefix:  # hashes that share their leading bits and differ below them
        stored = {h ^ 1 for h in new} | stored
    a = np.array(sorted(new | common), dtype=np.uint64)
    b = np.array(sorted(stored | common), dtype=np.uint64)
    np.testing.assert_array_equal(np.sort(_HashFilter(a).hits(b)), np.intersect1d(a, b))
