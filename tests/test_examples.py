"""Every script in ``examples/`` runs with ``--small`` and prints what it promises."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import run_ranks

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str, timeout: int = 300,
                before_retry: Callable[[], None] | None = None) -> str:
    """Run ``examples/name --small args`` (run again once after a crash where
    ``before_retry`` is given: see :func:`conftest.run_ranks`) and return its stdout."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = run_ranks([sys.executable, str(EXAMPLES / name), "--small", *args],
                     timeout=timeout, env=env, cwd=EXAMPLES.parent,
                     retry=before_retry is not None, before_retry=before_retry)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_every_example_is_tested() -> None:
    tested = {"plain_dataloader.py", "train_classifier.py", "selectors_and_transforms.py",
              "lightning_ddp.py", "class_balanced.py", "scvi_from_collection.py",
              "perturbation_pairs.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_plain_dataloader() -> None:
    out = run_example("plain_dataloader.py")
    losses = [float(x) for x in re.findall(r"epoch \d+: loss ([0-9.]+)", out)]
    assert len(losses) == 3
    assert losses[-1] < losses[0]


def test_train_classifier_beats_chance_by_far() -> None:
    out = run_example("train_classifier.py")
    m = re.search(r"held-out accuracy: ([0-9.]+) on ([0-9,]+) cells \(chance: ([0-9.]+)", out)
    assert m, out
    accuracy, chance = float(m.group(1)), float(m.group(3))
    assert int(m.group(2).replace(",", "")) > 500
    assert accuracy > chance + 0.3, out
    assert accuracy > 0.6, out
    speeds = re.findall(r"cells/s: ([0-9,]+)", out)
    assert len(speeds) == 3
    assert all(int(s.replace(",", "")) > 0 for s in speeds)


def test_class_balanced_training_learns_the_rare_types() -> None:
    out = run_example("class_balanced.py")
    m = re.search(r"smallest type ([0-9.]+)%", out)
    assert m, out
    assert float(m.group(1)) < 1.0
    acc = dict(re.findall(r"^(each row once|class-balanced): balanced accuracy ([0-9.]+)", out,
                          re.M))
    assert set(acc) == {"each row once", "class-balanced"}, out
    assert float(acc["class-balanced"]) > float(acc["each row once"]) + 0.05, out


def test_perturbation_pairs_recover_every_knocked_down_gene() -> None:
    out = run_example("perturbation_pairs.py")
    m = re.search(r"recovered (\d+) of (\d+) knocked-down genes", out)
    assert m, out
    assert int(m.group(1)) == int(m.group(2)) == 8, out


def test_selectors_and_transforms() -> None:
    out = run_example("selectors_and_transforms.py")
    assert "against the input files: OK" in out
    for key, kind in [("counts", "sparse CSR"), ("x", "sparse CSR"), ("pca", "dense"),
                      ("label", "dense"), ("library_size", "dense")]:
        assert re.search(rf"^\s+{key}\s+torch\.\w+\s+\(.*\) {kind}$", out, re.M), (key, out)


@pytest.mark.slow
def test_lightning_ddp_two_ranks(tmp_path: Path) -> None:
    """``strategy="ddp"`` re-launches the script as rank 1; both ranks print their steps."""
    pytest.importorskip("lightning.pytorch")
    work = tmp_path / "work"
    first = run_example("lightning_ddp.py", "--devices", "2", "--workdir", str(work),
                        timeout=240, before_retry=lambda: shutil.rmtree(work, ignore_errors=True))
    for e in range(2):
        steps = {int(r): int(s) for r, s in
                 re.findall(rf"rank (\d) epoch {e}: (\d+) steps", first)}
        assert set(steps) == {0, 1}, first
        assert steps[0] == steps[1] > 0
    acc = [float(a) for a in re.findall(r"validation accuracy ([0-9.]+)", first)]
    assert len(acc) == 2
    assert acc[-1] > 0.5  # 8 classes; chance (majority class) is ~0.25
    assert "store written by this run: True" in first


def test_the_readme_quickstart_runs_twice_verbatim(tmp_path: Path) -> None:
    """The README's quickstart makes its own inputs and reuses its collection when rerun."""
    readme = (EXAMPLES.parent / "README.md").read_text()
    code = re.search(r"## Quickstart\n\n```python\n(.*?)```", readme, re.S)
    assert code is not None
    script = tmp_path / "quickstart.py"
    script.write_text(code.group(1) + "print('loss', float(loss))\n")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    stamps = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=300, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert re.search(r"^loss \d", proc.stdout, re.M)
        stamps.append((tmp_path / "store" / "manifest.json").stat().st_mtime_ns)
    assert stamps[0] == stamps[1]  # the second run reused the collection


def test_scvi_from_collection_trains_scvi_and_scanvi() -> None:
    out = run_example("scvi_from_collection.py")
    m = re.search(r"validation ELBO ([0-9.]+) -> ([0-9.]+)", out)
    assert m, out
    assert float(m.group(2)) < float(m.group(1)), out
    n_obs = int(re.search(r"n_obs ([0-9,]+)", out).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert re.search(rf"latent: {n_obs:,} x 10", out), out
    acc = re.search(r"SCANVI accuracy on the unlabeled cells: ([0-9.]+) \(chance: ([0-9.]+)",
                    out)
    assert acc, out
    assert float(acc.group(1)) > float(acc.group(2)) + 0.3, out
