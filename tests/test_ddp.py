"""AnnBatchDataset under real multi-process DDP (``gloo`` on CPU): ``torch.multiprocessing``
spawn and a ``torchrun``-launched script. Each rank runs ``DataLoader(num_workers=2)`` and
an ``all_reduce`` after every batch (see ``tests/ddp_script.py``)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch.multiprocessing as tmp

from annbatch_torch import sampling

sys.path.insert(0, str(Path(__file__).parent))
import ddp_script
from conftest import run_ranks

WORLD = 2
SIZES = [700, 450, 333]  # 1483 rows: 23 full pools of 64 rows and a ragged one of 11
N_OBS = sum(SIZES)


def free_port() -> int:
    """A TCP port that was free a moment ago (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def h5ads(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    d = tmp_path_factory.mktemp("ddp_inputs")
    rng = np.random.default_rng(0)
    paths = []
    for i, n in enumerate(SIZES):
        x = sp.random(n, 20, density=0.2, format="csr", dtype=np.float32, random_state=rng)
        a = ad.AnnData(x, obs=pd.DataFrame(index=[f"f{i}_{j}" for j in range(n)]),
                       var=pd.DataFrame(index=[f"g{k}" for k in range(20)]))
        p = d / f"part{i}.h5ad"
        a.write_h5ad(p)
        paths.append(str(p))
    return paths


def _load(out: Path) -> list[dict[str, Any]]:
    ranks = []
    for r in range(WORLD):
        with np.load(out / f"rank{r}.npz") as z:
            res: dict[str, dict[str, Any]] = {}
            for key in z.files:
                case, field = key.split("/")
                res.setdefault(case, {})[field] = z[key]
            ranks.append(res)
    return ranks


def _rank_share(rank: int, epoch: int) -> np.ndarray:
    """The rows the plan gives ``rank`` under even_batches="drop", batch by batch."""
    bs = ddp_script.PLAN["batch_size"]
    items = sampling.rank_items(N_OBS, **ddp_script.PLAN, shuffle=True, seed=ddp_script.SEED,
                                epoch=epoch, rank=rank, world_size=WORLD, even_batches="drop")
    out = []
    for it in items:
        perm = sampling.item_permutation(it, seed=ddp_script.SEED, epoch=epoch, shuffle=True)
        rows = sampling.global_rows(it.ranges)
        out += [rows[sampling.batch_positions(it, b, bs, perm)]
                for b in range(it.batch_start, it.batch_stop)]
    return np.concatenate(out)


def _check_drop_case(ranks: list[dict[str, Any]], case: str, epoch: int = 0) -> np.ndarray:
    """Disjoint ranks, equal batch counts, coverage complete but for < WORLD batches."""
    res = [r[case] for r in ranks]
    for r, x in enumerate(res):  # each rank yields exactly the rows its plan gives it
        share = _rank_share(r, epoch)
        assert sorted(x["index"].tolist()) == sorted(share.tolist()), case
    for r, x in enumerate(res):
        assert int(x["rank"]) == r, case
        assert int(x["world_size"]) == WORLD, case
        assert len(x["sizes"]) == int(x["len"]), case  # len(ds) is the per-rank count
        assert x["all_counts"].tolist() == [len(x["sizes"])] * WORLD, case
        assert len(np.unique(x["index"])) == len(x["index"]), case
    seen = np.concatenate([x["index"] for x in res])
    assert len(np.unique(seen)) == len(seen), f"{case}: ranks overlap"
    assert seen.min() >= 0
    assert seen.max() < N_OBS
    missing = N_OBS - len(seen)  # drop: fewer than WORLD batches in all
    assert 0 <= missing < WORLD * ddp_script.PLAN["batch_size"], case
    expect = sampling.batches_per_rank(N_OBS, world_size=WORLD, **ddp_script.PLAN)
    assert all(len(x["sizes"]) == expect for x in res), case
    return np.concatenate([x["index"] for x in res])


@pytest.mark.slow
def test_spawned_gloo_group(h5ads: list[str], tmp_path: Path) -> None:
    tmp.spawn(ddp_script.spawn_entry, args=(WORLD, free_port(), h5ads, str(tmp_path)),
              nprocs=WORLD, join=True)
    ranks = _load(tmp_path)
    e0 = _check_drop_case(ranks, "drop_e0")
    e1 = _check_drop_case(ranks, "drop_e1", epoch=1)
    assert not np.array_equal(e0, e1)  # set_epoch changes the order
    assert len(e0) < N_OBS  # this layout drops: 22 pools dealt whole, 3 tail batches split 1+1
    # constructed before init_process_group: resolved once the group exists, with forked and
    # with spawned workers, and with no workers; all give the very same per-rank stream
    for case in ("before_fork", "before_spawn", "no_workers"):
        _check_drop_case(ranks, case)
        for r in range(WORLD):
            np.testing.assert_array_equal(
                np.sort(ranks[r][case]["index"]), np.sort(ranks[r]["drop_e0"]["index"])
            )
    # even_batches="pad": equal counts and every real row exactly once across ranks
    pad = [r["pad"] for r in ranks]
    assert pad[0]["all_counts"].tolist() == [len(pad[0]["sizes"])] * WORLD
    assert len(pad[0]["sizes"]) == len(pad[1]["sizes"]) == int(pad[0]["len"])
    real = np.concatenate([x["index"][x["mask"]] for x in pad])
    assert np.array_equal(np.sort(real), np.arange(N_OBS))
    assert sum(int((~x["mask"]).sum()) for x in pad) > 0  # this layout does need padding


@pytest.mark.slow
def test_torchrun_script(h5ads: list[str], tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
        f"--nproc_per_node={WORLD}", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        str(Path(__file__).parent / "ddp_script.py"), "--out", str(tmp_path), *h5ads,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_ranks(cmd, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = _load(tmp_path)
    e0 = _check_drop_case(ranks, "e0")
    e1 = _check_drop_case(ranks, "e1", epoch=1)
    assert not np.array_equal(e0, e1)
