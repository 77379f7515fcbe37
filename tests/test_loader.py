"""AnnBatchDataLoader's hand-off of dense batches: CSR from workers, densified in the main
process (``DensifyPolicy`` "main"), and dense batches written straight into shared memory by
workers of a plain DataLoader. Values are compared with the in-process dataset."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import annbatch_torch as abt
from annbatch_torch import A, sampling
from annbatch_torch.read.csr import PendingCSR
from annbatch_torch.read.pool_stream import PoolStream, ReadAhead
from annbatch_torch.store.collection import Collection

SEL = {"x": A.X, "counts": A.layers["counts"], "pca": A.obsm["X_pca"], "ct": A.obs["cell_type"]}


def _by_index(batches: list[dict]) -> dict[str, np.ndarray]:
    index = np.concatenate([b["index"].numpy() for b in batches])
    assert len(np.unique(index)) == len(index)
    order = np.argsort(index)
    return {k: np.concatenate([np.asarray(b[k]) for b in batches])[order]
            for k in batches[0] if k != "index"}


def _double(x: np.ndarray) -> np.ndarray:
    return x * 2


@pytest.mark.parametrize("loader_cls", [abt.AnnBatchDataLoader, DataLoader])
def test_dense_from_workers_equals_in_process(
    small_collection: Collection, loader_cls: type
) -> None:
    kw = dict(selector=SEL, batch_size=300, return_index=True, densify=True, seed=3)
    ref = _by_index(list(abt.AnnBatchDataset(small_collection, **kw)))
    ds = abt.AnnBatchDataset(small_collection, **kw)
    batches = list(loader_cls(ds, batch_size=None, num_workers=2))
    for b in batches:
        assert b["x"].layout == torch.strided
        assert b["x"].dtype == torch.float32
        assert b["counts"].layout == torch.strided
    got = _by_index(batches)
    assert set(got) == set(ref)
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k])


def test_only_untransformed_sparse_keys_are_deferred(small_collection: Collection) -> None:
    sel = {"x": A.X, "c2": A.layers["counts"].with_transform(_double), "pca": A.obsm["X_pca"]}
    ds = abt.AnnBatchDataset(small_collection, selector=sel, densify=True)
    assert ds.densify_policy_for_workers(num_workers=2).main_keys == {"x"}
    assert abt.AnnBatchDataset(small_collection, selector=sel).densify_policy_for_workers(
        num_workers=2).main_keys == set()
    conv = abt.AnnBatchDataset(small_collection, selector=sel, densify=True,
                               batch_converter=abt.batch_dict_converter)
    assert conv.densify_policy_for_workers(num_workers=2).main_keys == set()
    loader = abt.AnnBatchDataLoader(ds, num_workers=2)
    assert loader.densify_policy.main_keys == {"x"}
    b = next(iter(loader))
    assert b["x"].layout == torch.strided
    assert b["c2"].layout == torch.strided
    # nothing is deferred in-process or with pinned memory
    assert abt.AnnBatchDataLoader(ds).densify_policy.main_keys == frozenset()
    assert abt.AnnBatchDataLoader(ds, num_workers=2,
                                  pin_memory=True).densify_policy.main_keys == frozenset()


def test_a_field_under_a_plain_and_a_transformed_key_leaves_workers_as_csr(
        small_collection: Collection) -> None:
    """The plain key of a field is sent as CSR (by reference to the worker's pool memory,
    arriving as a PendingCSR viewing it) and densified here as the loader hands the batch
    over (private memory); its transformed key is densified in the worker (it must see
    dense values) and arrives in the worker's shared memory."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    sel = {"a": A.X, "b": A.X.with_transform(_double)}
    ds = abt.AnnBatchDataset(small_collection, selector=sel, densify=True, batch_size=300)
    loader = abt.AnnBatchDataLoader(ds, num_workers=2)
    sent = next(iter(StatefulDataLoader.__iter__(loader)))  # as it left the workers' queue
    assert isinstance(sent["a"], PendingCSR)
    assert sent["a"].values.is_shared()
    assert sent["b"].layout == torch.strided
    assert sent["b"].is_shared()
    for b in loader:
        assert b["a"].layout == torch.strided
        assert not b["a"].is_shared()
        np.testing.assert_array_equal(b["b"].numpy(), 2 * b["a"].numpy())


