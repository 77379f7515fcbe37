"""The ``annbatch-torch`` command line, called through ``main([...])``."""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import annbatch_torch.cli.main as cli
from annbatch_torch.cli.main import main
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
    assert re.search(r"8 categories: T cell \([\d,]+\), B cell \([\d,]+\)", text)  # with counts
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
    assert "annbatch-torch: error: --compressor 'foo' unknown" in capsys.readouterr().err
    # a usage error is reported the same way: a status, not a SystemExit out of main
    assert main(["shuffle", str(synthetic_h5ads[0]), "-o", str(out), "--var-join", "left"]) == 2


def test_demo_and_bench_delegate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    import annbatch_torch.cli.demo as demo

    seen: list[list[str]] = []
    monkeypatch.setattr(demo, "command", lambda argv: seen.append(argv) or 0)
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
    # an installed package: the folder above it is site-packages, whose benchmarks/ is
    # another distribution's: never run
    assert main(["bench", "--small"]) == 2
    assert not (tmp_path / "benchmarks" / "argv.txt").exists()
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "annbatch-torch"\n')
    assert main(["bench", "--small", "--only", "x", "--out", "o"]) == 0
    assert (tmp_path / "benchmarks" / "argv.txt").read_text() == "--small --only x --out o"
    assert main(["bench", "--fail"]) == 3


