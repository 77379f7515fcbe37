"""Batch values from DataLoader workers to the main process by reference to the workers'
pool memory (read/handoff.py): the values arrive unchanged, a slot is rewritten only after
the main process let go of every batch sent from it, the memory is reused, and anything
outside it travels as torch sends it."""

from __future__ import annotations

import gc
import os
import pickle
import re
import signal
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from conftest import dense_rows, run_python
from torch.utils.data import DataLoader

import annbatch_torch as abt
from annbatch_torch import Collection
from annbatch_torch.read import handoff
from annbatch_torch.read.buffers import BufferCache
from annbatch_torch.read.csr import PendingCSR, csr_view

#: several pools per worker and epoch on the 2,700-cell collection
SMALL_POOLS = dict(batch_size=64, chunk_size=64, preload_nchunks=4, return_index=True)


def _send(x: handoff.InSlot) -> bytes:
    return bytes(ForkingPickler.dumps(x))  # what a worker's queue does


def _as_dense(x: torch.Tensor) -> torch.Tensor:
    return x.to_dense() if x.layout == torch.sparse_csr else x


def _narrow(m: sp.csr_matrix, data: type, index: type) -> sp.csr_matrix:
    """``m`` with its values and column indices in the given dtypes (a pool's narrow ones)."""
    return csr_view(m.data.astype(data), m.indices.astype(index), m.indptr, m.shape)


@pytest.mark.parametrize(("data", "index", "out"), [
    (np.float32, np.int32, np.float32), (np.int16, np.int32, np.int16),
    (np.uint16, np.uint16, np.float32), (np.uint32, np.uint16, np.float32),
    (np.uint8, np.int32, np.float64), (np.float64, np.int32, np.float32)])
def test_values_outside_pool_memory_travel_as_torch_sends_them(data: type, index: type,
                                                               out: type) -> None:
    """A CSR value that does not lie in this process's pool memory (none here) is
    pickled as torch would, and arrives equal to its values cast to the dtype asked for
    (numpy's cast), whatever dtypes its values and indices have: as a CSR tensor,
    densified, or pending densification by the loader."""
    m = _narrow(sp.random(50, 30, density=0.2, format="csr", random_state=3) * 1000, data,
                index)
    m.data[:3] = [np.iinfo(data).max if np.dtype(data).kind in "iu" else 1e300 / 1e290,
                  0, 7]
    want = torch.from_numpy(csr_view(m.data.astype(out), m.indices.astype(np.int64),
                                     m.indptr, m.shape).toarray())
    got = pickle.loads(_send(handoff.InSlot(m, dtype=out)))
    assert got.layout == torch.sparse_csr
    assert got.values().dtype == want.dtype
    assert torch.equal(got.to_dense(), want)
    got_dense = pickle.loads(_send(handoff.InSlot(m, dense=True, dtype=out)))
    assert got_dense.layout == torch.strided
    assert torch.equal(got_dense, want)
    pending = pickle.loads(_send(handoff.InSlot(m, dtype=out, later=True)))
    assert isinstance(pending, PendingCSR)
    assert torch.equal(pending.to_dense(), want)
    with pytest.raises(RuntimeError, match="delivered already"):
        pending.to_dense()


