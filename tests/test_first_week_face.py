"""What a user meets in the first week (issue 29 items 4 and 10, review findings R2, R4): the
DataModule's split on a small collection, SCANVI's registry, ``-q`` anywhere, a tiny demo,
the flags named in the library's messages, ``python -m annbatch_torch.cli.demo``."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("lightning.pytorch")

import annbatch_torch as abt
from annbatch_torch import A, AnnBatchDataModule, sampling
from annbatch_torch.cli.main import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def h5ads(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """700 cells, and 50 others (an input to append) of the same 20 genes."""
    d = tmp_path_factory.mktemp("first_week_in")
    return abt.datasets.write_synthetic_h5ads(d, 2, [700, 50], 20, seed=0)


@pytest.fixture(scope="module")
def h5ad_700(h5ads: list[Path]) -> Path:
    return h5ads[0]


@pytest.fixture(scope="module")
def h5ad_new(h5ads: list[Path]) -> Path:
    return h5ads[1]


@pytest.fixture(scope="module")
def store_700(h5ad_700: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("first_week_store") / "store"
    abt.create_anndata_collection([h5ad_700], path, progress=False)
    return path


@pytest.fixture(scope="module")
def store_20k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 chunks of 512 rows: a collection whose split is whole chunks, as before."""
    d = tmp_path_factory.mktemp("first_week_big")
    paths = abt.datasets.write_synthetic_h5ads(d / "in", 1, [20_000], 4, seed=1)
    abt.create_anndata_collection(paths, d / "store", progress=False)
    return d / "store"


def _dm(store: Path, **kw: Any) -> AnnBatchDataModule:
    kw.setdefault("batch_size", 32)
    return AnnBatchDataModule(None, store, selector={"x": A.X},
                              dataset_kwargs={"return_index": True}, **kw)


def _rows(loader: Any) -> list[np.ndarray]:
    """Each batch's real rows (padding rows, flagged False under "mask", left out)."""
    out = []
    for b in loader:
        idx = b["index"].numpy()
        if "mask" in b:
            idx = idx[b["mask"].numpy().astype(bool)]
        out.append(idx)
    return out


def _split_rows(dm: AnnBatchDataModule) -> tuple[set[int], set[int], set[int]]:
    dm.setup(None)
    train = np.concatenate(_rows(dm.train_dataloader()))
    assert len(np.unique(train)) == len(train)  # each training row once
    val = np.concatenate(_rows(dm.val_dataloader()) or [np.zeros(0, np.int64)])
    test = (np.concatenate(_rows(dm.test_dataloader())) if dm.test_fraction
            else np.zeros(0, np.int64))
    for rows in (val, test):
        assert len(np.unique(rows)) == len(rows)
    return set(train.tolist()), set(val.tolist()), set(test.tolist())


# -- item 4: the split of a small collection ----------------------------------------------
@pytest.mark.parametrize(("val", "test"), [(0.1, 0.0), (0.1, 0.1), (0.2, 0.05)])
def test_a_small_collection_holds_out_near_the_fractions_asked(
        store_700: Path, val: float, test: float, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="annbatch_torch"):
        dm = _dm(store_700, val_fraction=val, test_fraction=test, seed=4)
        train, held_val, held_test = _split_rows(dm)
    assert train | held_val | held_test == set(range(700))  # every row in one split
    assert not train & held_val
    assert not train & held_test
    assert not held_val & held_test
    for frac, rows in ((val, held_val), (test, held_test)):
        if frac:
            assert frac / 2 <= len(rows) / 700 <= 2 * frac, (frac, len(rows))
        else:
            assert not rows
    assert dm.val_chunks is not None
    assert dm.train_chunks is not None
    assert dm.split_chunk_size < dm.chunk_size  # 512-row chunks: too coarse for 700 cells
    assert sampling.chunk_rows(700, dm.split_chunk_size, dm.val_chunks) == len(held_val)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # deterministic from the seed; another seed holds out other rows
    assert _split_rows(_dm(store_700, val_fraction=val, test_fraction=test, seed=4)) == (
        train, held_val, held_test)
    assert _split_rows(_dm(store_700, val_fraction=val, test_fraction=test, seed=5))[1] != (
        held_val)


