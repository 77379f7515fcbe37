"""CSR keys from DataLoader workers to the main process through reused shared-memory slots
(read/handoff.py): the values arrive unchanged, a slot is rewritten only after the main
process let go of it, and with every slot in flight the parts travel as torch sends them."""

from __future__ import annotations

import os
import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from torch.utils.data import DataLoader

import annbatch_torch as abt
from annbatch_torch import Collection
from annbatch_torch.convert import csr_to_torch
from annbatch_torch.read import handoff


def _csr(seed: int, dtype: type = np.float32) -> torch.Tensor:
    m = sp.random(50, 30, density=0.2, format="csr", random_state=seed, dtype=np.float64)
    m.data = np.round(m.data * 100)
    return csr_to_torch(m.astype(dtype), dtype=dtype)


def _send(x: handoff.InSlot) -> bytes:
    return bytes(ForkingPickler.dumps(x))  # what a worker's queue does


def test_slots_are_reused_only_once_read_and_a_full_ring_falls_back() -> None:
    handoff._RING = None  # a fresh ring for this process
    ring = handoff._ring()
    flags = ring.flags.numpy()
    cap = handoff.SLOTS  # slots for one key
    parts = [_csr(s) for s in range(cap + 1)]
    sent = [_send(handoff.InSlot(p, dense=False)) for p in parts]
    assert flags[:cap].tolist() == [1] * cap  # every slot in flight, the last one fell back
    assert len(ring.slots) == cap
    before = list(ring.slots)
    got = [pickle.loads(s) for s in sent]  # the main process reads them: slots freed
    assert flags.tolist() == [0] * handoff.MAX_SLOTS
    for p, g in zip(parts, got):
        assert g.layout == torch.sparse_csr
        assert torch.equal(g.to_dense(), p.to_dense())
    # the next batch reuses a slot (no new shared memory) and the earlier ones stay intact
    again = pickle.loads(_send(handoff.InSlot(_csr(99), dense=True)))
    assert len(ring.slots) == cap
    assert all(a is b for a, b in zip(ring.slots, before))
    assert torch.equal(again, _csr(99).to_dense())
    for p, g in zip(parts, got):
        assert torch.equal(g.to_dense(), p.to_dense())


def test_every_slot_is_made_early_and_used_in_turn() -> None:
    """Batches read one at a time still go through every slot, in turn, from the first
    ones: the main process maps them all early instead of one more late in training (an
    open descriptor and a mapping more, found by the soak test)."""
    handoff._RING = None
    ring = handoff._ring()
    taken = []
    for s in range(3 * handoff.SLOTS):
        before = ring.flags.numpy().copy()
        sent = _send(handoff.InSlot(_csr(s), dense=False))
        taken.append(int(np.flatnonzero(ring.flags.numpy() != before)[0]))
        pickle.loads(sent)
    assert len(ring.slots) == handoff.SLOTS
    assert taken == list(range(handoff.SLOTS)) * 3


def test_a_failing_slot_sends_as_torch_does_and_frees_it(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Pickling runs in the worker queue's feeder thread, which would drop a batch whose
    pickling raised (and the loader wait for it forever): a failure sends the parts as
    torch does, and a slot taken is given back."""
    handoff._RING = None
    ring = handoff._ring()
    p = _csr(5)

    def broken_copy(self: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        raise OSError("no space left on /dev/shm")

    monkeypatch.setattr(torch.Tensor, "copy_", broken_copy)
    sent = _send(handoff.InSlot(p, dense=False))
    monkeypatch.undo()
    assert ring.flags.numpy().tolist() == [0] * handoff.MAX_SLOTS
    assert torch.equal(pickle.loads(sent).to_dense(), p.to_dense())


def test_the_slots_of_workers_gone_are_let_go() -> None:
    """The main process keeps the slots it read mapped, but not those of a worker that
    exited once another worker's batch arrives; release() lets go of everything."""
    handoff.release()
    st = torch.UntypedStorage(8)
    gone_pid = 2**22 + 12345  # above Linux's pid_max default of 2**22: no such process
    handoff._keep_mapped(("gone", gone_pid, 2), 0, st, 1)
    handoff._keep_mapped(("live", os.getpid(), 2), 0, st, 1)
    assert set(handoff._MAPPED) == {("live", 0)}
    handoff.release()
    assert not handoff._MAPPED


def test_integer_values_arrive_in_their_dtype() -> None:
    p = _csr(3, np.int16)
    got = pickle.loads(_send(handoff.InSlot(p, dense=False)))
    assert got.values().dtype == torch.int16
    assert torch.equal(got.to_dense(), p.to_dense())
    dense = pickle.loads(_send(handoff.InSlot(p, dense=True)))
    assert dense.dtype == torch.int16
    assert torch.equal(dense, p.to_dense())


def test_plain_loader_workers_deliver_the_in_process_batches_kept_whole(
        small_collection: Collection) -> None:
    """Every batch of two epochs through two workers, all kept by the loop at once (no
    buffer may be reused under it), equals the in-process batch, sparse and dense."""
    for densify in (False, True):
        kw = dict(densify=densify, batch_size=200, seed=6, return_index=True)
        ds = abt.AnnBatchDataset(small_collection, **kw)
        loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
        ref_ds = abt.AnnBatchDataset(small_collection, **kw)
        for epoch in range(2):
            ds.set_epoch(epoch)
            ref_ds.set_epoch(epoch)
            got = {int(b["index"][0]): b for b in loader}
            ref = {int(b["index"][0]): b for b in ref_ds}
            assert got.keys() == ref.keys()
            for k, r in ref.items():
                g = got[k]["X"]
                assert g.layout == r["X"].layout
                if g.layout == torch.sparse_csr:
                    g, want = g.to_dense(), r["X"].to_dense()
                else:
                    want = r["X"]
                assert torch.equal(g, want)