def test_pool_memory_locates_values_and_frees_a_slot_when_its_array_is_garbage(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffer cache given pool memory allocates in it; a tensor viewing such an array
    is located (slot, offset); a slot is reused only once sent == done; the memory runs
    out of slots gracefully (private memory then)."""
    monkeypatch.setattr(handoff, "MAX_SLOTS", 3)
    memory = handoff.PoolMemory()
    cache = BufferCache(keep=2)
    cache.memory = memory
    a = cache.take(100, np.float32)
    k, slot, off = memory.locate(torch.from_numpy(a[10:20]))
    assert off == 40
    assert slot.data_ptr() == a.ctypes.data
    assert memory.locate(torch.zeros(4)) is None
    memory._c[k, handoff.SENT] += 1  # a batch sent from it, not yet let go of
    del a
    b = cache.take(100, np.float32)  # the first is busy: a second slot
    assert memory.locate(torch.from_numpy(b))[0] != k
    memory._c[k, handoff.DONE] += 1  # let go of by the main process
    del b
    again = cache.take(100, np.float32)
    assert memory.locate(torch.from_numpy(again))[0] == k  # reused
    held = [memory.allocate(8) for _ in range(3)]  # `again` and `b` (kept by the cache)
    assert [h is None for h in held] == [False, True, True]  # hold 2 of the 3 slots
    gen = int(memory._c[k, handoff.GEN])
    cache.clear()
    del again
    memory.locate(torch.zeros(1))  # (freed under the lock by the next call)
    assert int(memory._c[k, handoff.GEN]) == gen + 1  # freed: the main process unmaps it


@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.parametrize("densify", [False, True])
def test_batches_kept_while_reading_on_stay_intact(
        small_collection: Collection, densify: bool, context: str) -> None:
    """Two workers, persistent, three epochs: every batch of the first epoch is kept
    while two more epochs are read (a slot rewritten under it would change it), each
    epoch covers every row exactly once, every value equals the source, and the values
    came by reference (both workers' memory is mapped here)."""
    handoff.release()
    ds = abt.AnnBatchDataset(small_collection, densify=densify, seed=3, **SMALL_POOLS)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context=context)
    source = dense_rows(small_collection)
    kept = list(loader)
    for e in (1, 2):
        ds.set_epoch(e)
        rows = []
        for b in loader:
            np.testing.assert_array_equal(_as_dense(b["X"]).numpy(), source[b["index"]])
            rows.append(b["index"])
        assert sorted(torch.cat(rows).tolist()) == list(range(small_collection.n_obs))
    assert sorted(torch.cat([b["index"] for b in kept]).tolist()) == list(
        range(small_collection.n_obs))
    for b in kept:
        assert b["X"].layout == (torch.strided if densify else torch.sparse_csr)
        np.testing.assert_array_equal(_as_dense(b["X"]).numpy(), source[b["index"]])
    assert len(handoff._WORKERS) == 2
    del kept, b, loader
    handoff.release()


@pytest.mark.parametrize("densify", [False, True])
def test_a_loop_letting_go_of_its_batches_reuses_the_same_memory(
        small_collection: Collection, densify: bool) -> None:
    """Batches dropped as a training loop does: over three epochs of ~6 pools per
    worker, each worker sends from a handful of slots (its pool buffers and dense
    arrays, reused), not from new memory for every pool."""
    handoff.release()
    ds = abt.AnnBatchDataset(small_collection, densify=densify, seed=3, **SMALL_POOLS)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    n = 0
    for e in range(3):
        ds.set_epoch(e)
        n += sum(1 for _ in loader)
    assert n == 3 * -(-small_collection.n_obs // 64)
    assert len(handoff._WORKERS) == 2
    for w in handoff._WORKERS.values():
        c = w.counters[: handoff.MAX_SLOTS]
        used = np.flatnonzero(c[:, handoff.SENT])
        # 3 pools' buffers (2 each) are kept
        assert 0 < len(used) <= 6
        assert int(c[:, handoff.GEN].sum()) <= 2  # hardly any freed and made anew
    del loader
    handoff.release()


@pytest.mark.parametrize("densify", [False, True])
def test_a_loop_holding_its_last_k_batches_gets_them_intact_and_memory_reused(
        small_collection: Collection, densify: bool) -> None:
    """A training loop holding its last 3 batches (and every 7th for good) while it reads
    on, over three epochs through two persistent workers: each batch still equals the
    source when it leaves the window (and the ones held for good at the end), every epoch
    covers each row exactly once, and the workers reused their memory all the while."""
    import collections

    handoff.release()
    ds = abt.AnnBatchDataset(small_collection, densify=densify, seed=4, **SMALL_POOLS)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    source = dense_rows(small_collection)
    window: collections.deque[dict[str, torch.Tensor]] = collections.deque()
    for_good, n = [], 0
    for e in range(3):
        ds.set_epoch(e)
        rows = []
        for b in loader:
            rows.append(b["index"])
            n += 1
            window.append(b)
            if n % 7 == 0:
                for_good.append(b)
            if len(window) > 3:
                old = window.popleft()
                np.testing.assert_array_equal(_as_dense(old["X"]).numpy(),
                                              source[old["index"]])
            del b
        assert sorted(torch.cat(rows).tolist()) == list(range(small_collection.n_obs))
    for b in [*window, *for_good]:
        np.testing.assert_array_equal(_as_dense(b["X"]).numpy(), source[b["index"]])
    assert len(handoff._WORKERS) == 2
    made = sum(int(w.counters[: handoff.MAX_SLOTS, handoff.GEN].sum())
               + len(np.flatnonzero(w.counters[: handoff.MAX_SLOTS, handoff.SENT]))
               for w in handoff._WORKERS.values())
    # slots made: a working set per worker, plus (sparse) the 2 buffers of each pool a
    # batch held for good pins; without reuse, 2 per pool read (66)
    pinned = 0 if densify else 2 * len(for_good)
    assert made <= pinned + 12
    del window, for_good, loader
    handoff.release()


def _read_on(it: Any, kept: list) -> None:
    for _ in range(100):
        kept.append(next(it))


def test_a_worker_killed_mid_epoch_is_an_error_and_kept_batches_stay_whole(
        small_collection: Collection) -> None:
    """SIGKILL of a worker mid-epoch: the loader raises torch's error naming the worker,
    and the batches received before stay equal to the source."""
    handoff.release()
    ds = abt.AnnBatchDataset(small_collection, seed=5, **SMALL_POOLS)
    loader = DataLoader(ds, batch_size=None, num_workers=2, timeout=60)
    it = iter(loader)
    kept = [next(it) for _ in range(6)]
    os.kill(it._workers[0].pid, signal.SIGKILL)
    # torch reports it as its RuntimeError (its SIGCHLD handler, or the queue's timeout);
    # a worker killed while it sends a batch resets the connection first
    with pytest.raises((RuntimeError, ConnectionError, EOFError)) as info:
        _read_on(it, kept)
    if isinstance(info.value, RuntimeError):
        assert re.search(r"DataLoader worker .* exited unexpectedly|killed", str(info.value))
    try:  # the SIGCHLD handler may raise once more at the next step: here, not in pytest
        it._shutdown_workers()  # now: the error's reference cycle would hold it 5 s a worker
        del it
        gc.collect()
        time.sleep(0.5)
    except RuntimeError:
        pass
    source = dense_rows(small_collection)
    for b in kept:
        np.testing.assert_array_equal(b["X"].to_dense().numpy(), source[b["index"]])
    del kept, b
    handoff.release()


def test_a_loop_holding_every_batch_makes_the_workers_read_elsewhere(
        small_collection: Collection) -> None:
    """A training loop that keeps all batches of an epoch (e.g. a list of them) holds
    every slot they came from: the workers read their next pools into other memory and
    nothing is overwritten; once let go, the slots are given back (done == sent)."""
    handoff.release()
    ds = abt.AnnBatchDataset(small_collection, seed=9, **SMALL_POOLS)
    loader = DataLoader(ds, batch_size=None, num_workers=1, persistent_workers=True)
    first = list(loader)
    ds.set_epoch(1)
    second = list(loader)
    source = dense_rows(small_collection)
    for b in first + second:
        np.testing.assert_array_equal(b["X"].to_dense().numpy(), source[b["index"]])
    (w,) = handoff._WORKERS.values()
    c = w.counters[: handoff.MAX_SLOTS]
    assert (c[:, handoff.SENT] != c[:, handoff.DONE]).any()  # held right now
    del first, second, b
    ds.set_epoch(2)
    n = sum(1 for _ in loader)  # batches arriving sweep the slots let go of
    assert n > 0
    held_now = c[:, handoff.SENT] - c[:, handoff.DONE]
    # counted per part (2 per batch): at most the last pool's 4 batches, not 2 epochs'
    assert held_now.sum() <= 8
    del loader
    handoff.release()


def test_no_shared_memory_means_private_buffers_not_an_error(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A full /dev/shm: the pool memory gives ``None`` with a warning naming the fix, and
    the buffer cache takes private memory (batches then travel as torch sends them)."""
    memory = handoff.PoolMemory()
    cache = BufferCache(keep=2)
    cache.memory = memory

    def full(nbytes: int) -> torch.UntypedStorage:
        raise RuntimeError("unable to write to file </torch_1_2_3>: No space left on device")

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", staticmethod(full))
    a = cache.take(1000, np.float32)
    assert a.shape == (1000,)
    assert memory.locate(torch.from_numpy(a)) is None
    assert "shm-size" in caplog.text


def test_workers_of_a_dataset_iterated_here_first_still_send_by_reference(
        small_collection: Collection) -> None:
    """The same dataset object iterated in the main process first (its reader's buffers
    made here), then by forked workers: they still read into their pool memory and send
    by reference; once they exited, a new iteration here unmaps their memory."""
    source = dense_rows(small_collection)
    handoff.release()
    ds = abt.AnnBatchDataset(small_collection, seed=2, **SMALL_POOLS)
    next(iter(ds))
    got = list(DataLoader(ds, batch_size=None, num_workers=2))
    for b in got:
        np.testing.assert_array_equal(b["X"].to_dense().numpy(), source[b["index"]])
    assert len(handoff._WORKERS) == 2
    assert all(w.slots for w in handoff._WORKERS.values())
    del b
    for _ in range(100):  # the workers exit when the iterator is done with them
        if not any(handoff._alive(w.pid) for w in handoff._WORKERS.values()):
            break
        time.sleep(0.05)
    next(iter(ds))
    assert not handoff._WORKERS
    for b in got:  # their batches stay whole
        np.testing.assert_array_equal(b["X"].to_dense().numpy(), source[b["index"]])
    del got, b


def test_a_slot_storage_from_a_worker_that_died_is_named_as_such() -> None:
    """A slot's storage travels as torch sends one (the worker hands its descriptor over
    on request); it arrives equal, and when the worker died before handing it over (the
    connection reset) the error names the worker as exited, as torch's own does."""
    s = torch.arange(16, dtype=torch.uint8).untyped_storage().share_memory_()
    got = pickle.loads(ForkingPickler.dumps(handoff._Storage(s, 123)))
    assert bytes(got) == bytes(s)

    def gone(*args: Any) -> None:
        raise ConnectionResetError(104, "Connection reset by peer")

    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid 123\) exited "
                                           "unexpectedly"):
        handoff._received_storage(gone, (), 123)