def test_a_small_split_over_ranks_and_after_a_restored_seed(store_700: Path) -> None:
    """Two ranks: equal batch counts, disjoint rows, validation every held-out row once; a
    DataModule that restores another seed from a checkpoint splits as that seed does."""
    per_rank: list[tuple[list[np.ndarray], list[np.ndarray]]] = []
    for rank in range(2):
        dm = _dm(store_700, val_fraction=0.1, seed=2)
        dm.trainer = SimpleNamespace(  # type: ignore[assignment]
            global_rank=rank, world_size=2, strategy=SimpleNamespace(root_device=None))
        dm.setup("fit")
        per_rank.append((_rows(dm.train_dataloader()), _rows(dm.val_dataloader())))
    (train0, val0), (train1, val1) = per_rank
    assert len(train0) == len(train1)
    assert len(val0) == len(val1)
    t0, t1 = set(np.concatenate(train0).tolist()), set(np.concatenate(train1).tolist())
    assert not t0 & t1
    seen_val = np.concatenate(val0 + val1)
    assert len(np.unique(seen_val)) == len(seen_val)
    _, val_one_rank, _ = _split_rows(_dm(store_700, val_fraction=0.1, seed=2))
    assert set(seen_val.tolist()) == val_one_rank
    assert not (t0 | t1) & val_one_rank
    assert 35 <= len(val_one_rank) <= 140

    other = _dm(store_700, val_fraction=0.1, seed=9)
    other.setup("fit")
    other.load_state_dict({"version": 1, "seed": 2, "epoch": 0})
    assert set(np.concatenate(_rows(other.val_dataloader())).tolist()) == val_one_rank


def test_a_sampler_draws_from_the_small_training_split_only(store_700: Path) -> None:
    dm = _dm(store_700, val_fraction=0.2, sampler=abt.WeightedSampler(np.ones(700),
                                                                       num_samples=2000))
    dm.setup("fit")
    drawn = set(np.concatenate(_rows(dm.train_dataloader())).tolist())
    val = set(np.concatenate(_rows(dm.val_dataloader())).tolist())
    assert 70 <= len(val) <= 280
    assert not drawn & val
    assert len(drawn) > 400  # 2,000 draws with replacement from ~560 rows


def test_an_unreachable_fraction_is_warned_with_both_fractions(
        store_700: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="annbatch_torch"):
        dm = _dm(store_700, val_fraction=0.0001)
        dm.setup("fit")
    [rec] = [r for r in caplog.records if r.levelno == logging.WARNING]
    msg = rec.getMessage()
    assert "val_fraction=0.0001" in msg
    assert "1 of 700 rows" in msg
    assert "0.0014" in msg
    assert str(store_700) in msg


def test_a_large_collection_splits_whole_chunks_as_before(
        store_20k: Path, caplog: pytest.LogCaptureFixture) -> None:
    for val, test, seed in ((0.05, 0.0, 0), (0.1, 0.1, 3), (0.2, 0.05, 7)):
        with caplog.at_level(logging.WARNING, logger="annbatch_torch"):
            dm = _dm(store_20k, val_fraction=val, test_fraction=test, seed=seed)
            dm.setup(None)
        assert not caplog.records
        old = sampling.split_chunks3(20_000, 512, val, test, seed)
        assert dm.split_chunk_size == dm.chunk_size == 512
        for got, want in zip((dm.train_chunks, dm.val_chunks, dm.test_chunks), old,
                             strict=True):
            assert np.array_equal(got, want)
        assert dm.train_dataset is not None
        assert (dm.train_dataset.chunk_size, dm.train_dataset.preload_nchunks) == (512, 32)


