"""CSR keys from DataLoader workers to the main process through reused shared-memory slots
(read/handoff.py): the values arrive unchanged, a slot is rewritten only after the main
process let go of it, and with every slot in flight the parts travel as torch sends them."""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
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
    ring = handoff._ring()
    flags = ring.flags.numpy()
    flags[:] = 0
    parts = [_csr(s) for s in range(handoff.SLOTS + 1)]
    sent = [_send(handoff.InSlot(p, dense=False)) for p in parts]
    assert flags.tolist() == [1] * handoff.SLOTS  # every slot in flight
    before = [ring.slots[k] for k in range(handoff.SLOTS)]
    got = [pickle.loads(s) for s in sent]  # the main process reads them: slots freed
    assert flags.tolist() == [0] * handoff.SLOTS
    for p, g in zip(parts, got):
        assert g.layout == torch.sparse_csr
        assert torch.equal(g.to_dense(), p.to_dense())
    # the next batch reuses a slot (no new shared memory) and the earlier ones stay intact
    again = pickle.loads(_send(handoff.InSlot(_csr(99), dense=True)))
    assert [ring.slots[k] is before[k] for k in range(handoff.SLOTS)] == [True] * handoff.SLOTS
    assert torch.equal(again, _csr(99).to_dense())
    for p, g in zip(parts, got):
        assert torch.equal(g.to_dense(), p.to_dense())


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
