"""Workers of a plain DataLoader send batches densified on arrival in the loader's order
(``read/send_order.py``): the main process never keeps dense batches that came early."""

from __future__ import annotations

import copy
import logging
import multiprocessing
import os
import pickle
import signal
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import pytest
import torch
from conftest import dense_rows
from torch.utils.data import DataLoader

import annbatch_torch as abt
from annbatch_torch import Collection
from annbatch_torch.read import handoff, send_order

#: ~11 pools of 4 batches on the 2,700-cell collection: uneven shares for 3 workers
SMALL_POOLS = dict(batch_size=64, chunk_size=64, preload_nchunks=4, return_index=True)


def _late_worker_0(worker_id: int) -> None:
    """Worker 0 starts late: without the order, the others' batches would arrive first."""
    if worker_id == 0:
        time.sleep(1.5)


def _very_late_worker_0(worker_id: int) -> None:
    """Worker 0 starts later than a short stall limit plus a loaded CPU's first pool read."""
    if worker_id == 0:
        time.sleep(4.0)


class Arrivals(list):
    """The worker of each batch received by this process, in the order received, and the
    token of its loader iteration (``tokens``)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[int] = []

    def clear(self) -> None:
        super().clear()
        self.tokens.clear()

    def of(self, token: int) -> list[int]:
        """The workers of the batches of iteration ``token``."""
        return [w for w, t in zip(self, self.tokens, strict=True) if t == token]


@pytest.fixture
def arrivals(monkeypatch: pytest.MonkeyPatch) -> Arrivals:
    """Every batch received by this process (see :class:`Arrivals`)."""
    got = Arrivals()
    real = send_order.arrived

    def record(position: tuple[str, int, int, int]) -> None:
        got.append(position[3])
        got.tokens.append(position[1])
        real(position)

    monkeypatch.setattr(send_order, "arrived", record)
    return got


def _ordered(collection: Collection, seed: int) -> abt.AnnBatchDataset:
    """A dense dataset of small batches whose workers send every batch in order (the
    threshold for big batches set to 0; it travels to the workers with the dataset)."""
    ds = abt.AnnBatchDataset(collection, densify=True, seed=seed, **SMALL_POOLS)
    ds._send_order.min_bytes = 0
    return ds


def _loader_order(workers: list[int]) -> list[int]:
    """``workers`` (the worker of each batch received) put in the order a DataLoader
    deals tasks: each worker's j-th batch before any worker's (j+1)-th, workers in turn."""
    seen: dict[int, int] = {}
    keyed = []
    for w in workers:
        keyed.append((seen.get(w, 0), w))
        seen[w] = seen.get(w, 0) + 1
    return [w for _, w in sorted(keyed)]


def _check_epoch(batches: list[dict[str, torch.Tensor]], collection: Collection,
                 source: np.ndarray) -> None:
    rows = torch.cat([b["index"] for b in batches])
    assert sorted(rows.tolist()) == list(range(collection.n_obs))
    for b in batches:
        assert b["X"].layout == torch.strided
        np.testing.assert_array_equal(b["X"].numpy(), source[b["index"].numpy()])


def _epochs_in_order(ds: abt.AnnBatchDataset, loader: DataLoader, collection: Collection,
                     arrivals: Arrivals, epochs: int = 2) -> list[list[int]]:
    """Iterate ``epochs`` epochs: each received in the loader's order, covering every row
    once with the source's values; the workers of each epoch's batches."""
    source, out = dense_rows(collection), []
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        arrivals.clear()
        batches = list(loader)
        _check_epoch(batches, collection, source)
        assert len(arrivals) == len(batches)
        assert arrivals == _loader_order(arrivals)
        out.append(list(arrivals))
    return out


def test_dense_batches_arrive_in_the_loaders_order_though_a_worker_starts_late(
        small_collection: Collection, arrivals: Arrivals) -> None:
    """Three forked workers, worker 0 late: the main process receives every dense batch
    in the order the DataLoader hands them on (workers in turn, uneven shares at the end),
    each epoch covers every row once with the source's values."""
    handoff.release()
    ds = _ordered(small_collection, 3)
    loader = DataLoader(ds, batch_size=None, num_workers=3, worker_init_fn=_late_worker_0,
                        multiprocessing_context="fork")
    for got in _epochs_in_order(ds, loader, small_collection, arrivals):
        counts = np.bincount(got, minlength=3)
        assert counts.max() - counts.min() >= 1  # uneven shares: one worker ends first
    del loader
    handoff.release()


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spawned_persistent_workers_send_in_order_every_epoch(
        small_collection: Collection, arrivals: Arrivals, context: str) -> None:
    """Workers spawned or started by a fork server (the table and its lock travel with
    the dataset as they start), persistent over two epochs: in order each epoch, every
    row once, values equal."""
    handoff.release()
    ds = _ordered(small_collection, 5)
    loader = DataLoader(ds, batch_size=None, num_workers=2, worker_init_fn=_late_worker_0,
                        persistent_workers=True, multiprocessing_context=context)
    _epochs_in_order(ds, loader, small_collection, arrivals)
    del loader
    handoff.release()


