"""A remote collection read through a local mirror of its metadata and a chunk cache.

Opening ``s3://bucket/atlas`` (:meth:`Mirror.sync`) lists the prefix once and copies
every object except the chunk objects of raw arrays into a local folder with the same
layout: the manifest, ``var_names.json``, the ``zarr.json`` of every node and the chunks
of arrays that are not raw (compressed arrays, strings) - kilobytes to megabytes. The
local code then opens the collection as it opens a local one, and the raw arrays (X,
layers, codes: nearly all the bytes) get a :class:`RemoteChunks` that fetches the chunks a
read needs as byte ranges of their objects, all of one read concurrently
(:meth:`RemoteChunks.prefetch`), into the :class:`~.chunkcache.ChunkCache`, from whose
files the reader's ``preadv`` path reads and checks them (CRC-32C) as it does local chunk
files.

The mirror folder is named by the URL and the manifest's ETag: a collection rewritten on
the store gets a new folder (readers of the old one keep theirs), and a process that
opens a collection whose mirror is complete (``.mirror.json`` written last) lists
nothing. DataLoader workers receive the folder's name, never a client or credentials in
a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import LocalStore

from ...errors import CollectionError, InputError, check_int
from ..manifest import MANIFEST_NAME, ShardInfo
from ..metadata import NAME_HASHES
from .chunkcache import ChunkCache, cache_token
from .location import ObjectInfo, RemoteLocation

__all__ = ["Mirror", "MirrorStore", "RemoteChunks", "default_cache_size", "FETCH_THREADS",
           "mirror_store"]

logger = logging.getLogger(__name__)

#: objects fetched at once (the byte ranges of each concurrently too)
FETCH_THREADS = 16
_STATE = ".mirror.json"


def default_cache_size(root: Path) -> int:
    """A quarter of the free space of ``root``'s file system."""
    root.mkdir(parents=True, exist_ok=True)
    return max(shutil.disk_usage(root).free // 4, 64 << 20)


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _safe_key(root: Path, key: str, where: str) -> Path:
    """The mirror file of object ``key``; a key that would leave ``root`` (``..``, empty
    segments, absolute) is refused: a listing is input from the store, not trusted."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") or "\\" in p
                                              for p in parts):
        raise CollectionError(f"{where}/{key}: an object key the mirror refuses (empty, "
                              "'.' or '..' segments); the prefix holds objects that are not "
                              "a collection's. Remove them or read another prefix.")
    path = root.joinpath(*parts)
    if root.resolve() not in path.resolve().parents:
        raise CollectionError(f"{where}/{key}: the object key leads outside the mirror; "
                              "refusing it.")
    return path


def _identity(info: ObjectInfo) -> tuple[int, int, int]:
    """A stand-in for a local file's ``(inode, size, mtime)``: ``(0, size, hash of the
    ETag)``."""
    return 0, info[0], int(_digest(info[1]), 16)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # (a full disk: nothing half-written is left)
            tmp.unlink(missing_ok=True)
        raise


#: errors of the local file system that the user's ``cache_dir`` causes (no room, no write)
_LOCAL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES,
                           errno.EPERM, errno.ENOTDIR})


@contextlib.contextmanager
def _cache_dir_writes(url: str, base: Path) -> Iterator[None]:
    """Writes into the mirror's folder ``base``: one the file system refuses (no room, read
    only, not a folder) is a :class:`CollectionError` naming ``url``, the folder and the
    fix."""
    try:
        yield
    except OSError as e:
        if e.errno not in _LOCAL_ERRNOS:
            raise
        where = f": {e.filename}" if e.filename else ""
        raise CollectionError(
            f"{url}: cannot mirror the collection's metadata into cache_dir {base} "
            f"({e.strerror}{where}). Pass cache_dir= a writable folder with free space (the "
            "metadata objects are copied there at open, the chunks cached beside them), or "
            "make room there.") from e


class Mirror:
    """The local side of one remote collection: metadata folder, object table, cache.

    Parameters
    ----------
    location
        The collection's URL and options.
    cache_dir
        The folder for the mirror and the chunk cache (shared by processes and jobs);
        ``None``: a temporary folder of this process and its DataLoader workers, removed
        at exit.
    cache_size
        Bytes the chunk cache may hold (``None``: a quarter of the free disk space).
    """

    def __init__(self, location: RemoteLocation, cache_dir: str | os.PathLike[str] | None,
                 cache_size: int | None) -> None:
        self.location = location
        if cache_size is not None:
            cache_size = check_int(
                "cache_size", cache_size, 1, error=InputError,
                note=f" (bytes; or None for a quarter of the free disk space) for {location.url}")
        if cache_dir is None:
            base = Path(tempfile.mkdtemp(prefix="annbatch-remote-"))
            import atexit

            owner = os.getpid()
            atexit.register(lambda: os.getpid() == owner and shutil.rmtree(base, True))
        else:
            base = Path(cache_dir).expanduser()
        self.base = base
        with _cache_dir_writes(location.url, base):
            self.cache_size = (cache_size if cache_size is not None
                               else default_cache_size(base))
            self.cache = ChunkCache(base / "chunks", self.cache_size)
        self.root: Path = base  # set by sync
        self.manifest_etag = ""
        self.synced_identity: tuple[int, int, int] | None = None
        self._objects: dict[str, ObjectInfo] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_objects"] = None  # read again from the mirror's .mirror.json
        return state

    @property
    def objects(self) -> dict[str, ObjectInfo]:
        """``{key: (size, etag)}`` of the collection's objects when it was opened."""
        if self._objects is None:
            state = json.loads((self.root / _STATE).read_text())
            self._objects = {k: (int(v[0]), str(v[1])) for k, v in state["objects"].items()}
        return self._objects

    def manifest_identity(self) -> tuple[int, int, int] | None:
        """A stand-in for the local manifest's ``(inode, size, mtime)``: ``(0, size,
        hash(etag))`` of ``manifest.json`` on the store now, ``None`` when absent."""
        info = self.location.head(MANIFEST_NAME)
        return None if info is None else _identity(info)

    def current_shards(self) -> list[ShardInfo] | None:
        """The shard list of the manifest on the store now (``None`` if unreadable)."""
        try:
            obj = json.loads(self.location.get(MANIFEST_NAME))
            return [ShardInfo(str(s["path"]), int(s["n_obs"]), s.get("generation"),
                              dict(s.get("stored", {})), s.get("grouped_by"))
                    for s in obj["shards"]]
        except (ValueError, KeyError, TypeError):
            return None

    def sync(self) -> Path:
        """List the collection, mirror its metadata (once per manifest ETag and listing)
        and return the folder."""
        loc = self.location
        info = loc.head(MANIFEST_NAME)
        if info is None:
            try:
                some = loc.list()
            except FileNotFoundError:
                some = {}
            what = (f"holds {len(some)} objects but no {MANIFEST_NAME}: not a finished "
                    "collection (an interrupted write, or not a collection at all)"
                    if some else "holds no objects")
            raise CollectionError(
                f"{loc.where()}: {what}. Write one with create_anndata_collection(inputs, "
                f"{loc.url!r}), or check the URL.")
        self.manifest_etag = info[1]
        #: ``manifest_identity()`` of the manifest this mirror holds
        self.synced_identity = _identity(info)
        # listed at every open: an object replaced under an unchanged manifest gets a new
        # mirror (and new cache entries: their names carry the ETags listed here)
        objects = loc.list()
        listing = _digest(*(f"{k}\0{v[0]}\0{v[1]}" for k, v in sorted(objects.items())))
        self.root = self.base / "meta" / _digest(loc.url) / _digest(info[1], listing)
        if (self.root / _STATE).is_file():
            return self.root
        from filelock import FileLock

        with _cache_dir_writes(loc.url, self.base):
            self.root.mkdir(parents=True, exist_ok=True)
            with FileLock(str(self.root.parent / f"{self.root.name}.lock")):
                if not (self.root / _STATE).is_file():
                    self._copy_metadata(objects)
        self._objects = None
        return self.root

    def _copy_metadata(self, objects: dict[str, ObjectInfo]) -> None:
        from ..rawzarr import open_raw

        loc = self.location
        if MANIFEST_NAME not in objects:
            raise CollectionError(f"{loc.where(MANIFEST_NAME)} vanished while the collection "
                                  "was opened (rewritten?); open it again.")
        nodes = [k for k in objects if k == "zarr.json" or k.endswith("/zarr.json")
                 or k.endswith((".zarray", ".zgroup", ".zattrs", ".zmetadata"))]
        self._fetch_whole(nodes)
        raw_dirs = set()
        for k in nodes:
            if k.endswith("/zarr.json"):
                folder = k[: -len("/zarr.json")]
                if open_raw(self.root / folder) is not None:
                    raw_dirs.add(folder)

        def ranged(key: str) -> bool:  # a chunk object of a raw array (fetched as ranges)
            folder, _, rest = key.partition("/c/")  # or of a compressed matrix (whole, lazily)
            return bool(rest) and (folder in raw_dirs or _lazy_array(folder))

        rest = [k for k in objects if k not in nodes and not ranged(k)]
        whole = sum(objects[k][0] for k in rest)
        if whole > self.cache_size:  # not read by range: copied whole
            raise CollectionError(
                f"{loc.url}: {whole:,} bytes of this collection are not chunks read by range "
                "(obs, var and names; and the chunks of compressed layouts that are not, "
                "one file per chunk or other codecs) and would be copied whole into the "
                f"mirror at open, more than cache_size={self.cache_size:,}. Raise cache_size; "
                "raw chunks and lz4 / zstd chunks in zarr shard files (the writer's default "
                "layout) are read by range.")
        self._fetch_whole(rest)
        # the manifest again: it must be the one this mirror is named by
        if loc.head(MANIFEST_NAME) != (objects[MANIFEST_NAME][0], self.manifest_etag):
            raise CollectionError(f"{loc.where()}: the collection was rewritten while it was "
                                  "opened; open it again.")
        state = {"url": loc.url, "manifest_etag": self.manifest_etag,
                 "objects": {k: list(v) for k, v in objects.items()}}
        _write_atomic(self.root / _STATE, json.dumps(state).encode())
        logger.info("%s: mirrored %d metadata objects into %s (%d chunk objects read by "
                    "range)", loc.url, len(nodes) + len(rest), self.root,
                    len(objects) - len(nodes) - len(rest))

    def _fetch_whole(self, keys: list[str]) -> None:
        def one(key: str) -> None:
            _write_atomic(_safe_key(self.root, key, self.location.url), self.location.get(key))

        if not keys:
            return
        try:
            with ThreadPoolExecutor(FETCH_THREADS) as ex:
                list(ex.map(one, keys))
        except FileNotFoundError as e:
            raise CollectionError(f"{e}: deleted while the collection was opened (rewritten?); "
                                  "open it again.") from None

    def chunks(self) -> RemoteChunks:
        """A chunk source for an array of this mirror (one per array: its memos)."""
        return RemoteChunks(self)

    def key_of(self, path: str | os.PathLike[str]) -> str:
        """The object key of a file of the mirror."""
        rel = os.path.relpath(path, self.root)
        if rel.startswith(".."):
            raise ValueError(f"{path} is not inside the mirror {self.root}")
        return rel.replace(os.sep, "/")


