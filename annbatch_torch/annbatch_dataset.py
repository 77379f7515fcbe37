"""`AnnBatchDataset`: a chunk-shuffled, rank- and worker-sharded ``IterableDataset``.

A batch's path, one direction (``docs/architecture.md``, "A batch's path"): the
:class:`~annbatch_torch.world.World` of this copy is resolved once per ``__iter__``; the
plan (:class:`~annbatch_torch.sampling.ChunkPlan` or
:class:`~annbatch_torch.sampling.SamplePlan`, pure) gives its complete work items (a pool's
rows, their order, its batches) and answers every other planning question (``len``, the
resume fingerprint); a :class:`~annbatch_torch.read.pool_stream.PoolStream` reads each
pool (the next one in the background) into a host or device pool; a
:class:`~annbatch_torch.batches.BatchAssembler` cuts each batch out of it (``pool.batch(lo,
hi)``: a zero-copy slice, densified where the
:class:`~annbatch_torch.read.densify.DensifyPolicy` says) and applies the per-field
transforms and the ``batch_converter``. The dataset keeps the configuration, pickling and
``__iter__``; resume state lives in :mod:`annbatch_torch.resume`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torch.utils.data import Sampler as TorchSampler

from . import sampling
from .batches import CONTROL_PREFIX, BatchAssembler, output_selector
from .errors import SamplerError, SchemaError, check_bool, check_int
from .fields import Field, normalize_selector
from .read import handoff
from .read.densify import DensifyPolicy
from .read.device_pool import check_device
from .read.genes import GeneSelection, MemberGenes
from .read.pool_stream import PoolStream
from .read.reader import PoolReader, default_read_threads
from .read.send_order import SendOrder, Turn
from .resume import MAX_EPOCH, Resumer
from .sampling import ChunkPlan, EpochPlan, SamplePlan, Sampler, Segment
from .sampling.mixing import MixSampler
from .store.inputs.inplace import open_source
from .store.inputs.mixture import SOURCE_COLUMN, Mixture
from .store.manifest import RAW_X
from .store.native import forks_by_default, start_numba
from .store.source import Source
from .torch_sampler import bind_sampler
from .world import SharedEpoch, World, distributed_rank_world

__all__ = ["AnnBatchDataset", "DEFAULT_CHUNK_SIZE", "DEFAULT_PRELOAD_NCHUNKS"]

logger = logging.getLogger(__name__)

#: The settings the epoch plan is made of: read-only once the dataset is built (a change
#: would not reach the plan, its length or its resume fingerprint)
PLAN_SETTINGS = frozenset({"batch_size", "chunk_size", "preload_nchunks", "seed", "shuffle",
                           "drop_last", "even_batches", "chunk_ids", "sampler", "source"})

#: Rows per contiguous read. 512 rows of ~2k non-zeros are ~8 MB of CSR: big enough for
#: sequential-speed reads, small enough that a pool mixes many distant chunks.
DEFAULT_CHUNK_SIZE = 512
#: Chunks per pool: 32 x 512 = 16,384 rows shuffled together (~250 MB of CSR at 20k genes
#: and ~1.8k non-zeros per cell; two pools are alive with background prefetch).
DEFAULT_PRELOAD_NCHUNKS = 32


def _short(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters (a resume state, taken at every batch, names
    its source; many inputs read in place make a long name)."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _int_array(name: str, values: Any) -> np.ndarray:
    """``values`` as int64, refusing fractions and non-numbers (never truncated)."""
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iuf") or (
            arr.dtype.kind == "f" and not np.all(np.isfinite(arr) & (arr == np.round(arr)))):
        raise ValueError(f"{name} must be a 1-D list of integers, got {values!r}.")
    return arr.astype(np.int64)


#: the dtypes ``out_dtype`` may name (numpy dtypes torch has tensors of)
_OUT_DTYPES = tuple(np.dtype(t) for t in ("uint8", "int8", "int16", "int32", "int64",
                                          "float32", "float64"))


def _holds(stored: np.dtype, out: np.dtype) -> bool:
    """Whether ``out`` holds every value of ``stored`` exactly (integers in a float: up to
    its mantissa, so int64 does not go into float64)."""
    if out.kind == "f" and stored.kind in "iu":
        bits = stored.itemsize * 8 - (stored.kind == "i")
        return bits <= np.finfo(out).nmant + 1
    return bool(np.can_cast(stored, out, "safe"))


def _out_dtype(value: Any, source: Source, paths: Sequence[str],
               device: torch.device | None) -> np.dtype | None:
    """``AnnBatchDataset(out_dtype=value)`` checked: ``None`` for float32 (the default);
    refused when it cannot hold a value some shard stores in a selected sparse field."""
    if value is None:
        return None
    try:
        dtype = (torch.empty(0, dtype=value).numpy().dtype if isinstance(value, torch.dtype)
                 else np.dtype(value))
    except (TypeError, RuntimeError):
        dtype = None
    if dtype is None or dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {[str(d) for d in _OUT_DTYPES]} (or None "
                         f"for float32), got {value!r}.")
    if dtype == np.float32:
        return None
    if device is not None:
        raise ValueError(
            f"out_dtype={str(dtype)!r} cannot be combined with device={str(device)!r}: a "
            "device pool holds float32 values on the device. Leave out_dtype unset there, "
            "or read on the host (device=None) and move the batches yourself: to_device "
            "with densify=False keeps the dtype (its densify=True gives float32).")
    for path in paths:
        if source.fields[path].kind != "csr":
            continue
        stored = source.stored_value_dtypes(path)
        bad = [i for i, d in enumerate(stored) if not _holds(d, dtype)]
        if not bad:
            continue
        worst = max(bad, key=lambda i: (stored[i].kind == "f", stored[i].itemsize))
        fits = [str(d) for d in _OUT_DTYPES if all(_holds(s, d) for s in set(stored))]
        if stored[worst].kind == "f":
            fix = ("use 'float64'" if stored[worst] == np.float32 or "float64" in fits
                   else "leave out_dtype unset")
            fix += (": it holds integer counts as integers only in a collection written "
                    "by create_anndata_collection(..., data_dtype='auto') (the default) from "
                    "inputs whose values are all whole numbers")
        else:
            fix = (f"use out_dtype={fits[0]!r} (or a wider one), which holds what every "
                   f"{source.PART} stores" if fits else "leave out_dtype unset")
        raise ValueError(
            f"AnnBatchDataset(out_dtype={str(dtype)!r}) on {source.describe()}: field "
            f"{path!r} of {source.PART} {source.shard_name(worst)} stores {stored[worst]} "
            f"values ({len(bad)} of {len(stored)} {source.PART}s store values that "
            f"{dtype} cannot hold exactly): {fix}.")
    return dtype


class AnnBatchDataset(IterableDataset):
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
        Yield sparse fields as dense float32 (or ``out_dtype``; densified by scipy in the
        worker) instead of
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
        (``default_read_threads()``).
    prefetch
        Read the next pool in a background thread while the current one is consumed.
        Default ``None``: on in the main process (``num_workers=0``), off inside
        DataLoader workers, where the other workers already overlap reads and it would
        cost one more pool of memory per worker (docs/tuning.md has the measurements).
    device
        Hold each pool on this device (``"cuda"``, ``"cuda:1"``; the ``gpu`` extra) and cut
        and densify batches there (``read.device_pool.DevicePool``):
        batch values are then tensors on the device, also inside transforms and the
        ``batch_converter``. Needs ``num_workers=0``. ``"cpu"`` runs the same path on the
        host. Default ``None``: numpy/scipy batches on the host.
    var_names
        Read only these genes of X, layers and raw/X, in this order (a subset or reordering
        of the source's genes, e.g. 2,000 highly variable genes of a 30,000-gene
        collection); each must be a gene of the source (of its raw genes, for ``raw/X``).
        Default: all genes, in the source's order.
    sampler
        Sampling mode: a :class:`~annbatch_torch.Sampler` (``WeightedSampler``,
        ``ClassBalancedSampler``, ``SubsetSampler`` or your own) chooses the rows of each
        epoch, a stream of row ids seeded by ``(seed, epoch)``; a plain
        ``torch.utils.data.Sampler`` of row indices works too
        (``torch_sampler.py``: iterated with torch's generator seeded by
        ``(seed, epoch)``, refused if it gives other indices when iterated again). The
        stream is cut into batches, dealt to ranks (equal counts, ``even_batches``) and
        workers, and each pool (``chunk_size * preload_nchunks`` sampled rows, rounded
        down to whole batches) is read by random access. ``shuffle=False`` then keeps the
        stream's batch order with DataLoader workers. Default ``None``: chunked mode.
        Cannot be combined with ``chunk_ids`` (give the rows to a ``SubsetSampler``).
    out_dtype
        The dtype of sparse fields' values (X, layers, raw/X) in batches: ``"uint8"``,
        ``"int8"``, ``"int16"``, ``"int32"``, ``"int64"``, ``"float32"`` or ``"float64"``
        (a numpy or torch dtype, or its name), e.g. integer counts for a count model, or
        fewer bytes from workers to the training loop. Pools are filled in it as they are
        read (the reader widens a collection's narrow stored values anyway), CSR and
        densified batches keep it, and so does the default ``batch_converter`` for keys
        without a transform (a transform sees values in ``out_dtype``; its result is
        converted as usual: CSR values to float32, integer arrays to int64). It must hold
        every value the selected fields store, in every shard (checked here, from the
        manifest: a collection written with ``data_dtype="auto"`` stores integer counts
        as integers; float values need a float dtype). ``None`` (the default) and
        ``"float32"`` give float32 unchecked: integers beyond 2**24 and float64 values
        are rounded as numpy's cast rounds them. Not with ``device``; note that
        :func:`~annbatch_torch.to_device` densifies into float32 (``densify=False`` keeps
        the dtype). A converter of your own that composes with
        :func:`~annbatch_torch.batch_dict_converter` passes it ``keep_dtype=`` (the
        sparse keys) to keep it. Default ``None`` (and ``"float32"``): float32, as
        without it.
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
        var_names: Sequence[str] | None = None,
        sampler: Sampler | TorchSampler | None = None,
        out_dtype: str | np.dtype | torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.chunk_size = check_int("chunk_size", chunk_size, 1)
        self.preload_nchunks = check_int("preload_nchunks", preload_nchunks, 1)
        self.seed = check_int("seed", seed, 0)
        self.read_threads = (default_read_threads() if read_threads is None
                             else check_int("read_threads", read_threads, 1))
        if even_batches not in ("drop", "pad"):
            raise ValueError(f"even_batches must be 'drop' or 'pad', got {even_batches!r}.")
        if batch_converter is not None and not callable(batch_converter):
            raise TypeError("batch_converter must be callable (or None for the default).")
        self.shuffle = check_bool("shuffle", shuffle)
        self.drop_last = check_bool("drop_last", drop_last)
        self.even_batches = even_batches
        self.densify = check_bool("densify", densify)
        self.return_index = check_bool("return_index", return_index)
        self.mask_key = mask_key
        self.prefetch = None if prefetch is None else check_bool("prefetch", prefetch)
        self.batch_converter = batch_converter
        self.device = None if device is None else check_device(device)
        self.source: Source = open_source(source)
        self.selector = normalize_selector(selector)
        if isinstance(self.source, Mixture) and not any(
                k == SOURCE_COLUMN or f.path == f"obs/{SOURCE_COLUMN}"
                for k, f in self.selector.items()):
            # each row's collection, as batch["source"] (codes of the mixture's names)
            self.selector[SOURCE_COLUMN] = Field.parse(f"obs/{SOURCE_COLUMN}")
        self._validate_selector()
        paths = {f.path for f in self.selector.values()}
        self.out_dtype = _out_dtype(out_dtype, self.source, sorted(paths), self.device)
        by_var = any(p == "X" or p.startswith("layers/") for p in paths)
        # each gene axis the selector reads is cut to var_names (and must hold them)
        self.genes = (GeneSelection(self.source.var_names, var_names, self.source.describe())
                      if var_names is not None and (by_var or RAW_X not in paths) else None)
        raw_names = self.source.raw_var_names
        self._raw_genes = (GeneSelection(raw_names, var_names, f"{self.source.describe()} "
                                         "(raw)", attr="raw_var_names")
                           if var_names is not None and raw_names is not None
                           and RAW_X in paths else None)
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
        if isinstance(self.source, Mixture) and self.source.weights is not None:
            if sampler is not None:
                raise SamplerError(
                    f"{self.source!r} draws its rows by its weights; a sampler of your own "
                    "cannot draw from it too. Pass mix(...) without weights to read it as "
                    "one source with your sampler, or drop sampler=.")
            sampler = self._mix_sampler()
        self.sampler = None if sampler is None else self._bind_sampler(sampler)
        self._check_draws(reserved)
        self._explicit_dist = rank is not None or world_size is not None
        self._rank, self._world_size = 0, 1
        if self._explicit_dist:
            self._rank = check_int("rank", 0 if rank is None else rank, 0)
            self._world_size = check_int("world_size", 1 if world_size is None else world_size, 1)
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
        settings = dict(n_obs=self.source.n_obs, chunk_size=self.chunk_size,
                        preload_nchunks=self.preload_nchunks, batch_size=self.batch_size,
                        shuffle=self.shuffle, seed=self.seed, drop_last=self.drop_last,
                        even_batches=self.even_batches,
                        source_id=self.source.identity(),
                        source_name=_short(self.source.describe()))
        #: the epochs' plan, asked what they hold (chunked or sampling mode)
        try:
            self._epoch_plan: EpochPlan = (
                ChunkPlan(**settings, chunk_ids=self.chunk_ids) if self.sampler is None
                else SamplePlan(**settings, sampler=self.sampler))
        except ValueError as e:  # chunk_ids that are not chunks of this source
            raise ValueError(f"AnnBatchDataset on {self.source.describe()}: {e}") from None
        # set_epoch in the main process reaches (persistent) workers
        self._epoch = SharedEpoch()
        #: Where sparse fields are densified (AnnBatchDataLoader installs its own in its
        #: workers, see DensifyPolicy.for_workers).
        self.densify_policy = DensifyPolicy.for_dataset(self.densify, self.device)
        self._stream: PoolStream | None = None  # made in the process that iterates
        # exact resume (torchdata Stateful): what this copy yielded of the current epoch
        self._resumer = Resumer()
        self._iterations = 0  # iter() calls on this copy: only the newest iterator runs
        # a plain DataLoader's workers send batches densified on arrival in its order (a
        # table only where pools densify: each holds shared memory and an open file)
        self._send_order: SendOrder | None = (
            SendOrder() if self.densify_policy.where == "pool" else None)
        # reading needs numba's start: paid once here where workers are forked, so that
        # they inherit it instead of each paying it before its first batch (spawned ones
        # pay their own; in-process reading pays it at its first read either way)
        if forks_by_default():
            start_numba()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in PLAN_SETTINGS and "_epoch_plan" in self.__dict__:
            raise AttributeError(
                f"AnnBatchDataset.{name} is fixed when the dataset is built: the epoch plan, "
                "len() and resume states are made from it. Build a new AnnBatchDataset with "
                f"{name}={value!r} (the source is opened lazily, so this is cheap).")
        super().__setattr__(name, value)

    # -- configuration ---------------------------------------------------------------
    def _mix_sampler(self) -> Sampler:
        """A weighted mixture's sampler, bound to its rows (those of ``chunk_ids``, a split,
        when given: they are then the sampler's)."""
        mixture = self.source
        assert isinstance(mixture, Mixture)
        assert mixture.weights is not None
        rows = None
        if self.chunk_ids is not None:
            rows = ChunkPlan(n_obs=mixture.n_obs, chunk_size=self.chunk_size,
                             preload_nchunks=self.preload_nchunks, batch_size=self.batch_size,
                             chunk_ids=self.chunk_ids).rows()
            self.chunk_ids = None
        sampler = MixSampler(mixture.member_offsets, mixture.weights,
                             batch_size=self.batch_size,
                             chunk_size=mixture.chunk_size or self.chunk_size,
                             num_samples=mixture.num_samples, names=mixture.names,
                             member_samplers=mixture.samplers)
        return bind_sampler(mixture, sampler, rows)

    def _bind_sampler(self, sampler: Any) -> Sampler:
        if self.chunk_ids is not None:
            raise SamplerError(
                "sampler and chunk_ids cannot be combined: a sampler chooses the rows itself; "
                "give the rows to SubsetSampler(rows) (or leave chunk_ids for chunked mode).")
        if isinstance(sampler, Sampler) and sampler.is_bound:  # bound by the caller
            if sampler.n_obs != self.source.n_obs:
                raise SamplerError(
                    f"sampler {sampler!r} is bound to a source of {sampler.n_obs} rows, but "
                    f"{self.source.describe()} has {self.source.n_obs}; pass the sampler "
                    "unbound and the dataset binds it.")
            return sampler
        return bind_sampler(self.source, sampler)

    @property
    def draw_size(self) -> int:
        """Rows per draw of the sampler (``1``: single rows; ``PairedSampler``: a perturbed
        row and its controls, yielded under ``control_`` keys)."""
        return 1 if self.sampler is None else int(self.sampler.draw_size)

    @property
    def output_selector(self) -> dict[str, Field]:
        """``{output key: field}`` of the batches: the selector, and with a sampler of
        draws (``PairedSampler``) each key again prefixed ``control_``."""
        return output_selector(self.selector, self.draw_size)

    def _check_draws(self, reserved: set[str]) -> None:
        """A sampler of draws: its batches hold whole sets, and the ``control_`` keys
        clash with no other key."""
        if self.draw_size == 1:
            return
        set_size = getattr(self.sampler, "set_size", None)
        if set_size is not None and self.batch_size % set_size:
            raise SamplerError(
                f"batch_size={self.batch_size} must be a multiple of {self.sampler!r}'s "
                f"set_size={set_size}, so that every batch holds whole sets (e.g. "
                f"batch_size={max(1, self.batch_size // set_size) * set_size}).")
        twins = {CONTROL_PREFIX + k for k in (*self.selector, *reserved)}
        clash = sorted(twins & (set(self.selector) | reserved))
        if clash:
            raise ValueError(
                f"selector keys {clash} clash with the {CONTROL_PREFIX!r} keys of "
                f"{self.sampler!r} (its control rows); rename them.")

    def _validate_selector(self) -> None:
        for key, f in self.selector.items():
            try:
                self.source.check_field(f.path)  # says why a field is missing or refused
            except SchemaError as e:
                raise SchemaError(f"selector key {key!r}: {e}") from None

    def _resolve_dist(self) -> tuple[int, int]:
        if not self._explicit_dist:
            found = distributed_rank_world()
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
        return self._epoch.value

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch used by the next iteration (reaches persistent workers too)."""
        self._epoch.set(check_int("epoch", epoch, 0, maximum=MAX_EPOCH,
                                  maximum_text="2**63 - 1 (an int64)"))

    @property
    def epoch_plan(self) -> EpochPlan:
        """The epochs' plan (:class:`~annbatch_torch.sampling.ChunkPlan`, or
        :class:`~annbatch_torch.sampling.SamplePlan` with a sampler): the deal of an epoch,
        its batches per rank, its work items, the fingerprint a resume state records."""
        return self._epoch_plan

    def __len__(self) -> int:
        """Batches this rank yields per epoch (the same on every rank). In an epoch resumed
        on another number of ranks, the batches every rank yielded before plus those it
        yields now."""
        world = self._resolve_dist()[1]
        return self._epoch_plan.batches_per_rank(self.epoch, world,
                                                 self._resumer.planned(self.epoch, world))

    def plan(
        self, epoch: int | None = None, worker: int = 0, num_workers: int = 1, *,
        rank: int | None = None, world_size: int | None = None,
        segments: Sequence[Segment] | None = None,
    ) -> Sequence[sampling.WorkItem]:
        """The work items (pools, their row order and batch ranges) of one worker of a rank
        (default: this rank, in this world) in ``epoch``. ``segments``: the parts of the
        epoch run before under other topologies (default: those of a loaded state, see
        ``resume.py``)."""
        own_rank, own_world = self._resolve_dist()
        epoch = self.epoch if epoch is None else epoch
        world = World(own_rank if rank is None else rank,
                      own_world if world_size is None else world_size, worker,
                      max(1, num_workers))
        if segments is None:
            segments = self._resumer.planned(epoch, world.world_size)
        return self._items(epoch, world, tuple(segments))

    def _items(self, epoch: int, world: World, segments: tuple[Segment, ...] = ()
               ) -> Sequence[sampling.WorkItem]:
        return self._epoch_plan.items(epoch, rank=world.rank, world_size=world.world_size,
                                      worker=world.worker, num_workers=world.num_workers,
                                      segments=segments)

    def densify_policy_for_workers(self, *, num_workers: int, pin_memory: bool = False,
                                   collate_fn: Callable[..., Any] | None = None
                                   ) -> DensifyPolicy:
        """The ``read.densify.DensifyPolicy`` of a loader's workers
        (``DensifyPolicy.for_workers``): with
        ``densify=True`` and workers, sparse fields without a transform and with the
        default ``batch_converter`` are sent as CSR and densified in the main process."""
        return self.densify_policy.for_workers(
            self.output_selector, self.source.fields,
            default_converter=self.batch_converter is None,
            num_workers=num_workers, pin_memory=pin_memory, collate_fn=collate_fn)

    # -- resume (torchdata Stateful) -----------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Small JSON-serialisable progress of this copy: seed, epoch, worker, batches done.

        Called by ``torchdata.stateful_dataloader.StatefulDataLoader`` in each worker. After
        :meth:`set_epoch` moved to another epoch than the last one iterated, the state is
        the start of that epoch.
        """
        return self._resumer.state_dict(plan=self._epoch_plan, world_size=self.world_size,
                                        epoch=self.epoch)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration skips the batches done.

        The saved epoch becomes the dataset's epoch, unless a later epoch is set already:
        then the state is stale and that epoch runs from its start. A state saved after an
        epoch's last batch resumes that epoch with nothing left.
        """
        epoch = self._resumer.load(state_dict, plan=self._epoch_plan,
                                   world_size=self.world_size, epoch=self.epoch)
        if epoch is not None:
            self.set_epoch(epoch)
            self._epoch.forget_start()  # resuming the same epoch is intended

    def _resume_handed_to_workers(self, num_workers: int) -> None:
        """A loader's ``num_workers`` workers took their copies of this dataset, and with
        them a loaded state: this copy, which does not iterate, forgets it."""
        self._resumer.handed_over(self.world_size, num_workers)

    # -- pickling -----------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        self._resolve_dist()  # the process group lives here, not in a worker
        self._check_picklable()
        state = self.__dict__.copy()
        state["_stream"] = None
        return state

    def __copy__(self) -> AnnBatchDataset:
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__, _stream=None)
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> AnnBatchDataset:
        new = object.__new__(type(self))
        memo[id(self)] = new
        state = {k: v for k, v in self.__dict__.items() if k != "_stream"}
        new.__dict__.update(copy.deepcopy(state, memo), _stream=None)
        return new

    def _check_picklable(self) -> None:
        """Name the callable that cannot travel to ``spawn`` workers (pickle's own error
        names neither the selector key nor the converter)."""
        what = [(f"the transform of selector key {k!r}", f.transform)
                for k, f in self.selector.items() if f.transform is not None]
        if self.batch_converter is not None:
            what.append(("the batch_converter", self.batch_converter))
        for name, fn in what:
            try:
                pickle.dumps(fn)
            except Exception as e:
                raise pickle.PicklingError(
                    f"AnnBatchDataset: {name} ({fn!r}) cannot be pickled, which DataLoader "
                    f"workers started with 'spawn' or 'forkserver' need ({type(e).__name__}: "
                    f"{e}). Define it as a module-level function or a class instance (not a "
                    "lambda or a local function), or use num_workers=0 / the 'fork' start "
                    "method."
                ) from e

    # -- iteration ----------------------------------------------------------------------
    @property
    def var_names(self) -> Any:
        """The genes of X, layers and raw/X in the batches (``var_names=`` or the
        source's)."""
        genes = self.genes if self.genes is not None else self._raw_genes
        return self.source.var_names if genes is None else genes.var_names

    def _gene_cuts(self) -> dict[str, GeneSelection | MemberGenes]:
        """Selected fields indexed by gene (X, layers, raw/X) and their genes to read."""
        cuts: dict[str, GeneSelection | MemberGenes] = {}
        source = self.source
        for f in self.selector.values():
            genes = self._raw_genes if f.path == RAW_X else self.genes
            by_gene = f.path in ("X", RAW_X) or f.path.startswith("layers/")
            if by_gene and isinstance(source, Mixture):  # each member's columns mapped
                n = len(source.raw_var_names or ()) if f.path == RAW_X else source.n_vars
                cuts[f.path] = MemberGenes.of(source.member_offsets, source.gene_map(f.path),
                                              genes, n)
            elif genes is not None and by_gene:
                cuts[f.path] = genes
        return cuts

    def _pool_stream(self) -> PoolStream:
        if self._stream is None:
            paths = [f.path for f in self.selector.values()]
            # pools only densified keep the narrow dtypes shards store (cast as densified)
            reader = PoolReader(self.source, paths, threads=self.read_threads,
                                values_dtype=self.out_dtype,
                                stored_dtypes=self.densify and self.device is None)
            self._stream = PoolStream(reader, self.device, self._gene_cuts())
        return self._stream

    def drop_read_ahead(self) -> None:
        """Forget the next epoch's first pool read ahead at the end of an epoch (frees its
        memory; the next ``__iter__`` then reads it itself)."""
        if self._stream is not None:
            self._stream.drop_read_ahead()

    def __iter__(self) -> Iterator[Any]:
        rank, world_size = self._resolve_dist()
        world = World.current(rank, world_size)
        if not world.in_worker:  # workers of loaders done with: their memory unmapped
            handoff.forget_exited()
        epoch = self.epoch
        if world.worker == 0:
            self._epoch.start(epoch, warn_repeat=self.shuffle)
        segments, skip = self._resumer.start(epoch, world)
        if self.device is not None:
            check_device(self.device)  # refuses DataLoader workers with the fix
        items = self._items(epoch, world, segments)
        if skip:
            items = sampling.remaining_items(items, skip)
        self._iterations += 1
        return self._iter_items(items, epoch, world, self._iterations)

    def _iter_items(self, items: Sequence[sampling.WorkItem], epoch: int, world: World,
                    iteration: int) -> Iterator[Any]:
        prefetch = self.prefetch if self.prefetch is not None else not world.in_worker

        def upcoming() -> sampling.WorkItem | None:  # the next epoch's first pool
            nxt = self._items(epoch + 1, world)
            return nxt[0] if len(nxt) else None

        # closed on any exit: an exception kept by the caller must not keep the prefetch
        # thread and its pool alive, nor a pool read ahead for an epoch that failed
        assembler = self._assembler(world)
        slotted = assembler.handoff_keys()
        # a worker whose CSR keys travel by reference reads its pools into shared memory
        memory = handoff.pool_memory() if slotted else None
        # and sends those densified on arrival in the loader's order (read/send_order.py)
        turn = (self._send_order.turn(iteration)
                if self._send_order is not None and any(slotted.values()) else None)
        pools = self._pool_stream().pools(items, prefetch=prefetch, shared=world.in_worker,
                                          upcoming=upcoming, memory=memory)
        try:
            with contextlib.closing(pools):
                for item, pool in pools:
                    # a generator of its own: its last batch is let go before the next pool
                    yield from self._counted(assembler.batches(item, pool), iteration, turn)
            if world.worker == 0:
                self._epoch.finish(epoch)
        except Exception:
            if self._stream is not None:
                self._stream.drop_read_ahead(wait=True)
            raise
        finally:
            if turn is not None:  # the other workers wait for no more of this one
                turn.end()

    def _counted(self, batches: Iterator[Any], iteration: int,
                 turn: Turn | None = None) -> Iterator[Any]:
        """``batches``, each counted into this copy's progress as it is yielded (and sent
        in its loader's order with a ``turn``)."""
        for out in batches:
            if self._iterations != iteration:  # never counted into the newer one's progress
                raise RuntimeError(
                    "AnnBatchDataset: this iterator was superseded by a newer iter() of the "
                    "same dataset, which now owns its epoch and resume progress; use the "
                    "newest iterator, or iterate a copy.deepcopy(dataset) for a second, "
                    "independent stream.")
            if turn is not None:
                handoff.mark_position(out, turn.wait(handoff.dense_nbytes(out)))
            self._resumer.count()  # before yield: state_dict() follows the fetch
            yield out

    def _assembler(self, world: World) -> BatchAssembler:
        """How this copy turns a pool's rows into batches, in ``world``."""
        return BatchAssembler(
            self.source, self.selector, self.densify_policy, in_worker=world.in_worker,
            converter=self.batch_converter, index=self.return_index,
            mask_key=self.mask_key if self.even_batches == "pad" else None,
            out_dtype=self.out_dtype, owner=self, draw_size=self.draw_size)

    def __repr__(self) -> str:
        sel = {k: str(v) for k, v in self.selector.items()}
        return (
            f"AnnBatchDataset({self.source!r}, selector={sel}, batch_size={self.batch_size}, "
            f"chunk_size={self.chunk_size}, preload_nchunks={self.preload_nchunks}, "
            f"shuffle={self.shuffle}, "
            + (f"sampler={self.sampler!r}, " if self.sampler is not None else "")
            + (f"out_dtype={str(self.out_dtype)!r}, " if self.out_dtype is not None else "")
            + f"rank={self._rank}/{self._world_size}, pid={os.getpid()})"
        )
