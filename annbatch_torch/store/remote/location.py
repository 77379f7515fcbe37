"""Object-store locations (S3, GCS, Azure, HTTP): URLs and one client per process.

A collection on an object store is named by a URL (``s3://bucket/prefix``,
``gs://...``, ``az://...``, ``https://...``); :func:`is_url` tells such a name from a local
path (a URL is never taken for a folder), and :class:`RemoteLocation` reads and writes the
objects under it through `fsspec <https://filesystem-spec.readthedocs.io/>`_ (``s3fs``,
``gcsfs``, ``adlfs``, its own HTTP client): the byte ranges of one read are coalesced where
they touch and fetched concurrently on fsspec's event loop.

Why fsspec and not obstore: obstore's Rust runtime does not survive ``fork`` (measured
here: the first request of a forked DataLoader worker hangs forever, and its maintainers
document it as not fork safe), and ``fork`` is the default start method of DataLoader
workers on Linux. fsspec resets its event loop in a forked child and keys its clients by
process.

``storage_options`` are the fsspec filesystem's (for S3, s3fs's: ``key``, ``secret``,
``endpoint_url``, ``anon``, ``client_kwargs``, ``config_kwargs``...; anything left out
is read from the environment, as botocore does). Timeouts and retries are bounded by
default (:data:`S3_DEFAULTS`), so a server that went away fails a read with an error
naming the URL instead of hanging.

The client is created lazily in the process that uses it and never pickled: a
:class:`RemoteLocation` pickles as its URL and options, so DataLoader workers (fork or
spawn) open their own.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ...errors import CollectionError, InputError, ReadError

__all__ = ["RemoteLocation", "SCHEMES", "is_url", "url_typo", "check_url", "ObjectInfo"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: URL schemes of the object stores read through fsspec (s3fs, gcsfs, adlfs); plain HTTP
#: servers are not among them: they cannot list a prefix or tag an object's version
SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
#: bounded timeouts and retries of S3 requests unless ``storage_options`` say otherwise
S3_DEFAULTS: dict[str, Any] = {
    "config_kwargs": {"connect_timeout": 5, "read_timeout": 60,
                      "retries": {"max_attempts": 3, "mode": "standard"}},
}
#: s3fs's own retries of a failed request, on top of botocore's (``storage_options
#: ["retries"]`` overrides)
S3_RETRIES = 1
#: ranges of one object closer than this are fetched in one request
COALESCE_GAP = 0
#: ... up to this many bytes per request (larger reads stay concurrent)
COALESCE_MAX = 16 << 20

#: ``(size, etag)`` of one object as listed
ObjectInfo = tuple[int, str]


#: a known scheme followed by one slash: ``s3:/bucket`` typed, or ``Path("s3://bucket")``
#: (pathlib folds the two slashes into one); never a local folder anyone means
_MANGLED = re.compile(
    r"^(" + "|".join((*SCHEMES, "http", "https", "file")) + r"):/+(?=[^/])", re.IGNORECASE)


def _as_text(path: Any) -> str | None:
    """``path`` as text when it is a ``str`` or an ``os.PathLike`` of ``str``."""
    if isinstance(path, str):
        return path
    if isinstance(path, os.PathLike):
        text = os.fspath(path)
        return text if isinstance(text, str) else None
    return None


def is_url(path: Any) -> bool:
    """Whether ``path`` (a ``str`` or an ``os.PathLike``) names a URL rather than a local
    path: ``scheme://...``, or a known scheme with its slashes mangled (``s3:/bucket``, as
    ``pathlib.Path("s3://bucket")`` makes it), which :func:`check_url` then refuses."""
    text = _as_text(path)
    return text is not None and (_URL.match(text) is not None
                                 or _MANGLED.match(text) is not None)


def url_typo(path: Any) -> str | None:
    """The URL meant by a mangled one (``"s3://bucket/x"`` for ``"s3:/bucket/x"`` or
    ``Path("s3://bucket/x")``), or None when ``path`` is no such typo."""
    text = _as_text(path)
    if text is None or _URL.match(text) is not None:
        return None
    m = _MANGLED.match(text)
    return None if m is None else f"{m.group(1)}://{text[m.end():]}"


def check_url(url: Any, what: str = "path") -> str:
    """``url`` without trailing slashes if it names an object-store prefix; else
    :class:`~annbatch_torch.InputError` naming the scheme and the ones supported (or, for a
    mangled URL such as ``s3:/bucket``, the URL meant)."""
    meant = url_typo(url)
    if meant is not None and meant.lower().startswith("file:"):
        raise InputError(f"{what} {os.fspath(url)!r}: pass a local path as a path, without "
                         "file:.")
    if meant is not None:
        raise InputError(
            f"{what} {os.fspath(url)!r} is not a URL (one slash after the scheme): did you "
            f"mean {meant!r}? Pass URLs as str: pathlib.Path('{meant}') folds '//' into '/'. "
            "Nothing was written or read; for a local folder of that name, give it as an "
            "absolute path or a str starting with './'.")
    url = _as_text(url) or str(url)
    scheme = _URL.match(url).group(1).lower()  # type: ignore[union-attr]
    if scheme == "file":
        raise InputError(f"{what} {url!r}: pass a local path as a path, without file://.")
    if scheme in ("http", "https"):
        raise InputError(
            f"{what} {url!r}: a plain HTTP server cannot list a collection's objects or tag "
            "their versions, so it cannot be read safely; put the collection on an object "
            "store (s3://, gs://, az://; an S3-compatible server by storage_options="
            "{'endpoint_url': ...}) or copy it to a local folder.")
    if scheme not in SCHEMES:
        raise InputError(
            f"{what} {url!r}: the scheme {scheme}:// is not an object store annbatch_torch "
            f"reads; use one of {', '.join(s + '://' for s in SCHEMES)} or a local path.")
    rest = url.split("://", 1)[1].strip("/")
    if not rest:
        raise InputError(f"{what} {url!r} names no bucket; use {scheme}://bucket/prefix.")
    return f"{scheme}://{rest}"


def _fsspec_filesystem(scheme: str, options: dict[str, Any]) -> Any:
    try:
        import fsspec
    except ImportError as e:  # pragma: no cover - fsspec comes with the remote extra
        raise InputError("reading or writing an object store needs fsspec: pip install "
                         "'annbatch-torch[remote]'.") from e
    retries = None
    if scheme in ("s3", "s3a"):
        opts = dict(options)
        conf = {**S3_DEFAULTS["config_kwargs"], **(opts.pop("config_kwargs", None) or {})}
        opts.setdefault("use_listings_cache", False)  # a manifest replaced is seen at once
        opts.setdefault("skip_instance_cache", True)  # our retries: not on a shared instance
        # s3fs retries on top of botocore's (5 times, in two layers): one is enough
        retries = int(opts.pop("retries", S3_RETRIES))
        options = {**opts, "config_kwargs": conf}
    try:
        fs = fsspec.filesystem(scheme, **options)
        if retries is not None:
            fs.retries = retries
        return fs
    except ImportError as e:
        pkg = {"gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs",
               "adl": "adlfs", "http": "aiohttp", "https": "aiohttp"}.get(scheme, "s3fs")
        raise InputError(f"{scheme}:// needs {pkg}: pip install {pkg} (s3fs comes with "
                         "'annbatch-torch[remote]').") from e


def coalesce(starts: Sequence[int], ends: Sequence[int], gap: int = COALESCE_GAP,
             most: int = COALESCE_MAX) -> list[tuple[int, int, list[int]]]:
    """Requests for byte ranges: ``(start, stop, [range ids])``, ranges sorted and merged
    where they lie within ``gap`` bytes of each other, each request at most ``most``
    bytes unless one range alone is larger."""
    order = sorted(range(len(starts)), key=lambda i: (starts[i], ends[i]))
    out: list[tuple[int, int, list[int]]] = []
    for i in order:
        a, b = int(starts[i]), int(ends[i])
        if out and a <= out[-1][1] + gap and max(b, out[-1][1]) - out[-1][0] <= most:
            s0, e0, ids = out[-1]
            out[-1] = (s0, max(e0, b), [*ids, i])
        else:
            out.append((a, b, [i]))
    return out


class RemoteLocation:
    """The objects under one URL prefix, with one lazily created client per process.

    Parameters
    ----------
    url
        ``scheme://bucket/prefix`` (see :data:`SCHEMES`).
    storage_options
        The fsspec filesystem's options (see the module docstring).
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = check_url(url)
        if storage_options is not None and not isinstance(storage_options, dict):
            raise InputError(f"{self.url}: storage_options must be a dict, got "
                             f"{type(storage_options).__name__}.")
        self.options: dict[str, Any] = dict(storage_options or {})
        self._store: Any = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "options": self.options}  # never the client

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.url, self.options = state["url"], state["options"]
        self._store, self._pid = None, -1

    def __repr__(self) -> str:
        return f"RemoteLocation({self.url!r})"

    def where(self, key: str = "") -> str:
        """The URL of object ``key`` (relative to the prefix)."""
        return f"{self.url}/{key}" if key else self.url

    def child(self, key: str) -> RemoteLocation:
        """The location of the sub-prefix ``key``, same options."""
        return RemoteLocation(self.where(key.strip("/")), self.options)

    @property
    def fs(self) -> Any:
        """This process's fsspec filesystem (created on first use, again after a fork)."""
        if self._store is None or self._pid != os.getpid():
            try:
                self._store = _fsspec_filesystem(self.url.split("://", 1)[0], self.options)
            except InputError as e:  # a missing package (gcsfs, adlfs...) is named first
                raise InputError(f"{self.url}: {e}") from None
            except (TypeError, ValueError) as e:
                raise InputError(
                    f"{self.url}: the storage_options {sorted(self.options)} are not valid for "
                    f"this store ({type(e).__name__}: {e}); see the fsspec filesystem's "
                    "options (for S3, s3fs: key, secret, endpoint_url, anon...).") from None
            self._pid = os.getpid()
        return self._store

    def _path(self, key: str) -> str:
        scheme, rest = self.url.split("://", 1)
        base = self.url if scheme in ("http", "https") else rest
        return f"{base}/{key}" if key else base

    # -- requests, each error named by its URL -------------------------------------------
    def _call(self, key: str, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except FileNotFoundError as e:
            if "bucket" in str(e).lower() and "not exist" in str(e).lower():
                raise CollectionError(
                    f"{self.where(key)}: the bucket does not exist (or the endpoint is not the "
                    "one holding it); check the URL and storage_options.") from None
            raise FileNotFoundError(self.where(key)) from None
        except PermissionError as e:
            raise CollectionError(
                f"{self.where(key)}: access denied while {what} ({e}); give credentials with "
                "storage_options (for S3: key/secret) or the environment "
                "(AWS_ACCESS_KEY_ID...), or anon=True for a public bucket.") from None
        except (InputError, CollectionError):
            raise
        except TypeError as e:  # the client refused an option (its session is lazy)
            if "unexpected keyword" not in str(e):
                raise
            raise InputError(
                f"{self.url}: the storage_options {sorted(self.options)} are not valid for this "
                f"store ({e}); see the fsspec filesystem's options (for S3, s3fs: key, secret, "
                "endpoint_url, anon...).") from None
        except Exception as e:  # every client error is named by its URL
            if type(e).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
                raise CollectionError(
                    f"{self.where(key)}: no credentials for this store ({e}); give them with "
                    "storage_options (for S3: key/secret) or the environment "
                    "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE), or anon=True "
                    "for a public bucket.") from None
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            raise ReadError(
                f"{self.where(key)}: {what} failed after retries ({type(e).__name__}: "
                f"{first}); check that the server is reachable, or raise the retries / "
                "timeouts in storage_options.") from None

    def get(self, key: str) -> bytes:
        """The whole object ``key`` (``FileNotFoundError`` when absent)."""
        return self._call(key, "reading", lambda: bytes(self.fs.cat_file(self._path(key))))

    def get_ranges(self, key: str, starts: Sequence[int], ends: Sequence[int],
                   etag: str | None = None) -> list[Any]:
        """Byte ranges ``[starts[i], ends[i])`` of ``key``: touching ranges coalesced
        (:func:`coalesce`), the requests issued concurrently. ``etag``: on S3 every request
        carries ``If-Match`` (the object must be the version listed when the collection
        was opened; else :class:`~annbatch_torch.CollectionError`)."""
        reqs = coalesce(starts, ends)
        path = self._path(key)
        if etag is not None and self.url.startswith(("s3://", "s3a://")):
            got = self._call(key, "reading byte ranges",
                             lambda: self._s3_ranges_if_match(key, reqs, etag))
        else:
            got = self._call(key, "reading byte ranges", lambda: self.fs.cat_ranges(
                [path] * len(reqs), [r[0] for r in reqs], [r[1] for r in reqs],
                on_error="raise"))
        out: list[Any] = [b""] * len(starts)
        for (a, _, ids), data in zip(reqs, got):
            view = memoryview(data)
            for i in ids:
                out[i] = view[int(starts[i]) - a: int(ends[i]) - a]
        return out

    def _s3_ranges_if_match(self, rel: str, reqs: list[tuple[int, int, list[int]]],
                            etag: str) -> list[bytes]:
        import asyncio

        import fsspec.asyn

        fs = self.fs
        bucket, key, _ = fs.split_path(self._path(rel))

        async def one(a: int, b: int) -> bytes:
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key,
                                     Range=f"bytes={a}-{b - 1}", IfMatch=etag)
            try:
                return await resp["Body"].read()
            finally:
                resp["Body"].close()

        async def run() -> list[bytes]:
            return list(await asyncio.gather(*(one(a, b) for a, b, _ in reqs)))

        try:
            return fsspec.asyn.sync(fs.loop, run)
        except Exception as e:
            text = str(e)
            if "PreconditionFailed" in text or (isinstance(e, OSError)
                                                 and "pre-condition" in text.lower()):
                raise CollectionError(
                    f"{self.where(rel)}: the object changed on the store since the collection "
                    "was opened (rewritten in place?); its bytes cannot be mixed with those "
                    "read before. Open the collection again.") from None
            raise

    def head(self, key: str) -> ObjectInfo | None:
        """``(size, etag)`` of ``key``; ``None`` when it does not exist."""
        try:
            info = self._call(key, "reading metadata", lambda: self.fs.info(self._path(key)))
        except FileNotFoundError:
            return None
        if info.get("type") == "directory":
            return None
        return int(info["size"]), _etag(info)

    def list(self, prefix: str = "") -> dict[str, ObjectInfo]:
        """``{key: (size, etag)}`` of every object under ``prefix`` (relative keys)."""
        base = self._path("").rstrip("/") + "/"

        def run() -> dict[str, ObjectInfo]:
            self.fs.invalidate_cache()
            found = self.fs.find(self._path(prefix), detail=True)
            return {str(p)[len(base):]: (int(i["size"]), _etag(i)) for p, i in found.items()
                    if i.get("type") != "directory" and str(p).startswith(base)
                    and not (str(p).endswith("/") and not i.get("size"))}  # folder markers

        return self._call(prefix, "listing", run)

    def put(self, key: str, data: bytes | Path) -> None:
        """Write object ``key`` from bytes or a local file (large files in multipart
        uploads)."""
        path = self._path(key)
        if isinstance(data, Path):
            self._call(key, "writing", lambda: self.fs.put_file(str(data), path))
        else:
            self._call(key, "writing", lambda: self.fs.pipe_file(path, data))

    def delete(self, keys: Iterable[str]) -> None:
        """Delete objects (absent ones are ignored)."""
        keys = list(keys)
        for a in range(0, len(keys), 1000):
            part = [self._path(k) for k in keys[a: a + 1000]]
            self._call(keys[a], "deleting", lambda part=part: self.fs.rm(part))


def _etag(info: dict[str, Any]) -> str:
    """An object's version tag: its ETag, else its modification time and size."""
    for k in ("ETag", "etag", "e_tag", "md5Hash", "generation"):
        if info.get(k):
            return str(info[k])
    return f"{info.get('LastModified') or info.get('mtime') or info.get('last_modified')}"
