"""The shuffle-quality report (``diversity_report``, ``annbatch-torch diversity``): its figures
are those of the batches the loader actually yields, and known values on constructed data."""

from __future__ import annotations

import json
import math
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import annbatch_torch as abt
from annbatch_torch import A
from annbatch_torch.cli.main import main
from annbatch_torch.sampling.diversity import count_batches, entropy, presence

K_RUNS, RUN = 8, 64  # classes of the constructed collection, rows of each class's run


@pytest.fixture(scope="module")
def runs_collection(tmp_path_factory: pytest.TempPathFactory) -> abt.Collection:
    """Unshuffled: class k is rows [k * 64, (k + 1) * 64) (one class per 64-row chunk), plus
    a ``mixed`` column cycling through 4 values (each 64 rows hold 16 of each), an int
    column ``plate`` (row // 128), a bool ``flag`` (row % 3 == 0), a float ``dose`` of whole
    numbers and NaN (a nullable integer column) and a float ``score`` (not classes)."""
    n = K_RUNS * RUN
    rng = np.random.default_rng(0)
    x = sp.random(n, 5, density=0.5, format="csr", dtype=np.float32, random_state=rng)
    obs = pd.DataFrame({
        "cell_type": pd.Categorical.from_codes(np.repeat(np.arange(K_RUNS), RUN),
                                               [f"c{k}" for k in range(K_RUNS)]),
        "mixed": pd.Categorical.from_codes(np.arange(n) % 4, ["a", "b", "c", "d"]),
        "plate": (np.arange(n) // 128).astype(np.int32),
        "flag": np.arange(n) % 3 == 0,
        "dose": np.where(np.arange(n) % 5 == 0, np.nan, np.arange(n) % 3).astype(np.float32),
        "score": (np.arange(n) / 7).astype(np.float32),
    }, index=[f"r{i}" for i in range(n)])
    folder = tmp_path_factory.mktemp("runs")
    ad.AnnData(x, obs=obs).write_h5ad(folder / "in.h5ad")
    return abt.create_anndata_collection([folder / "in.h5ad"], folder / "store", shuffle=False,
                                         progress=False)


def _runs_dataset(coll: abt.Collection, **kw: object) -> abt.AnnBatchDataset:
    return abt.AnnBatchDataset(coll, batch_size=RUN, chunk_size=RUN, preload_nchunks=1, **kw)


def test_one_class_per_batch_gives_the_known_figures(runs_collection: abt.Collection) -> None:
    """chunk = batch = one class's run: every batch holds one class (entropy 0, 1 class),
    while a random batch of 64 of 512 rows (64 per class) almost surely holds all 8."""
    ds = _runs_dataset(runs_collection)
    row = abt.diversity_report(ds, "cell_type", None).loc["cell_type"]
    assert row["batches"] == K_RUNS
    assert row["rows"] == K_RUNS * RUN
    assert row["classes"] == K_RUNS
    assert row["entropy"] == 0.0
    assert row["entropy_ratio"] == 0.0
    assert row["distinct"] == 1.0
    n, k = K_RUNS * RUN, RUN  # P(a class absent) = C(n - k, 64) / C(n, 64)
    absent = math.comb(n - k, RUN) / math.comb(n, RUN)
    assert row["random_distinct"] == pytest.approx(K_RUNS * (1 - absent), rel=1e-9)
    assert row["random_entropy"] == pytest.approx(math.log(K_RUNS), rel=0.05)
    assert row["share_error"] == pytest.approx(0.0, abs=1e-12)  # the whole epoch
    classes = abt.diversity_report(ds, "cell_type", None, per="class").loc["cell_type"]
    np.testing.assert_allclose(classes["in_batches"], 1 / K_RUNS)
    np.testing.assert_allclose(classes["batch_share"], 1 / K_RUNS)
    np.testing.assert_allclose(classes["collection_share"], 1 / K_RUNS)
    assert list(classes["collection_cells"]) == [RUN] * K_RUNS
    # a pool of all 8 chunks mixes them into batches of (nearly) every class
    mixed = abt.AnnBatchDataset(runs_collection, batch_size=RUN, chunk_size=RUN,
                                preload_nchunks=K_RUNS)
    assert abt.diversity_report(mixed, "cell_type", None).loc["cell_type",
                                                               "entropy_ratio"] > 0.9


def test_evenly_mixed_batches_beat_random_ones(runs_collection: abt.Collection) -> None:
    """``mixed`` cycles a, b, c, d: every unshuffled 64-row batch holds 16 of each, the
    highest entropy there is (log 4), above random batches' mean."""
    ds = abt.AnnBatchDataset(runs_collection, batch_size=RUN, chunk_size=RUN,
                             preload_nchunks=1, shuffle=False)
    per_batch = abt.diversity_report(ds, "mixed", None, per="batch").loc["mixed"]
    np.testing.assert_allclose(per_batch["entropy"], math.log(4))
    assert (per_batch["distinct"] == 4).all()
    assert (per_batch["entropy_ratio"] > 1.0).all()


def test_integer_and_bool_columns_are_classes(runs_collection: abt.Collection) -> None:
    ds = _runs_dataset(runs_collection, shuffle=False)
    report = abt.diversity_report(ds, ["plate", "flag"], None)
    assert report.loc["plate", "classes"] == 4
    assert report.loc["plate", "distinct"] == 1.0
    assert report.loc["flag", "classes"] == 2
    assert report.loc["flag", "distinct"] == 2.0
    classes = abt.diversity_report(ds, ["plate", "flag"], None, per="class")
    assert list(classes.loc["plate"].index) == [0, 1, 2, 3]
    assert list(classes.loc["flag", "collection_cells"]) == [512 - 171, 171]


def test_whole_number_floats_are_classes_other_floats_are_refused(
        runs_collection: abt.Collection) -> None:
    ds = _runs_dataset(runs_collection, shuffle=False)
    classes = abt.diversity_report(ds, "dose", None, per="class").loc["dose"]
    assert list(classes.index[:3]) == [0.0, 1.0, 2.0]
    assert pd.isna(classes.index[3])
    n = K_RUNS * RUN
    missing = int((np.arange(n) % 5 == 0).sum())
    assert classes["collection_cells"].iloc[3] == missing
    assert int(classes["collection_cells"].sum()) == n
    with pytest.raises(abt.SchemaError, match=r"'score' holds float32 values that are not "
                       r"whole numbers.*\['cell_type', 'mixed', 'plate', 'flag'\]"):
        abt.diversity_report(ds, "score")


def test_identifier_columns_are_refused(runs_collection: abt.Collection,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import annbatch_torch.diversity as div

    monkeypatch.setattr(div, "MAX_CLASSES", 3)
    with pytest.raises(abt.SchemaError, match=r"'plate' holds 4 distinct values.*identifier"):
        abt.diversity_report(_runs_dataset(runs_collection), "plate")


def test_padding_batches_are_left_out(imbalanced_collection: abt.Collection) -> None:
    """even_batches="pad": a rank short of batches yields masked repeats; the report judges
    the data batches only, and they are the loader's, batch for batch."""
    k = len(imbalanced_collection.categories("cell_type"))
    padded = 0
    for rank in range(5):
        ds = abt.AnnBatchDataset(imbalanced_collection, selector={"y": A.obs["cell_type"]},
                                 batch_size=256, chunk_size=32, preload_nchunks=8, rank=rank,
                                 world_size=5, even_batches="pad")
        got = list(torch.utils.data.DataLoader(ds, batch_size=None))
        real = [b["y"].numpy().astype(np.int64) for b in got if b["mask"].any()]
        padded += len(got) - len(real)
        report = abt.diversity_report(ds, "cell_type", None, per="batch").loc["cell_type"]
        assert len(report) == len(real)
        np.testing.assert_allclose(report["entropy"],
                                   entropy(np.stack([np.bincount(b, minlength=k)
                                                     for b in real])), atol=1e-12)
    assert padded > 0  # the case was met


def test_presence_is_exact_at_atlas_scale() -> None:
    """Rare classes in 10^7 and 10^8 rows, against the product computed in 60-digit
    decimals (scipy's ``1 - hypergeom.pmf(0, ...)`` is off by 1e-6 relative here, and a
    difference of lgamma values of huge numbers would be too)."""
    from decimal import Decimal, localcontext

    def exact(total: int, n: int, b: int) -> float:
        m, x = (n, b) if n <= b else (b, n)
        with localcontext() as ctx:
            ctx.prec = 60
            absent = Decimal(1)
            for i in range(m):
                absent *= 1 - Decimal(x) / Decimal(total - i)
            return float(1 - absent)

    for total in (10**7, 10**8):
        pop = np.array([1, 3, 4096, 5000, total - 9100])
        want = [exact(total, int(n), 4096) for n in pop]
        np.testing.assert_allclose(presence(pop, 4096), want, rtol=1e-12)


def _read_labels(ds: abt.AnnBatchDataset, n: int | None, num_workers: int = 0
                 ) -> list[np.ndarray]:
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers)
    out = []
    for b in loader:
        out.append(b["y"].numpy().astype(np.int64))
        if n is not None and len(out) == n:
            break
    return out


@pytest.mark.parametrize("sampler", [None, "balanced", "weighted"])
def test_the_report_is_the_batches_the_loader_yields(imbalanced_collection: abt.Collection,
                                                     sampler: str | None) -> None:
    """Per batch, the report's class counts (as entropy and distinct classes) are those of
    the labels read through the loader, batch for batch."""
    coll = imbalanced_collection
    made = {None: None, "balanced": abt.ClassBalancedSampler("cell_type"),
            "weighted": abt.WeightedSampler(np.arange(coll.n_obs) % 5 + 0.5)}[sampler]
    ds = abt.AnnBatchDataset(coll, selector={"y": A.obs["cell_type"]}, batch_size=256,
                             chunk_size=32, preload_nchunks=32, seed=3, sampler=made)
    ds.set_epoch(2)
    report = abt.diversity_report(ds, "cell_type", 15, per="batch").loc["cell_type"]
    labels = _read_labels(ds, 15)
    k = len(coll.categories("cell_type"))
    counts = np.stack([np.bincount(b, minlength=k) for b in labels])
    assert len(report) == 15
    np.testing.assert_array_equal(report["rows"], [len(b) for b in labels])
    np.testing.assert_allclose(report["entropy"], entropy(counts), atol=1e-12)
    np.testing.assert_array_equal(report["distinct"], (counts > 0).sum(axis=1))


def test_whole_epoch_with_workers_and_ranks(imbalanced_collection: abt.Collection) -> None:
    """The whole epoch of rank 1 of 2, read by 2 workers: the same batches (as a multiset
    of class counts) as the report of that rank."""
    coll = imbalanced_collection
    ds = abt.AnnBatchDataset(coll, selector={"y": A.obs["cell_type"]}, batch_size=200,
                             chunk_size=50, preload_nchunks=4, rank=1, world_size=2)
    k = len(coll.categories("cell_type"))
    read = sorted(tuple(np.bincount(b, minlength=k)) for b in _read_labels(ds, None, 2))
    codes = np.asarray(coll.obs_at(np.arange(coll.n_obs), "cell_type")["cell_type"].cat.codes)
    from annbatch_torch.diversity import report_batches

    batches = report_batches(ds, None, 0)
    planned = sorted(tuple(r) for r in count_batches(codes, batches, k).dense())
    assert read == planned
    assert len(read) == len(ds)
    summary = abt.diversity_report(ds, "cell_type", None)
    assert summary.loc["cell_type", "batches"] == len(ds)


def test_class_shares_of_a_balanced_sampler(imbalanced_collection: abt.Collection) -> None:
    """Class-balanced: the epoch's shares are uniform where the collection's are Zipf; the
    batches follow the epoch."""
    ds = abt.AnnBatchDataset(imbalanced_collection, batch_size=500,
                             sampler=abt.ClassBalancedSampler("cell_type"))
    classes = abt.diversity_report(ds, "cell_type", None, per="class").loc["cell_type"]
    k = len(classes)
    np.testing.assert_allclose(classes["epoch_share"], 1 / k, atol=0.02)
    np.testing.assert_allclose(classes["batch_share"], classes["epoch_share"], atol=1e-12)
    assert classes["collection_share"].iloc[0] > 0.5 > classes["collection_share"].iloc[-1]


def test_missing_values_are_a_class(tmp_path: Path) -> None:
    n = 300
    cats = pd.Categorical.from_codes(np.where(np.arange(n) % 3 == 0, -1, np.arange(n) % 2),
                                     ["x", "y"])
    a = ad.AnnData(sp.random(n, 4, density=0.5, format="csr", dtype=np.float32),
                   obs=pd.DataFrame({"t": cats}, index=[f"c{i}" for i in range(n)]))
    a.write_h5ad(tmp_path / "a.h5ad")
    coll = abt.create_anndata_collection([tmp_path / "a.h5ad"], tmp_path / "s", progress=False)
    classes = abt.diversity_report(abt.AnnBatchDataset(coll, batch_size=50), "t", None,
                                   per="class").loc["t"]
    assert list(classes.index[:2]) == ["x", "y"]
    assert pd.isna(classes.index[2])
    assert list(classes["collection_cells"]) == [100, 100, 100]


def test_bad_arguments_are_refused(imbalanced_collection: abt.Collection) -> None:
    ds = abt.AnnBatchDataset(imbalanced_collection, batch_size=100)
    with pytest.raises(abt.SchemaError, match=r"'cell_typo' is not an obs column.*'donor'"):
        abt.diversity_report(ds, "cell_typo")
    with pytest.raises(ValueError, match="per must be one of"):
        abt.diversity_report(ds, "cell_type", per="row")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_batches must be an integer >= 1"):
        abt.diversity_report(ds, "cell_type", 0)
    with pytest.raises(ValueError, match="epoch must be an integer >= 0"):
        abt.diversity_report(ds, "cell_type", epoch=-1)
    with pytest.raises(TypeError, match="takes an AnnBatchDataset"):
        abt.diversity_report(imbalanced_collection, "cell_type")  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.integers(1, 60))