def test_forked_workers_inherit_numbas_start_from_the_process_that_made_the_dataset(
        small_collection: Collection, tmp_path: Path) -> None:
    """Making a dataset pays numba's start (its registries and runtime) then and there, so
    forked workers begin with it loaded rather than each paying it before its first batch
    (and again every epoch without persistent workers); their batches are still every row
    once. In a fresh process: here another test may have started numba already."""
    out = run_python(f"""
import torch
from numba.core.runtime import nrt
from torch.utils.data import DataLoader
import annbatch_torch as abt
from annbatch_torch.store import native
assert not nrt.rtsys._init, "importing the package started numba"
ds = abt.AnnBatchDataset({str(small_collection.path)!r}, batch_size=64, chunk_size=64,
                         preload_nchunks=4, return_index=True)
# paid by the constructor itself: a thread of its own, holding numba's compiler lock
# across a fork, deadlocked one (see store/native.py::start_numba)
assert nrt.rtsys._init, "the dataset did not start numba"
seen = torch.zeros(2, dtype=torch.int64).share_memory_()
def init(worker_id):  # before the worker reads anything
    seen[worker_id] = 1 + int(nrt.rtsys._init and native.compiled_started())
dl = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork",
                worker_init_fn=init)
rows = sorted(i for b in dl for i in b["index"].tolist())
print(seen.tolist(), rows == list(range({small_collection.n_obs})))
""", tmp_path)
    assert out.split() == ["[2,", "2]", "True"], out


def test_forks_by_default_follows_the_start_method_without_fixing_it(tmp_path: Path) -> None:
    """The dataset pays numba's start only where workers would be forked: the start
    method set, else the platform's default, read without fixing the default (a later
    ``set_start_method`` still works)."""
    out = run_python("""
import multiprocessing
from annbatch_torch.store import native
first = native.forks_by_default()
multiprocessing.set_start_method("spawn")  # raises if the first call fixed the default
spawn = native.forks_by_default()
multiprocessing.set_start_method("fork", force=True)
print(first == (multiprocessing.get_all_start_methods()[0] == "fork"), spawn,
      native.forks_by_default())
""", tmp_path)
    assert out.split() == ["True", "False", "True"], out