_POOL: list[Any] = [None, -1]  # this process's fetch threads and its pid
_POOL_LOCK = threading.Lock()


def _fetch_pool() -> ThreadPoolExecutor:
    """The fetch threads of this process (one pool for every array; new after a fork)."""
    with _POOL_LOCK:
        if _POOL[0] is None or _POOL[1] != os.getpid():
            _POOL[0] = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="abt-fetch")
            _POOL[1] = os.getpid()
        return _POOL[0]


class RemoteChunks:
    """Where a raw array's chunks come from when its objects are on a store: byte ranges
    fetched (concurrently, for all chunks of one read) into the chunk cache."""

    def __init__(self, mirror: Mirror) -> None:
        self.mirror = mirror
        self._keys: dict[str, str] = {}  # file of the mirror: object key (hot path: memo)
        self._tokens: dict[tuple[str, int, int], str] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"mirror": self.mirror}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["mirror"])  # type: ignore[misc]

    def _info(self, path: str) -> tuple[str, ObjectInfo | None]:
        key = self._keys.get(path)
        if key is None:
            key = self._keys[path] = self.mirror.key_of(path)
        return key, self.mirror.objects.get(key)

    def url_of(self, path: str) -> str:
        """The URL of the object a file of the mirror stands for."""
        return self.mirror.location.where(self._info(path)[0])

    def drop(self, local: str) -> None:
        """Forget a cache entry (a damaged copy): the next read fetches it again."""
        self.mirror.cache.drop(Path(local))

    def present(self, path: str) -> bool:
        return self._info(path)[1] is not None

    def identity(self, path: str) -> tuple[int, int, int] | None:
        """``(0, size, hash of the ETag)`` of the object, ``None`` when absent."""
        info = self._info(path)[1]
        return None if info is None else _identity(info)

    def size(self, path: str) -> int | None:
        info = self._info(path)[1]
        return None if info is None else info[0]

    def _token(self, key: str, info: ObjectInfo, start: int, stop: int) -> str:
        token = self._tokens.get((key, start, stop))
        if token is None:
            if len(self._tokens) > 1 << 16:
                self._tokens.clear()
            token = cache_token(self.mirror.location.where(key), info[1], start, stop)
            self._tokens[(key, start, stop)] = token
        return token

    def local(self, path: str, start: int, stop: int) -> str | None:
        """The cache file holding bytes ``[start, stop)`` of the object (fetched now if not
        cached); ``None`` when the object does not exist."""
        key, info = self._info(path)
        if info is None:
            return None
        stop = min(stop, info[0])
        token = self._token(key, info, start, stop)
        hit = self.mirror.cache.get(token)
        if hit is not None:
            return str(hit)
        self.fetch([(path, start, stop)])
        hit = self.mirror.cache.get(token)
        if hit is None:  # evicted at once: the cache is far too small for one read
            raise CollectionError(
                f"{self.mirror.cache.root}: cache_size={self.mirror.cache_size} is too small to "
                "hold the chunks of one read; raise it.")
        return str(hit)

    def fetch(self, wanted: list[tuple[str, int, int]]) -> None:
        """Fetch the byte ranges ``(path, start, stop)`` not cached yet: one request batch
        per object (touching ranges coalesced, requests concurrent), :data:`FETCH_THREADS`
        objects at once."""
        by_key: dict[str, list[tuple[int, int, str]]] = {}
        for path, start, stop in wanted:
            key, info = self._info(path)
            if info is None:
                continue
            stop = min(stop, info[0])
            token = self._token(key, info, start, stop)
            if self.mirror.cache.get(token) is None:
                by_key.setdefault(key, []).append((start, stop, token))
        if not by_key:
            return
        loc = self.mirror.location

        def one(item: tuple[str, list[tuple[int, int, str]]]) -> None:
            key, ranges = item
            ranges = sorted(set(ranges))
            try:
                bufs = loc.get_ranges(key, [r[0] for r in ranges], [r[1] for r in ranges],
                                      etag=self.mirror.objects[key][1])
            except FileNotFoundError:
                raise CollectionError(
                    f"{loc.where(key)}: the object was deleted since the collection was "
                    "opened (rewritten on the store?); open it again.") from None
            for (start, stop, token), buf in zip(ranges, bufs):
                view = memoryview(buf)
                if len(view) != stop - start:
                    from ..rawzarr import ChunkError

                    raise ChunkError(f"{loc.where(key)}: bytes [{start}, {stop}) arrived "
                                     f"as {len(view)} bytes (the object is truncated)")
                self.mirror.cache.put(token, view)

        items = list(by_key.items())
        if len(items) == 1:
            one(items[0])
            return
        list(_fetch_pool().map(one, items))


