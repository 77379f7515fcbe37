"""Range splitting at shard boundaries (pure) and pool reads against in-memory truth."""

from __future__ import annotations

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from annbatch_torch import Collection
from annbatch_torch.read.reader import PoolReader, split_ranges
from annbatch_torch.store.inputs.inplace import InPlaceSource


@st.composite
def shards_and_ranges(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    sizes = draw(st.lists(st.integers(0, 30), min_size=1, max_size=6))
    n = sum(sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    ranges = []
    for _ in range(draw(st.integers(0, 6))):
        if n == 0:
            break
        a = draw(st.integers(0, n - 1))
        b = draw(st.integers(a, n))
        ranges.append((a, b))
    return offsets, np.array(ranges, dtype=np.int64).reshape(-1, 2)


@given(shards_and_ranges())
def test_split_ranges_preserves_rows_and_order(case: tuple[np.ndarray, np.ndarray]) -> None:
    offsets, ranges = case
    pieces = split_ranges(ranges, offsets)
    want = np.concatenate([np.arange(a, b) for a, b in ranges] or [np.zeros(0, np.int64)])
    got = np.zeros(len(want), dtype=np.int64) - 1
    for p in pieces:
        assert 0 <= p.start < p.stop <= offsets[p.shard + 1] - offsets[p.shard]
        got[p.out_start : p.out_start + p.stop - p.start] = offsets[p.shard] + np.arange(
            p.start, p.stop
        )
    np.testing.assert_array_equal(got, want)


def _adata(n: int, seed: int, cats: list[str]) -> ad.AnnData:
    rng = np.random.default_rng(seed)
    x = sp.random(n, 13, density=0.3, format="csr", dtype=np.float32, random_state=rng)
    obs = pd.DataFrame(
        {"ct": pd.Categorical(rng.choice(cats, n), categories=cats), "v": rng.normal(size=n)},
        index=[f"c{seed}_{i}" for i in range(n)],
    )
    a = ad.AnnData(x, obs=obs, var=pd.DataFrame(index=[f"g{i}" for i in range(13)]))
    a.obsm["pca"] = rng.normal(size=(n, 4)).astype(np.float32)
    return a


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_pool_read_matches_concatenated_inputs(data: st.DataObject) -> None:
    a, b = _adata(17, 0, ["B", "T"]), _adata(23, 1, ["NK", "T"])
    src = InPlaceSource([a, b])
    assert src.categories("ct") == ["B", "T", "NK"]
    full = ad.concat([a, b])
    ct_global = pd.Categorical(full.obs["ct"].astype(str), categories=["B", "T", "NK"]).codes
    n = src.n_obs
    ranges = []
    for _ in range(data.draw(st.integers(1, 5))):
        lo = data.draw(st.integers(0, n - 1))
        ranges.append((lo, data.draw(st.integers(lo + 1, n))))
    ranges_a = np.array(ranges)
    rows = np.concatenate([np.arange(x, y) for x, y in ranges])
    out = PoolReader(src, ["X", "obsm/pca", "obs/ct", "obs/v"], threads=3).read(ranges_a)
    np.testing.assert_array_equal(out["X"].toarray(), full.X[rows].toarray())
    np.testing.assert_array_equal(out["obsm/pca"], full.obsm["pca"][rows])
    np.testing.assert_array_equal(out["obs/ct"], ct_global[rows])
    np.testing.assert_array_equal(out["obs/v"], full.obs["v"].to_numpy()[rows])


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_drawn_rows_of_inputs_with_their_own_categories_get_global_codes(
        data: st.DataObject) -> None:
    """Rows a sampler draws, one piece each (more than 64 of one input: the code map is
    applied by one gather over their rows), carry the global codes of their categories."""
    a, b = _adata(40, 0, ["B", "T"]), _adata(200, 1, ["NK", "T"])
    src = InPlaceSource([a, b])
    full = ad.concat([a, b])
    ct_global = pd.Categorical(full.obs["ct"].astype(str), categories=["B", "T", "NK"]).codes
    of_a = data.draw(st.lists(st.integers(0, 39), max_size=40, unique=True))
    # every other row of b: drawn rows next to each other would merge into one piece
    of_b = data.draw(st.lists(st.integers(0, 99), min_size=65, max_size=100, unique=True))
    rows = np.sort(np.asarray(of_a + [40 + 2 * k for k in of_b]))
    ranges = np.stack([rows, rows + 1], axis=1)
    out = PoolReader(src, ["obs/ct"], threads=2).read(ranges, random_access=True)
    np.testing.assert_array_equal(out["obs/ct"], ct_global[rows])


def test_warm_pools_let_the_deep_read_threads_go(small_collection: Collection) -> None:
    """The first pool is read by many threads (it may come from the disk); once pools come
    from the page cache, those threads exit and their read scratch with them, and every
    pool is read right."""
    import anndata as ad

    reader = PoolReader(small_collection, ["X"], threads=1, io_depth=8)
    ranges = np.array([[0, 300], [1100, 1400], [2200, 2500]])
    rows = np.concatenate([np.arange(a, b) for a, b in ranges])
    parts = [ad.read_zarr(small_collection.shard_path(i))
             for i in range(len(small_collection.shard_sizes))]
    truth = sp.vstack([p.X for p in parts]).tocsr()[rows].toarray()
    try:
        np.testing.assert_array_equal(reader.read(ranges)["X"].toarray(), truth)
        # the first pool was read as if from the disk: by the deep executor's threads
        assert reader._deep is not None
        deep = list(reader._deep._threads)
        assert len(deep) > 1
        for _ in range(2):
            np.testing.assert_array_equal(reader.read(ranges)["X"].toarray(), truth)
        assert reader._deep is None
        for t in deep:
            t.join(10)
        assert not any(t.is_alive() for t in deep)
    finally:
        reader.close()
