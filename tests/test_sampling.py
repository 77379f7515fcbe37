"""Tests of the epoch plan (annbatch_torch.sampling).

The property tests compare the lazy, range-based plan with a row-level reference written
directly from the rules in the module docstring, and check the contract on real row ids.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from annbatch_torch import sampling as S
from annbatch_torch.sampling import replay

FAST = settings(max_examples=200, deadline=None)
SLOW = settings(max_examples=100, deadline=None)

Batch = tuple[tuple[int, ...], bool]  # (row ids, padding)


@dataclass(frozen=True)
class P:
    n_obs: int
    chunk_size: int
    preload_nchunks: int
    batch_size: int
    world_size: int = 1
    drop_last: bool = False
    even_batches: str = "drop"
    shuffle: bool = True
    seed: int = 0
    epoch: int = 0
    chunk_ids: tuple[int, ...] | None = None

    @property
    def ids(self) -> np.ndarray | None:
        return None if self.chunk_ids is None else np.array(self.chunk_ids, dtype=np.int64)

    @property
    def pool(self) -> int:  # the documented formula, written out independently
        return max(1, (self.chunk_size * self.preload_nchunks) // self.batch_size) * self.batch_size

    def stream_rows(self) -> list[int]:
        order = S.chunk_order(
            self.n_obs,
            self.chunk_size,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=self.epoch,
            chunk_ids=self.ids,
        )
        cs = self.chunk_size
        return [r for c in order for r in range(c * cs, min((c + 1) * cs, self.n_obs))]


@st.composite
def params(draw, min_obs: int = 0, **fixed) -> P:
    n_obs = draw(st.integers(min_obs, 5000))
    chunk_size = draw(st.integers(1, 300) | st.sampled_from([1, 7, 64]))
    kw = dict(
        n_obs=n_obs,
        chunk_size=chunk_size,
        preload_nchunks=draw(st.integers(1, 8)),
        batch_size=draw(st.integers(1, 600) | st.integers(1, 16)),
        world_size=draw(st.integers(1, 4)),
        drop_last=draw(st.booleans()),
        even_batches=draw(st.sampled_from(["drop", "pad"])),
        shuffle=draw(st.booleans()),
        seed=draw(st.integers(0, 2**40)),
        epoch=draw(st.integers(0, 5)),
    )
    n = S.n_chunks(n_obs, chunk_size)
    if n and draw(st.booleans()):  # a subset of whole chunks, in scrambled order
        rng = np.random.default_rng(draw(st.integers(0, 2**32)))
        ids = np.flatnonzero(rng.random(n) < draw(st.floats(0.0, 1.0)))
        kw["chunk_ids"] = tuple(int(i) for i in rng.permutation(ids))
    kw.update(fixed)
    return P(**kw)


def items_of(p: P, rank: int):
    return S.rank_items(
        p.n_obs,
        p.chunk_size,
        p.preload_nchunks,
        p.batch_size,
        shuffle=p.shuffle,
        seed=p.seed,
        epoch=p.epoch,
        rank=rank,
        world_size=p.world_size,
        drop_last=p.drop_last,
        even_batches=p.even_batches,
        chunk_ids=p.ids,
    )


def item_batches(p: P, item: S.WorkItem) -> list[Batch]:
    perm = S.item_permutation(item, seed=p.seed, epoch=p.epoch, shuffle=p.shuffle)
    rows = S.global_rows(item.ranges)
    assert len(rows) == item.n_rows
    return [
        (tuple(int(r) for r in rows[S.batch_positions(item, b, p.batch_size, perm)]), item.padding)
        for b in range(item.batch_start, item.batch_stop)
    ]


def worker_batches(p: P, rank: int, num_workers: int) -> list[list[Batch]]:
    items = items_of(p, rank)
    return [
        [b for it in S.worker_items(items, w, num_workers) for b in item_batches(p, it)]
        for w in range(max(1, num_workers))
    ]


def loader_batches(per_worker: list[list[Batch]]) -> list[Batch]:
    order = replay.dataloader_order([len(b) for b in per_worker])
    return [per_worker[w][j] for w, j in order]


def reference(p: P) -> list[list[Batch]]:
    """Per-rank batch lists, computed row by row from the documented rules."""
    stream, bs, size = p.stream_rows(), p.batch_size, p.pool
    pools = []
    for i in range(0, len(stream), size):
        rows = stream[i : i + size]
        perm = S.pool_permutation(
            len(rows), seed=p.seed, epoch=p.epoch, pool_index=i // size, shuffle=p.shuffle
        )
        rows = [rows[j] for j in perm]
        pools.append([(tuple(rows[k : k + bs]), False) for k in range(0, len(rows), bs)])
    if p.drop_last and pools and len(pools[-1][-1][0]) < bs:
        pools[-1].pop()
    w = p.world_size
    n_full = len(stream) // size
    head = n_full // w * w
    ranks = [
        [b for i, pool in enumerate(pools[:head]) if i % w == r for b in pool] for r in range(w)
    ]
    tail = [b for pool in pools[head:] for b in pool]
    base, extra = divmod(len(tail), w)
    pad = (tuple(stream[: min(bs, len(stream))]), True)
    for r in range(w):
        if p.even_batches == "drop":
            ranks[r] += tail[r * base : (r + 1) * base]
        else:
            lo = r * base + min(r, extra)
            ranks[r] += tail[lo : lo + base + (r < extra)]
            ranks[r] += [pad] * (1 if extra and r >= extra else 0)
    return ranks


# ---------------------------------------------------------------- property tests


@FAST
@given(params())
def test_plan_matches_row_level_reference(p: P) -> None:
    ref = reference(p)
    for rank in range(p.world_size):
        assert loader_batches(worker_batches(p, rank, 1)) == ref[rank]


@FAST
@given(params(), st.integers(1, 4))
def test_rows_yielded_at_most_once_and_drops_bounded(p: P, num_workers: int) -> None:
    stream = p.stream_rows()
    seen: Counter[int] = Counter()
    for rank in range(p.world_size):
        batches = [b for wb in worker_batches(p, rank, num_workers) for b in wb]
        real = [r for rows, pad in batches if not pad for r in rows]
        seen.update(real)
        for rows, pad in batches:
            if pad:  # padding: the first rows of the stream, only in padding items
                assert rows == tuple(stream[: min(p.batch_size, len(stream))])
    assert max(seen.values(), default=1) == 1
    # drop: fewer than world_size batches in all (plus the partial batch with drop_last)
    slack = p.batch_size - 1 if p.drop_last else 0
    dropped = len(stream) - len(seen)
    bound = (p.world_size - 1) * p.batch_size if p.even_batches == "drop" else 0
    assert dropped <= bound + slack
    assert set(seen) <= set(stream)
    if p.world_size == 1 and not p.drop_last:
        assert sorted(seen) == sorted(stream)
        assert len(stream) == len(set(stream))
        if p.chunk_ids is None:
            assert sorted(seen) == list(range(p.n_obs))


@settings(max_examples=400, deadline=None)
@given(params())
def test_every_rank_yields_batches_per_rank(p: P) -> None:
    n = S.batches_per_rank(
        p.n_obs,
        p.chunk_size,
        p.preload_nchunks,
        p.batch_size,
        world_size=p.world_size,
        drop_last=p.drop_last,
        even_batches=p.even_batches,
        chunk_ids=p.ids,
    )
    lists = [items_of(p, r) for r in range(p.world_size)]
    assert [lst.n_batches for lst in lists] == [n] * p.world_size
    assert all(sum(it.n_batches for it in lst) == n for lst in lists)
    assert all(it.n_batches > 0 for lst in lists for it in lst)
    real = sum(int(lst.batch_counts[lst.pool_index >= 0].sum()) for lst in lists)
    total = len(p.stream_rows())
    all_batches = total // p.batch_size + (total % p.batch_size > 0 and not p.drop_last)
    if p.even_batches == "pad":
        assert real == all_batches
    else:
        assert all((lst.pool_index >= 0).all() for lst in lists)
        assert all_batches - real < p.world_size * (p.pool // p.batch_size) + 1


@FAST
@given(params())
def test_batch_sizes(p: P) -> None:
    stream_len = len(p.stream_rows())
    sizes = []
    for rank in range(p.world_size):
        for rows, pad in loader_batches(worker_batches(p, rank, 1)):
            if pad:
                assert len(rows) == min(p.batch_size, stream_len)
            else:
                sizes.append(len(rows))
    short = [s for s in sizes if s != p.batch_size]
    assert len(short) <= (0 if p.drop_last else 1)
    if short:
        assert short[0] == stream_len % p.batch_size


@SLOW
@given(params())
def test_batches_of_a_rank_do_not_depend_on_num_workers(p: P) -> None:
    for rank in range(p.world_size):
        multisets = [
            Counter(
                (frozenset(rows), pad) for wb in worker_batches(p, rank, nw) for rows, pad in wb
            )
            for nw in (1, 2, 3, 4)
        ]
        assert all(m == multisets[0] for m in multisets[1:])


@SLOW
@given(params(), st.integers(1, 4))
def test_deterministic_in_seed_and_epoch(p: P, num_workers: int) -> None:
    for rank in range(p.world_size):
        assert worker_batches(p, rank, num_workers) == worker_batches(p, rank, num_workers)


@SLOW
@given(params(min_obs=20, shuffle=True, world_size=1, drop_last=False, chunk_ids=None))
def test_epochs_and_seeds_give_different_orders(p: P) -> None:
    order = [r for rows, _ in loader_batches(worker_batches(p, 0, 1)) for r in rows]
    for other in (replace(p, epoch=p.epoch + 1), replace(p, seed=p.seed + 1)):
        assert [r for rows, _ in loader_batches(worker_batches(other, 0, 1)) for r in rows] != order


@FAST
@given(params(shuffle=False, world_size=1))
def test_unshuffled_single_rank_yields_rows_in_order(p: P) -> None:
    rows = [r for rows, _ in loader_batches(worker_batches(p, 0, 1)) for r in rows]
    expected = p.stream_rows()
    assert expected == sorted(expected)
    if p.drop_last:
        expected = expected[: len(expected) - len(expected) % p.batch_size]
    assert rows == expected
    if p.chunk_ids is None:  # touching pieces are merged: one range per pool
        assert all(len(it.ranges) == 1 for it in items_of(p, 0))


@FAST
@given(params(), st.integers(1, 4), st.data())
def test_resume_yields_exactly_the_rest(p: P, num_workers: int, data) -> None:
    items = items_of(p, 0)
    per_item = [S.worker_items(items, w, num_workers) for w in range(num_workers)]
    per_worker = worker_batches(p, 0, num_workers)
    counts = [len(b) for b in per_worker]
    order = replay.dataloader_order(counts)
    assert sorted(order) == [(w, j) for w in range(num_workers) for j in range(counts[w])]
    k = data.draw(st.integers(0, sum(counts)))
    done = replay.consumed_per_worker(counts, k)
    assert done == [sum(1 for w2, _ in order[:k] if w2 == w) for w in range(num_workers)]
    yielded = [per_worker[w][j] for w, j in order[:k]]
    rest = []
    for w in range(num_workers):
        for seq in (per_item[w], list(per_item[w])):
            left = S.remaining_items(seq, done[w])
            got = [b for it in left for b in item_batches(p, it)]
            assert got == per_worker[w][done[w] :]
        rest += got
    assert Counter(yielded + rest) == Counter(loader_batches(per_worker))
    assert sum(it.n_batches for it in per_item[0]) == counts[0]  # resume did not mutate


@FAST
@given(st.integers(0, 5000), st.integers(1, 300), st.floats(0.0, 0.99), st.integers(0, 2**40))
def test_split_chunks(n_obs: int, chunk_size: int, frac: float, seed: int) -> None:
    train, val = S.split_chunks(n_obs, chunk_size, frac, seed)
    n = S.n_chunks(n_obs, chunk_size)
    assert np.array_equal(np.sort(np.concatenate([train, val])), np.arange(n))
    assert np.all(np.diff(train) > 0)
    assert np.all(np.diff(val) > 0)
    expected = min(round(frac * n), max(n - 1, 0))
    if frac > 0 and n >= 2:
        expected = max(expected, 1)
    assert len(val) == expected
    again = S.split_chunks(n_obs, chunk_size, frac, seed)
    assert np.array_equal(again[0], train)
    assert np.array_equal(again[1], val)



@FAST
@given(st.integers(0, 5000), st.integers(1, 300), st.floats(0.0, 0.6), st.floats(0.0, 0.39),
       st.integers(0, 2**40))
def test_split_chunks3(n_obs: int, chunk_size: int, val: float, test: float, seed: int) -> None:
    train, v, t = S.split_chunks3(n_obs, chunk_size, val, test, seed)
    n = S.n_chunks(n_obs, chunk_size)
    assert np.array_equal(np.sort(np.concatenate([train, v, t])), np.arange(n))  # disjoint
    for part in (train, v, t):
        assert np.all(np.diff(part) > 0)
    assert np.array_equal(v, S.split_chunks(n_obs, chunk_size, val, seed)[1])
    if n >= 1:
        assert len(train) >= 1
    if test > 0 and n - 1 - len(v) > 0:
        assert len(t) >= max(1, min(round(test * n), n - 1 - len(v)))
    if test == 0:
        assert len(t) == 0


@FAST
@given(st.integers(0, 5000), st.integers(1, 300), st.integers(0, 2**40))
def test_chunk_rows_counts_the_rows_of_the_chunks(n_obs: int, chunk_size: int,
                                                  seed: int) -> None:
    n = S.n_chunks(n_obs, chunk_size)
    ids = np.flatnonzero(np.random.default_rng(seed).random(n) < 0.5)
    ranges = S.chunk_stream(n_obs, chunk_size, shuffle=False, seed=0, epoch=0, chunk_ids=ids)
    assert S.chunk_rows(n_obs, chunk_size, ids) == int((ranges[:, 1] - ranges[:, 0]).sum())
    assert S.chunk_rows(n_obs, chunk_size, np.arange(n)) == n_obs


# ---------------------------------------------------------------- unit tests


def test_pool_rows_and_n_chunks() -> None:
    assert S.pool_rows(4, 3, 2) == 4
    assert S.pool_rows(2, 3, 2) == 6
    assert S.pool_rows(1000, 64, 4) == 1000  # batch bigger than the budget: one batch per pool
    assert S.n_chunks(0, 5) == 0
    assert S.n_chunks(10, 5) == 2
    assert S.n_chunks(11, 5) == 3


def test_small_plan_by_hand() -> None:
    # 10 rows, chunks of 3 -> [0,3) [3,6) [6,9) [9,10); pools of 4 rows cut through chunks
    items = list(S.epoch_pools(10, 3, 2, 4, shuffle=False, seed=0, epoch=0))
    assert [it.pool_index for it in items] == [0, 1, 2]
    assert [it.ranges.tolist() for it in items] == [[[0, 4]], [[4, 8]], [[8, 10]]]
    assert [(it.n_rows, it.batch_start, it.batch_stop) for it in items] == [
        (4, 0, 1),
        (4, 0, 1),
        (2, 0, 1),
    ]
    assert not items[0].ranges.flags.writeable
    shuffled = S.chunk_stream(10, 3, shuffle=True, seed=1, epoch=0)
    assert sorted(map(tuple, shuffled.tolist())) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    # two ranks, pad: rank 1 owns pool 1 only -> one padding batch of the first 4 stream rows
    r1 = S.rank_items(
        10, 3, 2, 4, shuffle=False, seed=0, epoch=0, rank=1, world_size=2, even_batches="pad"
    )
    assert [(it.pool_index, it.padding, it.ranges.tolist()) for it in r1] == [
        (1, False, [[4, 8]]),
        (-1, True, [[0, 4]]),
    ]
    r1 = S.rank_items(
        10, 3, 2, 4, shuffle=False, seed=0, epoch=0, rank=0, world_size=2, drop_last=True
    )
    assert [it.pool_index for it in r1] == [0]


def test_drop_truncates_inside_a_pool() -> None:
    # 3 pools of 4 batches (P=8, bs=2) + 2 ranks: pools 0, 1 whole; pool 2 split 2 + 2
    kw = dict(shuffle=True, seed=3, epoch=1, world_size=2)
    r0 = S.rank_items(24, 8, 1, 2, rank=0, **kw)
    assert [(it.pool_index, it.batch_start, it.batch_stop) for it in r0] == [(0, 0, 4), (2, 0, 2)]
    r1 = S.rank_items(23, 8, 1, 2, rank=1, **kw)  # last pool: 7 rows = 4 batches
    assert [(it.pool_index, it.batch_start, it.batch_stop) for it in r1] == [(1, 0, 4), (2, 2, 4)]
    # P=4, 6 pools (the last one 2 rows): pools 0-3 dealt whole; the tail (pool 4's two
    # batches + pool 5's one) is split by batches: rank 0 gets (4, [0,1)), rank 1 (4, [1,2))
    kw0 = dict(world_size=2, shuffle=False, seed=0, epoch=0)
    r0 = S.rank_items(22, 4, 1, 2, rank=0, **kw0)
    assert [(it.pool_index, it.batch_start, it.batch_stop) for it in r0] == [
        (0, 0, 2), (2, 0, 2), (4, 0, 1)
    ]
    r1 = S.rank_items(22, 4, 1, 2, rank=1, **kw0)
    assert [(it.pool_index, it.batch_start, it.batch_stop) for it in r1] == [
        (1, 0, 2), (3, 0, 2), (4, 1, 2)
    ]


def test_fewer_pools_than_ranks_still_feeds_every_rank() -> None:
    # 100k cells, default pools of 16,384 rows, 8 ranks: 6 full pools < 8 ranks
    assert S.batches_per_rank(100_000, 512, 32, 4096, world_size=8) == 3
    seen = set()
    for r in range(8):
        items = S.rank_items(100_000, 512, 32, 4096, shuffle=True, seed=0, epoch=0, rank=r,
                             world_size=8)
        assert items.n_batches == 3
        for it in items:
            perm = S.item_permutation(it, seed=0, epoch=0, shuffle=True)
            rows = S.global_rows(it.ranges)
            for b in range(it.batch_start, it.batch_stop):
                got = set(rows[S.batch_positions(it, b, 4096, perm)].tolist())
                assert not got & seen
                seen |= got
    assert len(seen) == 24 * 4096


def test_dataloader_order_and_consumed() -> None:
    assert replay.dataloader_order([2, 0, 3]) == [(0, 0), (2, 0), (0, 1), (2, 1), (2, 2)]
    assert replay.consumed_per_worker([2, 0, 3], 3) == [2, 0, 1]
    assert replay.consumed_per_worker([5, 1, 5], 8) == [4, 1, 3]
    with pytest.raises(ValueError, match="n_consumed"):
        replay.consumed_per_worker([1], 2)
    with pytest.raises(ValueError, match="consumed"):
        S.remaining_items(S.epoch_pools(10, 3, 2, 4, shuffle=False, seed=0, epoch=0), 4)


try:  # torch is a dependency of the package, but the plan itself does not need it
    from torch.utils.data import IterableDataset as _IterableDataset
except ImportError:  # pragma: no cover
    _IterableDataset = object


class _CountingDataset(_IterableDataset):
    """Worker ``w`` yields ``(w, 0), ..., (w, counts[w] - 1)`` (an IterableDataset)."""

    def __init__(self, counts: list[int]) -> None:
        self.counts = counts

    def __iter__(self):
        import torch

        w = torch.utils.data.get_worker_info().id
        return iter([(w, j) for j in range(self.counts[w])])


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_dataloader_order_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    counts = [3, 1, 4]
    loader = torch.utils.data.DataLoader(_CountingDataset(counts), batch_size=None, num_workers=3)
    assert [(int(w), int(j)) for w, j in loader] == replay.dataloader_order(counts)


def test_documented_generators() -> None:
    ids = np.arange(50)
    got = S.chunk_order(500, 10, shuffle=True, seed=4, epoch=2)
    assert np.array_equal(got, np.random.default_rng([4, 2, S.TAG_CHUNKS]).permutation(ids))
    assert np.array_equal(S.chunk_order(500, 10, shuffle=False, seed=4, epoch=2), ids)
    sub = S.chunk_order(500, 10, shuffle=True, seed=4, epoch=2, chunk_ids=np.array([9, 3, 5]))
    assert np.array_equal(sub, np.random.default_rng([4, 2, S.TAG_CHUNKS]).permutation([3, 5, 9]))
    perm = S.pool_permutation(100, seed=4, epoch=2, pool_index=3, shuffle=True)
    assert np.array_equal(perm, np.random.default_rng([4, 2, 3, S.TAG_ROWS]).permutation(100))
    others = [
        S.pool_permutation(100, seed=4, epoch=2, pool_index=4, shuffle=True),
        S.pool_permutation(100, seed=4, epoch=3, pool_index=3, shuffle=True),
        S.pool_permutation(100, seed=5, epoch=2, pool_index=3, shuffle=True),
    ]
    assert not any(np.array_equal(perm, o) for o in others)
    assert S.pool_permutation(5, seed=4, epoch=2, pool_index=3, shuffle=False).tolist() == [
        0,
        1,
        2,
        3,
        4,
    ]


def test_item_equality_and_batch_positions() -> None:
    a = S.epoch_pools(100, 10, 2, 8, shuffle=True, seed=1, epoch=0)
    b = S.epoch_pools(100, 10, 2, 8, shuffle=True, seed=1, epoch=0)
    assert list(a) == list(b)
    assert a[0] != a[1]
    assert len(a[1:]) == len(a) - 1
    assert a[1:][0] == a[1]
    perm = S.item_permutation(a[0], seed=1, epoch=0, shuffle=True)
    assert sorted(perm.tolist()) == list(range(a[0].n_rows))
    with pytest.raises(ValueError, match=r"batch must lie in \[0, 2\)"):
        S.batch_positions(a[0], 2, 8, perm)


def test_global_rows() -> None:
    assert S.global_rows(np.array([[5, 8], [0, 2], [9, 9]])).tolist() == [5, 6, 7, 0, 1]
    assert S.global_rows(np.empty((0, 2), dtype=np.int64)).tolist() == []


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
        ({"batch_size": True}, "batch_size must be an integer >= 1, got True"),
        ({"chunk_size": 1.5}, "chunk_size must be an integer >= 1, got 1.5"),
        ({"preload_nchunks": 0}, "preload_nchunks must be an integer >= 1, got 0"),
        ({"n_obs": -1}, "n_obs must be an integer >= 0, got -1"),
        ({"world_size": 0}, "world_size must be an integer >= 1, got 0"),
        ({"rank": 2, "world_size": 2}, "rank must be an integer with 0 <= rank < world_size (= 2)"),
        ({"rank": -1}, "rank must be an integer >= 0, got -1"),
        ({"num_workers": -1}, "num_workers must be an integer >= 0, got -1"),
        ({"worker": 1, "num_workers": 0}, "worker must be an integer with 0 <= worker < num_wo"),
        ({"worker": 3, "num_workers": 3}, "(= 3), got 3"),
        ({"even_batches": "even"}, "even_batches must be 'drop' or 'pad', got 'even'"),
        ({"seed": -5}, "seed must be an integer >= 0, got -5"),
        ({"epoch": -1}, "epoch must be an integer >= 0, got -1"),
    ],
)
def test_validate_params_messages(override: dict, message: str) -> None:
    kw = dict(n_obs=10, chunk_size=2, preload_nchunks=2, batch_size=3)
    S.validate_params(**kw, worker=0, num_workers=0)  # 0 workers count as one
    with pytest.raises(ValueError, match=re.escape(message)):
        S.validate_params(**{**kw, **override})


@pytest.mark.parametrize(
    ("chunk_ids", "message"),
    [
        ([0, 4], "chunk_ids must lie in [0, 4)"),
        ([-1], "chunk_ids must lie in [0, 4)"),
        ([1, 1], "chunk_ids must not contain duplicates"),
        ([[0, 1]], "chunk_ids must be a 1-D integer array"),
        ([0.5], "chunk_ids must be a 1-D integer array"),
    ],
)
def test_chunk_ids_validation(chunk_ids: list, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        S.rank_items(10, 3, 2, 4, shuffle=True, seed=0, epoch=0, chunk_ids=np.array(chunk_ids))
    with pytest.raises(ValueError, match=re.escape(message)):
        S.batches_per_rank(10, 3, 2, 4, chunk_ids=np.array(chunk_ids))


def test_split_chunks_edges() -> None:
    assert [a.tolist() for a in S.split_chunks(0, 4, 0.5, 0)] == [[], []]
    assert [a.tolist() for a in S.split_chunks(3, 4, 0.9, 0)] == [[0], []]  # train keeps one
    train, val = S.split_chunks(4000, 4, 0.001, 0)
    assert len(val) == 1
    assert len(train) == 999
    a = S.split_chunks(4000, 4, 0.3, 0)[1]
    assert not np.array_equal(a, S.split_chunks(4000, 4, 0.3, 1)[1])
    with pytest.raises(ValueError, match=r"val_fraction must be a number in \[0, 1\)"):
        S.split_chunks(10, 2, 1.0, 0)
    with pytest.raises(ValueError, match=r"val_fraction \+ test_fraction must be < 1"):
        S.split_chunks3(10, 2, 0.5, 0.5, 0)
    assert [len(a) for a in S.split_chunks3(3, 1, 0.3, 0.3, 0)] == [1, 1, 1]
    assert [len(a) for a in S.split_chunks3(3, 1, 0.5, 0.4, 0)] == [1, 2, 0]  # val first


def test_worker_items_validation() -> None:
    items = S.epoch_pools(100, 10, 1, 10, shuffle=False, seed=0, epoch=0)
    assert [it.pool_index for it in S.worker_items(items, 1, 3)] == [1, 4, 7]
    assert len(S.worker_items(items, 0, 0)) == 10
    with pytest.raises(ValueError, match="worker must be"):
        S.worker_items(items, 3, 3)


@pytest.mark.parametrize(("chunk_size", "preload"), [(512, 1), (512, 64), (100, 2)])
def test_plan_of_a_large_source(chunk_size: int, preload: int) -> None:
    n_obs, bs = 10**8, 512
    items = S.rank_items(
        n_obs,
        chunk_size,
        preload,
        bs,
        shuffle=True,
        seed=0,
        epoch=7,
        rank=1,
        world_size=3,
        even_batches="pad",
    )
    mine = S.worker_items(items, 2, 4)
    n = S.batches_per_rank(n_obs, chunk_size, preload, bs, world_size=3, even_batches="pad")
    assert items.n_batches == n
    assert abs(n * 3 - n_obs / bs) <= 3 * S.pool_rows(bs, chunk_size, preload) / bs
    first = mine[0]
    assert first.n_rows == S.pool_rows(bs, chunk_size, preload)
    assert len(S.global_rows(first.ranges)) == first.n_rows
    assert S.remaining_items(mine, 5).n_batches == mine.n_batches - 5


@SLOW
@given(params(shuffle=False), st.integers(2, 4))
def test_per_batch_keeps_the_batches_and_dealt_to_workers_their_order(
        p: P, num_workers: int) -> None:
    """An unshuffled list cut into one item per batch has the same batches in the same
    order, and dealt round-robin to workers the DataLoader yields them in that order."""
    for rank in range(p.world_size):
        items = items_of(p, rank)
        whole = [b for it in items for b in item_batches(p, it)]
        per = items.per_batch()
        assert per.n_batches == items.n_batches
        assert [b for it in per for b in item_batches(p, it)] == whole
        dealt = [[b for it in S.worker_items(per, w, num_workers) for b in item_batches(p, it)]
                 for w in range(num_workers)]
        assert loader_batches(dealt) == whole


def test_per_batch_refuses_a_shuffled_list() -> None:
    with pytest.raises(ValueError, match="shuffled"):
        S.rank_items(100, 10, 2, 5, shuffle=True, seed=0, epoch=0).per_batch()
