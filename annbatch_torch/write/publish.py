"""A collection placed atomically: temporaries, fsync, the swap into place, the writers' lock.

A write builds its collection in a temporary folder beside the output
(:func:`sibling_path`), syncs it to disk (:func:`start_writeback` as its shards are done,
then :func:`sync_tree`, :func:`sync_dir`) and swaps it
into place (:func:`swap_into_place`): the old collection is removed only after the new one is
complete. Temporaries of writes that died are removed at the next write
(:func:`remove_stale_temporaries`); writers of one collection take its lock
(:func:`lock_path`). :func:`check_output` refuses outputs that overlap inputs or are not
collections; :func:`refuse_url` the paths of this machine that look like URLs.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import re
import secrets
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..store.manifest import (
    FORMAT,
    MANIFEST_NAME,
    looks_like_collection,
)
from ..store.remote.location import check_url, is_url

__all__ = [
    "check_output", "lock_path", "refuse_url", "remove_stale_temporaries", "sibling_path",
    "start_writeback", "swap_into_place", "sync_dir", "sync_tree", "writer_lock",
]

logger = logging.getLogger(__name__)


def check_output(out: Path, overwrite: bool, sources_paths: list[Path]) -> None:
    real = out.resolve()  # through symbolic links, as the inputs' paths are
    for p in sources_paths:
        if p == real or real in p.parents or p in real.parents:
            raise InputError(f"{out}: the output overlaps the input {p}; choose another "
                             "output_path.")
    blocker = next((q for q in out.parents if q.exists() and not q.is_dir()), None)
    if blocker is not None:
        raise InputError(f"{out}: {blocker} is a file, so no folder can be made inside it; "
                         "choose another output_path.")
    if not (out.exists() or out.is_symlink()):
        return
    if not overwrite:
        raise InputError(
            f"{out}: the output already exists. Pass overwrite=True to replace it (the old "
            "store is removed only after the new one is complete), or choose another "
            "output_path."
        )
    if out.is_dir() and not looks_like_collection(out) and any(out.iterdir()):
        raise InputError(
            f"{out}: exists and is not an annbatch_torch collection (no {MANIFEST_NAME} "
            f"with format {FORMAT!r}); "
            "refusing to delete it with overwrite=True. Remove it yourself or choose another "
            "output_path."
        )
    if not out.is_dir():
        raise InputError(f"{out}: exists and is a file, not a collection; refusing to delete "
                         "it with overwrite=True. Remove it or choose another output_path.")


_HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def sibling_path(out: Path, kind: str) -> Path:
    """``<out>.<kind>-<host>-<pid>-<random>``: a temporary folder beside ``out``."""
    return out.with_name(f"{out.name}.{kind}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temporaries(out: Path) -> None:
    """Delete temporary folders that killed writes to ``out`` left behind.

    Only those made on this host by a process that is gone: a write still running, here or
    on another node sharing the file system, is never touched (those are logged).
    """
    if not out.parent.is_dir():
        return
    for p in sorted(out.parent.glob(f"{glob.escape(out.name)}.*-*-*-*")):
        kind, _, rest = p.name[len(out.name) + 1 :].partition("-")
        parts = rest.rsplit("-", 2)
        if kind not in ("tmp", "old") or len(parts) != 3 or not parts[1].isdigit():
            continue
        host, pid = parts[0], int(parts[1])
        if kind == "old" and not (out / MANIFEST_NAME).is_file():
            # killed between the two renames of an overwrite: this is the only copy of the
            # previous collection; keep it for the user to rename back
            logger.warning("%s holds the previous collection of %s, which is missing (an "
                           "overwrite was interrupted); not removed: rename it back to keep it.",
                           p, out)
            continue
        if host == _HOST and pid != os.getpid() and not _alive(pid):
            logger.info("Removing %s, left by an interrupted write (process %d is gone).", p,
                        pid)
            shutil.rmtree(p, ignore_errors=True)
        else:
            logger.warning("%s belongs to a write that may still run (host %s, process %d); "
                           "not removed.", p, host, pid)


def sync_dir(path: Path) -> None:
    """``fsync`` a directory: the renames and new entries in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems cannot sync a directory; data is synced anyway
        logger.debug("fsync of directory %s: %s", path, e)
    finally:
        os.close(fd)


def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` (Linux), ``None`` elsewhere."""
    if not sys.platform.startswith("linux"):
        return None  # (ctypes.CDLL(None) is a TypeError on Windows)
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except Exception:  # a libc without it
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writing dirty pages out; do not wait


def start_writeback(root: Path) -> None:
    """Start writing every file below ``root`` to the disk without waiting for it (Linux'
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; elsewhere nothing): a writer calls it on
    each finished shard, so that the :func:`sync_tree` at its end finds the data on the
    disk already instead of waiting for all of it at once."""
    if _SYNC_FILE_RANGE is None:
        return
    for here, _, names in os.walk(root):
        for name in names:
            try:
                fd = os.open(os.path.join(here, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # failure: sync_tree's job
            finally:
                os.close(fd)


def sync_tree(root: Path) -> None:
    """``fsync`` every file below ``root``, then every directory (deepest first): written
    data is on the disk, not only in the page cache, before anything points to it."""
    dirs = []
    for here, _, names in os.walk(root):
        dirs.append(Path(here))
        for name in names:
            fd = os.open(os.path.join(here, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in reversed(dirs):
        sync_dir(d)


def swap_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename ``tmp`` to ``out``; an old ``out`` is moved aside first, deleted last."""
    if not (out.exists() or out.is_symlink()):
        os.replace(tmp, out)
        return
    check_output(out, overwrite, [])  # it may have appeared while we were writing
    old = sibling_path(out, "old")
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    if old.is_symlink():  # `out` was a link: drop the link, never what it pointed to
        logger.warning("%s was a symbolic link to %s; the new collection replaces the link, "
                       "the old collection there is left in place.", out, os.readlink(old))
        old.unlink()
        return
    shutil.rmtree(old, ignore_errors=True)


def refuse_url(store_path: Any) -> None:
    """An :class:`~annbatch_torch.InputError` for a URL: preparing (write-unless-current,
    serialised by a lock file beside the store) needs a local folder."""

    if is_url(store_path):
        check_url(store_path)  # a mangled URL (s3:/bucket) is named as the typo it is
        raise InputError(
            f"{store_path}: prepare_collection keeps a collection current in a local (or "
            "shared) folder, not on an object store. Write it there once with "
            f"create_anndata_collection(inputs, {str(store_path)!r}) (or append_to_collection"
            "), then read it by its URL.")


def lock_path(store_path: str | os.PathLike[str]) -> Path:
    """The lock file beside ``store_path`` that serialises writers (``<store>.lock``)."""
    refuse_url(store_path)
    p = Path(store_path)
    return p.with_name(p.name + ".lock")


def writer_lock(store_path: str | os.PathLike[str]) -> Any:
    """The ``filelock.FileLock`` of :func:`lock_path`: one instance per path in a process,
    taken again by the thread that holds it (``prepare_collection`` holds it while it
    writes through ``create_anndata_collection``, which takes it to put the collection in
    place); another process, or another thread, waits."""
    from filelock import FileLock

    return FileLock(str(lock_path(store_path)), is_singleton=True)
