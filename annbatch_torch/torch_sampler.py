"""A plain ``torch.utils.data.Sampler`` of row indices as a sampling-mode sampler.

``AnnBatchDataset(..., sampler=WeightedRandomSampler(weights, n))`` works: the torch
sampler's indices become the epoch's stream, and the dataset deals it to ranks and workers
as it deals its own samplers' (equal batch counts, each batch once). What makes that safe
under DDP and DataLoader workers is that every process must compute the same stream: the
sampler is iterated with torch's global generator seeded by ``(seed, epoch)`` (in a forked
RNG state, so the caller's is untouched) and ``set_epoch(epoch)`` first when it has one.
That covers torch's own samplers without a ``generator`` of their own
(``RandomSampler``, ``WeightedRandomSampler``, ``SubsetRandomSampler``,
``SequentialSampler``); one that draws from its own generator, or from anything else
that differs between processes, gives other rows when iterated again and is refused at
construction. A ``DistributedSampler`` is refused too: the dataset deals rows to ranks
itself.

:func:`bind_sampler` binds either kind to a source: the obs columns the sampler asks for
are read (as global codes) and handed to :meth:`~annbatch_torch.Sampler.bind`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DistributedSampler
from torch.utils.data import Sampler as TorchSampler

from .errors import SamplerError, SchemaError
from .read.reader import read_column
from .sampling import ObsColumn, Sampler
from .store.source import Source

__all__ = ["TorchIndexSampler", "bind_sampler"]

_TAG = 0x54524348  # "TRCH": torch's generator is seeded by (seed, epoch, _TAG)


class TorchIndexSampler(Sampler):
    """``sampler``'s indices as the epoch's stream (see the module docstring)."""

    _pure = True  # checked by prepare() itself

    def __init__(self, sampler: TorchSampler) -> None:
        if isinstance(sampler, DistributedSampler):
            raise SamplerError(
                "sampler: a DistributedSampler gives each rank its own share, but the dataset "
                "deals batches to ranks itself; pass the sampler it wraps (or a plain torch "
                "sampler) and every rank gets an equal share of its indices.")
        self.sampler = sampler

    def prepare(self, n_obs: int, columns: Mapping[str, ObsColumn]) -> None:
        first = self._draw(0, 0)
        if not np.array_equal(first, self._draw(0, 0)):
            raise SamplerError(
                f"sampler {self.sampler!r} gives other indices each time it is iterated with "
                "the same seed, so DataLoader workers and ranks would disagree on the epoch "
                "(it draws from a generator of its own?). Construct it without generator=, "
                "or use abt.WeightedSampler / ClassBalancedSampler / SubsetSampler.")
        allowed = self.allowed
        if allowed is not None and len(first):
            out = ~np.isin(first, allowed)
            if out.any():
                raise SamplerError(
                    f"sampler {self.sampler!r} draws row {int(first[out][0])}, which is held "
                    "out (with val_fraction, the DataModule trains on the training split's "
                    "rows only): use abt.WeightedSampler, ClassBalancedSampler or "
                    "SubsetSampler, which keep to the training split, or val_fraction=0.")
        self._len = len(first)

    def __len__(self) -> int:
        return self._length(getattr(self, "_len", None))

    def _draw(self, seed: int, epoch: int) -> np.ndarray:
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(np.random.SeedSequence([seed, epoch, _TAG])
                                  .generate_state(1, np.uint64)[0]) & (2**63 - 1))
            try:
                return np.fromiter(self.sampler, dtype=np.int64)
            except (TypeError, ValueError):
                first = next(iter(self.sampler), None)
        raise SamplerError(f"sampler {self.sampler!r} yields {type(first).__name__}s, not row "
                           "indices (a batch sampler?); pass a sampler of indices: the dataset "
                           "makes the batches.")

    def epoch_rows(self, seed: int, epoch: int) -> np.ndarray:
        return self._draw(seed, epoch)

    def __repr__(self) -> str:  # stable across processes (resume states compare it)
        n = f", {self._len} indices" if self.is_bound else ""
        return f"TorchIndexSampler({type(self.sampler).__name__}{n})"


def bind_sampler(source: Source, sampler: Any, rows: np.ndarray | None = None) -> Sampler:
    """``sampler`` bound to ``source`` with the obs columns it asked for (read as global
    codes), drawing from ``rows`` only when given (a training split)."""
    if isinstance(sampler, TorchSampler) and not isinstance(sampler, Sampler):
        sampler = TorchIndexSampler(sampler)  # its indices as the stream
    if not isinstance(sampler, Sampler):
        raise TypeError(
            "sampler must be an annbatch_torch Sampler (WeightedSampler, ClassBalancedSampler, "
            "SubsetSampler or a subclass of Sampler) or a torch.utils.data.Sampler of row "
            f"indices, got {type(sampler).__name__}.")
    columns = {}
    for name in sampler.columns:
        try:
            categories = source.categories(name)
        except SchemaError as e:
            raise SamplerError(f"sampler {sampler!r}: {e}") from None
        field = name if name.startswith("obs/") else f"obs/{name}"
        codes = read_column(source, field)
        grouped = source.group_by is not None and field == f"obs/{source.group_by}"
        columns[name] = ObsColumn(codes, tuple(categories), grouped=grouped)
    return sampler.bind(source.n_obs, columns, rows)
