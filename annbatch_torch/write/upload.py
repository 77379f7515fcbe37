"""Writing a collection to an object store: staged locally, uploaded, manifest last.

``create_anndata_collection(inputs, "s3://bucket/atlas")`` writes the collection as it
writes a local one, into a staging folder (``tempfile``'s: set ``TMPDIR`` to a disk with
room for one collection), then :func:`upload_collection` puts it on the store:

1. every file except the manifest goes under a fresh generation prefix
   (``g-<random>/shard_00000/...``), so no object an existing reader uses is touched;
2. ``manifest.json`` (its shard and gene-list paths pointing into that prefix) is written
   last, in one PUT: object stores make a single PUT atomic, so a reader sees the old
   collection or the new one, never a mix, and an interrupted upload leaves the old
   manifest (or none: a prefix without a manifest never opens as a collection);
3. with ``overwrite``, the objects of the previous generation are deleted after that.

A prefix that holds objects but no manifest is refused (it is not a collection this
writer made), as is an existing collection without ``overwrite``; with ``overwrite``, a
prefix holding only generation folders (an upload that stopped before its manifest) is
written over, those objects deleted after.
"""

from __future__ import annotations

import json
import logging
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import CollectionError, InputError
from ..store.manifest import MANIFEST_NAME
from ..store.remote.location import RemoteLocation

__all__ = ["check_remote_output", "upload_collection", "UPLOAD_THREADS"]

logger = logging.getLogger(__name__)

#: files uploaded at once (obstore splits large ones into concurrent multipart parts)
UPLOAD_THREADS = 8


def check_remote_output(loc: RemoteLocation, overwrite: bool) -> dict[str, tuple[int, str]]:
    """Refuse a prefix that is not ours to write; returns its objects now."""
    try:
        objects = loc.list()
    except FileNotFoundError:
        objects = {}
    if MANIFEST_NAME in objects and not overwrite:
        raise InputError(f"{loc.url} already holds a collection; pass overwrite=True to "
                         "replace it, or choose another prefix.")
    if objects and MANIFEST_NAME not in objects:
        if overwrite and all(k.startswith("g-") for k in objects):
            return objects  # an upload of ours that stopped before its manifest: replaced
        raise InputError(
            f"{loc.url} holds {len(objects)} objects but no {MANIFEST_NAME}: not a collection "
            "(or an interrupted upload); refusing to write over it. Choose an empty prefix, "
            "or delete those objects first.")
    return objects


def upload_collection(local: Path, loc: RemoteLocation, overwrite: bool,
                      progress: bool = True, *, append_to: str | None = None) -> None:
    """Upload the finished local collection ``local`` to ``loc`` (see the module).

    ``append_to``: ``local`` holds only the new shards of an append to the collection at
    ``loc``, whose manifest had this ETag; its other shards are on the store already (kept
    as listed, nothing deleted), and the upload is refused if that manifest changed."""
    if append_to is None:
        old = check_remote_output(loc, overwrite)  # again: the write took a while
    else:
        old = {}
        _check_unchanged(loc, append_to, "since it was opened for this append")
    gen = f"g-{secrets.token_hex(6)}"
    manifest = json.loads((local / MANIFEST_NAME).read_text())
    for s in manifest["shards"]:
        if (local / s["path"]).is_dir():  # uploaded now; others are on the store already
            s["path"] = f"{gen}/{s['path']}"
    for key in ("var_names_file", "raw_var_names_file"):
        if manifest.get(key):
            manifest[key] = f"{gen}/{manifest[key]}"
    files = {p: f"{gen}/{p.relative_to(local).as_posix()}" for p in sorted(local.rglob("*"))
             if p.is_file() and p != local / MANIFEST_NAME}  # local file: its key
    total = sum(p.stat().st_size for p in files)
    from tqdm.auto import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"upload to {loc.url}",
               disable=not progress)

    def one(p: Path) -> None:
        loc.put(files[p], p)
        bar.update(p.stat().st_size)

    try:
        with ThreadPoolExecutor(UPLOAD_THREADS) as ex:
            list(ex.map(one, files))
    except BaseException:
        bar.close()
        _delete_quietly(loc, list(files.values()))
        raise
    bar.close()
    if append_to is not None:  # again, just before the manifest replaces it
        try:
            _check_unchanged(loc, append_to, "during this append")
        except CollectionError:
            _delete_quietly(loc, list(files.values()))
            raise
    loc.put(MANIFEST_NAME, json.dumps(manifest, indent=1).encode())
    stale = [k for k in old if k != MANIFEST_NAME]
    if stale:
        loc.delete(stale)
    logger.info("%s: uploaded %d files (%d bytes) as generation %s%s", loc.url, len(files),
                total, gen, f"; deleted {len(stale)} objects of the old one" if stale else "")


def _check_unchanged(loc: RemoteLocation, etag: str, when: str) -> None:
    """Refuse an append whose collection's manifest is no longer the one it extends."""
    now = loc.head(MANIFEST_NAME)
    if now is None or now[1] != etag:
        raise CollectionError(f"{loc.url}: the collection changed on the store {when} "
                              "(another writer?); nothing was added. Append again.")


def _delete_quietly(loc: RemoteLocation, keys: list[str]) -> None:
    """Remove what a failed upload left (best effort: the store may be the failure)."""
    try:
        loc.delete(keys)
    except Exception as e:
        logger.warning("%s: could not delete the objects of a failed upload (%s); they are "
                       "not part of any collection and can be deleted", loc.url, e)
