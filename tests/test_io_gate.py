"""Reads that wait for the disk give their CPU slot back (store.diskio.io_gate)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import zarr

from annbatch_torch import Collection, open_collection
from annbatch_torch.read.reader import PoolReader
from annbatch_torch.store import diskio

# serial: these tests need pages out of the page cache until they read them, so they do
# not run beside other tests (make test runs the serial tests after the others)
pytestmark = [pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="needs Linux RWF_NOWAIT"),
              pytest.mark.serial]


class _Slot(diskio.CpuSlots):
    """Real slots (one) that record what is done with them."""

    def __init__(self) -> None:
        super().__init__(1)
        self.events: list[str] = []

    def acquire(self) -> None:
        super().acquire()
        self.events.append("acquire")

    def release(self) -> None:
        self.events.append("release")
        super().release()


def _gated_read(fd: int, bufs: list[np.ndarray], nbytes: int, want: np.ndarray,
                **kw: int) -> _Slot:
    """Read ``bufs`` under a fresh slot; the bytes read equal ``want``; returns the slot."""
    slot = _Slot()
    with diskio.io_gate(slot):
        n = diskio.preadv_full(fd, bufs, 0, nbytes, **kw)
    assert n == len(want)
    np.testing.assert_array_equal(np.concatenate(bufs)[: len(want)], want)
    return slot


def _uncached_file(path: Path, data: np.ndarray) -> int:
    """``path`` holding ``data``, written to disk and dropped from the page cache."""
    with open(path, "wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        _skip_if_cached(fd, len(data) // 2)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _skip_if_cached(fd: int, offset: int) -> None:
    """Skip the test when the page at ``offset`` of ``fd`` is in the page cache."""
    try:
        os.preadv(fd, [bytearray(4096)], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        return  # not in the page cache: what the test needs
    pytest.skip("this file system keeps the pages cached (POSIX_FADV_DONTNEED ignored)")


def _settle_cached(fd: int, nbytes: int) -> None:
    """Wait until all ``nbytes`` of ``fd`` copy from the page cache without blocking.

    A page may still be declined by ``RWF_NOWAIT`` after a read brought it in (a
    read-ahead marker the kernel left, or a page still under I/O): read it the usual way
    and try again, a few times, before calling the page cache unsettled.
    """
    buf = bytearray(nbytes)
    for _ in range(20):
        try:
            got = os.preadv(fd, [buf], 0, os.RWF_NOWAIT)
        except BlockingIOError:
            got = 0
        if got >= nbytes:
            return
        os.pread(fd, nbytes - got, got)
    pytest.fail(f"{nbytes} bytes just read do not copy from the page cache with RWF_NOWAIT")


def test_a_read_waiting_for_the_disk_gives_its_slot_back(tmp_path: Path) -> None:
    data = np.random.default_rng(0).integers(0, 255, 4 << 20, dtype=np.uint8)
    fd = _uncached_file(tmp_path / "f", data)
    try:
        out = np.zeros_like(data)
        half = len(data) // 2 + 17
        slot = _gated_read(fd, [out[:half], out[half:]], len(data), data)
        # taken, given back for the disk (once, or twice when the kernel's read-ahead
        # had not brought the rest in yet), taken again each time, given back at the end
        assert slot.events in (["acquire", "release"] * 2, ["acquire", "release"] * 3)
        # one read; counted as a wait when its page from the disk took longer than
        # diskio._DISK_WAIT_S (a hint: a fast disk or the host's cache can beat it, and
        # the kernel's read-ahead then brings the rest; failed ~1 in 3 runs on 2026-12-06)
        reads, waits = slot.take_counts()
        assert reads == 1
        assert waits in (0, 1)
        # now in the page cache: copied holding the slot
        _settle_cached(fd, len(data))
        slot = _gated_read(fd, [np.zeros_like(data)], len(data), data)
        assert slot.events == ["acquire", "release"]
        assert slot.take_counts() == (1, 0)
    finally:
        os.close(fd)


def test_a_partly_cached_read_reads_the_rest_from_the_disk(tmp_path: Path) -> None:
    data = np.random.default_rng(1).integers(0, 255, 2 << 20, dtype=np.uint8)
    fd = _uncached_file(tmp_path / "f", data)
    try:
        # the first half into the page cache, the second half not: the kernel's
        # read-ahead (8 MiB on some disks) may bring it in with the first, so drop it
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, 1 << 20, 0)
        os.posix_fadvise(fd, 1 << 20, 0, os.POSIX_FADV_DONTNEED)
        _skip_if_cached(fd, len(data) - 4096)
        bufs = [np.zeros(3000, np.uint8), np.zeros(len(data) - 3000, np.uint8)]
        slot = _gated_read(fd, bufs, len(data), data)
        assert slot.events in (["acquire", "release"] * 2, ["acquire", "release"] * 3)
    finally:
        os.close(fd)


def test_pool_reads_through_the_gate_equal_the_store(small_collection: Collection) -> None:
    """A reader with one CPU slot and many reads in flight reads what zarr reads."""
    coll = open_collection(small_collection.path)
    reader = PoolReader(coll, ["X"], threads=1, io_depth=8)
    assert reader.io_depth == 8
    n = coll.shard_sizes[0]
    order = np.random.default_rng(0).permutation(n)
    got = reader.read(np.array([[0, n]]), order)["X"]
    g = zarr.open_group(str(coll.shard_path(0)), mode="r")["X"]
    ref = sp.csr_matrix((g["data"][...], g["indices"][...], g["indptr"][...]),
                        shape=tuple(g.attrs["shape"]))
    np.testing.assert_array_equal(got.toarray(), ref[order].toarray())
    reader.close()


def test_the_reader_reads_deep_only_after_pools_that_waited_for_the_disk(
        small_collection: Collection) -> None:
    reader = PoolReader(open_collection(small_collection.path), ["X"], threads=2, io_depth=8)
    first = reader._executor()
    assert first is reader._deep  # nothing seen yet: data may come from the disk
    assert reader._slots is not None
    for _ in range(40):
        reader._slots.note(False)  # a pool from the page cache
    assert reader._executor() is reader._pool
    assert reader._pool is not None
    assert reader._pool._max_workers == 2
    assert reader._executor() is reader._pool  # no pool read since: unchanged
    for waited in [True] * 2 + [False] * 38:  # 5% of a pool's reads waited for the disk
        reader._slots.note(waited)
    assert reader._executor() is reader._deep
    assert reader._deep is not None
    assert reader._deep._max_workers == 8
    reader.close()


def _cached_file(path: Path, data: np.ndarray) -> int:
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    os.pread(fd, len(data) + 1, 0)  # into the page cache
    return fd


def test_many_buffers_from_the_page_cache_keep_the_slot(tmp_path: Path) -> None:
    """More buffers than one preadv takes (IOV_MAX): still read from the cache at once."""
    data = np.random.default_rng(2).integers(0, 255, 1 << 20, dtype=np.uint8)
    fd = _cached_file(tmp_path / "f", data)
    try:
        slot = _gated_read(fd, np.split(np.zeros_like(data), 2048), len(data), data)
        assert slot.events == ["acquire", "release"]
        assert slot.take_counts() == (1, 0)
    finally:
        os.close(fd)


def test_a_cached_chunk_file_with_its_end_probe_keeps_the_slot(tmp_path: Path) -> None:
    """A chunk file is read with one byte more than it holds (a longer file is damage): at
    its end, that probe is no reason to wait for the disk."""
    data = np.random.default_rng(3).integers(0, 255, 300_000, dtype=np.uint8)
    fd = _cached_file(tmp_path / "f", data)
    try:
        slot = _gated_read(fd, [np.zeros(len(data) + 1, np.uint8)], len(data) + 1, data,
                           need=len(data))
        assert slot.events == ["acquire", "release"]
        assert slot.take_counts() == (1, 0)
    finally:
        os.close(fd)


@pytest.mark.parametrize("n_bufs", [1, 1101])
def test_a_file_system_refusing_rwf_nowait_reads_as_usual(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n_bufs: int) -> None:
    real = os.preadv

    def preadv(fd: int, bufs: object, offset: int, flags: int = 0) -> int:
        if flags:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return real(fd, bufs, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(diskio, "_REFUSED_DEVICES", set())
    data = np.random.default_rng(4).integers(0, 255, 1 << 20, dtype=np.uint8)
    fd = _cached_file(tmp_path / "f", data)
    try:
        for _ in range(2):  # refused, then not asked again
            slot = _gated_read(fd, np.array_split(np.zeros_like(data), n_bufs), len(data),
                               data)
            assert slot.take_counts() == (1, 0)
            assert {os.fstat(fd).st_dev} == diskio._REFUSED_DEVICES
    finally:
        os.close(fd)


def test_a_refusal_is_remembered_for_its_file_system_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A remote collection's cache entries in ``/dev/shm`` (tmpfs refused ``RWF_NOWAIT``
    on Linux 6.18 here) must not turn the page-cache first try off for the files of a
    collection on another file system read in the same process."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a file system of its own")
    real, tried = os.preadv, []

    def preadv(fd: int, bufs: object, offset: int, flags: int = 0) -> int:
        dev = os.fstat(fd).st_dev
        if flags:
            tried.append(dev)
            if dev == os.stat(shm).st_dev:  # refused there, whatever this kernel does
                raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return real(fd, bufs, offset, flags)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(diskio, "_REFUSED_DEVICES", set())
    data = np.random.default_rng(5).integers(0, 255, 1 << 16, dtype=np.uint8)
    local = _cached_file(tmp_path / "f", data)
    path = shm / f"annbatch-test-{os.getpid()}"
    cached = _cached_file(path, data)
    try:
        local_dev, shm_dev = os.fstat(local).st_dev, os.fstat(cached).st_dev
        _gated_read(cached, [np.zeros_like(data)], len(data), data)
        assert {shm_dev} == diskio._REFUSED_DEVICES
        tried.clear()
        _gated_read(cached, [np.zeros_like(data)], len(data), data)
        _gated_read(local, [np.zeros_like(data)], len(data), data)
        assert tried == [local_dev]  # tmpfs not asked again; the local file still is
        with diskio.io_gate(_Slot()):
            assert diskio.fast_flags(local_dev) == os.RWF_NOWAIT
            assert diskio.fast_flags(None) == os.RWF_NOWAIT
            assert diskio.fast_flags(shm_dev) is None
    finally:
        os.close(local)
        os.close(cached)
        path.unlink()


def test_warm_pools_are_read_by_the_small_executor(small_collection: Collection) -> None:
    """Real reads of a collection in the page cache (just written): after the first pool
    (deep), pools of X and an obs column go to the read_threads-wide executor."""
    coll = open_collection(small_collection.path)
    reader = PoolReader(coll, ["X", "obs/cell_type"], threads=2, io_depth=8)
    n = coll.shard_sizes[0]
    order = np.random.default_rng(0).permutation(n)
    reader.read(np.array([[0, n]]), order)
    assert reader._deep is not None  # the first pool
    for _ in range(2):
        reader.read(np.array([[0, n]]), order)
        assert reader._executor() is reader._pool
    reader.close()