def test_workers_waiting_for_their_turn_exit_when_the_loop_breaks_off(
        small_collection: Collection) -> None:
    """A loop that stops after two batches: the workers waiting to send theirs leave the
    wait as the loader shuts them down, and exit by themselves: torch joins each for up to
    MP_STATUS_CHECK_INTERVAL (5 s) before it terminates it, so a worker left waiting shows
    as a shutdown that long (not a speed figure: a shutdown takes ~0.1 s here)."""
    from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL

    ds = _ordered(small_collection, 3)
    loader = DataLoader(ds, batch_size=None, num_workers=3, multiprocessing_context="fork")
    it = iter(loader)
    next(it), next(it)
    time.sleep(1.0)  # every worker has its next batch ready and waits for its turn
    workers = list(it._workers)  # type: ignore[attr-defined]
    start = time.monotonic()
    it._shutdown_workers()  # type: ignore[attr-defined]
    assert time.monotonic() - start < MP_STATUS_CHECK_INTERVAL
    assert not any(w.is_alive() for w in workers)
    handoff.release()


def test_two_loaders_over_one_dataset_at_once_each_keep_their_order(
        small_collection: Collection, arrivals: Arrivals,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two plain DataLoaders over the same dataset object, iterated side by side, with
    generators seeded alike (the same base seed: as DDP ranks seeded alike get): each
    counts in a lane of its own, so each comes in its own order with every row once and
    the source's values, and no worker waits for the other loader's batches (it would
    stall until STALL_S, set here far above the ~2 s the epoch takes: not a speed
    figure)."""
    monkeypatch.setattr(send_order, "STALL_S", 30.0)  # forked workers inherit it
    handoff.release()
    start = time.monotonic()
    ds = _ordered(small_collection, 3)
    loaders = [DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork",
                          generator=torch.Generator().manual_seed(0)) for _ in range(2)]
    source = dense_rows(small_collection)
    got: list[list[dict[str, torch.Tensor]]] = [[], []]
    for a, b in zip(*loaders, strict=True):
        got[0].append(a)
        got[1].append(b)
    for batches in got:
        _check_epoch(batches, small_collection, source)
    assert len(arrivals) == 2 * len(got[0])
    tokens = sorted(set(arrivals.tokens))
    assert len(tokens) == 2
    for token in tokens:
        assert arrivals.of(token) == _loader_order(arrivals.of(token))
    assert time.monotonic() - start < send_order.STALL_S
    del got, loaders
    handoff.release()


def test_a_loader_made_anew_with_the_same_seeded_generator_keeps_the_order(
        small_collection: Collection, arrivals: Arrivals) -> None:
    """A DataLoader made anew each epoch with a generator seeded alike repeats torch's base
    seed, and so the iteration's token: the second epoch still comes in order (the first
    epoch's counts do not let its batches through early)."""
    handoff.release()
    ds = _ordered(small_collection, 3)
    source = dense_rows(small_collection)
    for epoch in range(2):
        ds.set_epoch(epoch)
        loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork",
                            worker_init_fn=_late_worker_0,
                            generator=torch.Generator().manual_seed(0))
        arrivals.clear()
        batches = list(loader)
        _check_epoch(batches, small_collection, source)
        assert arrivals == _loader_order(arrivals)
    del batches, loader
    handoff.release()


