"""prepare_collection: write once, from racing processes too, never over a foreign folder."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import anndata as ad
import numpy as np
import pytest

import annbatch_torch as abt
from annbatch_torch import CollectionError
from annbatch_torch.write.publish import lock_path


def _stamp(store: Path) -> tuple[int, int]:
    st = (store / "manifest.json").stat()
    return st.st_mtime_ns, st.st_ino


def test_writes_once_then_only_when_stale(synthetic_h5ads: list[Path], tmp_path: Path) -> None:
    store = tmp_path / "store"
    assert abt.prepare_collection(synthetic_h5ads, store, layers=[], progress=False) is True
    assert "layers/counts" not in abt.open_collection(store).fields
    stamp = _stamp(store)
    assert abt.prepare_collection(synthetic_h5ads, store, progress=False) is False
    assert _stamp(store) == stamp
    # writer options that do not shape the store do not make it stale
    assert abt.prepare_collection(synthetic_h5ads, store, progress=False,
                                  max_memory="1GB") is False
    # a field the store lacks does
    assert abt.prepare_collection(synthetic_h5ads, store, layers=["counts"],
                                  progress=False) is True
    assert "layers/counts" in abt.open_collection(store).fields
    assert _stamp(store) != stamp
    # so does an explicit offline-shuffle seed that differs from the recorded one
    assert abt.prepare_collection(synthetic_h5ads, store, seed=5, progress=False) is True
    assert abt.open_collection(store).manifest.seed == 5
    assert abt.prepare_collection(synthetic_h5ads, store, progress=False) is False


def test_refuses_a_foreign_folder_and_no_inputs(synthetic_h5ads: list[Path],
                                                tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(CollectionError, match=r"mine exists but is not an annbatch_torch "
                       r"collection .*Remove it or choose another store_path"):
        abt.prepare_collection(synthetic_h5ads, foreign, progress=False)
    assert (foreign / "notes.txt").read_text() == "keep"
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty folder is fine to write into
    assert abt.prepare_collection(synthetic_h5ads[:1], empty, progress=False) is True
    with pytest.raises(ValueError, match="at least one input"):
        abt.prepare_collection([], tmp_path / "x")


@pytest.mark.slow
def test_racing_processes_write_once(synthetic_h5ads: list[Path], tmp_path: Path) -> None:
    """Three processes start together (as torchrun ranks would): exactly one writes, the
    others wait on the lock and find the store current; every row is in the store."""
    store = tmp_path / "store"
    go = tmp_path / "go"
    script = textwrap.dedent(f"""
        import os, sys, time
        import annbatch_torch as abt
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        wrote = abt.prepare_collection({[str(p) for p in synthetic_h5ads]!r}, {str(store)!r},
                                       progress=False)
        print("WROTE" if wrote else "CURRENT", flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    said = sorted(out.strip() for out, _ in outs)
    assert said == ["CURRENT", "CURRENT", "WROTE"]
    coll = abt.open_collection(store)
    names = np.concatenate([ad.read_h5ad(p, backed="r").obs_names.to_numpy()
                            for p in synthetic_h5ads])
    assert coll.n_obs == len(names)
    got = abt.AnnBatchDataset(coll, batch_size=512, shuffle=False, return_index=True)
    rows = np.concatenate([b["index"].numpy() for b in got])
    np.testing.assert_array_equal(np.sort(rows), np.arange(len(names)))
    assert lock_path(store).name == "store.lock"  # the lock file beside the store


def test_fingerprint_sees_content_not_mtime(tmp_path: Path) -> None:
    from annbatch_torch.store.inputs.fingerprint import fingerprint

    rng = np.random.default_rng(0)
    big = tmp_path / "big.bin"  # larger than what is read whole: the sampled path
    big.write_bytes(rng.bytes(8 << 20))
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 1000)
    folder = tmp_path / "store.zarr"
    (folder / "X").mkdir(parents=True)
    (folder / "zarr.json").write_text('{"node_type": "group"}')
    (folder / "X" / "c0").write_bytes(rng.bytes(3 << 20))
    before = {p: fingerprint(p) for p in (big, small, folder)}
    for p in (big, small, folder / "X" / "c0", folder / "zarr.json"):
        os.utime(p, (1, 1))  # touch: same content, another mtime
    assert {p: fingerprint(p) for p in (big, small, folder)} == before
    copy = tmp_path / "copy.bin"
    copy.write_bytes(big.read_bytes())  # cp without -p
    assert fingerprint(copy) == before[big]
    for p, where in ((big, 0), (big, (8 << 20) - 1), (small, 500), (folder / "X" / "c0", 0),
                     (folder / "zarr.json", 2)):
        data = bytearray(p.read_bytes())
        data[where] ^= 0xFF
        p.write_bytes(bytes(data))
        owner = folder if folder in p.parents else p
        assert fingerprint(owner) != before[owner], (p, where)
        data[where] ^= 0xFF
        p.write_bytes(bytes(data))
        assert fingerprint(owner) == before[owner]