def _lazy_array(folder: str) -> bool:
    """Whether a (not raw) array of the mirror is a matrix field's (X, layers, obsm, raw's
    X: nearly all the bytes) or the shard's obs_name hashes (8 bytes a cell, read by
    appends only), whose chunk objects are fetched when read rather than at open. Other
    arrays (obs, var, names) are copied at open: anndata's own readers open them as local
    files."""
    parts = folder.split("/")
    for i, p in enumerate(parts):
        if p.endswith(".zarr"):  # the shard folder; the field follows
            rest = parts[i + 1:]
            return bool(rest) and (rest[0] in ("X", "layers", "obsm")
                                   or rest[:2] in (["raw", "X"], ["uns", NAME_HASHES]))
    return False


class MirrorStore(LocalStore):
    """The mirror folder as a read-only zarr store whose chunk objects left on the object
    store (compressed matrix arrays the raw reader does not take: one file per chunk, other
    codecs) are fetched whole into the chunk cache on first read, then read from there (zarr
    decodes them as it decodes local chunks)."""

    def __init__(self, mirror: Mirror) -> None:
        super().__init__(mirror.root, read_only=True)
        self.mirror = mirror
        self.chunks = mirror.chunks()

    def __getstate__(self) -> dict[str, Any]:
        return {"mirror": self.mirror}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["mirror"])  # type: ignore[misc]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MirrorStore) and other.root == self.root

    def __hash__(self) -> int:
        return hash(("MirrorStore", str(self.root)))

    def _remote(self, key: str) -> bool:
        return key in self.mirror.objects and not (self.root / key).exists()

    async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
        if not self._remote(key):
            return await super().get(key, prototype, byte_range)
        size = self.mirror.objects[key][0]
        if isinstance(byte_range, RangeByteRequest):
            a, b = byte_range.start, byte_range.end
        elif isinstance(byte_range, OffsetByteRequest):
            a, b = byte_range.offset, size
        elif isinstance(byte_range, SuffixByteRequest):
            a, b = max(0, size - byte_range.suffix), size
        else:
            a, b = 0, size
        data = await asyncio.to_thread(self._read, str(self.root / key), size, a, b)
        if data is None:
            return None
        return (prototype or default_buffer_prototype()).buffer.from_bytes(data)

    def _read(self, path: str, size: int, a: int, b: int) -> bytes | None:
        """Bytes ``[a, b)`` of the object's cached copy; a copy of the wrong size (or one
        gone) is dropped and fetched once more. (A copy that fails the codecs' checksums is
        reported by zarr, as a local chunk would be.)"""
        for _ in (0, 1):
            local = self.chunks.local(path, 0, size)
            if local is None:
                return None
            try:
                fd = os.open(local, os.O_RDONLY)
            except FileNotFoundError:
                self.chunks.drop(local)
                continue
            try:
                if os.fstat(fd).st_size == size:
                    return os.pread(fd, b - a, a)
            finally:
                os.close(fd)
            self.chunks.drop(local)
        raise CollectionError(f"{self.chunks.url_of(path)}: its cached copy keeps the wrong size "
                              "or vanishes; check the cache folder.")

    async def get_partial_values(self, prototype: Any, key_ranges: Any) -> list[Any]:
        return [await self.get(k, prototype, r) for k, r in key_ranges]

    async def exists(self, key: str) -> bool:
        return key in self.mirror.objects or await super().exists(key)

    def _under(self, prefix: str) -> Iterator[tuple[str, str]]:
        """``(key, rest)`` of the objects under the folder ``prefix`` (as LocalStore reads
        a prefix: not ``emb2``'s keys for ``emb``)."""
        base = prefix.rstrip("/") + "/" if prefix else ""
        for k in self.mirror.objects:
            if k.startswith(base):
                yield k, k[len(base):]

    async def list_prefix(self, prefix: str) -> Any:
        seen = set()
        async for k in super().list_prefix(prefix):
            seen.add(k)
            yield k
        for k, _ in self._under(prefix):
            if k not in seen:
                yield k

    async def list_dir(self, prefix: str) -> Any:
        seen = set()
        async for k in super().list_dir(prefix):
            seen.add(k)
            yield k
        for _, rest in self._under(prefix):
            child = rest.split("/", 1)[0]
            if child not in seen:
                seen.add(child)
                yield child


def mirror_store(mirror: Mirror) -> MirrorStore:
    """The zarr store of a mirror (see :class:`MirrorStore`)."""
    return MirrorStore(mirror)
