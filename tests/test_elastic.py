"""Elastic resume, on the pure replay: an epoch run in segments on changing numbers of ranks
and workers yields every batch once (minus the documented drop), every rank as many.

The reference simulates torch's DataLoader directly: each rank's workers yield their items
round-robin (``dataloader_order``) and a segment stops after ``steps`` batches per rank.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from annbatch_torch import sampling as S
from annbatch_torch.sampling import replay
from annbatch_torch.sampling.mixing import MixSampler

SETTINGS = settings(max_examples=300, deadline=None)


def _batches(deal: S.EpochDeal, items, worker_count: int) -> list[list[tuple[int, tuple]]]:
    """Per worker, its batches as ``(epoch batch id or -1 for padding, rows)``."""
    out = []
    for seq in deal.workers(items, worker_count):
        got = []
        pp = seq.pool_size // seq.batch_size
        for it in seq:
            for b in range(it.batch_start, it.batch_stop):
                lo, hi = it.bounds(b)
                g = -1 if it.padding else it.pool_index * pp + b
                got.append((g, tuple(int(r) for r in it.rows[lo:hi])))
        out.append(got)
    return out


def _run(deal: S.EpochDeal, segments: list[replay.Segment], world: int, workers: int,
         stop: int | None) -> tuple[list[tuple[int, tuple]], list[int]]:
    """Every rank of a segment after ``segments``, stopped after ``stop`` batches per rank
    (None: to the end): the batches yielded and each rank's batch count."""
    yielded, counts = [], []
    for rank in range(world):
        items = replay.rank_items_after(deal, segments, rank, world)
        per_worker = _batches(deal, items, workers)
        order = replay.dataloader_order([len(b) for b in per_worker])
        counts.append(len(order))
        take = order if stop is None else order[:stop]
        yielded += [per_worker[w][j] for w, j in take]
    return yielded, counts


@st.composite
def deals(draw: st.DrawFn) -> S.EpochDeal:
    n_obs = draw(st.integers(0, 400))
    batch_size = draw(st.integers(1, 20))
    chunk_size = draw(st.integers(1, 40))
    preload = draw(st.integers(1, 5))
    shuffle, drop_last = draw(st.booleans()), draw(st.booleans())
    even = draw(st.sampled_from(["drop", "pad"]))
    seed, epoch = draw(st.integers(0, 2**32)), draw(st.integers(0, 5))
    if draw(st.booleans()) or n_obs == 0:
        return S.chunk_deal(n_obs, chunk_size, preload, batch_size, shuffle=shuffle, seed=seed,
                            epoch=epoch, drop_last=drop_last, even_batches=even)
    kind = draw(st.sampled_from(["weighted", "paired", "mixed"]))
    if kind == "paired" and n_obs >= 2:  # draws of a perturbed row and its controls, whole
        codes = np.array(draw(st.lists(st.integers(0, 2), min_size=n_obs, max_size=n_obs)))
        codes[0], codes[-1] = 0, 1  # a control and a perturbed row
        sampler = S.PairedSampler("p", "ctrl", n_controls=draw(st.integers(1, 2)),
                                  chunk_size=draw(st.sampled_from([None, 7]))).bind(
            n_obs, {"p": S.ObsColumn(codes, ("ctrl", "a", "b"))})
        positions = batch_size * sampler.draw_size
        return S.sample_deal(sampler, positions, S.pool_rows(positions, chunk_size, preload),
                             seed=seed, epoch=epoch, drop_last=drop_last, even_batches=even,
                             in_order=not shuffle and not sampler.mixes_in_pool)
    if kind == "mixed":  # a weighted mixture of two members: quotas per batch
        cut = draw(st.integers(1, n_obs))
        sampler = MixSampler([0, cut, n_obs] if cut < n_obs else [0, n_obs, n_obs],
                             [0.7, 0.3] if cut < n_obs else [1.0, 0.0],
                             batch_size=batch_size, chunk_size=chunk_size,
                             num_samples=draw(st.integers(1, 500))).bind(n_obs, {})
        return S.sample_deal(sampler, batch_size, S.pool_rows(batch_size, chunk_size, preload),
                             seed=seed, epoch=epoch, drop_last=drop_last, even_batches=even)
    weights = draw(st.lists(st.floats(0.0, 4.0), min_size=n_obs, max_size=n_obs))
    if not any(weights):
        weights[0] = 1.0
    sampler = S.WeightedSampler(weights, num_samples=draw(st.integers(1, 500))).bind(n_obs, {})
    return S.sample_deal(sampler, batch_size, S.pool_rows(batch_size, chunk_size, preload),
                         seed=seed, epoch=epoch, drop_last=drop_last, even_batches=even,
                         in_order=not shuffle)


