"""A pool's rows -> the user's batch: the last steps of a batch's path.

A :class:`BatchAssembler` takes a work item and its pool (a
:class:`~annbatch_torch.read.host_pool.HostPool` or
:class:`~annbatch_torch.read.device_pool.DevicePool`) and yields the item's batches as the
user sees them: each batch cut from the pool (densified where the
:class:`~annbatch_torch.read.densify.DensifyPolicy` says), every output key in its own
memory, the per-field transforms, the ``"index"`` and padding-mask keys, then the
``batch_converter``. A batch of draws (a sampler with ``draw_size`` ``d > 1``, e.g.
``PairedSampler``: a perturbed row and its ``d - 1`` controls) holds its draws' first rows
under the keys above and their other rows under the same keys prefixed ``control_``
(:data:`CONTROL_PREFIX`), ``d - 1`` rows per draw, in order; the pool lays each batch out
as those two runs (``sampling.sampled_plan.draw_layout``). A transform or converter that
raises becomes a :class:`~annbatch_torch.errors.BatchError` naming the key, the field and
the rows read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from .convert import batch_dict_converter
from .errors import BatchError
from .fields import Field
from .read.csr import csr_view, densify_csr
from .read.densify import DensifyPolicy
from .read.device_pool import DevicePool
from .read.handoff import InSlot, plain_worker_sends_csr
from .read.host_pool import HostPool
from .read.reader import describe_ranges
from .sampling import WorkItem
from .store.source import Source

__all__ = ["BatchAssembler", "own_copy", "CONTROL_PREFIX", "output_selector"]

#: Prefix of the keys of a draw's other rows (``control_X`` for ``X``).
CONTROL_PREFIX = "control_"


def output_selector(selector: Mapping[str, Field], draw_size: int = 1) -> dict[str, Field]:
    """``{output key: field}`` of a batch: ``selector``, and for draws of ``draw_size > 1``
    rows each key again prefixed :data:`CONTROL_PREFIX` (the draws' other rows)."""
    out = dict(selector)
    if draw_size > 1:
        out.update({CONTROL_PREFIX + key: f for key, f in selector.items()})
    return out


def own_copy(value: Any) -> Any:
    """A copy of a batch value (numpy, scipy sparse or torch), so that an in-place
    transform of one key never changes another key's values."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if sp.issparse(value):
        return value.copy()
    return np.array(value, copy=True)


@dataclass(frozen=True)
class BatchAssembler:
    """How one dataset copy turns a pool's rows into the user's batches.

    Parameters
    ----------
    source
        The source the pools were read from (named in a :class:`BatchError`).
    selector
        ``{output key: field}``; a field's ``transform`` runs on its key's value.
    policy
        Where sparse fields are densified.
    in_worker
        Whether this copy runs in a DataLoader worker (dense values go to shared memory).
    converter
        The ``batch_converter`` (``None``: :func:`~annbatch_torch.batch_dict_converter`).
    index
        Add an ``"index"`` key with the batch's global row ids.
    mask_key
        Add this key, the boolean "real row" mask (``False`` in a padding batch); ``None``:
        no mask.
    out_dtype
        The dtype of sparse fields' values (``AnnBatchDataset(out_dtype=...)``): densified
        in it, and kept by the default converter for the keys without a transform;
        ``None``: float32.
    owner
        The dataset whose batches these are: in a plain ``DataLoader`` worker fetching
        this very dataset, CSR keys travel by reference to the worker's shared pool
        memory (``read/handoff.py``).
    draw_size
        Rows per draw of the batches (``1``: single rows); with ``d > 1`` a batch of ``k``
        draws is ``k * d`` pool rows, the first ``k`` the draws' first rows, then the
        others: every key (also ``index`` and the mask) is given twice, the second time
        prefixed :data:`CONTROL_PREFIX` with ``k * (d - 1)`` rows.
    """

    source: Source
    selector: Mapping[str, Field]
    policy: DensifyPolicy
    in_worker: bool = False
    converter: Callable[[dict[str, Any]], Any] | None = None
    index: bool = False
    mask_key: str | None = None
    out_dtype: np.dtype | None = None
    owner: Any = field(default=None, repr=False, compare=False)
    draw_size: int = 1

    @functools.cached_property
    def keys(self) -> dict[str, tuple[Field, int]]:
        """``{output key: (field, part)}``: part 0, a draw's first rows; part 1, its others
        (the ``control_`` keys)."""
        return {key: (f, 0 if key in self.selector else 1)
                for key, f in output_selector(self.selector, self.draw_size).items()}

    def _sparse_keys(self) -> frozenset[str]:
        """The keys of CSR fields without a transform."""
        return frozenset(
            key for key, (f, _) in self.keys.items() if f.transform is None
            and getattr(self.source.fields.get(f.path), "kind", None) == "csr")

    def handoff_keys(self) -> dict[str, bool]:
        """``{key: deliver dense}`` of the keys sent to the main process by reference to
        the worker's pool memory (``read/handoff.py``): in a DataLoader worker handing
        batches on as they are, under the default converter, the CSR keys without a
        transform that the worker would not densify itself; delivered densified (by the
        main process as it unpickles them) under the ``"pool"`` policy. Empty elsewhere.
        Call it while the worker fetches (the fetch is found on the stack)."""
        converter = self.converter
        if not (self.in_worker and (converter is None or converter is batch_dict_converter)):
            return {}
        sparse_keys = self._sparse_keys()
        if not sparse_keys or not plain_worker_sends_csr(self.owner):
            return {}
        # a plain DataLoader's worker keeps "pool": densified as the batch is unpickled; an
        # AnnBatchDataLoader's ("main") densifies as it hands the batch over, after the
        # reordering of batches arrived from several workers (fewer dense arrays alive)
        policy, out = self.policy, {}
        for key in sparse_keys:
            if policy.where == "pool" or not policy.pool_densifies(key, True):
                out[key] = policy.where == "pool"
        return out

    def batches(self, item: WorkItem, pool: HostPool | DevicePool) -> Iterator[Any]:
        """The batches of ``item`` cut out of ``pool`` (its rows), converted."""
        converter = self.converter
        default = converter is None or converter is batch_dict_converter
        sparse_keys = self._sparse_keys()
        if default:
            keep = () if self.out_dtype is None else sparse_keys
            converter = functools.partial(batch_dict_converter, keep_dtype=keep)
        dense_dtype = np.dtype(np.float32 if self.out_dtype is None else self.out_dtype)
        policy = self.policy
        on_device = isinstance(pool, DevicePool)
        dense = {key: policy.pool_densifies(key, self.in_worker) for key in self.keys}
        # keys sent by reference stay CSR here (densified, when they are to be, by the
        # main process as it unpickles them)
        slotted = self.handoff_keys()
        for key in slotted:
            dense[key] = False
        # a field is densified in the pool when every key of it wants it dense; a key that
        # wants dense a field another key takes as CSR densifies its own copy
        dense_paths = {f.path for f, _ in self.keys.values()} - {
            f.path for key, (f, _) in self.keys.items() if not dense[key]}
        d = self.draw_size
        for b in range(item.batch_start, item.batch_stop):
            lo, hi = item.bounds(b)  # batches are contiguous in the pool
            # the draws' first rows, then their others (one part without draws)
            cut = lo + (hi - lo) // d
            parts = [(lo, cut), (cut, hi)] if d > 1 else [(lo, hi)]
            values = [pool.batch(p0, p1, policy.where == "device") if on_device
                      else pool.batch(p0, p1, dense_paths) for p0, p1 in parts]
            batch: dict[str, Any] = {}
            taken: set[tuple[int, str]] = set()
            for key, (f, part) in self.keys.items():  # every key its own memory
                value = values[part][f.path]
                if dense[key] and sp.issparse(value):
                    value = densify_csr(value, dtype=dense_dtype,  # fresh
                                        shared=self.in_worker)
                elif (part, f.path) in taken:  # one field under two keys: never the same memory
                    value = own_copy(value)
                else:
                    taken.add((part, f.path))
                if (sp.issparse(value) and key not in slotted and policy.where != "none"
                        and value.dtype != dense_dtype):
                    # a pool's narrow counts (PoolReader(stored_dtypes=True)) on their way
                    # to the converter, which keeps the dtype under out_dtype
                    value = csr_view(value.data.astype(dense_dtype), value.indices,
                                     value.indptr, value.shape)
                batch[key] = value
            for key, (f, _) in self.keys.items():
                if f.transform is not None:
                    rows = int(batch[key].shape[0])
                    kind = "selector" if key in self.selector else "output"
                    what = f"the transform of {kind} key {key!r} (field {f.path!r})"
                    try:
                        batch[key] = f.transform(batch[key])
                    except Exception as e:
                        raise self.error(what, item, b, e) from e
                    shape = getattr(batch[key], "shape", None)
                    if shape is not None and (len(shape) == 0 or int(shape[0]) != rows):
                        # rows dropped or added: the batch's other keys would not line up
                        raise self.error(what, item, b, returned=(
                            f"{tuple(shape)} for a batch of {rows} rows. Fix: return one "
                            "row per row it is given (the batch's other keys hold "
                            f"{rows})"))
            for (p0, p1), prefix in zip(parts, ("", CONTROL_PREFIX), strict=False):
                if self.index:
                    batch[prefix + "index"] = item.rows[p0:p1]
                if self.mask_key is not None:
                    batch[prefix + self.mask_key] = np.full(p1 - p0, not item.padding,
                                                            dtype=bool)
            # keys sent by reference travel as the pool holds them (the converter would
            # cast narrow counts and widen 16-bit indices into fresh memory)
            # (the default converter, the only one they pass, keeps the keys in order)
            order = list(batch)
            held = {key: batch.pop(key) for key in slotted}
            try:
                out = converter(batch)
            except Exception as e:
                raise self.error("the batch_converter", item, b, e) from e
            if held:
                later = policy.where == "main"
                out = type(out)({key: InSlot(held[key], slotted[key], len(slotted),
                                             dense_dtype, later) if key in held else out[key]
                                 for key in order})
            yield out

    def error(self, what: str, item: WorkItem, batch: int, exc: Exception | None = None,
              returned: str = "") -> BatchError:
        """``what`` raised ``exc`` (or returned what ``returned`` says) on ``batch`` of
        ``item``'s pool, as a :class:`BatchError`: it carries the exception's type and
        text (a DataLoader worker's error reaches the training loop re-raised from its
        text) and the rows read."""
        did = (f"raised {type(exc).__name__}: {exc}" if exc is not None
               else f"returned {returned}")
        return BatchError(
            f"{self.source.describe()}: {what} {did}; on batch {batch} of pool "
            f"{item.pool_index}, read from {describe_ranges(self.source, item.ranges)}."
        )
