"""The code of the pages the docs build does not execute, run here against real components.

Tutorial pages are MyST notebooks run by ``make docs``. The ```` ```python ```` blocks of the
other pages need what a docs build does not have: an S3 server (remote), scvi-tools (scvi),
``torchrun`` with several processes (ddp-lightning) or a GPU (gpu). Each page's blocks run
here in order, in one namespace, in a temporary folder holding the files they name, after
the substitutions listed per page (an endpoint for a placeholder URL, fewer epochs or
workers, ``"cpu"`` for ``"cuda"``). A substitution that no longer matches the page fails its
test, and a page with a ```` ```python ```` block that no test here runs fails
:func:`test_every_python_block_of_the_site_is_run`.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pytest
import torch
from conftest import run_ranks

import annbatch_torch as abt

DOCS = Path(__file__).resolve().parent.parent / "docs"

#: blocks run nowhere, each with the reason (page, block index from 0)
NOT_RUN = {
    ("scvi", 1): "4 GPUs; the same call on 2 CPU ranks is tests/test_scvi.py's DDP test",
}

#: the pages whose blocks the tests below run
RUN_HERE = ["index", "remote", "scvi", "tuning", "guides/ddp-lightning", "guides/gpu"]


def python_blocks(page: str) -> list[str]:
    """The page's ```` ```python ```` blocks (executed ``{code-cell}`` blocks excluded)."""
    text = (DOCS / f"{page}.md").read_text()
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def page_code(page: str, subs: dict[str, str]) -> list[str]:
    """The page's blocks after ``subs``, each of which must match somewhere."""
    blocks = python_blocks(page)
    for old, new in subs.items():
        assert any(old in b for b in blocks), (
            f"docs/{page}.md no longer contains {old!r}: update this test's substitutions")
        blocks = [b.replace(old, new) for b in blocks]
    return blocks


def run_page(page: str, namespace: dict[str, Any], subs: dict[str, str]) -> dict[str, Any]:
    for i, block in enumerate(page_code(page, subs)):
        if (page, i) in NOT_RUN:
            continue
        exec(compile(block, f"docs/{page}.md[block {i}]", "exec"), namespace)
    return namespace


def test_every_python_block_of_the_site_is_run() -> None:
    pages = sorted(str(p.relative_to(DOCS).with_suffix("")) for p in DOCS.rglob("*.md")
                   if "_build" not in p.parts and python_blocks(str(p.relative_to(DOCS))[:-3]))
    assert pages == sorted(RUN_HERE), (
        "pages with ```python blocks must be run by tests/test_doc_snippets.py "
        "(or become {code-cell} notebooks run by the build)")


def _write_inputs(folder: Path, n_obs: int = 600, **kwargs: Any) -> list[Path]:
    """``a.h5ad`` and ``b.h5ad`` (what the pages name), ``n_obs`` cells each."""
    paths = abt.datasets.write_synthetic_h5ads(folder, 2, n_obs, 120, seed=3, **kwargs)
    named = []
    for path, name in zip(paths, ["a.h5ad", "b.h5ad"], strict=True):
        named.append(path.rename(folder / name))
    return named


def _assert_rows_per_epoch(loader: Any, n_obs: int, key: str) -> None:
    """An epoch of ``loader`` yields ``n_obs`` rows in all (the page's selector carries no
    row ids; exact coverage is tested in tests/test_dataset.py)."""
    assert sum(len(b[key]) for b in loader) == n_obs


def test_index_page_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _write_inputs(tmp_path)
    ns = run_page("index", {}, {"num_workers=4": "num_workers=2"})
    _assert_rows_per_epoch(ns["loader"], 1200, "y")
    assert next(iter(ns["loader"]))["x"].layout == torch.strided


