"""Elastic resume in real runs: loaders with workers in ``gloo`` groups stopped mid-epoch
and resumed on other numbers of ranks and workers; the rows of the epoch are exactly-once
(minus the documented drop) and the next epoch is a fresh run's."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import anndata as ad
import elastic_ddp
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch.multiprocessing as tmp
from test_ddp import free_port

from annbatch_torch import AnnBatchDataLoader, WeightedSampler
from annbatch_torch.sampling import replay

N_OBS = 1003


@pytest.fixture(scope="module")
def h5ad(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(2)
    x = sp.random(N_OBS, 12, density=0.3, format="csr", dtype=np.float32, random_state=rng)
    obs = pd.DataFrame(index=[f"c{i}" for i in range(N_OBS)])
    p = tmp_path_factory.mktemp("elastic") / "a.h5ad"
    ad.AnnData(x, obs=obs, var=pd.DataFrame(index=[f"g{i}" for i in range(12)])).write_h5ad(p)
    return p


def _rows(ds: Any, epoch: int, rank: int, world: int, workers: int,
          segments: list[replay.Segment]) -> list[int]:
    """The rows a rank yields of ``epoch`` after ``segments`` (its plan, all workers)."""
    out: list[int] = []
    for w in range(max(1, workers)):
        for it in ds.plan(epoch, w, workers, rank=rank, world_size=world, segments=segments):
            for b in range(it.batch_start, it.batch_stop):
                lo, hi = it.bounds(b)
                if not it.padding:
                    out += it.rows[lo:hi].tolist()
    return out


def _spawn(fn: Any, world: int, *args: Any) -> None:
    tmp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


CASES = {
    "chunked": {},
    "sampled": {"sampler": WeightedSampler([1.0 + (i % 7) for i in range(N_OBS)],
                                           num_samples=900)},
}


@pytest.mark.parametrize("mode", ["chunked", "sampled"])
def test_two_ranks_with_workers_resume_on_one_rank_and_on_three(h5ad: Path, tmp_path: Path,
                                                                mode: str) -> None:
    kwargs = CASES[mode]
    ds = elastic_ddp.dataset(str(h5ad), **kwargs)
    batch = elastic_ddp.PLAN["batch_size"]
    stop = 9  # of 31 (chunked) / 28 (sampled) batches per rank
    _spawn(elastic_ddp.save_entry, 2, str(h5ad), 2, stop, str(tmp_path), kwargs)
    heads = [dict(np.load(tmp_path / f"head{r}.npz")) for r in range(2)]
    assert [int(h["n"]) for h in heads] == [stop, stop]
    state = json.loads((tmp_path / "state.json").read_text())
    assert len(json.dumps(state)) < 4000  # O(1) in the epoch's size
    head = np.concatenate([h["index"] for h in heads])
    segments = [replay.Segment(2, 2, stop)]
    epoch_rows = Counter(_rows(ds, 0, 0, 1, 0, []))  # what a 1-rank run yields in all

    topologies = [(1, 0), (3, 1)] if mode == "chunked" else [(3, 1)]
    for world, workers in topologies:
        tag = f"w{world}n{workers}_"
        _spawn(elastic_ddp.resume_entry, world, str(h5ad), workers, str(tmp_path), tag, kwargs)
        res = [dict(np.load(tmp_path / f"{tag}{r}.npz")) for r in range(world)]
        counts = [int(r["n"]) for r in res]
        assert len(set(counts)) == 1, counts  # equal batches on every new rank
        for r, got in enumerate(res):
            assert int(got["len"]) == stop + counts[0]  # len counts the batches done before
            want = _rows(ds, 0, r, world, workers, segments)
            assert sorted(got["index"].tolist()) == sorted(want), (world, r)
            # the next epoch is a fresh run's on this topology
            assert sorted(got["next"].tolist()) == sorted(_rows(ds, 1, r, world, workers, []))
            assert int(got["next_n"]) == int(got["next_len"])
        seen = Counter(head.tolist()) + Counter(np.concatenate([r["index"] for r in res]).tolist())
        assert not seen - epoch_rows, "a row yielded more often than the epoch holds it"
        missing = sum((epoch_rows - seen).values())
        assert missing < world * batch  # the documented drop: fewer than world_size batches
        if mode == "chunked":
            assert max(seen.values()) == 1


def test_one_process_loaders_resume_elastically_with_workers(h5ad: Path) -> None:
    """Without a group (explicit ranks): 2 ranks x 2 workers -> 1 rank x 2 workers, then
    that resumed epoch stopped again and resumed on 2 ranks x 0 workers (three segments);
    the state stays JSON and the rows are exactly-once."""
    def ds(rank: int, world: int) -> Any:
        return elastic_ddp.dataset(str(h5ad), rank=rank, world_size=world)

    def run(loader: AnnBatchDataLoader, stop: int | None = None) -> list[int]:
        out: list[int] = []
        for i, b in enumerate(loader):
            out += b["index"].tolist()
            if stop is not None and i + 1 == stop:
                break
        return out

    seen: list[int] = []
    loaders = [AnnBatchDataLoader(ds(r, 2), num_workers=2) for r in range(2)]
    for loader in loaders:
        seen += run(loader, 5)
    state = json.loads(json.dumps(loaders[0].state_dict()))
    one = AnnBatchDataLoader(ds(0, 1), num_workers=2)
    one.load_state_dict(state)
    n_one = len(one.dataset)
    seen += run(one, 20)
    state2 = json.loads(json.dumps(one.state_dict()))
    segs = state2["_snapshot"]["_worker_snapshots"]["worker_0"]["dataset_state"]["segments"]
    assert segs == [{"world_size": 2, "num_workers": 2, "steps": 5}]
    lens = []
    for r in range(2):
        again = AnnBatchDataLoader(ds(r, 2), num_workers=0)
        again.load_state_dict(state2)
        lens.append(len(again.dataset))
        seen += run(again)
    assert lens[0] == lens[1]
    assert n_one > 25
    c = Counter(seen)
    assert max(c.values()) == 1
    assert N_OBS - len(c) < 2 * elastic_ddp.PLAN["batch_size"]
