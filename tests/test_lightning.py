"""AnnBatchDataModule: write-once ``prepare_data`` (also with two racing processes), the
validation split, state_dict, and real ``lightning.pytorch.Trainer`` runs on CPU: epochs
advance in the workers with persistent workers on and off, and a 2-process DDP fit sees
every cell at most once per epoch with equal step counts per rank."""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

import annbatch_torch as abt  # noqa: E402
from annbatch_torch import A, AnnBatchDataModule, CollectionError, sampling  # noqa: E402
from annbatch_torch.lightning import store_is_current, store_staleness  # noqa: E402
from annbatch_torch.loader import AnnBatchDataLoader  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from lightning_helpers import EarlyLoaderRecorder, Recorder, race_prepare  # noqa: E402
from worker_probe import epoch_converter  # noqa: E402

SIZES = [700, 500]
N_OBS = sum(SIZES)
N_VARS = 30
PLAN = {"batch_size": 32, "chunk_size": 32, "preload_nchunks": 2}
POOL = sampling.pool_rows(PLAN["batch_size"], PLAN["chunk_size"], PLAN["preload_nchunks"])
TRAINER = dict(accelerator="cpu", logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


@pytest.fixture(scope="module")
def h5ads(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    d = tmp_path_factory.mktemp("lightning_inputs")
    return abt.datasets.write_synthetic_h5ads(d, 2, SIZES, N_VARS, grouped=True, seed=0)


@pytest.fixture(scope="module")
def store(h5ads: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A current collection of ``h5ads`` (written once for the module)."""
    path = tmp_path_factory.mktemp("lightning_store") / "store"
    dm = AnnBatchDataModule(h5ads, path, collection_kwargs={"progress": False})
    dm.prepare_data()
    assert dm.store_written is True
    return path


def _dm(h5ads: list[Path], store: Path, **kwargs: Any) -> AnnBatchDataModule:
    kw: dict[str, Any] = dict(
        PLAN, selector={"x": A.X}, densify=True, collection_kwargs={"progress": False},
        dataset_kwargs={"return_index": True, "batch_converter": epoch_converter},
    )
    kw.update(kwargs)
    return AnnBatchDataModule(h5ads, store, **kw)


def _chunk_rows(chunks: np.ndarray) -> np.ndarray:
    """Global rows of these chunks, in chunk order."""
    cs = PLAN["chunk_size"]
    return sampling.global_rows(np.stack([chunks * cs, np.minimum((chunks + 1) * cs, N_OBS)],
                                         axis=1))


def _manifest_stamp(store: Path) -> tuple[int, int]:
    st = (store / "manifest.json").stat()
    return st.st_mtime_ns, st.st_ino


# -- prepare_data --------------------------------------------------------------------------
def test_prepare_data_writes_once_and_rewrites_when_inputs_change(
    h5ads: list[Path], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    dm = _dm(h5ads, store)
    assert store_staleness(store, h5ads) is not None
    dm.prepare_data()
    assert dm.store_written is True
    assert store_is_current(store, h5ads)
    stamp = _manifest_stamp(store)
    for again in (dm, _dm(h5ads, store)):  # the same and a new DataModule: nothing written
        again.prepare_data()
        assert again.store_written is False
        assert _manifest_stamp(store) == stamp
    # another sampling seed reuses the (already shuffled) store ...
    other_seed = _dm(h5ads, store, seed=3)
    other_seed.prepare_data()
    assert other_seed.store_written is False
    # ... an explicit, different offline-shuffle setting asks for another store
    other_shuffle = _dm(h5ads, store, collection_kwargs={"seed": 3, "progress": False})
    assert "seed" in (store_staleness(store, h5ads, {"seed": 3}) or "")
    other_shuffle.prepare_data()
    assert other_shuffle.store_written is True
    assert abt.open_collection(store).manifest.seed == 3
    dm.prepare_data()  # no explicit collection seed: the seed-3 store is fine
    assert dm.store_written is False
    # a field asked for in collection_kwargs that the store lacks
    assert "obsm/X_umap" in (store_staleness(store, h5ads, {"obsm": ["X_umap"]}) or "")
    assert store_staleness(store, h5ads, {"obs_columns": ["cell_type"], "layers": []}) is None
    # an input only touched (its mtime, issue 17: touch / cp without -p) keeps the store:
    # its content fingerprint is unchanged (a changed content: tests/test_prepare.py)
    st = os.stat(h5ads[0])
    os.utime(h5ads[0], ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    try:
        assert store_staleness(store, h5ads) is None
        dm.prepare_data()
        assert dm.store_written is False
        assert store_is_current(store, h5ads)
    finally:
        os.utime(h5ads[0], ns=(st.st_atime_ns, st.st_mtime_ns))
    # fewer inputs than recorded
    assert "2 inputs" in (store_staleness(store, h5ads[:1]) or "")
    assert abt.open_collection(store).n_obs == N_OBS


def test_prepare_data_never_overwrites_a_foreign_folder(h5ads: list[Path], tmp_path: Path) -> None:
    store = tmp_path / "not_a_store"
    store.mkdir()
    (store / "precious.txt").write_text("keep me")
    with pytest.raises(CollectionError, match="not an annbatch_torch collection"):
        _dm(h5ads, store).prepare_data()
    assert (store / "precious.txt").read_text() == "keep me"


def test_loaders_pin_memory_on_cuda_unless_batches_are_on_the_gpu(store: Path) -> None:
    dm = AnnBatchDataModule(None, store, batch_size=100, dataset_kwargs={"device": "cpu"})
    dm.setup("fit")
    assert dm.train_dataset is not None
    dm.trainer = SimpleNamespace(  # type: ignore[assignment]
        strategy=SimpleNamespace(root_device=torch.device("cuda")))
    assert dm._loader(dm.train_dataset, "train").pin_memory  # CPU batches: pinned
    dm.train_dataset.device = torch.device("cuda")  # as device="cuda" sets it (no CUDA here)
    assert not dm._loader(dm.train_dataset, "train").pin_memory


def test_without_inputs_the_store_is_used_as_is(store: Path, tmp_path: Path) -> None:
    dm = AnnBatchDataModule(None, store, batch_size=100)
    dm.prepare_data()
    assert dm.store_written is False
    dm.setup("fit")
    assert dm.train_dataset is not None
    with pytest.raises(CollectionError, match="no such collection folder"):
        AnnBatchDataModule(None, tmp_path / "missing").prepare_data()


def test_two_processes_racing_write_the_store_once(h5ads: list[Path], tmp_path: Path) -> None:
    store = tmp_path / "raced"
    ctx = mp.get_context("fork")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=race_prepare, args=([str(p) for p in h5ads], str(store),
                                                    barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    writers = [r for r in results if r["written"]]
    waiters = [r for r in results if not r["written"]]
    assert len(writers) == 1
    assert len(waiters) == 1
    # both started within the (slowed, >= 1 s) write; the one that did not write waited for
    # the lock and returned only once the store was complete
    assert abs(results[0]["start"] - results[1]["start"]) < 1.0
    assert waiters[0]["end"] >= writers[0]["end"] - 0.05
    assert store_is_current(store, h5ads)
    assert abt.open_collection(store).n_obs == N_OBS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raced", "raced.lock"]


# -- setup, split, loaders, state ---------------------------------------------------------
def test_val_split_is_whole_chunks_disjoint_and_seeded(h5ads: list[Path], store: Path) -> None:
    dm = _dm(h5ads, store, val_fraction=0.25)
    dm.setup("fit")
    assert dm.train_chunks is not None
    assert dm.val_chunks is not None
    n_chunks = sampling.n_chunks(N_OBS, PLAN["chunk_size"])
    assert not set(dm.train_chunks.tolist()) & set(dm.val_chunks.tolist())
    assert sorted([*dm.train_chunks.tolist(), *dm.val_chunks.tolist()]) == list(range(n_chunks))
    assert len(dm.val_chunks) == round(0.25 * n_chunks)
    train_loader, val_loader = dm.train_dataloader(), dm.val_dataloader()
    assert isinstance(train_loader, AnnBatchDataLoader)
    assert isinstance(val_loader, AnnBatchDataLoader)
    train = np.concatenate([b["index"].numpy() for b in train_loader])
    val_batches = list(val_loader)
    val = np.concatenate([b["index"].numpy() for b in val_batches])
    assert all(b["mask"].all() for b in val_batches)  # one rank: nothing to pad
    # validation: whole chunks, read in order (no shuffle); with training: every row once
    assert np.array_equal(val, np.sort(val))
    assert set((val // PLAN["chunk_size"]).tolist()) == set(dm.val_chunks.tolist())
    assert np.array_equal(np.sort(np.concatenate([train, val])), np.arange(N_OBS))
    # the split is a function of the seed
    same, other = _dm(h5ads, store, val_fraction=0.25), _dm(h5ads, store, val_fraction=0.25,
                                                            seed=1)
    same.setup("fit")
    other.setup("fit")
    assert np.array_equal(same.val_chunks, dm.val_chunks)
    assert not np.array_equal(other.val_chunks, dm.val_chunks)
    assert dm.train_dataset is not None
    assert dm.train_dataset.shuffle
    assert dm.train_dataset.even_batches == "drop"
    assert dm.val_dataset is not None
    assert not dm.val_dataset.shuffle
    assert dm.val_dataset.even_batches == "pad"


def test_eval_loaders_pad_ranks_with_a_mask(h5ads: list[Path], store: Path) -> None:
    """Validation and test over 3 ranks (rank/world size from a stand-in trainer): equal
    batch counts, every real row exactly once, padding flagged in ``mask``."""
    for stage, attr in (("fit", "val_dataloader"), ("test", "test_dataloader")):
        per_rank = []
        for rank in range(3):
            dm = _dm(h5ads, store, val_fraction=0.3)
            dm.trainer = SimpleNamespace(global_rank=rank, world_size=3,
                                         strategy=SimpleNamespace(root_device=None))
            dm.setup(stage)
            per_rank.append(list(getattr(dm, attr)()))
        assert len({len(b) for b in per_rank}) == 1
        real = np.concatenate([b["index"].numpy()[b["mask"].numpy()]
                               for r in per_rank for b in r])
        expect = np.arange(N_OBS) if stage == "test" else _chunk_rows(dm.val_chunks)
        assert np.array_equal(np.sort(real), np.sort(expect))



def test_a_test_split_and_dropped_eval_remainders(h5ads: list[Path], store: Path) -> None:
    """``test_fraction`` holds out chunks for test (disjoint from train and validation);
    predict still reads everything; ``eval_even_batches="drop"`` gives 3 ranks equal batch
    counts without padding rows, leaving out fewer than 3 batches."""
    per_rank: dict[str, list[list[dict[str, Any]]]] = {"val": [], "test": [], "predict": []}
    for rank in range(3):
        dm = _dm(h5ads, store, val_fraction=0.2, test_fraction=0.25, eval_even_batches="drop")
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=3,
                                     strategy=SimpleNamespace(root_device=None))
        dm.setup(None)
        assert dm.train_chunks is not None
        assert dm.val_chunks is not None
        assert dm.test_chunks is not None
        parts = [dm.train_chunks, dm.val_chunks, dm.test_chunks]
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(-(-N_OBS // 32)))
        assert len(dm.test_chunks) == round(0.25 * len(np.concatenate(parts)))
        per_rank["val"].append(list(dm.val_dataloader()))
        per_rank["test"].append(list(dm.test_dataloader()))
        per_rank["predict"].append(list(dm.predict_dataloader()))
    for name, chunks in (("val", dm.val_chunks), ("test", dm.test_chunks),
                         ("predict", np.arange(-(-N_OBS // 32)))):
        batches = per_rank[name]
        assert len({len(b) for b in batches}) == 1, name  # equal counts
        assert all("mask" not in b for r in batches for b in r), name  # no padding rows
        seen = np.concatenate([b["index"].numpy() for r in batches for b in r])
        want = _chunk_rows(np.asarray(chunks))
        assert len(np.unique(seen)) == len(seen), name
        assert set(seen.tolist()) <= set(want.tolist()), name
        assert len(want) - len(seen) < 3 * PLAN["batch_size"], name
    with pytest.raises(ValueError, match=r"val_fraction \+ test_fraction must be < 1"):
        _dm(h5ads, store, val_fraction=0.5, test_fraction=0.5)
    with pytest.raises(ValueError, match="eval_even_batches must be 'pad' or 'drop'"):
        _dm(h5ads, store, eval_even_batches="equal")


def test_an_opened_source_is_read_as_it_is(h5ads: list[Path], store: Path) -> None:
    """A Collection or inputs read in place as ``store_path``: nothing written, no lock."""
    for src in (abt.open_collection(store), abt.open_source(list(h5ads))):
        dm = AnnBatchDataModule(None, src, **PLAN, dataset_kwargs={"return_index": True})
        dm.prepare_data()
        assert dm.store_written is False
        dm.setup("fit")
        assert dm.collection is src
        rows = np.concatenate([b["index"].numpy() for b in dm.train_dataloader()])
        assert np.array_equal(np.sort(rows), np.arange(N_OBS))
        with pytest.raises(ValueError, match="nothing is written, so there is no lock"):
            _ = dm.lock_path
    with pytest.raises(ValueError, match="pass adata_paths=None"):
        AnnBatchDataModule(h5ads, abt.open_collection(store))


def test_setup_feeds_every_rank_and_refuses_fewer_batches_than_ranks(
    h5ads: list[Path], store: Path
) -> None:
    """1,200 rows in one pool of 1,024 + a partial one still feed 4 ranks (the last round
    of pools is split by batches); only fewer batches than ranks is refused."""
    dm = _dm(h5ads, store, preload_nchunks=32)
    dm.trainer = SimpleNamespace(global_rank=0, world_size=4,
                                 strategy=SimpleNamespace(root_device=None))
    dm.setup("fit")
    assert dm.train_dataset is not None
    n_batches = -(-dm.train_dataset.source.n_obs // PLAN["batch_size"])
    assert len(dm.train_dataset) >= (n_batches - 4) // 4 > 0
    dm = _dm(h5ads, store, batch_size=1000)
    dm.trainer = SimpleNamespace(global_rank=0, world_size=4,
                                 strategy=SimpleNamespace(root_device=None))
    with pytest.raises(ValueError, match=r"even_batches='drop' leaves out .*Fix: lower "
                                         r"batch_size .*or lower preload_nchunks"):
        dm.setup("fit")
    dm.dataset_kwargs["even_batches"] = "pad"  # the other way out
    dm.setup("fit")


def test_state_dict_restores_seed_and_epoch(h5ads: list[Path], store: Path) -> None:
    dm = _dm(h5ads, store, val_fraction=0.2, seed=4)
    dm.setup("fit")
    dm.set_epoch(3)
    state = dm.state_dict()
    assert state["seed"] == 4
    assert state["epoch"] == 3
    json.dumps(state)  # plain JSON
    # restored before setup (a manual loop) ...
    before = _dm(h5ads, store, val_fraction=0.2, seed=0)
    before.load_state_dict(state)
    before.setup("fit")
    # ... and after setup (what Lightning does when resuming): datasets are rebuilt
    after = _dm(h5ads, store, val_fraction=0.2, seed=0)
    after.setup("fit")
    after.load_state_dict(state)
    for restored in (before, after):
        assert restored.seed == 4
        assert restored.epoch == 3
        assert restored.train_dataset is not None
        assert restored.train_dataset.epoch == 3
        assert restored.train_dataset.seed == 4
        assert np.array_equal(restored.val_chunks, dm.val_chunks)
        rows = [b["index"].numpy() for b in restored.train_dataset]
        want = [b["index"].numpy() for b in dm.train_dataset]
        assert all(np.array_equal(a, b) for a, b in zip(rows, want, strict=True))
    with pytest.raises(ValueError, match="lacks"):
        dm.load_state_dict({"seed": 1})
    # the epoch set through the loader's sampler (as Lightning does) survives a new setup()
    dm.train_dataloader().sampler.set_epoch(6)
    dm.setup("fit")
    assert dm.train_dataset.epoch == 6
    assert dm.state_dict()["epoch"] == 6


def test_bad_arguments(h5ads: list[Path], store: Path) -> None:
    with pytest.raises(ValueError, match="val_fraction"):
        AnnBatchDataModule(h5ads, store, val_fraction=1.0)
    with pytest.raises(ValueError, match="num_workers"):
        AnnBatchDataModule(h5ads, store, num_workers=-1)
    with pytest.raises(ValueError, match=r"dataset_kwargs must not set \['chunk_size'\]"):
        AnnBatchDataModule(h5ads, store, dataset_kwargs={"chunk_size": 7})
    with pytest.raises(ValueError, match="batch_size"):
        AnnBatchDataModule(h5ads, store, dataloader_kwargs={"batch_size": 7})
    with pytest.raises(RuntimeError, match="setup"):
        AnnBatchDataModule(h5ads, store).train_dataloader()


# -- real Trainer runs ---------------------------------------------------------------------
def _load_train(out: Path, rank: int, epoch: int) -> dict[str, np.ndarray]:
    with np.load(out / f"train_r{rank}_e{epoch}.npz") as z:
        return {k: z[k] for k in z.files}


def _expected_batches(dm: AnnBatchDataModule, epoch: int, rank: int = 0,
                      world: int = 1) -> list[np.ndarray]:
    """The batches of (rank, epoch) computed afresh in this process, without workers."""
    assert dm.collection is not None
    ds = abt.AnnBatchDataset(dm.collection, **PLAN, seed=dm.seed, return_index=True,
                             chunk_ids=dm.train_chunks, rank=rank, world_size=world)
    ds.set_epoch(epoch)
    return [b["index"].numpy() for b in ds]


@pytest.mark.parametrize("persistent", [True, False])
def test_trainer_advances_epochs_in_workers(
    h5ads: list[Path], store: Path, tmp_path: Path, persistent: bool
) -> None:
    epochs = 3
    dm = _dm(h5ads, store, num_workers=2, val_fraction=0.2, seed=2,
             dataloader_kwargs={"persistent_workers": persistent})
    model = Recorder(str(tmp_path), N_VARS)
    pl.Trainer(devices=1, max_epochs=epochs, **TRAINER).fit(model, datamodule=dm)
    assert dm.store_written is False
    orders, pids = [], []
    for e in range(epochs):
        rec = _load_train(tmp_path, 0, e)
        # the workers' own dataset copies were at the trainer's epoch ...
        assert rec["worker_epoch"].tolist() == [e] * len(rec["sizes"])
        assert os.getpid() not in rec["worker_pid"].tolist()
        # ... and produced exactly that epoch's batches (the set; workers interleave them)
        want = _expected_batches(dm, e)
        got = np.split(rec["index"], np.cumsum(rec["sizes"])[:-1])
        assert sorted(map(tuple, got)) == sorted(map(tuple, want))
        assert np.array_equal(np.sort(rec["index"]), np.sort(np.concatenate(want)))
        orders.append(rec["index"])
        pids.append(set(rec["worker_pid"].tolist()))
    for a, b in itertools.pairwise(orders):
        assert not np.array_equal(a, b)
    # persistent workers live across epochs; otherwise every epoch has fresh ones
    assert (pids[0] == pids[1] == pids[2]) is persistent
    with np.load(tmp_path / "val_r0_n0.npz") as z:
        assert z["mask"].all()
        assert not set(z["index"].tolist()) & set(orders[0].tolist())


@pytest.mark.parametrize("num_workers", [1, 2])
def test_trainer_validate_test_and_predict(h5ads: list[Path], store: Path,
                                           tmp_path: Path, num_workers: int) -> None:
    """Validation and prediction read in order, also with several workers."""
    dm = _dm(h5ads, store, num_workers=num_workers, val_fraction=0.2)
    model = Recorder(str(tmp_path), N_VARS)
    trainer = pl.Trainer(devices=1, **TRAINER)
    trainer.validate(model, datamodule=dm)
    with np.load(tmp_path / "val_r0_n0.npz") as z:
        assert np.array_equal(z["index"], _chunk_rows(dm.val_chunks))  # in order
    preds = trainer.predict(model, datamodule=dm)
    assert preds is not None
    idx = np.concatenate([p["index"].numpy()[p["mask"].numpy()] for p in preds])
    assert np.array_equal(idx, np.arange(N_OBS))  # in order, every row once


@pytest.mark.parametrize(("num_workers", "early_loader"), [(0, False), (2, False), (2, True)])
def test_resume_from_checkpoint_restores_seed_and_epoch(
    h5ads: list[Path], store: Path, tmp_path: Path, num_workers: int, early_loader: bool
) -> None:
    """Lightning creates the first epoch's iterator before it calls ``set_epoch``; after a
    resume that epoch is 1, not 0, and the workers must still see it. With
    ``early_loader`` the model reads ``trainer.estimated_stepping_batches``, so Lightning
    builds the train loader even before it restores its loops."""
    module = EarlyLoaderRecorder if early_loader else Recorder
    cb = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    kw = {**TRAINER, "enable_checkpointing": True, "default_root_dir": tmp_path}
    first = _dm(h5ads, store, seed=5, num_workers=num_workers)
    pl.Trainer(devices=1, max_epochs=1, callbacks=[cb], **kw).fit(
        module(str(tmp_path), N_VARS), datamodule=first)
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    resumed = _dm(h5ads, store, seed=0, num_workers=num_workers)  # the checkpoint's seed wins
    out = tmp_path / "resumed"
    out.mkdir()
    pl.Trainer(devices=1, max_epochs=2, **kw).fit(
        module(str(out), N_VARS), datamodule=resumed, ckpt_path=ckpt)
    assert resumed.seed == 5
    assert not (out / "train_r0_e0.npz").exists()  # epoch 0 was not repeated
    rec = _load_train(out, 0, 1)
    want = _expected_batches(first, 1)
    if num_workers:
        assert rec["worker_epoch"].tolist() == [1] * len(want)
        got = np.split(rec["index"], np.cumsum(rec["sizes"])[:-1])
        assert sorted(map(tuple, got)) == sorted(map(tuple, want))
    else:
        assert np.array_equal(rec["index"], np.concatenate(want))


@pytest.mark.slow
def test_ddp_two_ranks(h5ads: list[Path], store: Path, tmp_path: Path) -> None:
    world, epochs = 2, 2
    stamp = _manifest_stamp(store)
    dm = _dm(h5ads, store, num_workers=1, val_fraction=0.2, seed=7)
    model = Recorder(str(tmp_path), N_VARS)
    trainer = pl.Trainer(devices=world, strategy="ddp_spawn", max_epochs=epochs, **TRAINER)
    trainer.fit(model, datamodule=dm)
    # the store was current: rank 0 (the only one that prepares) did not rewrite it
    assert json.loads((tmp_path / "fit_r0.json").read_text())["store_written"] is False
    assert json.loads((tmp_path / "fit_r1.json").read_text())["store_written"] is None
    assert _manifest_stamp(store) == stamp
    dm.setup("fit")  # the same split, computed here
    assert dm.train_chunks is not None
    train_rows = _chunk_rows(dm.train_chunks)
    orders = []
    for e in range(epochs):
        recs = [_load_train(tmp_path, r, e) for r in range(world)]
        steps = [len(r["sizes"]) for r in recs]
        assert steps[0] == steps[1] > 0  # equal steps: no rank waits for the other
        assert steps[0] == sampling.batches_per_rank(
            N_OBS, **PLAN, world_size=world, chunk_ids=dm.train_chunks)
        for r, rec in enumerate(recs):
            assert rec["worker_epoch"].tolist() == [e] * steps[r]
            want = np.concatenate(_expected_batches(dm, e, rank=r, world=world))
            assert np.array_equal(np.sort(rec["index"]), np.sort(want))
        seen = np.concatenate([r["index"] for r in recs])
        assert len(np.unique(seen)) == len(seen)  # every cell at most once across ranks
        assert set(seen.tolist()) <= set(train_rows.tolist())
        assert len(train_rows) - len(seen) < world * POOL  # documented drop bound
        orders.append(recs[0]["index"])
    assert not np.array_equal(orders[0], orders[1])
    # validation after each epoch: padded to equal counts, real rows exactly once
    for n in range(epochs):
        vals = []
        for r in range(world):
            with np.load(tmp_path / f"val_r{r}_n{n}.npz") as z:
                vals.append((z["index"], z["mask"]))
        assert len(vals[0][0]) == len(vals[1][0])
        real = np.concatenate([i[m] for i, m in vals])
        assert set(real.tolist()).isdisjoint(train_rows.tolist())
        assert len(np.unique(real)) == len(real) == N_OBS - len(train_rows)
