"""Workers of a plain DataLoader send batches densified on arrival in the loader's order
(``read/send_order.py``): the main process never keeps dense batches that came early."""

from __future__ import annotations

import copy
import logging
import pickle
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


@pytest.fixture
def arrivals(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The worker of each batch received by this process, in the order received."""
    got: list[int] = []
    real = send_order.arrived

    def record(position: tuple[str, int, int]) -> None:
        got.append(position[2])
        real(position)

    monkeypatch.setattr(send_order, "arrived", record)
    return got


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
                     arrivals: list[int], epochs: int = 2) -> list[list[int]]:
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
        small_collection: Collection, arrivals: list[int]) -> None:
    """Three forked workers, worker 0 late: the main process receives every dense batch
    in the order the DataLoader hands them on (workers in turn, uneven shares at the end),
    each epoch covers every row once with the source's values."""
    handoff.release()
    ds = abt.AnnBatchDataset(small_collection, densify=True, seed=3, **SMALL_POOLS)
    loader = DataLoader(ds, batch_size=None, num_workers=3, worker_init_fn=_late_worker_0,
                        multiprocessing_context="fork")
    for got in _epochs_in_order(ds, loader, small_collection, arrivals):
        counts = np.bincount(got, minlength=3)
        assert counts.max() - counts.min() >= 1  # uneven shares: one worker ends first
    del loader
    handoff.release()


def test_spawned_persistent_workers_send_in_order_every_epoch(
        small_collection: Collection, arrivals: list[int]) -> None:
    """Spawned workers (the table reaches them through torch's pickler), persistent over
    two epochs: in order each epoch, every row once, values equal."""
    handoff.release()
    ds = abt.AnnBatchDataset(small_collection, densify=True, seed=5, **SMALL_POOLS)
    loader = DataLoader(ds, batch_size=None, num_workers=2, worker_init_fn=_late_worker_0,
                        persistent_workers=True, multiprocessing_context="spawn")
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

    ds = abt.AnnBatchDataset(small_collection, densify=True, seed=3, **SMALL_POOLS)
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


def test_a_worker_stops_waiting_after_a_stall_and_every_batch_still_arrives(
        small_collection: Collection, arrivals: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing received for longer than STALL_S (worker 0 starting late, the limit set
    low): the others send as torch asks (their batches arrive first), and the epoch
    still covers every row once with the source's values."""
    monkeypatch.setattr(send_order, "STALL_S", 0.3)  # forked workers inherit it
    handoff.release()
    ds = abt.AnnBatchDataset(small_collection, densify=True, seed=3, **SMALL_POOLS)
    loader = DataLoader(ds, batch_size=None, num_workers=2, worker_init_fn=_late_worker_0,
                        multiprocessing_context="fork")
    batches = list(loader)
    _check_epoch(batches, small_collection, dense_rows(small_collection))
    assert arrivals[0] == 1  # worker 1 did not wait for worker 0's late start
    del batches, loader
    handoff.release()


def test_sparse_batches_and_in_process_iteration_take_no_turn(
        small_collection: Collection, arrivals: list[int]) -> None:
    """Only batches densified on arrival are ordered: CSR batches (the main process keeps
    views, not dense arrays) and a dataset iterated in-process count nothing."""
    ds = abt.AnnBatchDataset(small_collection, densify=False, seed=3, **SMALL_POOLS)
    n = sum(1 for _ in DataLoader(ds, batch_size=None, num_workers=2))
    dense = abt.AnnBatchDataset(small_collection, densify=True, seed=3, **SMALL_POOLS)
    n += sum(1 for _ in dense)
    assert n > 0
    assert arrivals == []
    handoff.release()


def test_a_copy_of_a_dataset_gets_a_table_of_its_own() -> None:
    """copy.copy shares the table (same process); deepcopy, a plain pickle and torch's
    pickler loaded in a process that is not a worker of the owner make a table of their
    own (another process's loaders must never write into it)."""
    order = send_order.SendOrder()
    assert copy.copy(order) is order
    for other in (copy.deepcopy(order), pickle.loads(pickle.dumps(order)),
                  pickle.loads(ForkingPickler.dumps(order))):
        assert other.id != order.id
        assert other._t.data_ptr() != order._t.data_ptr()
        assert other._t.is_shared()
        assert send_order._TABLES[other.id] is other
    assert order.turn(1) is None  # not in a DataLoader worker


def test_a_main_process_counts_only_into_tables_it_owns(
        caplog: pytest.LogCaptureFixture) -> None:
    """Counting: a batch from worker 1 of an iteration counts in its lane; a position of
    an unknown table is ignored."""
    order = send_order.SendOrder()
    token = 12345
    lane = order._c[token % send_order.LANES]
    for _ in range(3):
        send_order.arrived((order.id, token, 1))
    assert int(lane[1, send_order.ARRIVED]) == (token << 32) | 3
    send_order.arrived((order.id, token + send_order.LANES, 1))  # another iteration, same lane
    assert int(lane[1, send_order.ARRIVED]) == ((token + send_order.LANES) << 32) | 1
    with caplog.at_level(logging.WARNING):
        send_order.arrived(("no such table", token, 0))
    assert not caplog.records


def _turn(order: send_order.SendOrder, token: int, worker: int, n: int) -> Any:
    return send_order.Turn(order.id, order._c[token % send_order.LANES], token, worker, n,
                           None)


def test_a_turn_waits_for_every_batch_before_it_and_for_no_more_of_a_worker_that_ended(
        ) -> None:
    """The rule itself, on a table written by hand: worker 1 of 3 sends its j-th batch
    once j+1 batches of worker 0 and j of worker 2 were received; an ended worker is
    waited for up to the batches it sent."""
    order, token = send_order.SendOrder(), 777
    t = _turn(order, token, 1, 3)
    assert t._missing()[0] is False  # worker 0's first batch not received yet
    send_order.arrived((order.id, token, 0))
    assert t._missing()[0] is True
    t.sent = 1  # its second batch: needs two of worker 0 and one of worker 2
    send_order.arrived((order.id, token, 2))
    assert t._missing()[0] is False
    send_order.arrived((order.id, token, 0))
    assert t._missing()[0] is True
    t.sent = 3  # worker 2 ended after one batch: it is waited for no more
    send_order.arrived((order.id, token, 0)), send_order.arrived((order.id, token, 0))
    assert t._missing()[0] is False
    w2 = _turn(order, token, 2, 3)
    w2.sent = 1
    w2.end()
    assert t._missing()[0] is True
