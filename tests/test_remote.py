"""Collections on an object store: a real S3-compatible server (moto) on loopback."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SMALL_SHARD_OBS, S3Server

import annbatch_torch as abt
from annbatch_torch import A
from annbatch_torch.errors import CollectionError, InputError, ReadError
from annbatch_torch.store.collection import open_collection
from annbatch_torch.store.remote import location as remote_mod
from annbatch_torch.write.writer import create_anndata_collection

pytest.importorskip("s3fs")
pytest.importorskip("moto")

LAYOUT = {"n_obs_per_shard": SMALL_SHARD_OBS, "zarr_chunk_elems": 4096,
          "zarr_shard_elems": 65536}


def _write(inputs: list[Path], url: str, s3: Any, **kw: Any) -> abt.Collection:
    return create_anndata_collection(inputs, url, seed=0, progress=False,
                                     storage_options=s3.options, **{**LAYOUT, **kw})


@pytest.fixture(scope="module")
def remote_pair(synthetic_h5ads: list[Path], s3: Any, tmp_path_factory: pytest.TempPathFactory
                ) -> tuple[str, abt.Collection]:
    """The small inputs written to the server and, with the same seed, locally."""
    url = s3.bucket("pair") + "/atlas"
    _write(synthetic_h5ads, url, s3)
    local = create_anndata_collection(synthetic_h5ads, tmp_path_factory.mktemp("l") / "c",
                                      seed=0, progress=False, **LAYOUT)
    return url, local


def _epoch(source: Any, **kw: Any) -> list[dict[str, np.ndarray]]:
    ds = abt.AnnBatchDataset(source, selector={"x": A.X, "y": A.obs["cell_type"]},
                             batch_size=128, chunk_size=64, preload_nchunks=4, seed=3,
                             return_index=True, **kw)
    out = []
    for b in ds:
        out.append({k: (v.to_dense() if v.layout == torch.sparse_csr else v).numpy()
                    for k, v in b.items()})
    return out


def _loader_rows(source: Any, workers: int, context: str | None) -> dict[int, np.ndarray]:
    ds = abt.AnnBatchDataset(source, selector={"x": A.X}, batch_size=128, chunk_size=64,
                             preload_nchunks=4, seed=3, return_index=True, densify=True)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers,
                                     multiprocessing_context=context)
    rows: dict[int, np.ndarray] = {}
    for b in dl:
        for i, r in zip(b["index"].tolist(), b["x"].numpy()):
            assert i not in rows, f"row {i} delivered twice"
            rows[i] = r
    return rows


def test_same_batches_as_the_local_collection(remote_pair: tuple[str, abt.Collection],
                                              s3: Any, tmp_path: Path) -> None:
    url, local = remote_pair
    coll = open_collection(url, storage_options=s3.options, cache_dir=tmp_path / "cache")
    assert coll.url == url
    assert coll.n_obs == local.n_obs
    assert list(coll.var_names) == list(local.var_names)
    got, want = _epoch(coll), _epoch(local)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in g:
            np.testing.assert_array_equal(g[k], w[k])
    # the metadata answers come from the store too
    assert list(coll.obs_names_at(np.arange(50))) == list(local.obs_names_at(np.arange(50)))


@pytest.mark.parametrize(("workers", "context"), [(2, "fork"), (2, "spawn")])
def test_workers_read_every_row_once_with_the_source_values(
        remote_pair: tuple[str, abt.Collection], s3: Any, tmp_path: Path, workers: int,
        context: str) -> None:
    url, local = remote_pair
    coll = open_collection(url, storage_options=s3.options, cache_dir=tmp_path / "cache")
    rows = _loader_rows(coll, workers, context)
    assert sorted(rows) == list(range(local.n_obs))
    want = _loader_rows(local, 0, None)
    for i in (0, 1, 777, local.n_obs - 1):
        np.testing.assert_array_equal(rows[i], want[i])


def test_the_second_epoch_reads_the_cache_only(remote_pair: tuple[str, abt.Collection],
                                               s3: Any, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    url, _local = remote_pair
    calls: list[str] = []
    real = remote_mod.RemoteLocation.get_ranges

    def counted(self: Any, key: str, starts: Any, ends: Any, **kw: Any) -> Any:
        calls.append(key)
        return real(self, key, starts, ends, **kw)

    monkeypatch.setattr(remote_mod.RemoteLocation, "get_ranges", counted)
    coll = open_collection(url, storage_options=s3.options, cache_dir=tmp_path / "cache")
    first = _epoch(coll)
    assert calls, "the first epoch fetched nothing"
    calls.clear()
    second = _epoch(coll)
    assert calls == []
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a["x"], b["x"])
    # another process (a new open of the same cache folder) finds the chunks there too
    again = open_collection(url, storage_options=s3.options, cache_dir=tmp_path / "cache")
    _epoch(again)
    assert calls == []


def test_eviction_keeps_the_cache_under_its_size(remote_pair: tuple[str, abt.Collection],
                                                 s3: Any, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from annbatch_torch.store.remote import chunkcache

    monkeypatch.setattr(chunkcache, "KEEP_RECENT_S", 0.0)
    url, local = remote_pair
    bound = 150_000  # a third of the collection's chunks
    coll = open_collection(url, storage_options=s3.options, cache_dir=tmp_path / "cache",
                           cache_size=bound)
    got = _epoch(coll)
    want = _epoch(local)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g["x"], w["x"])
    size = coll.mirror.cache.size()
    # at most the bound, one eviction step's growth (a tenth) and one 16 KB chunk
    assert size <= bound + bound // 10 + 20_000, size
    assert size > 0


def test_two_processes_fill_one_cache(remote_pair: tuple[str, abt.Collection], s3: Any,
                                      tmp_path: Path) -> None:
    url, local = remote_pair
    script = textwrap.dedent(f"""
        import sys, numpy as np, annbatch_torch as abt
        from annbatch_torch import A
        coll = abt.open_collection({url!r}, storage_options={s3.options!r},
                                   cache_dir={str(tmp_path / 'cache')!r}, cache_size=300_000)
        ds = abt.AnnBatchDataset(coll, selector={{"x": A.X}}, batch_size=128, chunk_size=64,
                                 preload_nchunks=4, seed=int(sys.argv[1]), return_index=True,
                                 densify=True)
        total = np.zeros(coll.n_vars)
        n = 0
        for b in ds:
            total += b["x"].numpy().astype(np.float64).sum(0)
            n += len(b["index"])
        np.save(sys.argv[2], total)
        print(n)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(seed), str(tmp_path / f"{seed}")],
                              stdout=subprocess.PIPE, text=True) for seed in (1, 2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert [int(o.strip().splitlines()[-1]) for o in outs] == [local.n_obs] * 2
    want = np.zeros(local.n_vars)
    for b in _loader_rows(local, 0, None).values():
        want += b.astype(np.float64)
    for seed in (1, 2):
        np.testing.assert_allclose(np.load(tmp_path / f"{seed}.npy"), want, rtol=1e-6)


def test_a_url_is_never_a_local_folder(synthetic_h5ads: list[Path], s3: Any, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    url = s3.bucket("direct") + "/atlas"
    _write(synthetic_h5ads[:1], url, s3)
    assert not (tmp_path / "s3:").exists()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(InputError, match="scheme ftp://"):
        open_collection("ftp://host/atlas")
    with pytest.raises(InputError, match="scheme ftp://"):
        create_anndata_collection(synthetic_h5ads[:1], "ftp://host/atlas", progress=False)
    with pytest.raises(InputError, match=r"download the \.h5ad"):
        create_anndata_collection(["s3://direct/in.h5ad"], tmp_path / "o", progress=False)
    with pytest.raises(InputError, match="storage_options"):
        open_collection(tmp_path, storage_options={"region": "x"})


def test_a_cache_dir_that_cannot_be_written_is_named_with_the_fix(
        remote_pair: tuple[str, abt.Collection], s3: Any, tmp_path: Path) -> None:
    """A cache_dir inside a file (no folder can be made) and, where this process may mount
    one, a tmpfs too small for the metadata: a CollectionError naming the URL, the cache_dir
    and the fix, and no half-written metadata file left in the small one."""
    url, _ = remote_pair
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CollectionError, match=r"s3://pair/atlas: cannot mirror the "
                       r"collection's metadata into cache_dir .*afile/cache \(Not a "
                       r"directory.*Pass cache_dir= a writable folder with free space"):
        open_collection(url, storage_options=s3.options, cache_dir=tmp_path / "afile" / "cache")
    small = tmp_path / "small"
    small.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                                            str(small)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        with pytest.raises(CollectionError, match=r"cache_dir .*small/c \(No space left on "
                           r"device\)\. Pass cache_dir="):
            open_collection(url, storage_options=s3.options, cache_dir=small / "c",
                            cache_size=2**30)
        assert not [p for p in small.rglob("*.tmp")]
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_missing_bucket_empty_prefix_and_foreign_objects(synthetic_h5ads: list[Path],
                                                         s3: Any, tmp_path: Path) -> None:
    with pytest.raises(CollectionError, match=r"s3://no-such-bucket/atlas.*bucket does not"):
        open_collection("s3://no-such-bucket/atlas", storage_options=s3.options,
                        cache_dir=tmp_path)
    url = s3.bucket("foreign")
    with pytest.raises(CollectionError, match=r"s3://foreign/empty: holds no objects"):
        open_collection(url + "/empty", storage_options=s3.options, cache_dir=tmp_path)
    s3.fs().pipe_file("foreign/mine/notes.txt", b"hello")
    with pytest.raises(CollectionError, match=r"holds 1 objects but no manifest.json"):
        open_collection(url + "/mine", storage_options=s3.options, cache_dir=tmp_path)
    with pytest.raises(InputError, match=r"s3://foreign/mine holds 1 objects but no manifest"):
        _write(synthetic_h5ads[:1], url + "/mine", s3)
    # nothing was written over it
    assert s3.fs().find("foreign") == ["foreign/mine/notes.txt"]


def test_overwrite_replaces_the_manifest_last_and_the_old_objects_after(
        synthetic_h5ads: list[Path], s3: Any, tmp_path: Path) -> None:
    url = s3.bucket("over") + "/atlas"
    _write(synthetic_h5ads[:2], url, s3)
    with pytest.raises(InputError, match="already holds a collection; pass overwrite=True"):
        _write(synthetic_h5ads[:2], url, s3)
    old = open_collection(url, storage_options=s3.options, cache_dir=tmp_path / "a")
    old_keys = set(s3.fs().find("over"))
    new = _write(synthetic_h5ads, url, s3, overwrite=True)
    assert new.n_obs > old.n_obs
    keys = set(s3.fs().find("over"))
    assert keys & old_keys == {"over/atlas/manifest.json"}  # the old generation is gone
    reopened = open_collection(url, storage_options=s3.options, cache_dir=tmp_path / "a")
    assert reopened.n_obs == new.n_obs
    assert reopened.path != old.path
    # a reader of the old collection is told, not fed rows of the new one
    with pytest.raises(CollectionError, match="rewritten"):
        _epoch(old)


def test_a_corrupted_chunk_object_is_an_error_not_values(synthetic_h5ads: list[Path],
                                                         s3: Any, tmp_path: Path) -> None:
    url = s3.bucket("corrupt") + "/atlas"
    coll = _write(synthetic_h5ads[:1], url, s3)
    fs = s3.fs()
    key = next(k for k in fs.find("corrupt") if "/X/data/c/" in k)
    body = bytearray(fs.cat_file(key))
    body[100] ^= 0xFF
    fs.pipe_file(key, bytes(body))
    # the manifest is unchanged, the object is not: opened afresh, its chunk fails its CRC
    fresh = open_collection(url, storage_options=s3.options, cache_dir=tmp_path / "c")
    assert fresh.n_obs == coll.n_obs
    with pytest.raises(ReadError, match=r"checksum mismatch") as err:
        _epoch(fresh)
    assert "s3://corrupt/atlas/" in str(err.value)  # the shard by its URL


def test_a_server_gone_mid_epoch_fails_in_bounded_time(synthetic_h5ads: list[Path],
                                                       tmp_path: Path) -> None:
    server = S3Server()
    try:
        url = server.bucket("gone") + "/atlas"
        create_anndata_collection(synthetic_h5ads, url, seed=0, progress=False,
                                  storage_options=server.options, **LAYOUT)
        coll = open_collection(url, storage_options=server.options, cache_dir=tmp_path)
        ds = abt.AnnBatchDataset(coll, selector={"x": A.X}, batch_size=128, chunk_size=64,
                                 preload_nchunks=2, seed=0, prefetch=False)
        it = iter(ds)
        next(it)
    finally:
        server.stop()
    t0 = time.monotonic()
    with pytest.raises((ReadError, CollectionError), match=r"s3://gone/atlas"):
        for _ in it:
            pass
    assert time.monotonic() - t0 < 120


def test_storage_options_that_the_store_refuses(s3: Any, tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"s3://x/y: the storage_options \['no_such_key'\]"):
        open_collection("s3://x/y", storage_options={"no_such_key": 1}, cache_dir=tmp_path)


def test_remote_location_pickles_without_its_client(
        remote_pair: tuple[str, abt.Collection], s3: Any) -> None:
    import pickle

    loc = remote_mod.RemoteLocation("s3://pair/atlas", s3.options)
    assert loc.head("manifest.json") is not None
    back = pickle.loads(pickle.dumps(loc))
    assert back._store is None
    assert back.url == loc.url
    assert os.getpid() == loc._pid


def test_two_gloo_ranks_share_the_rows_of_a_remote_collection(
        remote_pair: tuple[str, abt.Collection], s3: Any, tmp_path: Path) -> None:
    import remote_ddp
    import torch.multiprocessing as tmp_mp

    url, local = remote_pair
    tmp_mp.start_processes(remote_ddp.entry, nprocs=2, start_method="spawn", args=(
        2, f"file://{tmp_path / 'rdv'}", url, s3.options, str(tmp_path / "cache"),
        str(tmp_path)))
    ranks = [np.load(tmp_path / f"rank{r}.npy") for r in (0, 1)]
    assert np.load(tmp_path / "batches0.npy")[0] == np.load(tmp_path / "batches1.npy")[0]
    assert not set(ranks[0].tolist()) & set(ranks[1].tolist())
    assert sorted(np.concatenate(ranks).tolist()) == list(range(local.n_obs))


def test_the_datamodule_and_the_cli_read_a_url(remote_pair: tuple[str, abt.Collection],
                                               s3: Any, tmp_path: Path) -> None:
    url, local = remote_pair
    dm = abt.AnnBatchDataModule(None, store_path=url, storage_options=s3.options,
                                cache_dir=tmp_path / "cache", selector={"x": A.X},
                                batch_size=128, chunk_size=64, preload_nchunks=4,
                                num_workers=0, dataset_kwargs={"return_index": True})
    dm.prepare_data()
    assert dm.store_written is False
    dm.setup("fit")
    seen = [i for b in dm.train_dataloader() for i in b["index"].tolist()]
    assert len(seen) == len(set(seen)) > 0
    with pytest.raises(ValueError, match="prepare_data does not write there"):
        abt.AnnBatchDataModule(store_path=url, adata_paths=["a.h5ad"], selector={"x": A.X})
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_ENDPOINT_URL": s3.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}
    r = subprocess.run([sys.executable, "-m", "annbatch_torch.cli", "info", url],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"collection  {url}" in r.stdout
    assert f"cells       {local.n_obs:,}" in r.stdout


class _SlowProxy:
    """A TCP proxy on loopback that holds every reply of the server ``delay`` seconds."""

    def __init__(self, port: int, delay: float) -> None:
        import socket
        import threading

        self.delay, self.target = delay, port
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while not self._stop:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pipe, args=(client, upstream, 0.0),
                             daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self.delay),
                             daemon=True).start()

    @staticmethod
    def _pipe(src: Any, dst: Any, delay: float) -> None:
        try:
            while data := src.recv(65536):
                if delay:
                    time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def close(self) -> None:
        self._stop = True
        self.sock.close()