def _mark(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    assert info is not None
    info.dataset._marked = worker_id


def test_user_worker_init_fn_still_runs(small_collection: Collection) -> None:
    ds = abt.AnnBatchDataset(small_collection, densify=True, batch_size=500)
    loader = abt.AnnBatchDataLoader(ds, num_workers=1, worker_init_fn=_mark)
    assert len(list(loader)) == len(ds)
    assert ds.densify_policy.where == "pool"  # the main process' dataset is left alone


def _own_collate(batch: Any) -> Any:
    return batch


class _Log1p(torch.utils.data.IterableDataset):
    """A user's wrapper that touches the values of the batches it passes on."""

    def __init__(self, ds: abt.AnnBatchDataset) -> None:
        self.ds = ds

    def __iter__(self) -> Any:
        for b in self.ds:
            b["X"] = torch.log1p(b["X"])
            yield b


def test_a_wrapper_dataset_in_a_worker_gets_dense_tensors(small_collection: Collection
                                                          ) -> None:
    """Batches consumed inside the worker (a wrapper dataset, a worker_init_fn peeking)
    are dense tensors: only torch's fetcher of this very dataset gets CSR to send on."""
    kw = dict(densify=True, batch_size=256, seed=4)
    ref = list(abt.AnnBatchDataset(small_collection, **kw))
    got = list(DataLoader(_Log1p(abt.AnnBatchDataset(small_collection, **kw)),
                          batch_size=None, num_workers=1))
    assert len(got) == len(ref)
    for r, g in zip(ref, got):
        assert torch.equal(g["X"], torch.log1p(r["X"]))


def test_dense_worker_batches_travel_as_csr_unless_a_collate_fn_sees_them(
        small_collection: Collection) -> None:
    """A plain DataLoader's worker sends a densified key as CSR, densified as the main
    process unpickles it (private memory, equal to the in-process batches); under a
    collate_fn of the caller's, which must see dense values, the worker densifies it
    into shared memory (no second copy on the way out)."""
    kw = dict(densify=True, batch_size=256, return_index=True, seed=4)
    ref = list(abt.AnnBatchDataset(small_collection, **kw))
    got = list(DataLoader(abt.AnnBatchDataset(small_collection, **kw), batch_size=None,
                          num_workers=1))
    assert len(got) == len(ref)
    for r, g in zip(ref, got):
        assert g["X"].layout == torch.strided
        assert not g["X"].is_shared()
        assert g["X"].dtype == r["X"].dtype
        assert torch.equal(g["X"], r["X"])
        assert torch.equal(g["index"], r["index"])
    spawned = list(DataLoader(abt.AnnBatchDataset(small_collection, **kw), batch_size=None,
                              num_workers=1, multiprocessing_context="spawn"))
    assert all(torch.equal(g["X"], r["X"]) for r, g in zip(ref, spawned, strict=True))
    it = iter(DataLoader(abt.AnnBatchDataset(small_collection, **kw), batch_size=None,
                         num_workers=1, collate_fn=_own_collate))
    b = next(it)
    assert b["X"].is_shared()
    assert torch.equal(b["X"], ref[0]["X"])
    del it


@pytest.mark.parametrize("densify", [True, False])
def test_device_pool_path_equals_host_path(small_collection: Collection, densify: bool) -> None:
    # device="cpu" runs the DevicePool path (upload, slice, densify) on the host; on CUDA the
    # same code runs with cupy's kernel (tests/test_gpu.py, gpu marker)
    kw = dict(selector=SEL, batch_size=300, return_index=True, densify=densify, seed=5)
    ref = list(abt.AnnBatchDataset(small_collection, **kw))
    got = list(abt.AnnBatchDataset(small_collection, device="cpu", **kw))
    assert len(got) == len(ref)
    for r, g in zip(ref, got):
        assert set(r) == set(g)
        for k in r:
            a, b = r[k], g[k]
            if a.layout == torch.sparse_csr:
                assert b.layout == torch.sparse_csr
                a, b = a.to_dense(), b.to_dense()
            assert a.dtype == b.dtype
            assert torch.equal(a, b)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_device_without_cuda_says_why(small_collection: Collection) -> None:
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        abt.AnnBatchDataset(small_collection, device="cuda")


def test_pin_memory_is_refused_for_batches_on_the_gpu(small_collection: Collection) -> None:
    ds = abt.AnnBatchDataset(small_collection, selector=SEL, batch_size=300, device="cpu")
    abt.AnnBatchDataLoader(ds, pin_memory=True)  # CPU device pools can be pinned
    ds.device = torch.device("cuda")  # as device="cuda" sets it (no CUDA here)
    with pytest.raises(ValueError, match=r"pin_memory=True: the dataset's batches are on "
                       r"cuda already .*leave pin_memory off"):
        abt.AnnBatchDataLoader(ds, pin_memory=True)
    assert not abt.AnnBatchDataLoader(ds).pin_memory


def test_batches_are_views_and_kept_batches_stay_intact(small_collection: Collection) -> None:
    """In-process sparse batches share the pool's buffers (no copy); the buffers are reused
    once batches are dropped, and never while a batch is still held."""
    from annbatch_torch.read.reader import PoolReader

    kw = dict(batch_size=128, chunk_size=64, preload_nchunks=4, return_index=True, seed=1)
    ref = {int(i): r for b in abt.AnnBatchDataset(small_collection, densify=True, **kw)
           for i, r in zip(b["index"].numpy(), b["X"].numpy())}
    ds = abt.AnnBatchDataset(small_collection, **kw)
    held = list(ds)  # every batch kept alive: no buffer may be reused under them
    for b in held:
        for i, row in zip(b["index"].numpy(), b["X"].to_dense().numpy()):
            np.testing.assert_array_equal(row, ref[int(i)])
    # dropped batches: buffers come back (bounded), values still right
    ds2 = abt.AnnBatchDataset(small_collection, **kw)
    seen_ptrs: set[int] = set()
    it = iter(ds2)
    for b in it:
        assert ds2._stream is not None
        reader = ds2._stream.reader
        assert isinstance(reader, PoolReader)
        x = b["X"]
        # the batch's values are a view of one of the reader's buffers
        owners = reader.buffers._owners
        ptr = x.values().data_ptr()
        assert any(o.ctypes.data <= ptr < o.ctypes.data + o.nbytes for o in owners)
        seen_ptrs.update(o.ctypes.data for o in owners)
        for i, row in zip(b["index"].numpy(), x.to_dense().numpy()):
            np.testing.assert_array_equal(row, ref[int(i)])
        del b, x
    n_pools = len(ds2.plan(0))
    assert n_pools >= 8
    # reused: two pools' buffers at a time (the one read ahead), not two fresh per pool
    assert reader.buffers.allocations <= 4 < 2 * n_pools
    assert len(seen_ptrs) <= reader.buffers.keep


def test_csr_view_never_copies() -> None:
    import scipy.sparse as sp

    from annbatch_torch.read.csr import csr_view

    big = np.arange(1000, dtype=np.float32)
    idx = np.tile(np.arange(10, dtype=np.int32), 100)
    m = csr_view(big[:30], idx[:30], np.array([0, 10, 30], dtype=np.int32), (2, 20))
    assert np.shares_memory(m.data, big)
    assert np.shares_memory(m.indices, idx)
    assert m.nnz == 30
    ref = sp.csr_matrix((big[:30].copy(), idx[:30].copy(), [0, 10, 30]), shape=(2, 20))
    np.testing.assert_array_equal(m.toarray(), ref.toarray())


def test_default_read_threads_follow_the_cpus(small_collection: Collection,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from annbatch_torch.annbatch_dataset import default_read_threads

    for cpus, want in ((1, 1), (2, 2), (3, 3), (16, 4)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        assert default_read_threads() == want
        assert abt.AnnBatchDataset(small_collection).read_threads == want
    assert abt.AnnBatchDataset(small_collection, read_threads=7).read_threads == 7


def test_buffer_cache_is_fresh_in_a_forked_child() -> None:
    import multiprocessing as mp

    from annbatch_torch.read.buffers import BufferCache

    cache = BufferCache(keep=2)
    held = cache.take(100, np.float32)
    cache._lock.acquire()  # as if another thread were inside take() when the fork happens
    try:
        ctx = mp.get_context("fork")
        q = ctx.Queue()

        def child() -> None:
            a = cache.take(10, np.float32)  # would deadlock on the copied lock
            q.put((len(cache._owners), a.size))

        p = ctx.Process(target=child)
        p.start()
        p.join(30)
        assert p.exitcode == 0
        assert q.get(timeout=5) == (1, 10)
    finally:
        cache._lock.release()
    assert held.size == 100


def test_reused_buffers_are_never_handed_out_under_a_live_view() -> None:
    """Pool buffers and dense arrays live in memory maps of their own (no huge-page
    madvise): a view of a view, or a tensor over one, must still keep its memory from
    being handed out again, and memory nothing uses any more is reused."""
    import torch

    from annbatch_torch.read.buffers import BufferCache, DenseBuffers

    dense = DenseBuffers(keep=2)
    a = dense.take((8, 5), np.dtype(np.float32))
    a[:] = 7.0
    kept = [a[2:][::2], torch.from_numpy(a[1:3].reshape(-1))]
    del a
    for _ in range(3):  # freed arrays come back; the one under the views never does
        b = dense.take((8, 5), np.dtype(np.float32))
        b[:] = -1.0
        assert not np.shares_memory(b, kept[0])
        del b
    assert float(kept[0].min()) == 7.0
    assert float(kept[1].min()) == 7.0
    assert dense.allocations == 2
    del kept
    c = dense.take((4, 10), np.dtype(np.float32))  # same bytes, other shape: reused
    d = dense.take((3, 5), np.dtype(np.float32))  # an epoch's short last batch: reused
    assert dense.allocations == 2
    assert c.shape == (4, 10)
    assert d.shape == (3, 5)
    assert c.flags.writeable
    assert d.flags.writeable

    cache = BufferCache(keep=4)
    x = cache.take(1000, np.dtype(np.int32))
    x[:] = 3
    view = x[10:20][::3]
    del x
    y = cache.take(1000, np.dtype(np.int32))
    y[:] = 0
    assert not np.shares_memory(y, view)
    assert int(view.min()) == 3
    del y
    z = cache.take(500, np.dtype(np.float64))
    assert cache.allocations == 2
    assert z.size == 500


def _ahead(ds: abt.AnnBatchDataset) -> ReadAhead | None:
    """The pool a dataset read ahead, if any."""
    return None if ds._stream is None else ds._stream.ahead


def _epoch_batches(ds: abt.AnnBatchDataset) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(b["index"].numpy().copy(), b["X"].to_dense().numpy().copy()) for b in ds]


def test_next_epoch_first_pool_is_read_ahead(small_collection: Collection,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    kw = dict(batch_size=100, chunk_size=64, preload_nchunks=4, return_index=True, seed=2)
    ds = abt.AnnBatchDataset(small_collection, **kw)
    plans = {e: list(ds.plan(e)) for e in range(3)}

    def epoch_of(item: sampling.WorkItem) -> int:  # which epoch's pool (rows and order)
        return next(e for e, items in plans.items() for it in items
                    if it == item and np.array_equal(it.order, item.order))

    reads: list[tuple[int, int]] = []
    real = PoolStream.read

    def spy(self, item, shared=False):  # type: ignore[no-untyped-def]
        reads.append((epoch_of(item), item.pool_index))
        return real(self, item, shared)

    monkeypatch.setattr(PoolStream, "read", spy)
    n_pools = len(ds.plan(0))
    e0 = _epoch_batches(ds)
    ahead = _ahead(ds)
    assert ahead is not None  # epoch 1's first pool was read during epoch 0's last
    ahead.future.result()  # the read runs in the prefetch thread: wait for it
    del ahead
    assert reads[-1] == (1, ds.plan(1)[0].pool_index)
    pickle.loads(pickle.dumps(ds))  # pickles without the pending read
    ds.set_epoch(1)
    reads.clear()
    e1 = _epoch_batches(ds)
    ahead = _ahead(ds)
    assert ahead is not None
    ahead.future.result()
    del ahead
    # epoch 1 did not read its first pool again; epoch 2's was read ahead instead
    assert [e for e, _ in reads] == [1] * (n_pools - 1) + [2]
    fresh = abt.AnnBatchDataset(small_collection, **kw)
    fresh.set_epoch(1)
    want = _epoch_batches(fresh)
    assert len(e1) == len(want)
    for (i, x), (j, y) in zip(e1, want):
        np.testing.assert_array_equal(i, j)
        np.testing.assert_array_equal(x, y)
    # a different epoch than the one read ahead: dropped, the epoch is still exact
    ds.set_epoch(0)
    again = _epoch_batches(ds)
    for (i, x), (j, y) in zip(again, e0):
        np.testing.assert_array_equal(i, j)
        np.testing.assert_array_equal(x, y)
    ds.drop_read_ahead()
    assert _ahead(ds) is None


def test_a_forked_copy_never_touches_the_parents_read_ahead(
        small_collection: Collection) -> None:
    """A DataLoader worker forked while a read-ahead was pending holds copies of the
    parent's future and executor, whose locks a parent thread may have held at fork time:
    the copy drops them without calling into them."""
    import os

    calls: list[str] = []

    class Touch:
        def cancel(self) -> None:
            calls.append("cancel")

        def shutdown(self, **kw: object) -> None:
            calls.append("shutdown")

    ds = abt.AnnBatchDataset(small_collection, batch_size=100)
    stream = ds._pool_stream()
    first = ds.plan(0)[0]
    stream.ahead = ReadAhead(first, Touch(), Touch(), os.getpid() + 1)  # type: ignore[arg-type]
    ds.drop_read_ahead()
    assert _ahead(ds) is None
    assert calls == []
    stream.ahead = ReadAhead(first, Touch(), Touch(), os.getpid())  # type: ignore[arg-type]
    ds.drop_read_ahead()  # its own: cancelled and shut down
    assert calls == ["cancel", "shutdown"]


def test_an_epoch_with_nothing_left_frees_the_read_ahead(small_collection: Collection) -> None:
    ds = abt.AnnBatchDataset(small_collection, batch_size=100, seed=4)
    ds.set_epoch(1)
    n = sum(1 for _ in ds)
    assert _ahead(ds) is not None  # epoch 2's first pool, read during epoch 1's last
    state = {**ds.state_dict(), "epoch": 1, "batches": n}  # epoch 1 finished
    ds.load_state_dict(state)
    assert list(ds) == []
    assert _ahead(ds) is None


def test_no_read_ahead_without_prefetch(small_collection: Collection) -> None:
    ds = abt.AnnBatchDataset(small_collection, batch_size=100, prefetch=False)
    assert len(list(ds)) == len(ds)
    assert _ahead(ds) is None


def test_dense_epochs_reuse_two_pools_of_buffers(small_collection: Collection) -> None:
    # dense batches never reference the pool: the pool being read and the one being
    # consumed are all that is ever allocated, across epochs and read-ahead included
    ds = abt.AnnBatchDataset(small_collection, batch_size=100, chunk_size=64,
                             preload_nchunks=4, densify=True)
    for e in range(6):
        ds.set_epoch(e)
        assert len(list(ds)) == len(ds)
    assert ds._stream is not None
    # 2 pools x (data, indices) (buffers get 50% headroom: pool sizes vary). A read thread
    # preempted on a loaded machine may let go of a pool's buffers late, once (seen in CI:
    # 6); a pool kept alive by a stray reference costs a set per pool (170 for these 84
    # pools, measured by keeping each pool's values)
    assert ds._stream.reader.buffers.allocations <= 6


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_dataloader_that_collates_again_is_refused_with_the_fix(
        small_collection: Collection, batch_size: int) -> None:
    """DataLoader(ds) (batch_size=1 by default) would stack whole batches silently."""
    ds = abt.AnnBatchDataset(small_collection, batch_size=100, densify=True)
    with pytest.raises(TypeError, match=r"batch_size=None"):
        next(iter(DataLoader(ds, batch_size=batch_size)))
    it = iter(DataLoader(ds, batch_size=batch_size, num_workers=1))
    with pytest.raises(TypeError, match=r"batch_size=None"):
        next(it)
    it._shutdown_workers()  # now: the error's reference cycle would hold it 5 s at collection
    assert next(iter(DataLoader(ds, batch_size=None)))["X"].shape == (100, small_collection.n_vars)


@pytest.mark.parametrize("what", ["transform", "converter"])
def test_an_unpicklable_callable_under_spawn_is_named(small_collection: Collection,
                                                      what: str) -> None:
    if what == "transform":
        ds = abt.AnnBatchDataset(small_collection, batch_size=500,
                                 selector={"x": A.X.with_transform(lambda v: v)})
        match = "the transform of selector key 'x'"
    else:
        ds = abt.AnnBatchDataset(small_collection, batch_size=500,
                                 batch_converter=lambda b: b)
        match = "the batch_converter"
    loader = abt.AnnBatchDataLoader(ds, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(Exception, match=match):
        next(iter(loader))
    import copy

    assert copy.deepcopy(ds).batch_size == 500  # copies need no pickling
    assert len(list(copy.copy(ds))) == len(ds)


@pytest.mark.parametrize("loader_cls", [abt.AnnBatchDataLoader, DataLoader])
@pytest.mark.parametrize("num_workers", [2, 3])
def test_unshuffled_batches_arrive_in_order_from_workers(
        small_collection: Collection, loader_cls: type, num_workers: int) -> None:
    """shuffle=False reads the collection in order, whatever the number of workers (pools
    dealt whole to workers interleaved their batches)."""
    kw = dict(batch_size=100, chunk_size=64, preload_nchunks=8, shuffle=False,
              return_index=True)
    ds = abt.AnnBatchDataset(small_collection, **kw)
    got = np.concatenate([b["index"].numpy()
                          for b in loader_cls(ds, batch_size=None, num_workers=num_workers)])
    np.testing.assert_array_equal(got, np.arange(small_collection.n_obs))
    # as many batches as in-process
    ref = [b["index"].numpy() for b in abt.AnnBatchDataset(small_collection, **kw)]
    assert len(ref) == len(ds)


def test_a_read_thread_slow_to_let_go_of_its_task_keeps_no_pool_alive(
        small_collection: Collection, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read thread keeps its task (function and arguments) until it gets to drop it, which
    may be after the pool is complete (a busy machine preempts it between the two); a task
    holding the pool's buffers then kept a dropped pool alive and the next took fresh
    buffers (failed once in CI)."""
    import concurrent.futures.thread as cft
    import threading

    from annbatch_torch.read.reader import PoolReader

    release = threading.Event()
    run = cft._WorkItem.run

    def run_then_stall(self: Any) -> None:  # as if preempted right after the result is set
        run(self)
        if threading.current_thread().name.startswith("annbatch-read"):
            release.wait(30)

    monkeypatch.setattr(cft._WorkItem, "run", run_then_stall)
    reader = PoolReader(small_collection, ["X"], threads=2)
    try:
        # rows of one shard: one task, so one read thread stalls and the other reads again
        pool = reader.read(np.array([[0, 300]]))
        assert pool["X"].nnz > 0
        del pool
        # every task of the read is done; its threads still hold their work items (the
        # pool's data and indices share one buffer)
        assert len(reader.buffers._free_owners()) == len(reader.buffers._owners) == 1
        again = reader.read(np.array([[0, 300]]))
        assert reader.buffers.allocations == 1  # the first pool's buffer, reused
        del again
    finally:
        release.set()
        reader.close()


def test_dense_batches_reuse_arrays_only_once_let_go(small_collection: Collection) -> None:
    """Dense batch arrays are reused (no page faults on fresh memory) only when nothing
    references them: batches, and views of them, kept by the caller stay intact."""
    kw: dict[str, Any] = dict(batch_size=100, chunk_size=64, preload_nchunks=4,
                              densify=True, return_index=True, seed=2)
    ref = {int(i): r for b in abt.AnnBatchDataset(small_collection, **kw)
           for i, r in zip(b["index"].numpy(), b["X"].numpy().copy())}
    ds = abt.AnnBatchDataset(small_collection, **kw)
    kept = list(ds)  # every batch alive
    views = [(b["index"][:3], b["X"][:3]) for b in kept]  # views outlive their batches
    ptrs = {b["X"].data_ptr() for b in kept}
    assert len(ptrs) == len(kept)  # none reused under a live batch
    del kept
    for _ in abt.AnnBatchDataset(small_collection, **kw):  # a new stream, fresh buffers
        pass
    for _ in ds:  # the first stream again: arrays of dropped batches come back
        pass
    for idx, x in views:
        for i, row in zip(idx.numpy(), x.numpy()):
            np.testing.assert_array_equal(row, ref[int(i)])
    # a loop that drops each batch: a handful of arrays, not one per batch
    ds2 = abt.AnnBatchDataset(small_collection, **kw)
    n = 0
    for b in ds2:
        i, x = b["index"].numpy(), b["X"].numpy()
        for k in (0, len(i) - 1):
            np.testing.assert_array_equal(x[k], ref[int(i[k])])
        n += 1
    assert ds2._stream is not None
    assert ds2._stream.dense.allocations <= 4 < n  # the last batch's shape differs


def test_batches_densified_in_the_main_process_reuse_arrays_once_let_go(
        small_collection: Collection) -> None:
    kw: dict[str, Any] = dict(batch_size=100, chunk_size=64, preload_nchunks=4,
                              densify=True, return_index=True, seed=4)
    ref = {int(i): r for b in abt.AnnBatchDataset(small_collection, **kw)
           for i, r in zip(b["index"].numpy(), b["X"].numpy().copy())}
    loader = abt.AnnBatchDataLoader(abt.AnnBatchDataset(small_collection, **kw),
                                    num_workers=2)
    kept = list(loader)  # workers send CSR, the main process densifies
    assert len({b["X"].data_ptr() for b in kept}) == len(kept)
    for b in kept:
        for i, row in zip(b["index"].numpy(), b["X"].numpy()):
            np.testing.assert_array_equal(row, ref[int(i)])
    it = iter(loader)
    before = it._dense.allocations  # (the loader's arrays: the first pass's are all kept)
    n = 0
    for b in it:
        i, x = b["index"].numpy(), b["X"].numpy()
        np.testing.assert_array_equal(x[0], ref[int(i[0])])
        n += 1
    # (a few fresh ones until the kept arrays, all held, count as held for good)
    assert it._dense.allocations - before <= 6 < n
    for b in kept:  # the first pass's batches, held all along, were never written over
        for i, row in zip(b["index"].numpy(), b["X"].numpy()):
            np.testing.assert_array_equal(row, ref[int(i)])


def test_loader_never_reads_a_shards_own_categories(small_collection: Collection) -> None:
    """Codes of a collection's shards index the manifest's categories: an epoch opens every
    shard's categorical without reading its category strings (~15 ms a shard), while
    obs_at, which labels rows from the shard, still gets them."""
    from annbatch_torch.store.elements import CategoricalElement

    coll = abt.open_collection(small_collection.path)
    ds = abt.AnnBatchDataset(coll, selector={"y": "obs/cell_type", "b": "obs/batch"},
                             batch_size=256)
    labels = np.concatenate([b["y"].numpy() for b in ds])
    assert len(labels) == coll.n_obs
    cats = [el for el in ds.source._elements.values() if isinstance(el, CategoricalElement)]
    assert len(cats) == 2 * len(coll.shard_sizes)
    assert all(callable(el._categories) for el in cats)  # not read
    got = coll.obs_at(np.arange(coll.n_obs), "cell_type")["cell_type"]
    assert set(got.astype(str)) <= set(coll.categories("cell_type"))


def test_loader_densifies_into_the_same_arrays_every_epoch(small_collection: Collection
                                                          ) -> None:
    """An AnnBatchDataLoader densifying its workers' CSR keeps its dense arrays from one
    epoch to the next (fresh ones each epoch would fault in the whole dense batch again):
    over three epochs it makes two, and the batches equal the in-process ones."""
    kw = dict(densify=True, batch_size=256, return_index=True, seed=1)
    ds = abt.AnnBatchDataset(small_collection, **kw)
    loader = abt.AnnBatchDataLoader(ds, num_workers=1, persistent_workers=True)
    assert loader.densify_policy.where == "main"
    ref_ds = abt.AnnBatchDataset(small_collection, **kw)
    for epoch in range(3):
        ds.set_epoch(epoch)
        ref_ds.set_epoch(epoch)
        for got, ref in zip(loader, ref_ds, strict=True):
            assert torch.equal(got["X"], ref["X"])
    assert loader._dense_arrays.allocations == 2


@pytest.mark.parametrize("cache", ["dense", "pool"])
def test_reuse_goes_on_when_a_caller_holds_one_more_or_one_for_good(cache: str) -> None:
    """A consumer holding ``keep + 1`` arrays at a time (a loop keeping its last batches)
    still gets many arrays reused; one holding its first array for good while a loop
    holds the last gets the others reused (the held one is forgotten, the newest kept).
    Values handed out are never under a live array."""
    from collections import deque

    from annbatch_torch.read.buffers import BufferCache, DenseBuffers

    def take(c: Any) -> np.ndarray:
        return c.take((4, 5), np.float32) if cache == "dense" else c.take(20, np.float32)

    c: Any = DenseBuffers(keep=2) if cache == "dense" else BufferCache(keep=2)
    window: deque = deque(maxlen=3)
    for i in range(60):
        a = take(c)
        assert all(not np.shares_memory(a, w) for w in window)
        a[...] = i
        window.append(a)
    assert c.allocations <= 40  # (forgetting the longest-held one at once: 60)
    c = DenseBuffers(keep=2) if cache == "dense" else BufferCache(keep=2)
    held = take(c)
    held[...] = -1
    previous = None
    for i in range(60):  # a loop holding the last batch while it takes the next
        a = take(c)
        assert previous is None or not np.shares_memory(a, previous)
        a[...] = i
        previous = a
    assert (held == -1).all()
    assert c.allocations <= 6  # (never forgetting the held one: ~30)
