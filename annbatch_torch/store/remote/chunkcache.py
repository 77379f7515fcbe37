"""A bounded local cache of remote chunks, shared by every process of a machine.

Each entry is one file holding the bytes of one chunk of a remote object (the inner chunk
of a zarr shard file, or a whole chunk object), named by a digest of the object's URL, its
ETag and the byte range: a changed remote object gets new names, so it is never served
stale, and its old entries age out. Entries are written to a temporary name and renamed
into place (readers never see half a chunk); a hit refreshes the entry's mtime, and
:meth:`ChunkCache.evict` deletes the least recently used entries beyond ``max_bytes``
under a ``filelock`` (one evictor at a time; writers and readers never wait for it).
Entries used in the last :data:`KEEP_RECENT_S` seconds are not evicted, so a chunk one
process just fetched or hit is still there when it reads it.

A cache directory that runs out of space (``ENOSPC``, ``EDQUOT``) is not an error: the
process warns once and keeps the chunks it fetches in memory-backed files under
``/dev/shm`` for as long as they are read (see :meth:`ChunkCache.put`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import secrets
import shutil
import tempfile
import time
import warnings
from pathlib import Path

__all__ = ["ChunkCache", "KEEP_RECENT_S", "cache_token"]

logger = logging.getLogger(__name__)

#: entries used this recently (seconds) are kept even beyond the size bound
KEEP_RECENT_S = 10.0
#: a process records its use of an entry (its mtime) at most this often: an entry it used
#: more recently is known to be there still (it is within KEEP_RECENT_S of its mtime)
TOUCH_EVERY_S = 2.0
_FULL = (errno.ENOSPC, errno.EDQUOT)


def cache_token(url: str, etag: str, start: int, stop: int) -> str:
    """The entry name of bytes ``[start, stop)`` of the object at ``url`` with ``etag``."""
    h = hashlib.sha256(f"{url}\0{etag}\0{start}\0{stop}".encode()).hexdigest()
    return h[:40]


class ChunkCache:
    """Chunk files under ``root``, at most about ``max_bytes`` in all.

    Parameters
    ----------
    root
        The cache directory (created; shared by every process that names it).
    max_bytes
        The bound: after this process added about a tenth of it, the least recently used
        entries beyond it are deleted.
    """

    def __init__(self, root: str | os.PathLike[str], max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = int(max_bytes)
        self._added = 0
        self._full = False  # the directory ran out of space: memory-backed files instead
        self._spill: Path | None = None
        self._touched: dict[str, tuple[float, Path]] = {}  # token: (when, file), this process

    def __getstate__(self) -> dict[str, object]:
        return {"root": self.root, "max_bytes": self.max_bytes}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["root"], state["max_bytes"])  # type: ignore[misc, arg-type]

    def path(self, token: str) -> Path:
        return self.root / token[:2] / token

    def get(self, token: str) -> Path | None:
        """The entry's file if cached (its use recorded), else ``None``."""
        now = time.monotonic()
        seen = self._touched.get(token)
        if seen is not None and now - seen[0] < min(TOUCH_EVERY_S, KEEP_RECENT_S / 2):
            return seen[1]
        for p in (self.path(token), *([self._spill / token] if self._spill else [])):
            try:
                os.utime(p)
            except FileNotFoundError:
                continue
            self._remember(token, p, now)
            return p
        self._touched.pop(token, None)
        return None

    def _remember(self, token: str, path: Path, now: float) -> None:
        if len(self._touched) > 1 << 16:  # bounded: forget all, re-touch as used
            self._touched.clear()
        self._touched[token] = (now, path)

    def put(self, token: str, data: memoryview | bytes) -> Path:
        """Store an entry (atomically) and return its file."""
        if not self._full:
            p = self.path(token)
            tmp = p.parent / f".{token}.{secrets.token_hex(4)}.tmp"
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, p)
                self._remember(token, p, time.monotonic())
            except OSError as e:
                _remove(tmp)
                if e.errno not in _FULL:
                    raise
                self._full = True
                warnings.warn(
                    f"{self.root}: the chunk cache ran out of disk space ({e.strerror}); "
                    "reading on without caching new chunks (each chunk fetched from now on "
                    "is held in a memory-backed file under /dev/shm only while it is read, "
                    "and fetched again when read again; free space or pass a smaller "
                    "cache_size / another cache_dir).", RuntimeWarning, stacklevel=2)
            else:
                self._added += len(data)
                if self._added > self.max_bytes // 10:
                    self.evict()
                return p
        return self._spill_put(token, data)

    def drop(self, path: Path) -> None:
        """Delete an entry (by its file) and forget this process's record of it."""
        self._touched.pop(path.name, None)
        _remove(path)

    def _spill_put(self, token: str, data: memoryview | bytes) -> Path:
        """An entry in this process's memory-backed folder (``/dev/shm``), kept only for a
        short while: the reads of the chunks just fetched."""
        if self._spill is None:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._spill = Path(tempfile.mkdtemp(prefix="annbatch-chunks-", dir=base))
            import atexit
            import multiprocessing.util

            spill, owner = self._spill, os.getpid()
            atexit.register(lambda: os.getpid() == owner and shutil.rmtree(spill, True))
            # DataLoader workers exit without atexit handlers; multiprocessing's run these
            multiprocessing.util.Finalize(None, shutil.rmtree, (spill, True), exitpriority=10)
        now = time.time()
        for old in self._spill.iterdir():  # what was read a while ago is gone
            with contextlib.suppress(FileNotFoundError):
                if now - old.stat().st_mtime > KEEP_RECENT_S:
                    old.unlink()
        p = self._spill / token
        with open(p, "wb") as f:
            f.write(data)
        return p

    def size(self) -> int:
        """Bytes of the entries now in the cache."""
        return sum(s for _, s, _ in self._entries())

    def _entries(self) -> list[tuple[Path, int, float]]:
        out = []
        if not self.root.is_dir():
            return out
        for sub in os.scandir(self.root):
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for e in os.scandir(sub.path):
                if e.name.startswith("."):
                    continue
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                out.append((Path(e.path), st.st_size, st.st_mtime))
        return out

    def evict(self) -> None:
        """Delete the least recently used entries until the cache holds ``max_bytes`` or
        less (entries used in the last :data:`KEEP_RECENT_S` seconds are kept)."""
        from filelock import FileLock, Timeout

        self._added = 0
        try:
            lock = FileLock(str(self.root / ".evict.lock"), timeout=0)
            with lock:
                entries = sorted(self._entries(), key=lambda e: e[2])
                total = sum(s for _, s, _ in entries)
                now = time.time()
                for path, size, mtime in entries:
                    if total <= self.max_bytes or now - mtime < KEEP_RECENT_S:
                        break
                    _remove(path)
                    total -= size
        except Timeout:
            return  # another process is evicting now
        logger.debug("%s: chunk cache at %d bytes after eviction", self.root, total)

    def close(self) -> None:
        if self._spill is not None:
            shutil.rmtree(self._spill, ignore_errors=True)
            self._spill = None


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
