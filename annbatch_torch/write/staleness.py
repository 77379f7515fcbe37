"""Whether a collection on disk is current for given inputs and writer settings.

Used by :meth:`AnnBatchDataModule.prepare_data <annbatch_torch.AnnBatchDataModule>` to write
the collection only when it is missing or stale; needs no Lightning. Compares the
manifest's recorded inputs (resolved path, size, mtime, as :mod:`annbatch_torch.store.inputs`
records them) and the collection settings passed explicitly. An input whose mtime changed but
whose size and content fingerprint (:mod:`annbatch_torch.store.inputs.fingerprint`) did not is
unchanged: ``touch`` or a ``cp`` without ``-p`` does not rewrite the collection.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import CollectionError
from ..store.inputs.fingerprint import fingerprint
from ..store.inputs.open import disk_usage
from ..store.manifest import RAW_X, Manifest, read_manifest

__all__ = ["store_is_current", "store_staleness", "RECORDED_SETTINGS", "FIELD_SETTINGS"]

#: collection settings recorded in the manifest and compared by :func:`store_staleness`
RECORDED_SETTINGS = ("seed", "shuffle", "var_join", "var_names")
#: writer arguments naming fields; a store lacking a field named there is stale (and
#: ``raw=True``: one lacking raw/X)
FIELD_SETTINGS = {"layers": "layers/", "obsm": "obsm/", "obs_columns": "obs/"}


def _input_signature(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What the manifest records of an input: resolved path, size and mtime (the same
    function the writer uses, so the two always agree)."""
    p = Path(path).expanduser().resolve()
    size, mtime = disk_usage(p)
    return {"path": str(p), "size": size, "mtime": mtime}


def store_staleness(
    store_path: str | os.PathLike[str],
    adata_paths: Sequence[str | os.PathLike[str]],
    settings: Mapping[str, Any] | None = None,
) -> str | None:
    """Why ``store_path`` must be (re)written from ``adata_paths``, or ``None`` if current.

    Parameters
    ----------
    store_path
        The collection folder.
    adata_paths
        The inputs it should have been written from, in order.
    settings
        Writer settings to compare with the manifest's record (``seed``, ``shuffle``,
        ``var_join``, ``var_names``: the reference gene list, which makes ``var_join``
        moot; ``group_by``, compared when given, ``None`` included), and field lists
        (``layers``, ``obsm``, ``obs_columns``; ``raw=True``) whose
        fields the store must hold; keys missing or ``None`` here are not compared.

    Returns
    -------
    str or None
        A human-readable reason (missing store, unfinished write, changed input or setting),
        or ``None`` when the store is a finished collection of exactly these inputs,
        unchanged since (same resolved paths and sizes, and the same modification times or,
        where those differ, the same content fingerprint).
    """
    from .publish import refuse_url

    refuse_url(store_path)
    try:
        manifest = read_manifest(store_path)
    except CollectionError as e:
        return str(e)
    return _manifest_staleness(manifest, adata_paths, settings or {})


def _manifest_staleness(
    manifest: Manifest, adata_paths: Sequence[str | os.PathLike[str]], settings: Mapping[str, Any]
) -> str | None:
    recorded = manifest.inputs
    if len(recorded) != len(adata_paths):
        return f"it was written from {len(recorded)} inputs, now there are {len(adata_paths)}"
    for rec, path in zip(recorded, adata_paths):
        if not Path(path).exists():
            return f"input {path} does not exist"
        now = _input_signature(path)
        if rec.get("path") != now["path"]:
            return f"input {now['path']} replaces {rec.get('path')}"
        if rec.get("size") != now["size"]:
            return f"input {now['path']} changed size ({rec.get('size')} -> {now['size']} bytes)"
        if (abs(float(rec.get("mtime") or 0.0) - now["mtime"]) > 1e-3
                and rec.get("fingerprint") != fingerprint(now["path"])):
            # a touched input with the same content (same fingerprint) is unchanged
            return f"input {now['path']} was modified after the store was written"
    recorded_settings = {"seed": manifest.seed, "shuffle": manifest.shuffle,
                         "var_join": manifest.var_join}
    if settings.get("var_names") is not None:
        wanted = [str(v) for v in settings["var_names"]]
        if manifest.var_join != "reference" or manifest.var_names != wanted:
            how = ("another reference gene list" if manifest.var_join == "reference"
                   else f"var_join={manifest.var_join!r}")
            return (f"it was written with {how} ({manifest.n_vars} genes), now var_names= "
                    f"({len(wanted)} genes)")
        settings = {k: v for k, v in settings.items() if k != "var_join"}  # moot then
    for key in ("seed", "shuffle", "var_join"):
        if settings.get(key) is not None and recorded_settings[key] != settings[key]:
            return f"it was written with {key}={recorded_settings[key]!r}, now {settings[key]!r}"
    if "group_by" in settings:  # asked for (None: rows in shuffled order): as written?
        want = settings["group_by"]
        want = want.removeprefix("obs/") if isinstance(want, str) else want
        have = manifest.grouped_by()
        if want != have:
            return f"it was written with group_by={have!r}, now {want!r}"
    if settings.get("raw") is True and RAW_X not in manifest.fields:
        return "it lacks raw/X, asked for by raw=True"
    for key, prefix in FIELD_SETTINGS.items():
        missing = [f"{prefix}{n}" for n in settings.get(key) or () if
                   f"{prefix}{n}" not in manifest.fields]
        if missing:
            return f"it lacks {missing}, asked for by {key}={list(settings[key])!r}"
    return None


def appended_inputs(
    store_path: str | os.PathLike[str],
    adata_paths: Sequence[str | os.PathLike[str]],
    settings: Mapping[str, Any] | None = None,
) -> list[str | os.PathLike[str]] | None:
    """The inputs to append when ``store_path`` is current for the first of ``adata_paths``
    and only lacks the rest (the input list only grew), else ``None``."""
    try:
        manifest = read_manifest(store_path)
    except CollectionError:
        return None
    n = len(manifest.inputs)
    if not 0 < n < len(adata_paths):
        return None
    if _manifest_staleness(manifest, adata_paths[:n], settings or {}) is not None:
        return None
    return list(adata_paths[n:])


def store_is_current(
    store_path: str | os.PathLike[str],
    adata_paths: Sequence[str | os.PathLike[str]],
    settings: Mapping[str, Any] | None = None,
) -> bool:
    """Whether ``store_path`` is a finished collection written from exactly these inputs,
    unchanged since (see :func:`store_staleness`)."""
    return store_staleness(store_path, adata_paths, settings) is None