def test_a_touched_input_keeps_the_store_a_changed_one_rewrites_it(
        synthetic_h5ads: list[Path], tmp_path: Path) -> None:
    import shutil

    inputs = [tmp_path / p.name for p in synthetic_h5ads]
    for src, dst in zip(synthetic_h5ads, inputs):
        shutil.copyfile(src, dst)
    store = tmp_path / "store"
    assert abt.prepare_collection(inputs, store, progress=False) is True
    stamp = _stamp(store)
    os.utime(inputs[0], None)  # touch
    shutil.copyfile(inputs[1], tmp_path / "tmp.h5ad")
    os.replace(tmp_path / "tmp.h5ad", inputs[1])  # cp without -p: new file, new mtime
    assert abt.prepare_collection(inputs, store, progress=False) is False
    assert _stamp(store) == stamp
    a = ad.read_h5ad(inputs[0])
    a.X = a.X * 2  # same shape, same size on disk (float32 values), other content
    a.write_h5ad(inputs[0])
    assert abt.prepare_collection(inputs, store, progress=False) is True


def test_fingerprints_read_ahead_equal_the_function_and_reach_the_manifest(
        synthetic_h5ads: list[Path], tmp_path: Path) -> None:
    from annbatch_torch.store.inputs.fingerprint import Fingerprints, fingerprint

    folder = tmp_path / "store.zarr"
    (folder / "X").mkdir(parents=True)
    (folder / "zarr.json").write_text('{"node_type": "group"}')
    (folder / "X" / "c0").write_bytes(np.random.default_rng(0).bytes(3 << 20))
    gone = tmp_path / "gone.h5ad"
    ahead = Fingerprints([*synthetic_h5ads, folder, gone])
    for p in (*synthetic_h5ads, folder):
        assert ahead.get(p) == fingerprint(p), p
    assert ahead.get(gone) is None  # left to whoever computes it again (and meets the error)
    ahead.close()

    def not_here(path: object) -> str:
        raise AssertionError(f"{path} fingerprinted where the manifest is written")

    import annbatch_torch.store.inputs.view as view

    with pytest.MonkeyPatch.context() as mp:  # the writer's thread computed them already
        mp.setattr(view, "fingerprint", not_here)
        coll = abt.create_anndata_collection(synthetic_h5ads, tmp_path / "out", progress=False)
    assert [r["fingerprint"] for r in coll.manifest.inputs] == [
        fingerprint(p) for p in synthetic_h5ads]


def test_a_rewrite_that_loses_a_field_names_it(synthetic_h5ads: list[Path], tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """An added input without the collection's layer: the append is refused, the
    collection rewritten from all inputs without that layer, and a WARNING names the
    field it lost and how to have such an input refused instead; a rewrite that loses
    nothing says nothing of the kind."""
    store = tmp_path / "store"
    abt.prepare_collection(synthetic_h5ads[:1], store, progress=False)
    assert "layers/counts" in abt.open_collection(store).fields
    bare = ad.read_h5ad(synthetic_h5ads[1])
    del bare.layers["counts"]
    bare.write_h5ad(tmp_path / "bare.h5ad")
    caplog.set_level("WARNING", logger="annbatch_torch")
    assert abt.prepare_collection([synthetic_h5ads[0], tmp_path / "bare.h5ad"], store,
                                  progress=False) is True
    assert "layers/counts" not in abt.open_collection(store).fields
    lost = [r.getMessage() for r in caplog.records if "without fields it held" in
            r.getMessage()]
    assert len(lost) == 1, lost
    assert "['layers/counts']" in lost[0]
    assert "layers=[...]" in lost[0]
    caplog.clear()
    assert abt.prepare_collection(synthetic_h5ads, store, seed=7, progress=False) is True
    assert not [r for r in caplog.records if "without fields it held" in r.getMessage()]