def test_many_chunks_keep_whole_chunks_and_warn_a_missed_fraction(
        store_20k: Path, caplog: pytest.LogCaptureFixture) -> None:
    """More than FEW_CHUNKS chunks (here 20,000 rows in 157 chunks of 128): a fraction whole
    chunks miss by more than 2x keeps the whole-chunk split (checkpoints of runs on it stay
    valid) and is warned about, naming the fraction and the rows held out."""
    with caplog.at_level(logging.WARNING, logger="annbatch_torch"):
        dm = _dm(store_20k, chunk_size=128, val_fraction=0.001, seed=2)
        dm.setup("fit")
    assert dm.split_chunk_size == 128
    old = sampling.split_chunks3(20_000, 128, 0.001, 0.0, 2)
    assert np.array_equal(dm.val_chunks, old[1])
    assert np.array_equal(dm.train_chunks, old[0])
    [rec] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "val_fraction=0.001" in rec.getMessage()
    assert "128 of 20000 rows" in rec.getMessage()


def test_scvi_split_sizes_follow_the_small_split(store_700: Path) -> None:
    pytest.importorskip("scvi")
    from annbatch_torch.integrations.scvi import SCVIDataModule

    dm = SCVIDataModule(abt.open_collection(store_700), batch_size=32, train_size=0.9,
                        check_counts=False)
    assert dm.n_train + dm.n_val == 700
    assert 35 <= dm.n_val <= 140
    dm.setup("fit")
    val = np.concatenate([b["ind_x"].numpy().ravel() for b in dm.val_dataloader()])
    assert len(val) <= dm.n_val  # eval drops its remainder (no padding for scvi-tools)


# -- item 10a: SCANVI's registry -------------------------------------------------------------
def test_the_documented_scanvi_call_builds_a_model(store_700: Path) -> None:
    """The call the registry's docstring shows for SCANVI works with the real scvi-tools
    (``SCANVI(registry=dm.registry)`` alone fails inside scvi-tools: it needs the
    DataModule for the labels)."""
    scvi = pytest.importorskip("scvi")
    from annbatch_torch.integrations.scvi import SCVIDataModule

    doc = SCVIDataModule.registry.__doc__ or ""
    calls = re.findall(r"``(SCANVI\([^`]*\))``", doc)
    assert calls, doc
    dm = SCVIDataModule(abt.open_collection(store_700), labels_key="cell_type",
                        model_name="SCANVI", batch_size=32, check_counts=False)
    model = eval(calls[0].replace("...", "dm.registry"),  # the docstring's call
                 {"SCANVI": scvi.model.SCANVI, "dm": dm})
    assert model.module.n_labels == dm.n_labels
    assert "datamodule=dm" in (SCVIDataModule.__doc__ or "")