@SETTINGS
@given(deals(), st.lists(st.tuples(st.integers(1, 8), st.integers(0, 4), st.floats(0, 1)),
                         min_size=2, max_size=3))
def test_an_epoch_in_segments_yields_every_batch_once(deal: S.EpochDeal, topologies) -> None:
    segments: list[replay.Segment] = []
    seen: list[tuple[int, tuple]] = []
    for i, (world, workers, frac) in enumerate(topologies):
        last = i == len(topologies) - 1
        _, counts = _run(deal, segments, world, workers, None)
        assert len(set(counts)) == 1, counts  # equal batch counts on every rank
        rank_batches = counts[0]
        stop = None if last else int(frac * rank_batches)
        got, _ = _run(deal, segments, world, workers, stop)
        seen += got
        if not last:
            segments.append(replay.Segment(world, max(1, workers), stop))
            left = replay.remaining_batches(deal, segments)
            real = [g for g, _ in seen if g >= 0]
            # consumed + remaining = the epoch, disjoint
            assert sorted(real + left.tolist()) == list(range(deal.n_batches))
    ids = Counter(g for g, _ in seen if g >= 0)
    assert all(c == 1 for c in ids.values()), "a batch yielded twice"
    missing = deal.n_batches - len(ids)
    final_world = topologies[-1][0]
    assert missing == 0 if deal.even_batches == "pad" else 0 <= missing < final_world
    fresh = {g: rows for g, rows in _run(deal, [], 1, 1, None)[0] if g >= 0}
    assert all(fresh[g] == rows for g, rows in seen if g >= 0)  # a batch's rows never change
    if isinstance(deal.source, S.ChunkRows):  # chunked: every row at most once
        rows = Counter(r for g, rows in seen if g >= 0 for r in rows)
        assert all(c == 1 for c in rows.values())


@SETTINGS
@given(deals(), st.integers(1, 8), st.integers(0, 4), st.floats(0, 1))
def test_the_same_topology_continues_the_same_batches(deal: S.EpochDeal, world: int,
                                                       workers: int, frac: float) -> None:
    """A segment's own topology resumed by skipping (what torchdata restores) and the
    replay agree on what was consumed."""
    full, counts = _run(deal, [], world, workers, None)
    stop = int(frac * counts[0])
    head, _ = _run(deal, [], world, workers, stop)
    left = replay.remaining_batches(deal, [replay.Segment(world, max(1, workers), stop)])
    consumed = {g for g, _ in head if g >= 0}
    dealt = {g for g, _ in full if g >= 0}
    assert set(left.tolist()) == set(range(deal.n_batches)) - consumed
    assert dealt - consumed <= set(left.tolist())


def test_a_state_claiming_more_steps_than_an_epoch_is_refused() -> None:
    deal = S.chunk_deal(100, 10, 2, 10, shuffle=True, seed=0, epoch=0)
    import pytest

    with pytest.raises(ValueError, match="11 batches were yielded on 1 ranks x 1 workers, "
                       "but a rank had only 10"):
        replay.remaining_batches(deal, [replay.Segment(1, 1, 11)])
    assert np.array_equal(replay.remaining_batches(deal, [replay.Segment(2, 2, 5)]),
                          np.zeros(0, np.int64))
