"""The ``annbatch-torch`` command line, called through ``main([...])``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import annbatch_torch.cli as cli
from annbatch_torch.cli import main
from annbatch_torch.store.collection import open_collection

REPO = Path(__file__).resolve().parents[1]


def test_shuffle_and_info(synthetic_h5ads: list[Path], tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "store"
    rc = main(["shuffle", *map(str, synthetic_h5ads), "-o", str(out), "--seed", "7",
               "--obs", "cell_type", "batch", "--layers", "--obsm", "--shard-size", "1000",
               "--no-progress", "--max-memory", "4GB"])
    assert rc == 0
    assert f"wrote {out}: 2,700 cells x 200 genes in 3 shards" in capsys.readouterr().out
    coll = open_collection(out)
    assert set(coll.fields) == {"X", "obs/cell_type", "obs/batch"}
    assert coll.manifest.seed == 7
    assert coll.shard_sizes == [1000, 1000, 700]

    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cells       2,700" in text
    assert "shards      3 of 700-1,000 rows" in text
    assert "obs/cell_type" in text
    assert "8 categories: T cell, B cell" in text
    assert "X                        csr          float32  (n, 200)" in text
    assert str(synthetic_h5ads[0].resolve()) in text

    assert main(["info", "--json", str(out)]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["n_obs"] == 2700
    assert manifest["seed"] == 7


def test_shuffle_options_reach_the_writer(synthetic_h5ads: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "store"
    rc = main(["-q", "shuffle", str(synthetic_h5ads[0]), "-o", str(out), "--no-shuffle",
               "--var-join", "outer", "--zarr-format", "2", "--compressor", "none",
               "--chunk-elems", "4096", "--no-progress"])
    assert rc == 0
    m = open_collection(out).manifest
    assert (m.shuffle, m.var_join) == (False, "outer")
    assert m.extra["writer"]["zarr_format"] == 2
    assert m.extra["writer"]["zarr_chunk_elems"] == 4096
    assert "layers/counts" in m.fields
    assert "obsm/X_pca" in m.fields


def test_errors_are_reported_not_raised(synthetic_h5ads: list[Path], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tmp_path / "nowhere")]) == 2
    assert "error:" in capsys.readouterr().err
    out = tmp_path / "store"
    args = ["shuffle", str(synthetic_h5ads[2]), "-o", str(out), "--no-progress"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{out}: the output already exists" in err
    assert "overwrite" in err
    assert main([*args, "--overwrite"]) == 0
    # the writer's default chunking (the CLI once defaulted to another)
    from annbatch_torch.write.writer import DEFAULT_CHUNK_ELEMS

    assert open_collection(out).manifest.extra["writer"]["zarr_chunk_elems"] == \
        DEFAULT_CHUNK_ELEMS
    capsys.readouterr()
    assert main([*args, "--overwrite", "--compressor", "foo"]) == 2  # reported, no traceback
    assert "error: compressor 'foo' unknown" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["shuffle", str(synthetic_h5ads[0]), "-o", str(out), "--var-join", "left"])
    assert e.value.code == 2


def test_demo_and_bench_delegate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import annbatch_torch.demo as demo

    seen: list[list[str]] = []
    monkeypatch.setattr(demo, "main", lambda argv: seen.append(argv) or 0)
    assert main(["demo", "--n-obs", "100", "--workers", "0"]) == 0
    assert seen == [["--n-obs", "100", "--workers", "0"]]

    monkeypatch.setattr(cli, "_REPO", tmp_path)
    assert main(["bench", "--small"]) == 2  # no benchmarks/run.py there
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "run.py").write_text(
        "import sys, pathlib\n"
        "pathlib.Path(sys.argv[0]).with_name('argv.txt').write_text(' '.join(sys.argv[1:]))\n"
        "sys.exit(3 if '--fail' in sys.argv else 0)\n"
    )
    assert main(["bench", "--small", "--only", "x"]) == 0
    assert (tmp_path / "benchmarks" / "argv.txt").read_text() == "--small --only x"
    assert main(["bench", "--fail"]) == 3


def test_python_dash_m(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "annbatch_torch.cli", "--help"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0
    assert "shuffle" in r.stdout
    assert "info" in r.stdout
    r = subprocess.run([sys.executable, "-m", "annbatch_torch.cli", "info", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    assert "manifest.json is missing" in r.stderr