def test_a_slow_server_is_waited_for_within_the_timeouts_and_refused_beyond(
        remote_pair: tuple[str, abt.Collection], s3: Any, tmp_path: Path) -> None:
    url, local = remote_pair
    slow = _SlowProxy(s3.port, 0.02)
    try:
        opts = {**s3.options, "endpoint_url": f"http://127.0.0.1:{slow.port}"}
        coll = open_collection(url, storage_options=opts, cache_dir=tmp_path / "a")
        for g, w in zip(_epoch(coll), _epoch(local)):
            np.testing.assert_array_equal(g["x"], w["x"])
    finally:
        slow.close()
    stuck = _SlowProxy(s3.port, 30.0)
    try:
        opts = {**s3.options, "endpoint_url": f"http://127.0.0.1:{stuck.port}",
                "config_kwargs": {"read_timeout": 1, "connect_timeout": 1,
                                  "retries": {"max_attempts": 2}}}
        t0 = time.monotonic()
        with pytest.raises(ReadError, match=r"s3://pair/atlas/manifest\.json: .*failed after "
                           r"retries"):
            open_collection(url, storage_options=opts, cache_dir=tmp_path / "b")
        assert time.monotonic() - t0 < 30
    finally:
        stuck.close()


def test_an_object_deleted_after_the_open_is_named(synthetic_h5ads: list[Path], s3: Any,
                                                   tmp_path: Path) -> None:
    url = s3.bucket("deleted") + "/atlas"
    _write(synthetic_h5ads[:1], url, s3)
    coll = open_collection(url, storage_options=s3.options, cache_dir=tmp_path)
    fs = s3.fs()
    for key in fs.find("deleted"):
        if "/X/" in key and "/c/" in key:
            fs.rm(key)
    with pytest.raises(ReadError, match=r"s3://deleted/atlas/g-.*deleted since the collection "
                       "was opened"):
        _epoch(coll)


