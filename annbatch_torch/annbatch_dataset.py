"""`AnnBatchDataset`: a chunk-shuffled, rank- and worker-sharded ``IterableDataset``.

Per epoch, each DataLoader worker computes its share of the epoch plan
(:mod:`annbatch_torch.sampling`, pure functions) and reads one pool at a time with
:class:`~annbatch_torch.reader.PoolReader`, straight into the pool's shuffled batch-by-batch
layout (the next pool is read in the background while the current one is consumed). A
batch is then a contiguous row slice of the pool (zero copy), densified if asked, passed
through the per-field transforms and the ``batch_converter``, and yielded. See
``docs/architecture.md``, "The data path of one pool".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch
from torch.utils.data import IterableDataset, get_worker_info

from . import sampling
from .convert import batch_dict_converter, densify_csr
from .errors import BatchError, SchemaError
from .fields import Field, normalize_selector
from .read import device_pool as gpu
from .read.pool_stream import ReadAheadMixin
from .read.reader import PoolReader, default_read_threads, describe_ranges, row_slice
from .resume import ResumeMixin
from .store.collection import Source
from .store.inplace import as_source

__all__ = ["AnnBatchDataset", "DEFAULT_CHUNK_SIZE", "DEFAULT_PRELOAD_NCHUNKS",
           "default_read_threads"]

logger = logging.getLogger(__name__)

#: Rows per contiguous read. 512 rows of ~2k non-zeros are ~8 MB of CSR: big enough for
#: sequential-speed reads, small enough that a pool mixes many distant chunks.
DEFAULT_CHUNK_SIZE = 512
#: Chunks per pool: 32 x 512 = 16,384 rows shuffled together (~250 MB of CSR at 20k genes
#: and ~1.8k non-zeros per cell; two pools are alive with background prefetch).
DEFAULT_PRELOAD_NCHUNKS = 32


def _dist_rank_world() -> tuple[int, int] | None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return None


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
    return int(value)


def _own_copy(value: Any) -> Any:
    """A copy of a batch value (numpy, scipy sparse or torch), so that an in-place
    transform of one key never changes another key's values."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if sp.issparse(value):
        return value.copy()
    return np.array(value, copy=True)


def _int_array(name: str, values: Any) -> np.ndarray:
    """``values`` as int64, refusing fractions and non-numbers (never truncated)."""
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iuf") or (
            arr.dtype.kind == "f" and not np.all(np.isfinite(arr) & (arr == np.round(arr)))):
        raise ValueError(f"{name} must be a 1-D list of integers, got {values!r}.")
    return arr.astype(np.int64)