def test_tuning_page_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shuffle-quality report of the tuning guide, on the synthetic inputs (their second
    column is ``batch``, not ``donor_id``)."""
    monkeypatch.chdir(tmp_path)
    _write_inputs(tmp_path, grouped=True)
    ns = run_page("tuning", {"abt": abt}, {"batch_size=4096": "batch_size=128",
                                           '"donor_id"': '"batch"'})
    report = abt.diversity_report(ns["ds"], ["cell_type", "batch"])
    assert list(report.index) == ["cell_type", "batch"]
    assert 0 < report.loc["cell_type", "entropy_ratio"] <= 1.05


def test_remote_page_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3: Any) -> None:
    monkeypatch.chdir(tmp_path)
    _write_inputs(tmp_path)
    s3.bucket("lab-bucket")
    subs = {
        '{"endpoint_url": "https://s3.example.org", "key": "...", "secret": "..."}':
            repr(s3.options),
        '"/scratch/abt-cache"': repr(str(tmp_path / "cache")),
        "num_workers=8": "num_workers=2",
    }
    ns = run_page("remote", {}, subs)
    _assert_rows_per_epoch(ns["loader"], 1200, "y")
    assert ns["coll"].n_obs == 1200


@pytest.mark.slow
def test_ddp_page_code_under_torchrun(tmp_path: Path) -> None:
    """The plain-DDP block, as a script under ``torchrun`` with 2 CPU ranks (gloo); after
    it, the ranks' last epoch holds equal row counts that add up to the epoch less fewer
    than ``world_size`` batches (``even_batches="drop"``)."""
    _write_inputs(tmp_path, n_obs=6000)
    (block,) = page_code("guides/ddp-lightning", {'"nccl"': '"gloo"', "range(10)": "range(2)"})
    script = tmp_path / "train.py"
    script.write_text(
        block
        + "sizes = [int(b['x'].shape[0]) for b in loader]\n"
        + "import torch\nassert batch['x'].layout == torch.strided\n"
        + "out = [None, None]\n"
        + "dist.all_gather_object(out, sum(sizes))\n"
        + "assert out[0] == out[1] and 12000 - 4096 < out[0] + out[1] <= 12000, out\n"
        # one write per rank: the ranks share the pipe, unbuffered under torchrun, and
        # print's pieces of two ranks interleave ("rankrank  10  okok")
        + "import os\nos.write(1, f'rank {dist.get_rank()} ok {out}\\n'.encode())\n")
    res = run_ranks(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", str(script)], cwd=tmp_path, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert res.stdout.count(" ok ") == 2, res.stdout


def test_gpu_page_code_on_the_cpu(tmp_path: Path, small_collection: Any) -> None:
    """The CSR-to-device path with ``"cpu"`` for ``"cuda"`` (the page's code, no GPU)."""
    subs = {'"cuda"': '"cpu"', "num_workers=4": "num_workers=2",
            '"store/"': repr(str(small_collection.path))}
    ns = run_page("guides/gpu", {}, subs)
    batch = ns["batch"]
    assert batch["x"].layout == torch.strided
    assert batch["x"].shape[1] == small_collection.n_vars
    assert ns["ds"].batch_size == 4096


@pytest.mark.slow
def test_scvi_page_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("scvi")
    monkeypatch.chdir(tmp_path)
    paths = _write_inputs(tmp_path, n_obs=6000, layers=("counts",))
    parts = []
    for path in paths:
        a = ad.read_h5ad(path)
        hidden = np.random.default_rng(0).random(a.n_obs) < 0.3
        a.obs["cell_type"] = a.obs["cell_type"].cat.add_categories("Unknown")
        a.obs.loc[hidden, "cell_type"] = "Unknown"
        a.write_h5ad(path)
        parts.append(a)
    abt.create_anndata_collection(paths, "store/", progress=False)
    ad.concat(parts).write_h5ad("atlas.h5ad")
    subs = {"max_epochs=20": "max_epochs=1", "num_workers=4": "num_workers=0"}
    ns = run_page("scvi", {}, subs)
    adata = ns["adata"]
    assert ns["latent"].shape == (12000, 10)
    assert adata.obsm["X_scVI"].shape == (12000, 10)
    assert np.isfinite(adata.obsm["X_scVI"]).all()
    assert len(ns["labels"]) == 12000
    assert set(ns["labels"]) <= set(adata.obs["cell_type"].cat.categories) - {"Unknown"}
