"""URL typos refused before anything is written, inputs by URL named as inputs, a missing
filesystem package named first, and the Dask writer bounded when its cluster loses every
worker (issue 29 items 5, 12a, 12b)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

import annbatch_torch as abt
from annbatch_torch import InputError
from annbatch_torch.cli.main import main as cli_main
from annbatch_torch.store.remote.location import check_url, is_url, url_typo


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory, empty: a relative 's3:' folder would land here."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _left_behind(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize(("text", "meant"), [
    ("s3:/bkt/atlas", "s3://bkt/atlas"),
    ("gs:/bkt/a/b", "gs://bkt/a/b"),
    ("S3:/bkt", "S3://bkt"),
    ("https:/host/a.h5ad", "https://host/a.h5ad"),
])
def test_mangled_urls_are_recognised(text: str, meant: str) -> None:
    for obj in (text, Path(meant)):
        assert is_url(obj), obj
        assert url_typo(obj) == meant, obj
        with pytest.raises(InputError, match=f"did you mean '{meant}'"):
            check_url(obj)


@pytest.mark.parametrize("text", ["./s3:/bkt", "store/s3:/x", "s3:bkt", "s3", "/data/s3:/x",
                                  "atlas", "my-s3:/x"])
def test_local_paths_stay_local(text: str) -> None:
    assert not is_url(text)
    assert url_typo(text) is None
    if str(Path(text)) == text:  # pathlib drops a leading './'
        assert not is_url(Path(text))


def test_real_urls_are_not_typos() -> None:
    assert is_url("s3://bkt/x")
    assert url_typo("s3://bkt/x") is None
    assert check_url("s3://bkt/x/") == "s3://bkt/x"


@pytest.mark.parametrize("output", ["s3:/bkt/atlas", Path("s3://bkt/atlas")],
                         ids=["one-slash", "pathlib"])
def test_writer_refuses_a_mangled_output(in_tmp: Path, synthetic_h5ads: list[Path],
                                         output: Any) -> None:
    with pytest.raises(InputError, match="did you mean 's3://bkt/atlas'"):
        abt.create_anndata_collection(synthetic_h5ads[:1], output, progress=False)
    assert _left_behind(in_tmp) == []


def test_prepare_append_open_refuse_a_pathlib_url(in_tmp: Path,
                                                  synthetic_h5ads: list[Path]) -> None:
    url = Path("s3://bkt/atlas")
    calls = [
        lambda: abt.prepare_collection(synthetic_h5ads[:1], url, progress=False),
        lambda: abt.append_to_collection(url, synthetic_h5ads[:1], progress=False),
        lambda: abt.open_collection(url),
        lambda: abt.AnnBatchDataset(url),
        lambda: abt.AnnBatchDataModule(synthetic_h5ads[:1], url),
    ]
    for call in calls:
        with pytest.raises(InputError, match="did you mean 's3://bkt/atlas'"):
            call()
    assert _left_behind(in_tmp) == []  # no folder, no lock file


def test_cli_refuses_a_mangled_output(in_tmp: Path, synthetic_h5ads: list[Path],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["shuffle", str(synthetic_h5ads[0]), "-o", "s3:/bkt/atlas"])
    assert rc != 0
    assert "did you mean 's3://bkt/atlas'" in capsys.readouterr().err
    assert _left_behind(in_tmp) == []


@pytest.mark.parametrize("url", ["https://host/data/a.h5ad", "s3://bkt/a.h5ad"])
def test_an_input_by_url_gets_the_inputs_message(url: str) -> None:
    with pytest.raises(InputError, match="inputs are read from local") as e:
        abt.AnnBatchDataset(url)
    assert url in str(e.value)
    assert "cannot list a collection" not in str(e.value)  # not the collections message
    with pytest.raises(InputError, match="inputs are read from local"):
        abt.AnnBatchDataset([url])


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs installed")
def test_gs_without_gcsfs_names_the_package() -> None:
    with pytest.raises(InputError) as e:
        abt.open_collection("gs://bkt/atlas")
    msg = str(e.value)
    assert msg.startswith("gs://bkt/atlas: gs:// needs gcsfs: pip install gcsfs"), msg
    assert "storage_options" not in msg


# ------------------------------------------------------------------ the Dask writer, bounded

distributed = pytest.importorskip("distributed")


@pytest.mark.slow
@pytest.mark.timeout(400)  # the old code waited forever
def test_dask_writer_fails_in_bounded_time_when_every_worker_dies(
        tmp_path: Path, synthetic_h5ads: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that dies on every try of one input, with retries allowed (Dask's
    allowed-failures raised): the LocalCluster's nannies give up, no worker is left, and the
    write must fail with a clear error, not wait forever; nothing is published.

    For speed, the grace (30 s in the library, read at call time) is 5 s here, and the
    LocalCluster gives a lost worker 0.2 s to be back before it closes its nanny (Dask's
    ``lost-worker-timeout``, 15 s by default, checked once per death; a restart takes longer):
    the nannies give up at their workers' first deaths instead of after a random number of
    restarts, and the write must still notice that no worker is left."""
    import dask
    import dask_helpers

    from annbatch_torch.write import parallel

    monkeypatch.setattr(parallel, "NO_WORKERS_GRACE_S", 5.0)
    bad = tmp_path / "bad_input.h5ad"
    bad.write_bytes(synthetic_h5ads[1].read_bytes())
    out = tmp_path / "out"
    with dask.config.set({"distributed.scheduler.allowed-failures": 50,
                          "distributed.deploy.lost-worker-timeout": "200ms"}), \
            pytest.raises(abt.CollectionError, match="no workers for") as e:
        abt.create_anndata_collection(
            [synthetic_h5ads[0], bad], out, scheduler="processes", n_workers=2,
            value_check=dask_helpers.DieOnInput("bad_input"), progress=False)
    msg = str(e.value)
    assert "nothing was published" in msg
    # a cluster started here had workers: their deaths are the cause named, whenever the
    # first look at the cluster came (not "no worker joined it", an adaptive cluster's)
    assert "its workers died" in msg, msg
    assert "adaptive" not in msg, msg
    assert "scheduler=None to see a failing input's own error" in msg, msg
    assert sorted(os.listdir(tmp_path)) == ["bad_input.h5ad"]  # no output, no temporaries
