"""Write a collection once, safely, from any number of processes.

:func:`prepare_collection` is what :meth:`AnnBatchDataModule.prepare_data
<annbatch_torch.AnnBatchDataModule.prepare_data>` runs, usable without Lightning (a plain
``torchrun`` script calls it on every rank, or on local rank 0 before a barrier). The
collection is written when it is missing or stale (see :mod:`annbatch_torch.write.staleness`);
a file lock beside the store (``<store>.lock``) serialises processes that race: the first
writes, the others wait and then find the store current. A folder that exists but is not
a collection is never overwritten.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import CollectionError, InputError
from ..store.manifest import FORMAT, MANIFEST_NAME, looks_like_collection, read_manifest
from .publish import lock_path, refuse_url, writer_lock
from .staleness import FIELD_SETTINGS, RECORDED_SETTINGS, appended_inputs, store_staleness

__all__ = ["prepare_collection", "explicit_settings", "write_if_stale"]

logger = logging.getLogger(__name__)


def explicit_settings(collection_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The writer arguments in ``collection_kwargs`` that a current store must match
    (``seed``, ``shuffle``, ``var_join``, ``var_names``, ``group_by``, and the ``layers`` /
    ``obsm`` / ``obs_columns`` it must hold); others (``progress``, ``max_memory``...) do
    not make a store stale."""
    return {k: collection_kwargs[k] for k in (*RECORDED_SETTINGS, *FIELD_SETTINGS, "raw",
                                              "group_by")
            if k in collection_kwargs}


def _fields_of(store: Path) -> set[str]:
    """The fields of the collection at ``store`` (none where there is no readable one)."""
    try:
        return set(read_manifest(store).fields)
    except CollectionError:
        return set()


def _check_overwritable(p: Path) -> None:
    if p.exists() and not looks_like_collection(p):
        if p.is_dir() and not any(p.iterdir()):
            return
        raise CollectionError(
            f"{p} exists but is not an annbatch_torch collection (no {MANIFEST_NAME} with "
            f"format {FORMAT!r}); "
            "refusing to overwrite it. Remove it or choose another store_path."
        )


def write_if_stale(
    adata_paths: Sequence[str | os.PathLike[str]],
    store_path: str | os.PathLike[str],
    settings: Mapping[str, Any],
    writer_kwargs: Mapping[str, Any],
) -> bool:
    """Write ``store_path`` with ``writer_kwargs`` unless it is current for ``adata_paths``
    and ``settings``; returns whether it wrote. See :func:`prepare_collection`."""
    refuse_url(store_path)
    store = Path(store_path)
    store.parent.mkdir(parents=True, exist_ok=True)
    if store_staleness(store, adata_paths, settings) is None:  # no lock to read a manifest
        logger.info("Collection %s is current; not rewriting it.", store)
        return False
    from filelock import Timeout

    lock = writer_lock(store)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("Another process holds %s; waiting for it to finish writing.",
                    lock_path(store))
        t0 = time.monotonic()
        lock.acquire()
        logger.info("Got %s after %.1f s.", lock_path(store), time.monotonic() - t0)
    try:
        reason = store_staleness(store, adata_paths, settings)  # written meanwhile?
        if reason is None:
            logger.info("Collection %s is current; not rewriting it.", store)
            return False
        _check_overwritable(store)
        new = appended_inputs(store, adata_paths, settings)
        if new is not None:  # the input list only grew: add the new ones, rewrite nothing
            from .append import append_locked
            from .budget import parse_memory

            logger.info("Appending %d new input(s) to collection %s (a validation split "
                        "drawn from its chunks, as AnnBatchDataModule's val_fraction, is drawn "
                        "again over the grown collection).", len(new), store)
            mem = writer_kwargs.get("max_memory")
            try:
                append_locked(store.expanduser().absolute(), new,
                              seed=int(writer_kwargs.get("seed") or 0),
                              budget=None if mem is None else parse_memory(mem),
                              progress=bool(writer_kwargs.get("progress", True)),
                              scheduler=writer_kwargs.get("scheduler"),
                              n_workers=writer_kwargs.get("n_workers"),
                              value_check=writer_kwargs.get("value_check"))
                return True
            except InputError as e:  # refused before anything was published: rewrite
                logger.warning("Cannot append to %s (%s); rewriting it from all inputs.",
                               store, e)
        from .writer import create_anndata_collection

        logger.info("Writing collection %s from %d inputs (%s).", store, len(adata_paths),
                    reason)
        before = _fields_of(store)
        coll = create_anndata_collection(adata_paths, store,
                                         **{**writer_kwargs, "overwrite": True})
        lost = sorted(before - set(coll.fields))
        if lost:
            logger.warning(
                "Collection %s was rewritten from all %d inputs without fields it held "
                "before: %s (not every input holds them). Selectors naming them now fail; "
                "ask for them (layers=[...], obsm=[...], obs_columns=[...]) to have an input "
                "lacking them refused instead, or add them to that input.", store,
                len(adata_paths), lost)
        return True
    finally:
        lock.release()


def prepare_collection(
    adata_paths: Sequence[str | os.PathLike[str]],
    store_path: str | os.PathLike[str],
    **collection_kwargs: Any,
) -> bool:
    """Write the collection at ``store_path`` unless it is current; safe to call from
    several processes at once.

    Parameters
    ----------
    adata_paths
        ``.h5ad`` / AnnData-zarr inputs.
    store_path
        The collection folder.
    **collection_kwargs
        Arguments of :func:`~annbatch_torch.create_anndata_collection`. Those that shape
        the store (``seed``, ``shuffle``, ``var_join``, ``var_names``, ``group_by``,
        ``layers``, ``obsm``, ``obs_columns``) are compared with the existing store's
        manifest when given: a store written with another explicit ``seed`` is stale, one
        written with any seed is current when ``seed`` is not given (``group_by=None``
        given: a grouped store is stale).

    Returns
    -------
    bool
        ``True`` if this call wrote the store, ``False`` if it was current.

    Raises
    ------
    CollectionError
        If ``store_path`` exists but is not a collection (it is never overwritten).

    Examples
    --------
    >>> import torch.distributed as dist  # doctest: +SKIP
    >>> prepare_collection(["a.h5ad", "b.h5ad"], "store/")  # every rank: one writes
    >>> ds = AnnBatchDataset("store/", rank=dist.get_rank(),
    ...                      world_size=dist.get_world_size())
    """
    if not adata_paths:
        raise ValueError("prepare_collection needs at least one input (adata_paths is empty).")
    if collection_kwargs.get("var_names") is not None and not isinstance(
            collection_kwargs["var_names"], str | bytes):
        # read once: the staleness check and the writer both use it (a generator would be
        # empty for the second)
        collection_kwargs["var_names"] = list(collection_kwargs["var_names"])
    return write_if_stale(adata_paths, store_path, explicit_settings(collection_kwargs),
                          collection_kwargs)