def test_presence_is_the_hypergeometric_probability(population: list[int], size: int) -> None:
    from scipy.stats import hypergeom

    pop = np.array(population)
    total = int(pop.sum())
    if total == 0:
        return
    got = presence(pop, size)
    b = min(size, total)
    want = [0.0 if n == 0 else 1 - hypergeom.pmf(0, total, n, b) for n in pop]
    np.testing.assert_allclose(got, want, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_count_batches_counts_every_row(data: st.DataObject) -> None:
    k = data.draw(st.integers(1, 5))
    codes = np.array(data.draw(st.lists(st.integers(0, k - 1), min_size=1, max_size=30)))
    batches = [np.array(data.draw(st.lists(st.integers(0, len(codes) - 1), max_size=12)),
                        dtype=np.int64)
               for _ in range(data.draw(st.integers(0, 4)))]
    counts = count_batches(codes, batches, k)
    got = counts.dense()
    want = np.array([[int((codes[b] == c).sum()) for c in range(k)] for b in batches]
                    ).reshape(len(batches), k)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(counts.entropy(), entropy(want), atol=1e-12)
    np.testing.assert_array_equal(counts.distinct(), (want > 0).sum(axis=1))
    np.testing.assert_array_equal(counts.class_rows(), want.sum(axis=0))


# -- the command ---------------------------------------------------------------------------
def test_cli_prints_json_and_plots(runs_collection: abt.Collection, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    store = str(runs_collection.path)
    args = ["diversity", store, "--obs", "cell_type", "--obs", "mixed", "--chunk-size", "64",
            "--preload-nchunks", "1", "--batch-size", "64", "--n-batches", "0"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["cell_type"]["distinct"] == 1.0
    assert out["summary"]["cell_type"]["batches"] == K_RUNS
    assert [c["category"] for c in out["classes"]["mixed"]] == ["a", "b", "c", "d"]
    png = tmp_path / "report.png"
    assert main([*args, "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "cell_type: 8 batches, 512 rows, 8 classes in the epoch (of 8 in" in text
    assert png.stat().st_size > 1000
    assert main(["diversity", store, "--obs", "cell_type", "--sampler",
                 "balanced:cell_type", "--n-batches", "2"]) == 0
    assert "sampler ClassBalancedSampler('cell_type'" in capsys.readouterr().out
    # the obs/ spelling, JSON beside a plot (stdout stays JSON), per-batch figures included
    assert main([*args[:2], "--obs", "obs/cell_type", *args[4:], "--json", "--plot",
                 str(png)]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert len(out["batches"]["cell_type"]) == K_RUNS
    assert "plot written" in captured.err


@pytest.mark.parametrize(("extra", "message"), [
    (["--obs", "cell_typo"], "'cell_typo' is not an obs column"),
    (["--obs", "cell_type", "--sampler", "weighted:cell_type"],
     "weighted:COL takes per-row weights from a numeric obs column"),
    (["--obs", "cell_type", "--sampler", "balanced:nothere"], "nothere"),
    (["--obs", "cell_type", "--sampler", "uniform"], "argument --sampler: 'uniform'"),
    (["--obs", "cell_type", "--sampler", "balanced:cell_type:0"],
     "argument --sampler: 'balanced:cell_type:0'"),
    (["--obs", "cell_type", "--plot", "out.xyz"], "--plot out.xyz: give a file name ending"),
    (["--obs", "cell_type", "--plot", "/nowhere/out.png"], "the folder /nowhere does not"),
    (["--obs", "cell_type", "--rank", "2", "--world-size", "2"], "--rank 2: give a rank"),
])
def test_cli_errors_name_the_column(runs_collection: abt.Collection, extra: list[str],
                                    message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diversity", str(runs_collection.path), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_cli_reports_the_perturbed_rows_of_a_paired_sampler(
        screen_collection: abt.Collection, capsys: pytest.CaptureFixture[str]) -> None:
    """``--sampler paired:COL:CONTROL:MATCH,...``: the report counts the perturbed rows (no
    control), each drawn once in the epoch."""
    args = ["diversity", str(screen_collection.path), "--obs", "target_gene", "--obs",
            "cell_line", "--batch-size", "120", "--n-batches", "0", "--json", "--sampler"]
    assert main([*args, "paired:target_gene:non-targeting:cell_line,gem_group"]) == 0
    out = json.loads(capsys.readouterr().out)
    classes = {c["category"]: c for c in out["classes"]["target_gene"]}
    assert classes["non-targeting"]["epoch_share"] == 0.0  # controls are not counted
    perturbed = int((screen_collection.obs_at(np.arange(screen_collection.n_obs),
                                              "target_gene")["target_gene"]
                     != "non-targeting").sum())
    assert out["summary"]["target_gene"]["rows"] == perturbed  # each perturbed row once
    assert out["summary"]["cell_line"]["rows"] == perturbed
    assert "PairedSampler('target_gene'" in out["settings"]
    assert "match=('cell_line', 'gem_group')" in out["settings"]
    # a control value the column does not hold: an error naming it, no traceback
    assert main([*args[:-2], "--sampler", "paired:target_gene:scrambled"]) == 2
    err = capsys.readouterr().err
    assert "scrambled" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("bad", ["paired:target_gene", "paired::non-targeting",
                                 "paired:target_gene:non-targeting:cell_line,"])
def test_cli_refuses_an_incomplete_paired_sampler(screen_collection: abt.Collection, bad: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diversity", str(screen_collection.path), "--obs", "target_gene",
                 "--sampler", bad]) == 2
    assert f"argument --sampler: {bad!r}" in capsys.readouterr().err


def test_cli_error_names_the_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diversity", str(tmp_path / "nowhere"), "--obs", "cell_type"]) == 2
    assert str(tmp_path / "nowhere") in capsys.readouterr().err


def test_cli_says_missing_values_count_as_a_class(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A column of 2 categories and missing values: the report's class count (3) says the
    missing values are one of them; a column without any says nothing of it."""
    n = 120
    labels = pd.Categorical(np.where(np.arange(n) % 3 == 2, None,
                                     np.where(np.arange(n) % 3 == 0, "a", "b")))
    obs = pd.DataFrame({"cell_type": labels, "full": pd.Categorical(np.arange(n) % 2)},
                       index=[f"c{i}" for i in range(n)])
    a = ad.AnnData(sp.random(n, 10, density=0.3, format="csr", dtype=np.float32,
                             random_state=0), obs=obs)
    a.write_h5ad(tmp_path / "a.h5ad")
    store = abt.create_anndata_collection([tmp_path / "a.h5ad"], tmp_path / "s", progress=False)
    assert main(["diversity", str(store.path), "--obs", "cell_type", "--obs", "full",
                 "--batch-size", "30"]) == 0
    out = capsys.readouterr().out
    assert "3 classes in the epoch (of 3 in the collection, missing values counted as one)" in out
    assert "2 classes in the epoch (of 2 in the collection)" in out