def test_python_dash_m(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "annbatch_torch.cli", "--help"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0
    assert "shuffle" in r.stdout
    assert "info" in r.stdout
    (tmp_path / "shard_00000.zarr").mkdir()  # a folder left by an interrupted write
    r = subprocess.run([sys.executable, "-m", "annbatch_torch.cli", "info", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    assert "manifest.json is missing" in r.stderr


# -- issue 17: the command speaks its own flags ------------------------------------------
PYTHON_SPEAK = ("overwrite=True", "max_memory", "n_obs_per_shard", "zarr_chunk_elems",
                "output_path", "create_anndata_collection", "Traceback")


def _error_line(err: str) -> str:
    """The one error line of ``err`` (other lines may only be log records)."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if "error" in ln.lower()]
    assert len(lines) == 1, err
    assert lines[0].startswith("annbatch-torch: error: "), err
    assert err.rstrip().endswith(lines[0]), err  # the last thing said
    return lines[0]


@pytest.fixture
def h5ad(synthetic_h5ads: list[Path]) -> str:
    return str(synthetic_h5ads[2])


@pytest.mark.parametrize(("extra", "expected"), [
    (["--max-memory", "lots"], "--max-memory lots cannot be parsed"),
    (["--max-memory", "100MB"], "is too small: this process already uses"),
    (["--max-memory", "100MB"], "Pass at least --max-memory "),
    (["--shard-size", "0"], "--shard-size 0 must be a positive integer"),
    (["--chunk-elems", "0"], "--chunk-elems must be an integer >= 1 (default 65536), got 0"),
    (["--var-join", "outer", "--compressor", "foo"], "--compressor 'foo' unknown"),
])
def test_bad_shuffle_flags_are_named_as_flags(h5ad: str, tmp_path: Path, extra: list[str],
                                              expected: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["shuffle", h5ad, "-o", str(tmp_path / "store"), "--no-progress", *extra])
    err = capsys.readouterr().err
    assert rc == 2
    line = _error_line(err)
    assert expected in line
    assert not [w for w in PYTHON_SPEAK if w in err], err
    assert not (tmp_path / "store").exists()


def test_existing_output_and_missing_input_speak_flags(
        h5ad: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "store"
    assert main(["-q", "shuffle", h5ad, "-o", str(out), "--no-progress"]) == 0
    assert capsys.readouterr().out == f"wrote {out}: 600 cells x 200 genes in 1 shard\n"
    assert main(["shuffle", h5ad, "-o", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    line = _error_line(err)
    assert f"{out}: the output already exists. Pass --overwrite to replace it" in line
    assert "choose another --output" in line
    assert not [w for w in PYTHON_SPEAK if w in err], err

    missing = tmp_path / "missing.h5ad"
    assert main(["shuffle", str(missing), "-o", str(tmp_path / "s2")]) == 2
    line = _error_line(capsys.readouterr().err)
    assert f"{missing}: no such file or folder" in line


def test_collection_errors_name_the_shuffle_command(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "half" / "shard_00000.zarr").mkdir(parents=True)  # an interrupted write
    assert main(["info", str(tmp_path / "half")]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "manifest.json is missing" in line
    # (--overwrite would refuse this folder: it is not offered)
    assert ("remove the folder yourself (--overwrite replaces only a folder with a "
            "manifest) and write the collection again with annbatch-torch shuffle INPUT "
            "... --output OUTPUT." in line)


def test_translation_table_comes_from_the_flags() -> None:
    from annbatch_torch.write.writer import create_anndata_collection

    parser = cli.build_parser()
    shuffle = parser.commands["shuffle"]
    params = inspect.signature(create_anndata_collection).parameters
    assert set(shuffle.feeds) <= set(params)  # every flag feeds a real parameter
    assert {f.param: f.flag for f in shuffle.feeds.values()} == {
        "adata_paths": "INPUT", "output_path": "--output", "seed": "--seed",
        "shuffle": "--no-shuffle", "var_join": "--var-join", "var_names": "--var-names",
        "obs_columns": "--obs", "raw": "--raw",
        "layers": "--layers", "obsm": "--obsm", "max_memory": "--max-memory",
        "n_obs_per_shard": "--shard-size", "overwrite": "--overwrite",
        "progress": "--no-progress", "zarr_format": "--zarr-format",
        "zarr_chunk_elems": "--chunk-elems", "zarr_shard_elems": "--shard-elems",
        "compressor": "--compressor", "scheduler": "--scheduler", "n_workers": "--n-workers",
        "data_dtype": "--data-dtype", "index_dtype": "--index-dtype", "group_by": "--group-by"}
    from annbatch_torch.write.append import append_to_collection

    append = parser.commands["append"]
    assert set(append.feeds) <= set(inspect.signature(append_to_collection).parameters)
    assert {f.param: f.flag for f in append.feeds.values()} == {
        "collection": "STORE", "adata_paths": "INPUT", "seed": "--seed",
        "max_memory": "--max-memory", "progress": "--no-progress",
        "scheduler": "--scheduler", "n_workers": "--n-workers",
        "data_dtype": "--data-dtype", "index_dtype": "--index-dtype"}
    speak = functools.partial(cli.speak_cli, parser=parser)
    assert speak("Pass overwrite=True to replace it, or choose another output_path.") == \
        "Pass --overwrite to replace it, or choose another --output."
    assert speak("Rewrite it with create_anndata_collection(..., overwrite=True).") == \
        "Rewrite it with annbatch-torch shuffle ... --overwrite."
    assert speak("Create one with annbatch_torch.create_anndata_collection(inputs, "
                 "output_path).") == \
        "Create one with annbatch-torch shuffle INPUT ... --output OUTPUT."
    assert speak("Rewrite the collection with annbatch_torch.create_anndata_collection.") == \
        "Rewrite the collection with annbatch-torch shuffle."
    assert speak("var_join='inner' leaves no genes; pass var_join='outer'.") == \
        "--var-join inner leaves no genes; pass --var-join outer."
    assert speak("with shuffle=False rows keep their order; progress=False hides bars") == \
        "with --no-shuffle rows keep their order; --no-progress hides bars"
    assert speak("max_memory='0.0001MB' is too small. Pass at least max_memory='415MB'.") == \
        "--max-memory 0.0001MB is too small. Pass at least --max-memory 415MB."
    # a value ending a sentence keeps its full stop out (it read "with without --overwrite")
    assert speak("refusing to delete it with overwrite=True. Remove it yourself.") == \
        "refusing to delete it with --overwrite. Remove it yourself."
    assert speak("use n_obs_per_shard=1024, or max_memory=1.5e9.") == \
        "use --shard-size 1024, or --max-memory 1.5e9."
    assert speak("leave it out with raw=False. raw=True requires it; raw=None.") == \
        "leave it out with --raw false. --raw true requires it; --raw auto."
    # what no flag feeds, and names inside paths, stay as they are
    assert speak("zarr_shard_elems=5 is too small") == "--shard-elems 5 is too small"
    unchanged = ("value_check=print and value_check stay; /data/max_memory/a.h5ad and "
                 "/tmp/test_max_memory0/store and my_overwrite=True are paths or not ours")
    assert speak(unchanged) == unchanged


def test_user_errors_and_bugs_without_traceback_and_with_debug(
        h5ad: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from annbatch_torch.errors import InputError

    missing = str(tmp_path / "missing.h5ad")
    for argv in (["--debug", "shuffle", missing, "-o", str(tmp_path / "s")],
                 ["shuffle", missing, "-o", str(tmp_path / "s"), "--debug"]):
        with pytest.raises(InputError, match="no such file or folder"):
            main(argv)
    # argument errors: one line, status 2, no usage block, no SystemExit out of main
    assert main(["shuffle", h5ad, "-o", str(tmp_path / "s"), "--var-join", "left"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "argument --var-join: invalid choice: 'left'" in line
    assert "annbatch-torch shuffle --help" in line
    assert main(["shuffle", h5ad]) == 2
    assert "the following arguments are required: -o/--output" in \
        _error_line(capsys.readouterr().err)
    assert main(["--no-such-flag"]) == 2
    _error_line(capsys.readouterr().err)

    import annbatch_torch.write.writer as writer

    def raising(exc: BaseException) -> Any:
        def fake(*args: Any, **kwargs: Any) -> None:
            raise exc
        return fake

    argv = ["shuffle", h5ad, "-o", str(tmp_path / "s"), "--no-progress"]
    for exc, text in ((PermissionError(13, "Permission denied", "/root/x"),
                       "annbatch-torch: error: /root/x: Permission denied"),
                      (FileNotFoundError(2, "No such file or directory", "/gone"),
                       "annbatch-torch: error: /gone: No such file or directory")):
        monkeypatch.setattr(writer, "create_anndata_collection", raising(exc))
        assert main(argv) == 2
        assert _error_line(capsys.readouterr().err) == text
    # a bug: one line, status 1, and the way to the traceback
    monkeypatch.setattr(writer, "create_anndata_collection", raising(TypeError("boom")))
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines() == [
        "annbatch-torch: internal error: TypeError: boom (run with --debug for the traceback)"]
    with pytest.raises(TypeError, match="boom"):
        main([*argv, "--debug"])
    monkeypatch.setattr(writer, "create_anndata_collection", raising(KeyboardInterrupt()))
    assert main(argv) == 130
    assert capsys.readouterr().err == "annbatch-torch: interrupted\n"


@pytest.mark.filterwarnings("ignore:Writing zarr v2 data")
def test_info_describes_anndata_inputs(synthetic_h5ads: list[Path], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    import anndata as ad

    path = synthetic_h5ads[0]
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(
        f"{path.resolve()}: an AnnData .h5ad file, not a collection folder. Shuffle it into "
        f"one with: annbatch-torch shuffle {path.resolve()} -o STORE")
    assert "cells       1,200" in out
    assert "genes       200 (first: gene_0," in out
    assert "X           csr float32, 200 columns" in out
    assert "layers      counts (csr float32, 200 columns)" in out
    assert "obsm        X_pca (dense float32, 8 columns)" in out
    assert "obs         5 columns" in out
    assert "8 categories: T cell, B cell" in out
    assert "is_doublet" in out

    store = tmp_path / "a.zarr"
    ad.read_h5ad(synthetic_h5ads[2]).write_zarr(store)
    assert main(["info", "--json", str(store)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["kind"] == "zarr"
    assert summary["collection"] is False
    assert (summary["n_obs"], summary["n_vars"]) == (600, 200)
    assert set(summary["layers"]) == {"counts"}
    assert set(summary["obsm"]) == {"X_pca"}
    assert summary["obs"]["batch"]["categories"] == ["batch_0", "batch_1"]
    assert main(["info", str(store)]) == 0
    assert "an AnnData zarr store, not a collection folder" in capsys.readouterr().out

    assert main(["info", str(tmp_path / "nowhere")]) == 2
    line = _error_line(capsys.readouterr().err)
    assert line == f"annbatch-torch: error: {tmp_path / 'nowhere'}: no such file or folder."
    (tmp_path / "notes.txt").write_text("hello")
    assert main(["info", str(tmp_path / "notes.txt")]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "a file, not a collection folder" in line
    assert "not an AnnData .h5ad" in line


def test_info_into_a_closed_pipe_ends_quietly(small_collection: Any, tmp_path: Path) -> None:
    """`annbatch-torch info STORE | head -1`: no BrokenPipeError traceback, status 0 (with
    pipefail, so the status is annbatch-torch's own)."""
    import anndata as ad
    import numpy as np
    import pandas as pd
    import scipy.sparse as sp

    from annbatch_torch.write.writer import create_anndata_collection

    # one column of 20,000 categories: a line longer than the pipe's buffer
    n = 20_000
    labels = pd.Categorical([f"label_{i:05d}" for i in range(n)])
    a = ad.AnnData(sp.random(n, 4, density=0.5, format="csr", dtype=np.float32, rng=0),
                   obs=pd.DataFrame({"label": labels}, index=[f"c{i}" for i in range(n)]))
    a.write_h5ad(tmp_path / "many.h5ad")
    big = create_anndata_collection([tmp_path / "many.h5ad"], tmp_path / "big", progress=False)
    exe = shlex.quote(str(REPO / ".venv" / "bin" / "annbatch-torch"))
    if not (REPO / ".venv" / "bin" / "annbatch-torch").exists():
        exe = f"{shlex.quote(sys.executable)} -m annbatch_torch"
    for store, extra in ((small_collection.path, ""), (big.path, " --max-categories 100000")):
        r = subprocess.run(
            ["bash", "-c", f"set -o pipefail; {exe} info {shlex.quote(str(store))}{extra} "
                           "| head -1"],
            capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert "Traceback" not in r.stderr, r.stderr
        assert "BrokenPipe" not in r.stderr, r.stderr
        assert r.stderr == ""
        assert r.returncode == 0
        assert r.stdout == f"collection  {store}\n"


def test_version_and_python_dash_m_annbatch_torch(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"annbatch-torch {version('annbatch-torch')}\n"
    assert cli.version() == version("annbatch-torch")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "annbatch_torch", "--version"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"annbatch-torch {version('annbatch-torch')}\n"
    r = subprocess.run([sys.executable, "-m", "annbatch_torch", "info", "/nonexistent/x"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    assert r.stderr == "annbatch-torch: error: /nonexistent/x: no such file or folder.\n"


def test_version_falls_back_to_the_package_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata as md

    import annbatch_torch

    def missing(name: str) -> str:
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "version", missing)
    assert cli.version() == annbatch_torch.__version__


@pytest.mark.parametrize("command", [[], ["shuffle"], ["info"], ["demo"], ["bench"]])
def test_help_is_plain_text(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: annbatch-torch {' '.join(command)}".rstrip())
    for markup in ("``", ":class:", ":func:", ":mod:", ":meth:", "::"):
        assert markup not in text, (markup, text)
    assert all(len(line) <= 100 for line in text.splitlines())


def _option_help(text: str, flag: str) -> str:
    """The help paragraph of ``flag`` in an argparse help text."""
    m = re.search(rf"^  (?:-\w \S+, )?{re.escape(flag)}\b.*?(?=^  -|\Z)", text, re.M | re.S)
    assert m, (flag, text)
    return " ".join(m.group(0).split())


def test_shuffle_help_describes_every_option_with_the_library_defaults(
        capsys: pytest.CaptureFixture[str]) -> None:
    from annbatch_torch.write.budget import DEFAULT_WORK_MEMORY
    from annbatch_torch.write.writer import DEFAULT_CHUNK_ELEMS, create_anndata_collection

    params = inspect.signature(create_anndata_collection).parameters
    shuffle = cli.build_parser().commands["shuffle"]
    kwargs = shuffle.api_kwargs(shuffle.parse_args(["a.h5ad", "-o", "out"]))
    assert kwargs.pop("adata_paths") == ["a.h5ad"]
    assert kwargs.pop("output_path") == "out"
    assert kwargs == {k: params[k].default for k in kwargs}  # the writer's own defaults
    assert kwargs["zarr_chunk_elems"] == DEFAULT_CHUNK_ELEMS

    assert main(["shuffle", "--help"]) == 0
    text = capsys.readouterr().out
    for f in shuffle.feeds.values():
        if f.kind == "positional":
            continue
        described = _option_help(text, f.flag).split(f.flag, 1)[1].strip()
        assert len(described) > 20, f"{f.flag} has no help: {described!r}"
    for flag, default in (("--seed", 0), ("--var-join", "inner"), ("--zarr-format", 3),
                          ("--chunk-elems", DEFAULT_CHUNK_ELEMS), ("--compressor", "raw")):
        assert f"(default: {default})" in _option_help(text, flag), flag
    assert f"{DEFAULT_WORK_MEMORY / 1e6:.0f} MB of buffers" in _option_help(text, "--max-memory")


def test_demo_options_have_help_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--help"]) == 0
    text = capsys.readouterr().out
    for flag, default in (("--n-obs", "60000"), ("--n-vars", "4000"), ("--batch-size", "1024"),
                          ("--workers", "2"), ("--epochs", "1"), ("--seed", "0"),
                          ("--workdir", "a temporary folder")):
        assert f"(default: {default}" in _option_help(text, flag), flag


@pytest.mark.parametrize(("bad", "expected"), [
    (["--n-obs", "-5"], "argument --n-obs: must be an integer >= 2, got -5"),
    (["--n-obs", "many"], "argument --n-obs: must be an integer >= 2, got 'many'"),
    (["--n-vars", "0"], "argument --n-vars: must be an integer >= 1, got 0"),
    (["--batch-size", "0"], "argument --batch-size: must be an integer >= 1, got 0"),
    (["--workers", "-1"], "argument --workers: must be an integer >= 0, got -1"),
    (["--epochs", "0"], "argument --epochs: must be an integer >= 1, got 0"),
    (["--seed", "1.5"], "argument --seed: must be an integer >= 0, got '1.5'"),
])
def test_demo_bad_values_are_one_line(bad: list[str], expected: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--n-obs", "200", "--n-vars", "20", "--workers", "0", *bad])
    assert rc == 2
    line = _error_line(capsys.readouterr().err)
    assert expected in line
    assert "annbatch-torch demo --help" in line


def test_demo_runs_and_reports_workdir_errors(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--n-obs", "600", "--n-vars", "40", "--workers", "0",
                 "--workdir", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    assert "(1 shard) in" in out
    assert "held-out accuracy" in out
    assert (tmp_path / "w" / "store" / "manifest.json").is_file()
    (tmp_path / "file").write_text("")
    assert main(["demo", "--n-obs", "600", "--workers", "0",
                 "--workdir", str(tmp_path / "file" / "w")]) == 2
    line = _error_line(capsys.readouterr().err)
    assert str(tmp_path / "file") in line


def test_bench_writes_outside_the_repository_by_default(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    fake = tmp_path / "repo"
    (fake / "benchmarks").mkdir(parents=True)
    (fake / "pyproject.toml").write_text('[project]\nname = "annbatch-torch"\n')
    (fake / "benchmarks" / "run.py").write_text(
        "import argparse, pathlib\n"
        "def _parser():\n"
        "    p = argparse.ArgumentParser()\n"
        "    p.add_argument('--out')\n"
        "    p.add_argument('--data-dir')\n"
        "    p.add_argument('--small', action='store_true')\n"
        "    return p\n"
        "def main(argv):\n"
        "    _parser().parse_args(argv)\n"
        "    pathlib.Path(__file__).with_name('argv.txt').write_text(' '.join(argv))\n"
    )
    monkeypatch.setattr(cli, "_REPO", fake)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    argv_txt = fake / "benchmarks" / "argv.txt"

    assert main(["bench", "--small"]) == 0
    flag, out, data_flag, data, rest = argv_txt.read_text().split(" ")
    assert (flag, data_flag, rest) == ("--out", "--data-dir", "--small")
    assert Path(out).parent == cwd / "annbatch-torch-bench"
    assert re.fullmatch(r"\d{8}-\d{6}(-\d+)?", Path(out).name)
    # the generated inputs beside the results, not in the source tree
    assert Path(data) == cwd / "annbatch-torch-bench" / "data"
    printed = capsys.readouterr().out
    assert f"results go to {out}" in printed
    assert f"generated inputs to {data}" in printed
    assert main(["bench", "--small", "--data-dir", "mine"]) == 0
    assert argv_txt.read_text().split(" ")[2:] == ["--small", "--data-dir", "mine"]
    # an explicit --out (the maintainers' committed results) is passed on untouched
    for given in (["--out", "benchmarks/results"], ["--out=benchmarks/results"],
                  ["--ou", "benchmarks/results"]):
        assert main(["bench", "--small", *given]) == 0
        assert argv_txt.read_text() == " ".join(["--small", *given])
    capsys.readouterr()
    assert main(["bench", "--help"]) == 0  # the benchmark's own help, nothing run
    assert "--small" in capsys.readouterr().out
    assert argv_txt.read_text() == "--small --ou benchmarks/results"
    # a bad option: one line, no folder announced or made, nothing run
    argv_txt.unlink()
    assert main(["bench", "--small", "--bogus"]) == 2
    captured = capsys.readouterr()
    assert "results go to" not in captured.out
    assert not argv_txt.exists()
    assert not (cwd / "annbatch-torch-bench").exists()


def test_benchmarks_run_keeps_its_documented_out_default() -> None:
    """`python benchmarks/run.py` (make bench) still writes the committed results."""
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "run.py"), "--help"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    help_out = re.sub(r"-\s+", "-", _option_help(r.stdout, "--out"))
    assert "default: benchmarks/results/" in help_out
    assert "annbatch-torch bench" in help_out


def test_info_prints_cells_per_category(small_collection: Any,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Class weights need the counts: info shows them next to each category."""
    assert main(["info", str(small_collection.path), "--max-categories", "100"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("obs/cell_type"))
    counts = small_collection.category_counts("cell_type")
    for cat, n in counts.items():
        assert f"{cat} ({int(n):,})" in line


def test_info_lists_the_var_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import anndata as ad
    import numpy as np
    import pandas as pd

    a = ad.AnnData(np.ones((4, 3), dtype=np.float32),
                   var=pd.DataFrame({"symbol": ["A", "B", "C"], "hv": [True, False, True]},
                                    index=["g0", "g1", "g2"]))
    a.obs_names = [f"c{i}" for i in range(4)]
    from annbatch_torch import create_anndata_collection

    create_anndata_collection([a], tmp_path / "store", progress=False)
    assert main(["info", str(tmp_path / "store")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "var         symbol, hv" in lines


def test_a_damaged_obs_chunk_is_a_user_error_with_the_fix(
        small_collection: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """info counts categories: a truncated chunk there was an 'internal error' (status 1)
    from rawzarr's ChunkError (found in review); the metadata API raised it bare too."""
    import shutil

    from annbatch_torch import CollectionError, open_collection

    store = tmp_path / "store"
    shutil.copytree(small_collection.path, store)
    chunk = next(p for p in sorted((store / "shard_00000.zarr" / "obs" / "cell_type" /
                                    "codes").rglob("*")) if p.is_file() and p.name != "zarr.json")
    chunk.write_bytes(b"garbage")
    coll = open_collection(store)
    for call in (lambda: coll.category_counts("cell_type"),
                 lambda: coll.obs_at(range(10), "cell_type")):
        with pytest.raises(CollectionError, match=r"shard_00000.*rewrite it with "
                                                  r"create_anndata_collection"):
            call()
    assert main(["info", str(store)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("annbatch-torch: error: ")
    assert "annbatch-torch shuffle ... --overwrite" in err[0]


def test_info_with_no_categories_shown_gives_the_counts(
        small_collection: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(small_collection.path), "--max-categories", "0"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines()
                if ln.strip().startswith("obs/cell_type"))
    n = len(small_collection.categories("cell_type"))
    assert line.rstrip().endswith(f"{n} categories")  # was "N categories: , ... (+N)"


def test_an_output_under_a_file_and_info_on_an_empty_folder_say_so(
        h5ad: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both printed only 'File exists' / an interrupted-write guess (found in review)."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("x")
    assert main(["shuffle", h5ad, "-o", str(blocker / "store"), "--no-progress"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert f"{blocker} is a file, so no folder can be made inside it" in line
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["info", str(empty)]) == 2
    line = _error_line(capsys.readouterr().err)
    assert f"{empty}: an empty folder, neither a collection nor an AnnData store" in line