# -- item 10b: -q anywhere --------------------------------------------------------------------
def test_quiet_anywhere_on_the_line(h5ad_700: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    for i, argv in enumerate((["-q", "shuffle"], ["shuffle", "-q"], ["shuffle", "--quiet"])):
        out = tmp_path / f"store{i}"
        args = [*argv, str(h5ad_700), "-o", str(out), "--no-progress"]
        if i == 2:
            args = ["shuffle", str(h5ad_700), "-o", str(out), "--no-progress", "--quiet"]
        assert main(args) == 0, capsys.readouterr().err
        err = capsys.readouterr().err
        assert "INFO" not in err, (argv, err)
    assert main(["info", str(tmp_path / "store0"), "-q"]) == 0
    assert "700" in capsys.readouterr().out
    assert main(["shuffle", str(h5ad_700), "-o", str(tmp_path / "loud"), "--no-progress"]) == 0
    assert "INFO" in capsys.readouterr().err  # without -q: the writer's INFO lines
    assert main(["--", "-q"]) == 2  # after "--" it is no option


# -- item 10c: a demo too small to hold out a chunk --------------------------------------------
def test_a_tiny_demo_holds_out_cells(capsys: pytest.CaptureFixture[str], tmp_path: Path
                                     ) -> None:
    assert main(["demo", "--n-obs", "100", "--n-vars", "50", "--workers", "0", "-q",
                 "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    m = re.search(r"held-out accuracy: [\d.]+ on ([\d,]+) cells", out)
    assert m, out
    assert int(m.group(1).replace(",", "")) >= 1


# -- R2: the flags in the library's messages --------------------------------------------------
@pytest.mark.parametrize(("argv", "expected"), [
    (["shuffle", "IN", "-o", "OUT", "--seed", "-1"],
     "--seed must be an integer >= 0, got -1."),
    (["append", "STORE", "NEW", "--seed", "-1"], "--seed must be an integer >= 0, got -1."),
    (["shuffle", "IN", "-o", "OUT", "--shard-size", "0"], "--shard-size 0 must be a positive"),
    (["shuffle", "IN", "-o", "OUT", "--chunk-elems", "0"],
     "--chunk-elems must be an integer >= 1 (default 65536), got 0."),
    (["shuffle", "IN", "-o", "OUT", "--shard-elems", "-1"],
     "--shard-elems must be an integer >= 0 (0: one file per chunk; default 8388608), got -1."),
    (["shuffle", "IN", "-o", "OUT", "--scheduler", "threads", "--n-workers", "0"],
     "--n-workers must be an integer >= 1, got 0."),
    (["append", "STORE", "NEW", "--scheduler", "threads", "--n-workers", "0"],
     "--n-workers must be an integer >= 1, got 0."),
])
def test_checked_integers_name_their_flag(argv: list[str], expected: str, h5ad_700: Path,
                                          h5ad_new: Path, store_700: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"  # a copy: a failed check must not reach the shared one
    shutil.copytree(store_700, store)
    subst = {"IN": str(h5ad_700), "OUT": str(tmp_path / "out"), "STORE": str(store),
             "NEW": str(h5ad_new)}
    rc = main([subst.get(a, a) for a in argv] + ["--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2, err
    line = [x for x in err.splitlines() if x.startswith("annbatch-torch: error:")][-1]
    assert expected in line, line
    assert "None" not in line
    assert not re.search(r"(?<![\w-])(seed|n_workers|zarr_\w+|n_obs_per_shard)\b", line), line


def test_a_none_note_reads_as_leaving_the_flag_out() -> None:
    """A flag whose absence means None: the note says to leave the flag out."""
    from annbatch_torch.cli.args import CliParser, speak_cli

    p = CliParser(prog="x")
    sub = p.add_subparsers(parser_class=CliParser)
    cmd = sub.add_parser("run")
    p.commands["run"] = cmd
    cmd.feed("--seed", param="seed", type=int, default=None)
    cmd.feed("--cache-size", param="cache_size", type=int, default=5)
    assert speak_cli("seed must be an integer >= 0 (or None for a fresh random seed), got "
                     "-1.", p) == ("--seed must be an integer >= 0 (or leave --seed out for "
                                   "a fresh random seed), got -1.")
    assert speak_cli("cache_size must be an integer >= 1 (or None), got 0.", p) == (
        "--cache-size must be an integer >= 1, got 0.")
    assert speak_cli("a.h5ad: seed must be an integer >= 0, got -1.", p) == (
        "a.h5ad: --seed must be an integer >= 0, got -1.")
    assert speak_cli("the seed of a.h5ad is kept.", p) == "the seed of a.h5ad is kept."
    # a word that only happens to be a parameter's name, inside a sentence, stays
    assert speak_cli("obs column seed must be categorical.", p) == (
        "obs column seed must be categorical.")
    from annbatch_torch.cli.main import build_parser

    real = build_parser()  # --raw feeds raw; a sentence that is no check stays
    assert speak_cli("raw holds one matrix, X.", real) == "raw holds one matrix, X."
    assert speak_cli("seed must be an integer >= 0 (or None for a fresh random seed), got "
                     "-1.", real) == "--seed must be an integer >= 0, got -1."


# -- R4: python -m annbatch_torch.cli.demo -----------------------------------------------------
def test_the_demo_module_runs_as_a_script() -> None:
    r = subprocess.run([sys.executable, "-m", "annbatch_torch.cli.demo", "--help"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: annbatch-torch demo")
    assert "--n-obs" in r.stdout
    r = subprocess.run([sys.executable, "-m", "annbatch_torch.cli.demo", "--n-obs", "1"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert r.returncode == 2
    assert "annbatch-torch: error: argument --n-obs" in r.stderr