class AnnBatchDataset(ResumeMixin, ReadAheadMixin, IterableDataset):
    """Minibatches of AnnData rows, read chunk-wise and shuffled within pools.

    Use it with ``torch.utils.data.DataLoader(ds, batch_size=None, num_workers=N)``: the
    dataset yields whole batches.

    Parameters
    ----------
    source
        A :class:`~annbatch_torch.Collection`, a collection folder, or AnnData inputs read
        in place: a ``.h5ad`` / AnnData-zarr path, an ``AnnData`` or a list of those.
    selector
        ``{output key: field}`` with fields such as ``A.X``, ``A.layers["counts"]``,
        ``A.obsm["X_pca"]``, ``A.obs["cell_type"]`` or field strings (``"obsm/X_pca"``).
        Default ``{"X": A.X}``.
    batch_size
        Rows per batch (any value >= 1).
    chunk_size
        Consecutive rows per read (default 512).
    preload_nchunks
        Chunks per pool; rows are shuffled within a pool (default 32, i.e. 16,384 rows).
        The pool is rounded down to a multiple of ``batch_size`` (at least one batch).
    shuffle
        Shuffle chunk order and rows within pools. ``False`` reads rows in order.
    seed
        Base seed; the order of an epoch is a function of ``(seed, epoch)`` only.
    drop_last
        Drop the one partial batch of the epoch.
    even_batches
        How ranks get equal batch counts (DDP hangs otherwise): ``"drop"`` drops the
        remainder (fewer than ``world_size`` batches per epoch in all), ``"pad"`` gives the
        short ranks one padding batch whose rows are flagged ``False`` under ``mask_key``.
    densify
        Yield sparse fields as dense float32 (densified by scipy in the worker) instead of
        ``torch.sparse_csr_tensor``.
    return_index
        Add an ``"index"`` key with the global row ids (positions in the source).
    batch_converter
        Callable run in the worker on ``{key: numpy/scipy value}``; its result is yielded.
        Default :func:`~annbatch_torch.batch_dict_converter`. Must be picklable for
        ``spawn`` workers (no lambdas).
    rank, world_size
        Override the distributed rank / world size (default: from ``torch.distributed``
        when a process group is initialised, else 0 / 1).
    chunk_ids
        Restrict the plan to these chunk indices (used for train/validation splits).
    mask_key
        Key of the boolean "real row" mask, present when ``even_batches="pad"``.
    read_threads
        Concurrent reads per process. Default: the usable CPUs, at most 4
        (:func:`default_read_threads`).
    prefetch
        Read the next pool in a background thread while the current one is consumed.
        Default ``None``: on in the main process (``num_workers=0``; measured here: dense
        1.35x faster; sparse 1.2-1.3x with a 20 ms training step per batch, ~0.9x with a
        consumer that does nothing), off inside DataLoader workers, where the other
        workers already overlap reads and it would cost one more pool of memory per worker
        (measured with 2 workers, dense: 0.82-0.93x as fast with it, worker peak 751 vs
        516 MiB).
    device
        Hold each pool on this device (``"cuda"``, ``"cuda:1"``; the ``gpu`` extra) and cut
        and densify batches there (:class:`~annbatch_torch.gpu.DevicePool`): batch values
        are then tensors on the device, also inside transforms and the
        ``batch_converter``. Needs ``num_workers=0``. ``"cpu"`` runs the same path on the
        host. Default ``None``: numpy/scipy batches on the host.
    """

    def __init__(
        self,
        source: Any,
        *,
        selector: Mapping[str, Field | str] | None = None,
        batch_size: int = 4096,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        preload_nchunks: int = DEFAULT_PRELOAD_NCHUNKS,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        even_batches: str = "drop",
        densify: bool = False,
        return_index: bool = False,
        batch_converter: Callable[[dict[str, Any]], Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        chunk_ids: Sequence[int] | np.ndarray | None = None,
        mask_key: str = "mask",
        read_threads: int | None = None,
        prefetch: bool | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.chunk_size = _check_int("chunk_size", chunk_size, 1)
        self.preload_nchunks = _check_int("preload_nchunks", preload_nchunks, 1)
        self.seed = _check_int("seed", seed, 0)
        self.read_threads = (default_read_threads() if read_threads is None
                             else _check_int("read_threads", read_threads, 1))
        if even_batches not in ("drop", "pad"):
            raise ValueError(f"even_batches must be 'drop' or 'pad', got {even_batches!r}.")
        if batch_converter is not None and not callable(batch_converter):
            raise TypeError("batch_converter must be callable (or None for the default).")
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.even_batches = even_batches
        self.densify = bool(densify)
        self.return_index = bool(return_index)
        self.mask_key = mask_key
        self.prefetch = None if prefetch is None else bool(prefetch)
        self.batch_converter = batch_converter
        self.device = None if device is None else gpu.check_device(device)
        self.source: Source = as_source(source)
        self.selector = normalize_selector(selector)
        self._validate_selector()
        if not isinstance(mask_key, str) or not mask_key:
            raise ValueError(f"mask_key must be a non-empty string, got {mask_key!r}.")
        if even_batches == "pad" and self.return_index and mask_key == "index":
            raise ValueError("mask_key='index' clashes with the row ids of return_index=True; "
                             "choose another mask_key (default 'mask').")
        reserved = {"index"} if self.return_index else set()
        if even_batches == "pad":
            reserved.add(mask_key)
        clash = reserved & set(self.selector)
        if clash:
            raise ValueError(f"selector keys {sorted(clash)} clash with reserved output keys.")
        self.chunk_ids = None if chunk_ids is None else _int_array("chunk_ids", chunk_ids)
        self._explicit_dist = rank is not None or world_size is not None
        self._rank, self._world_size = 0, 1
        if self._explicit_dist:
            self._rank = _check_int("rank", 0 if rank is None else rank, 0)
            self._world_size = _check_int("world_size", 1 if world_size is None else world_size, 1)
            if self._rank >= self._world_size:
                raise ValueError(
                    f"rank must be in [0, world_size={self._world_size}), got {self._rank}."
                )
        self._resolve_dist()
        sampling.validate_params(
            n_obs=self.source.n_obs, chunk_size=self.chunk_size,
            preload_nchunks=self.preload_nchunks, batch_size=self.batch_size,
            rank=self._rank, world_size=self._world_size, even_batches=self.even_batches,
        )
        # shared memory: set_epoch in the main process reaches (persistent) workers
        self._shared = torch.zeros(2, dtype=torch.int64).share_memory_()
        self._shared[1] = -1  # last epoch that started iterating
        self._reader: PoolReader | None = None
        # set in DataLoader workers by AnnBatchDataLoader: leave deferred_dense_keys() as CSR
        self._defer_densify = False
        # (key, future, executor) of the next epoch's first pool, read ahead (in-process)
        self._ahead: tuple[tuple[Any, ...], Future[Any], ThreadPoolExecutor] | None = None
        # exact resume (torchdata Stateful): batches this copy yielded in the current epoch
        self._progress = {"worker": 0, "num_workers": 1, "epoch": 0, "batches": 0}
        self._resume: dict[str, int] | None = None

    # -- configuration ---------------------------------------------------------------
    def _validate_selector(self) -> None:
        for key, f in self.selector.items():
            try:
                self.source.check_field(f.path)  # says why a field is missing or refused
            except SchemaError as e:
                raise SchemaError(f"selector key {key!r}: {e}") from None

    def _resolve_dist(self) -> tuple[int, int]:
        if not self._explicit_dist:
            found = _dist_rank_world()
            if found is not None:
                self._rank, self._world_size = found
        return self._rank, self._world_size

    @property
    def rank(self) -> int:
        return self._resolve_dist()[0]

    @property
    def world_size(self) -> int:
        return self._resolve_dist()[1]

    @property
    def epoch(self) -> int:
        return int(self._shared[0])

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch used by the next iteration (reaches persistent workers too)."""
        self._shared[0] = _check_int("epoch", epoch, 0)

    def _plan_kwargs(self) -> dict[str, Any]:
        return dict(
            n_obs=self.source.n_obs, chunk_size=self.chunk_size,
            preload_nchunks=self.preload_nchunks, batch_size=self.batch_size,
            drop_last=self.drop_last, even_batches=self.even_batches, chunk_ids=self.chunk_ids,
        )

    def __len__(self) -> int:
        """Batches this rank yields per epoch (the same on every rank)."""
        world = self._resolve_dist()[1]
        return sampling.batches_per_rank(**self._plan_kwargs(), world_size=world)

    def plan(
        self, epoch: int | None = None, worker: int = 0, num_workers: int = 1
    ) -> Sequence[sampling.WorkItem]:
        """The work items (pools and batch ranges) of one worker of this rank."""
        rank, world = self._resolve_dist()
        epoch = self.epoch if epoch is None else epoch
        items = sampling.rank_items(
            **self._plan_kwargs(), shuffle=self.shuffle, seed=self.seed, epoch=epoch,
            rank=rank, world_size=world,
        )
        return sampling.worker_items(items, worker, max(1, num_workers))

    def deferred_dense_keys(self) -> set[str]:
        """Output keys that :class:`~annbatch_torch.AnnBatchDataLoader` densifies in the
        main process when ``densify=True`` and DataLoader workers are used: sparse fields
        without a transform, with the default ``batch_converter``. Workers then send CSR
        (~5x fewer bytes than dense at typical sparsity) instead of dense batches."""
        if not self.densify or self.batch_converter is not None:
            return set()
        return {
            key for key, f in self.selector.items()
            if f.transform is None and self.source.fields[f.path].kind == "csr"
        }

    # -- pickling -----------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        self._resolve_dist()  # the process group lives here, not in a worker
        state = self.__dict__.copy()
        state["_reader"] = None
        state["_ahead"] = None
        return state

    # -- iteration ----------------------------------------------------------------------
    def _get_reader(self) -> PoolReader:
        if self._reader is None:
            paths = [f.path for f in self.selector.values()]
            self._reader = PoolReader(self.source, paths, threads=self.read_threads)
        return self._reader

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch = self.epoch
        if worker == 0:
            if self.shuffle and int(self._shared[1]) == epoch:
                logger.warning(
                    "AnnBatchDataset: epoch %d is iterated again with the same order; call "
                    "dataset.set_epoch(epoch) before each epoch.", epoch
                )
            self._shared[1] = epoch
        skip = self._take_resume(epoch, worker, num_workers)
        if self.device is not None:
            gpu.check_device(self.device)  # refuses DataLoader workers with the fix
        items = self.plan(epoch, worker, num_workers)
        if skip:
            items = sampling.remaining_items(items, skip)
        self._progress = {"worker": worker, "num_workers": num_workers, "epoch": epoch,
                          "batches": skip}
        return self._iter_items(items, epoch, worker, num_workers)

    def _read_pool(self, reader: PoolReader, item: sampling.WorkItem, epoch: int
                   ) -> tuple[dict[str, Any], np.ndarray]:
        """Read an item's pool laid out batch after batch (see :func:`sampling.pool_order`)."""
        perm = sampling.item_permutation(item, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
        order = sampling.pool_order(perm, self.batch_size)
        pool = reader.read(item.ranges, order)
        if self.device is not None:  # uploaded here: overlaps the current pool's batches
            return gpu.DevicePool(pool, self.device), order
        return pool, order

    def _iter_items(self, items: Sequence[sampling.WorkItem], epoch: int, worker: int,
                    num_workers: int) -> Iterator[Any]:
        if not items:
            self.drop_read_ahead()  # nothing to read: free a pool read ahead for this epoch
            return
        reader = self._get_reader()
        prefetch = self.prefetch if self.prefetch is not None else get_worker_info() is None
        ahead = self._take_read_ahead(epoch, worker, num_workers, items[0]) if prefetch else None
        bg = None
        if ahead is not None:
            bg = ahead[1]
        elif prefetch:
            bg = ThreadPoolExecutor(1, thread_name_prefix="annbatch-prefetch")
        kept = False  # bg then reads the next epoch's first pool (self._ahead)
        try:
            nxt: Future[Any] | None = ahead[0] if ahead is not None else (
                bg.submit(self._read_pool, reader, items[0], epoch) if bg else None
            )
            ahead = None  # its future holds the pool: no reference may outlive the pool
            for i, item in enumerate(items):
                if nxt is not None:
                    pool, order = nxt.result()
                else:
                    pool, order = self._read_pool(reader, item, epoch)
                nxt = None
                if bg is not None and i + 1 < len(items):
                    # buffers of the previous pool are reused when the caller let go of its
                    # batches (always for dense batches), else fresh ones are taken
                    nxt = bg.submit(self._read_pool, reader, items[i + 1], epoch)
                elif bg is not None:
                    kept = self._read_ahead(bg, reader, epoch + 1, worker, num_workers)
                yield from self._batches(item, pool, order)
                if isinstance(pool, gpu.DevicePool):
                    pool.close()
                del pool  # without prefetch: free this pool before the next is read
        finally:
            if bg is not None and not kept:
                bg.shutdown(wait=True, cancel_futures=True)
            if not kept:
                reader.buffers.clear()

    def _batches(
        self, item: sampling.WorkItem, pool: dict[str, Any] | gpu.DevicePool, order: np.ndarray
    ) -> Iterator[Any]:
        rows = sampling.global_rows(item.ranges)[order] if self.return_index else None
        converter = self.batch_converter or batch_dict_converter
        bs, n = self.batch_size, len(order)
        in_worker = get_worker_info() is not None
        deferred = self.deferred_dense_keys() if in_worker and self._defer_densify else set()
        dev = pool if isinstance(pool, gpu.DevicePool) else None
        for b in range(item.batch_start, item.batch_stop):
            lo, hi = b * bs, min((b + 1) * bs, n)  # batches are contiguous in the pool
            batch: dict[str, Any] = {}
            on_device = dev.batch(lo, hi, self.densify) if dev is not None else None
            used: set[str] = set()
            for key, f in self.selector.items():
                if on_device is not None:
                    value = on_device[f.path]
                else:
                    value = row_slice(pool[f.path], lo, hi)
                if self.densify and sp.issparse(value) and key not in deferred:
                    # in a worker: straight into shared memory, no copy on the way out
                    value = densify_csr(value, shared=in_worker)
                if f.path in used:  # one field under two keys: never the same memory
                    value = _own_copy(value)
                used.add(f.path)
                if f.transform is not None:
                    try:
                        value = f.transform(value)
                    except Exception as e:
                        what = f"the transform of selector key {key!r} (field {f.path!r})"
                        raise self._batch_error(what, item, b, e) from e
                batch[key] = value
            if rows is not None:
                batch["index"] = rows[lo:hi]
            if self.even_batches == "pad":
                batch[self.mask_key] = np.full(hi - lo, not item.padding, dtype=bool)
            try:
                out = converter(batch)
            except Exception as e:
                raise self._batch_error("the batch_converter", item, b, e) from e
            self._progress["batches"] += 1  # before yield: state_dict() follows the fetch
            yield out

    def _batch_error(
        self, what: str, item: sampling.WorkItem, batch: int, exc: Exception
    ) -> BatchError:
        # the DataLoader passes only the message to the training loop: carry type and text
        return BatchError(
            f"{self.source.describe()}: {what} raised {type(exc).__name__}: {exc} on batch "
            f"{batch} of pool {item.pool_index}, read from "
            f"{describe_ranges(self.source, item.ranges)}."
        )

    def __repr__(self) -> str:
        sel = {k: str(v) for k, v in self.selector.items()}
        return (
            f"AnnBatchDataset({self.source!r}, selector={sel}, batch_size={self.batch_size}, "
            f"chunk_size={self.chunk_size}, preload_nchunks={self.preload_nchunks}, "
            f"shuffle={self.shuffle}, rank={self._rank}/{self._world_size}, pid={os.getpid()})"
        )