def test_a_full_cache_disk_reads_on_uncached_with_a_warning(
        remote_pair: tuple[str, abt.Collection], s3: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins
    import errno

    from annbatch_torch.store.remote import chunkcache

    url, local = remote_pair
    cache = tmp_path / "cache"
    real_open = builtins.open

    def full(path: Any, *a: Any, **k: Any) -> Any:
        if str(path).startswith(str(cache / "chunks")):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(chunkcache, "open", full, raising=False)
    coll = open_collection(url, storage_options=s3.options, cache_dir=cache)
    with pytest.warns(RuntimeWarning, match="ran out of disk space"):
        got = _epoch(coll)
    for g, w in zip(got, _epoch(local)):
        np.testing.assert_array_equal(g["x"], w["x"])
    assert coll.mirror.cache.size() == 0


def test_append_to_a_remote_collection_adds_objects_only(synthetic_h5ads: list[Path],
                                                         s3: Any, tmp_path: Path) -> None:
    url = s3.bucket("grow") + "/atlas"
    first = _write(synthetic_h5ads[:2], url, s3)
    fs = s3.fs()
    before = {k: fs.info(k)["ETag"] for k in fs.find("grow") if not k.endswith("manifest.json")}
    reader = open_collection(url, storage_options=s3.options, cache_dir=tmp_path / "r")
    grown = abt.append_to_collection(url, synthetic_h5ads[2:], storage_options=s3.options,
                                     progress=False)
    assert grown.n_obs == 1200 + 900 + 600
    after = {k: fs.info(k)["ETag"] for k in fs.find("grow")}
    assert all(after.get(k) == v for k, v in before.items())  # no old object touched
    # every cell once, the new ones among them; the old reader reads on (shards only added)
    names = grown.obs_names_at(np.arange(grown.n_obs))
    assert len(set(names)) == grown.n_obs
    assert any(n.startswith("part2_") for n in names)
    rows = _loader_rows(reader, 0, None)
    assert sorted(rows) == list(range(first.n_obs))
    with pytest.raises(InputError, match="already"):
        abt.append_to_collection(url, synthetic_h5ads[2:], storage_options=s3.options,
                                 progress=False)


def test_denied_access_names_the_url_and_the_fix(tmp_path: Path) -> None:
    server = S3Server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})  # credentials enforced
    try:
        with pytest.raises(CollectionError, match=r"s3://locked/atlas.*access denied.*"
                           r"credentials"):
            open_collection("s3://locked/atlas", storage_options=server.options,
                            cache_dir=tmp_path)
    finally:
        server.stop()


