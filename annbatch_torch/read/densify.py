"""Where sparse fields become dense: one policy, decided once.

``AnnBatchDataset(densify=True)`` yields sparse fields as dense float32 (or the dataset's
``out_dtype``: the main process densifies in the CSR values' dtype). Where that happens
is a :class:`DensifyPolicy`:

* ``"pool"``: where the pool lives, when a batch is cut (:meth:`HostPool.batch`; inside a
  DataLoader worker straight into shared memory);
* ``"device"``: on the pool's device (:class:`~annbatch_torch.read.device_pool.DevicePool`);
* ``"main"``: DataLoader workers send CSR (~5x fewer bytes than dense at typical
  sparsity) and the main process densifies :attr:`DensifyPolicy.main_keys` (scipy) as
  batches arrive. :class:`~annbatch_torch.AnnBatchDataLoader` chooses it for its workers
  with :meth:`DensifyPolicy.for_workers`, which also chooses those keys: keys with a
  transform, or all keys under a custom ``batch_converter``, stay densified in the workers
  (the transform and converter see dense values).

A dataset decides its policy at construction (:meth:`DensifyPolicy.for_dataset`); a loader
decides once, at construction, whether its workers use ``"main"``, and installs that
policy in each worker's dataset copy (:meth:`DensifyPolicy.installer`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.utils.data import get_worker_info

from .buffers import DenseBuffers
from .csr import PendingCSR, csr_tensor_to_dense

__all__ = ["DensifyPolicy", "Densifying"]

Where = Literal["none", "pool", "device", "main"]


@dataclass(frozen=True)
class DensifyPolicy:
    """Where sparse fields are densified.

    Parameters
    ----------
    where
        ``"none"`` (sparse fields stay CSR), ``"pool"``, ``"device"`` or ``"main"``.
    main_keys
        Under ``"main"``: the output keys the main process densifies.
    """

    where: Where = "none"
    main_keys: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def for_dataset(cls, densify: bool, device: torch.device | None) -> DensifyPolicy:
        """A dataset's own policy: none, on its device, or where its pools are."""
        if not densify:
            return cls("none")
        return cls("device" if device is not None else "pool")

    def for_workers(self, selector: Mapping[str, Any], fields: Mapping[str, Any], *,
                    default_converter: bool, num_workers: int, pin_memory: bool = False,
                    collate_fn: Callable[..., Any] | None = None) -> DensifyPolicy:
        """The policy of a loader's workers: ``"main"`` when the dataset densifies where its
        pools are, there are workers, and nothing between the workers and the main process
        (``pin_memory``, a ``collate_fn``) expects dense values.

        Parameters
        ----------
        selector
            ``{output key: field}`` of the dataset (each with a ``path`` and a
            ``transform``).
        fields
            The source's fields by path (each with a ``kind``: ``"csr"`` for sparse).
        default_converter
            Whether the batches go through the default ``batch_converter``.
        num_workers, pin_memory, collate_fn
            The loader's.

        Returns
        -------
        DensifyPolicy
            Under ``"main"``, :attr:`main_keys` are the sparse keys without a transform,
            sent as CSR (~5x fewer bytes than dense at typical sparsity) and densified in
            the main process; a transform or a custom converter sees dense values, so
            those keys (all keys under a custom converter) stay densified in the workers.
        """
        keys = frozenset()
        if default_converter:
            keys = frozenset(key for key, f in selector.items()
                             if f.transform is None and fields[f.path].kind == "csr")
        if (self.where != "pool" or num_workers <= 0 or pin_memory
                or collate_fn is not None or not keys):
            return self
        return DensifyPolicy("main", keys)

    def pool_densifies(self, key: str, in_worker: bool) -> bool:
        """Whether output ``key`` is densified when its batch is cut out of the pool."""
        if self.where in ("none", "device"):
            return False
        return not (self.where == "main" and in_worker and key in self.main_keys)

    def installer(self, user_fn: Callable[[int], None] | None) -> _Install:
        """A ``worker_init_fn`` that gives the worker's dataset copy this policy, then runs
        the user's ``worker_init_fn`` (picklable for ``spawn``)."""
        return _Install(self, user_fn)

    def dense_arrays(self) -> DenseBuffers:
        """Reused arrays to densify :attr:`main_keys` into: per key, the batch in use and
        the one being made."""
        return DenseBuffers(keep=2 * max(1, len(self.main_keys)))

    def finish(self, batch: Any, buffers: DenseBuffers | None = None) -> Any:
        """Densify :attr:`main_keys` of a batch that arrived from a worker (in place;
        ``buffers``: into reused arrays)."""
        if self.where == "main" and isinstance(batch, dict):
            for k in self.main_keys:
                v = batch.get(k)
                if isinstance(v, PendingCSR):  # sent by reference (read/handoff.py)
                    batch[k] = v.to_dense(buffers)
                elif isinstance(v, torch.Tensor) and v.layout == torch.sparse_csr:
                    batch[k] = csr_tensor_to_dense(v, buffers)
        return batch


class _Install:
    def __init__(self, policy: DensifyPolicy, user_fn: Callable[[int], None] | None) -> None:
        self.policy = policy
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        info = get_worker_info()
        if info is not None and hasattr(info.dataset, "densify_policy"):
            info.dataset.densify_policy = self.policy
        if self.user_fn is not None:
            self.user_fn(worker_id)


class Densifying:
    """Iterator over a loader's batches that applies :meth:`DensifyPolicy.finish`, into
    the reused arrays ``dense`` (the loader's, kept from one epoch to the next; default:
    its own, one per densified key for the batch in use and the one being made)."""

    def __init__(self, it: Iterator[Any], policy: DensifyPolicy,
                 dense: DenseBuffers | None = None) -> None:
        self._it = it
        self._policy = policy
        self._dense = policy.dense_arrays() if dense is None else dense

    def __iter__(self) -> Densifying:
        return self

    def __next__(self) -> Any:
        return self._policy.finish(next(self._it), self._dense)

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