def test_a_pause_of_the_loop_longer_than_a_stall_keeps_the_order(
        small_collection: Collection, arrivals: Arrivals,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A training loop that pauses (validation, a checkpoint) longer than STALL_S while
    the workers have batches waiting in the queue: they keep waiting their turn (the
    main process has not received what was sent: a pause, not a loader dealing out of
    turn), and the whole epoch comes in order."""
    monkeypatch.setattr(send_order, "STALL_S", 1.0)  # forked workers inherit it
    handoff.release()
    ds = _ordered(small_collection, 3)
    loader = DataLoader(ds, batch_size=None, num_workers=3, multiprocessing_context="fork")
    batches = []
    for i, b in enumerate(loader):
        batches.append(b)
        if i == 4:
            time.sleep(3.0)
    _check_epoch(batches, small_collection, dense_rows(small_collection))
    assert arrivals == _loader_order(arrivals)
    del batches, loader
    handoff.release()


def test_a_worker_stops_waiting_after_a_stall_and_every_batch_still_arrives(
        small_collection: Collection, arrivals: Arrivals,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing received for longer than STALL_S (worker 0 starting late, the limit set
    low): the others send as torch asks (their batches arrive first), and the epoch
    still covers every row once with the source's values."""
    monkeypatch.setattr(send_order, "STALL_S", 0.3)  # forked workers inherit it
    handoff.release()
    ds = _ordered(small_collection, 3)
    loader = DataLoader(ds, batch_size=None, num_workers=2, worker_init_fn=_very_late_worker_0,
                        multiprocessing_context="fork")
    batches = list(loader)
    _check_epoch(batches, small_collection, dense_rows(small_collection))
    assert arrivals[0] == 1  # worker 1 did not wait for worker 0's late start
    del batches, loader
    handoff.release()


def test_sparse_batches_and_in_process_iteration_take_no_turn(
        small_collection: Collection, arrivals: Arrivals) -> None:
    """Only batches densified on arrival are ordered: CSR batches (the main process keeps
    views, not dense arrays) and a dataset iterated in-process count nothing."""
    ds = abt.AnnBatchDataset(small_collection, densify=False, seed=3, **SMALL_POOLS)
    assert ds._send_order is None  # no table where nothing is densified on arrival
    n = sum(1 for _ in DataLoader(ds, batch_size=None, num_workers=2))
    n += sum(1 for _ in _ordered(small_collection, 3))
    assert n > 0
    assert arrivals == []
    handoff.release()


def test_only_datasets_that_densify_where_their_pools_are_hold_a_table(
        small_collection: Collection) -> None:
    """A table holds shared memory and an open file: a sparse dataset (or one densifying on
    a device) makes none, so that many datasets alive at once (one per donor, say) hold
    one file each (their shared epoch), not two."""
    def open_files() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_files()
    sparse = [abt.AnnBatchDataset(small_collection, **SMALL_POOLS) for _ in range(20)]
    assert open_files() - before <= 20
    dense = abt.AnnBatchDataset(small_collection, densify=True, **SMALL_POOLS)
    assert all(ds._send_order is None for ds in sparse)
    assert isinstance(dense._send_order, send_order.SendOrder)


def test_a_copy_of_a_dataset_gets_a_table_of_its_own() -> None:
    """copy.copy shares the table (same process); deepcopy and a pickle not made to start
    a process make a table of their own (with the same threshold)."""
    order = send_order.SendOrder()
    order.min_bytes = 7
    assert copy.copy(order) is order
    for other in (copy.deepcopy(order), pickle.loads(pickle.dumps(order)),
                  pickle.loads(ForkingPickler.dumps(order))):
        assert other.id != order.id
        assert other._t.data_ptr() != order._t.data_ptr()
        assert other._t.is_shared()
        assert send_order._TABLES[other.id] is other
        assert other.min_bytes == 7
    assert order.turn(1) is None  # not in a DataLoader worker


def _turn(order: send_order.SendOrder, token: int, worker: int, n: int) -> Any:
    return send_order.Turn(order, token, worker, n, None)


def test_iterations_at_once_take_lanes_of_their_own() -> None:
    """Two iterations of one dataset at once count into lanes of their own: batches of
    one never count for the other."""
    order = send_order.SendOrder()
    a, b = _turn(order, 5, 1, 2), _turn(order, 6, 1, 2)
    assert a._k != b._k
    send_order.arrived((order.id, 6, 2, 0))  # b's worker 0
    assert a._ready()[0] is False
    assert b._ready()[0] is True
    send_order.arrived((order.id, 5, 2, 0))
    assert a._ready()[0] is True


def test_a_token_used_again_after_its_iteration_ended_starts_from_zero() -> None:
    """A loader re-made with the same seeded generator repeats the token of the iteration
    before: once that one's workers all ended, the new one's counts start from zero (the
    old counts would let every batch through)."""
    order = send_order.SendOrder()
    w0, w1 = _turn(order, 9, 0, 2), _turn(order, 9, 1, 2)
    send_order.arrived((order.id, 9, 2, 0))
    assert w1._ready()[0] is True
    w0.sent, w1.sent = 1, 1
    w0.end(), w1.end()
    again = _turn(order, 9, 1, 2)  # the next iteration's worker 1 joins first
    assert again._ready()[0] is False


def test_a_turn_waits_for_every_batch_before_it_and_for_no_more_of_a_worker_that_ended(
        ) -> None:
    """The rule itself: worker 1 of 3 sends its j-th batch once j+1 batches of worker 0
    and j of worker 2 were received; an ended worker is waited for up to the batches it
    sent; a batch under the threshold is sent at once."""
    order, token = send_order.SendOrder(), 777
    t = _turn(order, token, 1, 3)
    assert t._ready()[0] is False  # worker 0's first batch not received yet
    send_order.arrived((order.id, token, 3, 0))
    assert t._ready()[0] is True
    t.sent = 1  # its second batch: needs two of worker 0 and one of worker 2
    send_order.arrived((order.id, token, 3, 2))
    assert t._ready()[0] is False
    send_order.arrived((order.id, token, 3, 0))
    assert t._ready()[0] is True
    t.sent = 3  # worker 2 ended after one batch: it is waited for no more
    send_order.arrived((order.id, token, 3, 0))
    send_order.arrived((order.id, token, 3, 0))
    assert t._ready()[0] is False
    w2 = _turn(order, token, 2, 3)
    w2.sent = 1
    w2.end()
    assert t._ready()[0] is True
    t.sent = 4
    start = time.monotonic()
    position, ordered = t.wait(order.min_bytes - 1)  # small: not waited for
    assert position[3] == 1
    assert ordered is False
    assert time.monotonic() - start < 1
    assert t.sent == 5


def _count_in_spawned(order: send_order.SendOrder, q: Any) -> None:
    order.count(4242, 1, 0)  # under the lock it was given
    q.put((order.id, order._lock._semlock.name))


def test_spawned_processes_share_a_twin_table_and_the_forked_keep_theirs() -> None:
    """A table made with a fork context's lock (which cannot travel) gives the processes it
    spawns a twin table with a spawn context's lock, made once; its own lock is never
    swapped, so workers forked before go on sharing one lock with the main process while
    spawned ones (another loader's) share another: a batch counted in a spawned process is
    in the twin's memory here, and ``arrived`` of its position counts there too."""
    order = send_order.SendOrder()
    fork_lock = order._lock
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    ids = []
    for _ in range(2):
        p = ctx.Process(target=_count_in_spawned, args=(order, q))
        p.start()
        ids.append(q.get(timeout=60))
        p.join(60)
        assert p.exitcode == 0
    assert order._lock is fork_lock  # the forked workers' lock stays this table's
    twin = order._twin
    assert twin is not None
    assert [i for i, _ in ids] == [twin.id, twin.id]  # one twin for every spawn
    assert twin.id != order.id
    assert {n for _, n in ids} == {twin._lock._semlock.name}
    assert twin._rows[twin.lane(4242, 1), 0, send_order.ARRIVED] == 2
    send_order.arrived((twin.id, 4242, 1, 0))
    assert twin._rows[twin.lane(4242, 1), 0, send_order.ARRIVED] == 3
    assert not order._rows[..., send_order.ARRIVED].any()


def test_loaders_spawning_from_two_threads_at_once_share_one_twin() -> None:
    """Two threads starting spawned workers over one dataset at once get the same twin
    (a second one would replace the first, whose table the main process then no longer
    finds: its loader's batches would never be counted)."""
    import threading

    for _ in range(20):
        order = send_order.SendOrder()
        start = threading.Barrier(2)
        got: list[send_order.SendOrder] = []

        def take(order: send_order.SendOrder = order, start: Any = start,
                 got: list = got) -> None:
            start.wait()
            got.append(order._for_spawned())

        threads = [threading.Thread(target=take) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got[0] is got[1] is order._twin
        assert send_order._TABLES[got[0].id] is got[0]


def _die_holding(order: send_order.SendOrder) -> None:
    order._lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_process_killed_holding_the_lock_stops_the_ordering_not_the_loop(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A worker killed while it held the table's lock never lets it go: the main process
    counting a batch waits LOCK_S for it, then stops using the table with a warning
    (its later batches are counted at once: nothing waits for them), instead of hanging
    inside the unpickling of a batch."""
    monkeypatch.setattr(send_order, "LOCK_S", 0.5)
    order = send_order.SendOrder()
    p = multiprocessing.get_context("fork").Process(target=_die_holding, args=(order,))
    p.start()
    p.join()
    assert p.exitcode == -signal.SIGKILL
    with caplog.at_level(logging.WARNING):
        send_order.arrived((order.id, 5, 2, 0))
    assert order.broken
    assert "was not released" in caplog.text
    assert order.lane(5, 2) is None
    assert _turn(order, 5, 1, 2).waiting is False  # a worker that cannot join sends freely