def test_a_damaged_cache_entry_is_fetched_again(remote_pair: tuple[str, abt.Collection],
                                                s3: Any, tmp_path: Path) -> None:
    url, local = remote_pair
    coll = open_collection(url, storage_options=s3.options, cache_dir=tmp_path / "cache")
    want = _epoch(local)
    _epoch(coll)
    damaged = 0
    for f in sorted((tmp_path / "cache" / "chunks").rglob("*")):
        if f.is_file() and f.stat().st_size > 1000:
            b = bytearray(f.read_bytes())
            b[len(b) // 2] ^= 0xFF
            f.write_bytes(bytes(b))
            damaged += 1
    assert damaged > 10
    again = open_collection(url, storage_options=s3.options, cache_dir=tmp_path / "cache")
    for g, w in zip(_epoch(again), want):
        np.testing.assert_array_equal(g["x"], w["x"])


def test_object_keys_that_leave_the_mirror_are_refused(synthetic_h5ads: list[Path], s3: Any,
                                                       tmp_path: Path) -> None:
    url = s3.bucket("hostile") + "/atlas"
    _write(synthetic_h5ads[:1], url, s3)
    target = tmp_path / "pwned"
    s3.fs().pipe_file(f"hostile/atlas/zz/../../../../../../../../..{target}", b"x")
    with pytest.raises(CollectionError, match=r"s3://hostile/atlas/.*refuses"):
        open_collection(url, storage_options=s3.options, cache_dir=tmp_path / "c")
    assert not target.exists()


def test_prepare_collection_refuses_a_url(synthetic_h5ads: list[Path], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match=r"s3://prep/atlas: prepare_collection keeps"):
        abt.prepare_collection(synthetic_h5ads[:1], "s3://prep/atlas")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(InputError, match="plain HTTP server"):
        open_collection("https://example.org/atlas")


def test_an_object_replaced_in_place_after_the_open_is_refused(synthetic_h5ads: list[Path],
                                                                s3: Any, tmp_path: Path) -> None:
    url = s3.bucket("inplace") + "/atlas"
    _write(synthetic_h5ads[:1], url, s3)
    coll = open_collection(url, storage_options=s3.options, cache_dir=tmp_path)
    fs = s3.fs()
    for key in fs.find("inplace"):
        if "/X/data/c/" in key:  # another version of the object, as a rewrite in place would
            body = bytearray(fs.cat_file(key))
            body[0] ^= 0x01
            fs.pipe_file(key, bytes(body))
    with pytest.raises(ReadError, match=r"s3://inplace/atlas/g-.*changed on the store since"):
        _epoch(coll)


def test_a_compressed_collection_is_fetched_lazily_through_the_cache(
        synthetic_h5ads: list[Path], s3: Any, tmp_path: Path) -> None:
    url = s3.bucket("zstd") + "/atlas"
    _write(synthetic_h5ads[:1], url, s3, compressor="zstd")
    local = create_anndata_collection(synthetic_h5ads[:1], tmp_path / "local", seed=0,
                                      progress=False, compressor="zstd", **LAYOUT)
    coll = open_collection(url, storage_options=s3.options, cache_dir=tmp_path / "a")
    meta = [p for p in (tmp_path / "a" / "meta").rglob("*") if p.is_file()]
    assert not [p for p in meta if "/X/" in p.as_posix() and "/c/" in p.as_posix()]
    for g, w in zip(_epoch(coll), _epoch(local)):
        np.testing.assert_array_equal(g["x"], w["x"])
    assert coll.mirror.cache.size() > 0  # the X objects came through the bounded cache
    # what is still copied whole at open (obs, var, names) must fit the cache's bound
    with pytest.raises(CollectionError, match=r"s3://zstd/atlas: .* not chunks read by range"):
        open_collection(url, storage_options=s3.options, cache_dir=tmp_path / "b",
                        cache_size=100)


def test_an_upload_stopped_before_its_manifest_is_overwritable(synthetic_h5ads: list[Path],
                                                                s3: Any) -> None:
    url = s3.bucket("halfway") + "/atlas"
    s3.fs().pipe_file("halfway/atlas/g-0123456789ab/shard_00000.zarr/zarr.json", b"{}")
    with pytest.raises(InputError, match="holds 1 objects but no manifest"):
        _write(synthetic_h5ads[:1], url, s3)
    coll = _write(synthetic_h5ads[:1], url, s3, overwrite=True)
    assert coll.n_obs == 1200
    assert not [k for k in s3.fs().find("halfway") if "g-0123456789ab" in k]


def test_folder_markers_and_look_alike_array_names(synthetic_h5ads: list[Path], s3: Any,
                                                   tmp_path: Path) -> None:
    """A zero-byte 'folder' key (what consoles make) is not an object; a compressed obsm
    'X_pca' beside 'X_pca2' reads its own chunks only."""
    import anndata as ad

    a = ad.read_h5ad(synthetic_h5ads[2])
    a.obsm["X_pca2"] = a.obsm["X_pca"][:, :3] * 2
    url = s3.bucket("lookalike") + "/atlas"
    _write([a], url, s3, compressor="zstd")
    s3.fs().pipe_file("lookalike/atlas/notes/", b"")
    coll = open_collection(url, storage_options=s3.options, cache_dir=tmp_path)
    ds = abt.AnnBatchDataset(coll, selector={"p": A.obsm["X_pca"], "q": A.obsm["X_pca2"]},
                             batch_size=128, shuffle=False, return_index=True)
    names = coll.obs_names_at(np.arange(coll.n_obs))
    want = a.obsm["X_pca"][a.obs_names.get_indexer(names)]
    got = np.concatenate([b["p"].numpy() for b in ds])
    np.testing.assert_allclose(got, want, rtol=1e-6)
