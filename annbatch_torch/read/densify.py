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

import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.utils.data import get_worker_info

from .buffers import DenseBuffers
from .csr import csr_tensor_to_dense

__all__ = ["ARRIVED", "DenseOnArrival", "DensifyPolicy", "Densifying", "arrive_dense",
           "plain_worker_sends_csr"]

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

    def finish(self, batch: Any, buffers: DenseBuffers | None = None) -> Any:
        """Densify :attr:`main_keys` of a batch that arrived from a worker (in place;
        ``buffers``: into reused arrays)."""
        if self.where == "main" and isinstance(batch, dict):
            for k in self.main_keys:
                v = batch.get(k)
                if isinstance(v, torch.Tensor) and v.layout == torch.sparse_csr:
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


def plain_worker_sends_csr(dataset: Any) -> bool:
    """Whether ``dataset``'s batches are being fetched right now by a plain ``DataLoader``
    worker that hands them on as they are: torch's iterable fetcher, called by its worker
    loop, holding this very dataset (not a wrapper of it, which may touch the values), with
    ``batch_size=None`` and no ``collate_fn`` of the caller's (torch's ``default_convert``).
    Then a densified key may travel as CSR and become dense as the main process unpickles
    it (:class:`DenseOnArrival`): nothing sees it in between. Found on the stack (the
    fetcher's frame is short-lived: looking at it keeps nothing alive); ``False`` when not
    known, and the worker densifies as before."""
    if get_worker_info() is None:
        return False
    from torch.utils.data._utils.collate import default_convert

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "fetch":
            back = frame.f_back
            fetcher = frame.f_locals.get("self")
            return (back is not None and back.f_code.co_name == "_worker_loop"
                    and getattr(fetcher, "dataset", None) is dataset
                    and getattr(fetcher, "collate_fn", None) is default_convert
                    and getattr(fetcher, "auto_collation", True) is False)
        frame = frame.f_back
    return False


#: dense arrays of arrived batches, reused once the training loop let go of them (the
#: batch in use, one a loop may prefetch and the one being made, per densified key)
ARRIVED = DenseBuffers(keep=3)


def arrive_dense(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor,
                 shape: tuple[int, int], n_keys: int = 1) -> torch.Tensor:
    """Unpickling a :class:`DenseOnArrival` (in the main process): the batch densified
    by scipy, in the values' dtype, into an array the training loop let go of (or a fresh
    one); ``n_keys``: the batch's densified keys (the arrays kept for reuse grow to three
    per key; ``ARRIVED.clear()`` lets them go)."""
    ARRIVED.keep = max(ARRIVED.keep, 3 * n_keys)
    return csr_tensor_to_dense(torch.sparse_csr_tensor(crow, col, values, size=shape,
                                                       check_invariants=False), ARRIVED)


class DenseOnArrival:
    """A densified key of a batch made in a plain ``DataLoader`` worker: sent as its CSR
    (the compact parts, through torch's shared memory) and densified when the main process
    unpickles it, so the worker never fills a fresh shared-memory segment of the whole dense
    batch (its pages fault in on both sides, and it would be the bulk of the worker's
    memory). Only made where nothing but the queue sees it (:func:`plain_worker_sends_csr`).

    Parameters
    ----------
    csr
        The key's value as a CPU ``torch.sparse_csr_tensor``.
    n_keys
        The batch's densified keys (see :func:`arrive_dense`).
    """

    __slots__ = ("csr", "n_keys")

    def __init__(self, csr: torch.Tensor, n_keys: int = 1) -> None:
        self.csr = csr
        self.n_keys = n_keys

    def __reduce__(self) -> tuple[Any, ...]:
        t = self.csr
        return (arrive_dense, (t.crow_indices(), t.col_indices(), t.values(),
                               (int(t.shape[0]), int(t.shape[1])), self.n_keys))


class Densifying:
    """Iterator over a loader's batches that applies :meth:`DensifyPolicy.finish`."""

    def __init__(self, it: Iterator[Any], policy: DensifyPolicy) -> None:
        self._it = it
        self._policy = policy
        # one array per densified key for the batch in use and the one being made
        self._dense = DenseBuffers(keep=2 * max(1, len(policy.main_keys)))

    def __iter__(self) -> Densifying:
        return self

    def __next__(self) -> Any:
        return self._policy.finish(next(self._it), self._dense)

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


