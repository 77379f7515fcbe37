"""Reading compressed zarr arrays through the zarrs (Rust) codec pipeline, fork-safely.

Collections written with ``compressor="lz4"`` / ``"zstd"`` and AnnData zarr stores read
in place are decoded by zarr. When `zarrs <https://github.com/zarrs/zarrs-python>`_ is
installed, arrays opened for reading use its Rust codec pipeline instead of zarr-python's
(measured 1.6-2.3x the cells/s on an lz4 collection, see ``docs/format.md``).

The switch is scoped: only arrays that annbatch_torch opens for reading (through
:func:`read_group`) get the pipeline; ``zarr.config`` is left as the user set it, so the
writer and the user's own zarr code are unaffected.

Fork safety
-----------
zarrs runs its parallel work on rayon's global thread pool, set up as soon as a zarrs
pipeline object is built. After ``fork()`` a child inherits the pool's bookkeeping but not
its threads, so the child's first multi-chunk read waits forever for workers that do not
exist (zarrs-python issue #171, rayon issue #708). Reproduced here: a parent that read an
lz4 collection (or only opened one array) through zarrs, then a ``DataLoader`` with
``num_workers=2`` and the default ``fork`` start method (persistent workers or not):
the workers hang until the DataLoader timeout. Reads of a single chunk run inline and
still work, which hides the problem in small tests.

:class:`ZarrsReadPipeline` therefore records the first process that built a zarrs
pipeline (``_pool_pid``). In processes forked from it (and their descendants) zarrs runs
serially: one thread and one chunk at a time, so no work reaches the pool and reads run
inline on the calling thread (verified to finish, with values equal to zarr-python's, for
lz4, zstd, sharded, zarr v2 and in-place AnnData stores). A pipeline built before the
fork rebuilds its Rust object on first use in the child. Processes that did not inherit a
pool (the parent itself, ``spawn`` / ``forkserver`` workers, ``fork`` workers of a parent
that opened no compressed array) use the parallel pipeline. Workers still read
concurrently through the reader's threads; measured on 2 cores, serial workers are no
slower than parallel ones (see ``docs/format.md``).

Choosing
--------
``ANNBATCH_TORCH_ZARRS=0`` (or ``false``/``no``/``off``) keeps zarr-python's pipeline,
``=1`` asks for zarrs (a warning and zarr-python when zarrs is not installed), unset or
``auto``: zarrs when importable. :func:`set_codec_pipeline` sets the same choice from
Python (it writes the variable, so ``spawn`` workers inherit it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any, Literal

from .groups import FastGroup

__all__ = [
    "ENV_VAR",
    "PIPELINE_PATH",
    "set_codec_pipeline",
    "ensure_codec_pipeline",
    "read_group",
    "ReadGroup",
    "zarrs_available",
]

#: Environment variable holding the choice (``auto`` / ``1`` / ``0``), inherited by workers.
ENV_VAR = "ANNBATCH_TORCH_ZARRS"
#: ``codec_pipeline.path`` under which :class:`ZarrsReadPipeline` is registered in zarr.
PIPELINE_PATH = f"{__name__}.ZarrsReadPipeline"

_ON = {"1", "true", "yes", "on", "zarrs"}
_OFF = {"0", "false", "no", "off", "zarr"}
_AUTO = {"", "auto"}

_lock = threading.RLock()
#: (pid, choice) -> resolved pipeline path (``None``: zarr-python's)
_resolved: dict[tuple[int, str], str | None] = {}
_available: bool | None = None
_registered = False
_warned = False
#: First process that built a zarrs pipeline object (which sets up rayon's global pool);
#: its forked descendants see a different pid here and run zarrs serially.
_pool_pid: int | None = None


def zarrs_available() -> bool:
    """Whether the ``zarrs`` codec pipeline can be imported (checked once)."""
    global _available
    if _available is None:
        try:
            import zarrs  # noqa: F401
            from zarrs._internal import CodecPipelineImpl  # noqa: F401
        except Exception:
            _available = False
        else:
            _available = True
    return _available


def set_codec_pipeline(choice: Literal["auto", "zarrs", "zarr"] = "auto") -> None:
    """Choose the codec pipeline annbatch_torch reads compressed zarr arrays with.

    Parameters
    ----------
    choice
        ``"auto"`` (default): the zarrs Rust pipeline when the ``zarrs`` package is
        installed, else zarr-python's. ``"zarrs"``: zarrs (raises if it is not installed).
        ``"zarr"``: zarr-python's own pipeline.

    Notes
    -----
    Sets ``os.environ["ANNBATCH_TORCH_ZARRS"]``, so DataLoader workers inherit the choice
    under ``fork`` and ``spawn``. It applies to arrays opened afterwards: a source that
    already read keeps its open arrays until ``source.close()``. zarr's global
    ``zarr.config`` is never changed.

    Raises
    ------
    ValueError
        For an unknown ``choice``.
    ImportError
        For ``"zarrs"`` when ``zarrs`` cannot be imported.
    """
    if choice not in ("auto", "zarrs", "zarr"):
        raise ValueError(f"choice must be 'auto', 'zarrs' or 'zarr', got {choice!r}.")
    if choice == "zarrs" and not zarrs_available():
        raise ImportError(
            "set_codec_pipeline('zarrs'): the zarrs package is not importable; install it "
            "(pip install zarrs) or use 'auto'."
        )
    os.environ[ENV_VAR] = {"auto": "auto", "zarrs": "1", "zarr": "0"}[choice]


def ensure_codec_pipeline() -> str | None:
    """The ``codec_pipeline.path`` to open arrays for reading with in this process.

    Follows ``ANNBATCH_TORCH_ZARRS`` (see :func:`set_codec_pipeline`), resolved once per
    process and value: the zarrs read pipeline (registered with zarr on first use) when
    chosen and importable, else ``None`` for zarr-python's default.
    """
    global _warned
    value = os.environ.get(ENV_VAR, "auto").strip().lower()
    key = (os.getpid(), value)
    path = _resolved.get(key, "?")
    if path != "?":
        return path
    with _lock:
        if value in _OFF:
            want = False
        elif value in _ON:
            want = True
            if not zarrs_available() and not _warned:
                _warned = True
                warnings.warn(
                    f"{ENV_VAR}={value!r} asks for the zarrs codec pipeline but zarrs is not "
                    "importable; reading with zarr-python's.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        else:
            if value not in _AUTO and not _warned:
                _warned = True
                warnings.warn(
                    f"{ENV_VAR}={value!r} is not one of auto, 1, 0; using auto.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            want = True
        path = PIPELINE_PATH if want and zarrs_available() and _register() else None
        _resolved[key] = path
        return path


@contextlib.contextmanager
def _opening(path: str | None) -> Iterator[None]:
    """Open arrays inside this block with pipeline ``path`` (``None``: leave zarr's)."""
    if path is None:
        yield
        return
    import zarr

    # zarr.config.set is global and restores on exit: the lock keeps two openers from
    # interleaving their set/restore (which could leave the pipeline switched for good)
    with _lock, zarr.config.set({"codec_pipeline.path": path}):
        yield


class ReadGroup:
    """A zarr group (``zarr.Group`` or :class:`~annbatch_torch.store.groups.FastGroup`) whose
    arrays open with the read pipeline chosen for the process.

    The codec pipeline is bound when zarr opens an array, so only ``group[key]`` needs the
    switch; everything else is delegated. Subgroups come back wrapped too.
    """

    def __init__(self, group: Any, path: str | None) -> None:
        self._group = group
        self._path = path

    def __getitem__(self, key: str) -> Any:
        # a FastGroup's subgroups and raw arrays need no zarr
        node = self._group.plain(key) if isinstance(self._group, FastGroup) else None
        if node is None:
            if self._path == _LATER:
                self._path = ensure_codec_pipeline()
            with _opening(self._path):
                node = self._group[key]
        if hasattr(node, "keys") and not hasattr(node, "dtype"):
            return ReadGroup(node, self._path)
        pipe = getattr(getattr(node, "_async_array", None), "codec_pipeline", None)
        if getattr(pipe, "checksummed", False) and getattr(node, "ndim", 0) >= 1:
            return ChunkAligned(node)
        return node

    def __contains__(self, key: object) -> bool:
        return key in self._group

    def __iter__(self) -> Iterator[str]:
        return iter(self._group)

    def __len__(self) -> int:
        return len(self._group)

    def __getattr__(self, name: str) -> Any:
        if name in ("_group", "_path") or name.startswith("__"):
            raise AttributeError(name)  # unpickling / copying looks these up before __init__
        return getattr(self._group, name)

    def __repr__(self) -> str:
        return f"ReadGroup({self._group!r}, pipeline={self._path!r})"


class ChunkAligned:
    """A zarr array whose row slices are read in whole chunks along the first axis (the
    rest of the array is read whole), so that zarrs validates their checksums; the rows
    asked for are cut out of that block. Everything else is the array's."""

    def __init__(self, array: Any) -> None:
        self._array = array
        self._rows = max(1, int(array.chunks[0]))

    def __getitem__(self, key: Any) -> Any:
        arr = self._array
        if key is Ellipsis:
            key = slice(None)
        if not isinstance(key, slice) or key.step not in (None, 1):
            return arr[key]  # other selections: zarr-python validates parts of chunks
        n = int(arr.shape[0])
        lo, hi, _ = key.indices(n)
        if hi <= lo:
            return arr[lo:lo]
        a = lo // self._rows * self._rows
        b = min(-(-hi // self._rows) * self._rows, n)
        block = arr[a:b]
        return block if (a, b) == (lo, hi) else block[lo - a : hi - a].copy()

    def __getattr__(self, name: str) -> Any:
        if name == "_array" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._array, name)

    def __repr__(self) -> str:
        return f"ChunkAligned({self._array!r})"


def read_group(group: Any) -> Any:
    """Wrap a zarr group so the arrays opened through it use the process's read pipeline
    (:func:`ensure_codec_pipeline`); returned unchanged when that is zarr-python's.

    A :class:`~annbatch_torch.store.groups.FastGroup` is wrapped with the choice left
    open until zarr opens an array through it: its subgroups and raw arrays need no zarr,
    so a process reading a raw collection never imports zarr or zarrs (~0.4 s of CPU in
    each DataLoader worker)."""
    if isinstance(group, FastGroup):
        return ReadGroup(group, _LATER)
    path = ensure_codec_pipeline()
    return group if path is None else ReadGroup(group, path)


#: a :class:`ReadGroup`'s pipeline not chosen yet (see :func:`read_group`)
_LATER = "?"


# -- the pipeline ---------------------------------------------------------------------


def _register() -> bool:
    """Define :class:`ZarrsReadPipeline` and register it with zarr (once per import)."""
    global _registered
    if _registered:
        return True
    try:
        _define_pipeline()
    except Exception as e:  # zarrs' internals changed: stay on zarr-python
        warnings.warn(
            f"zarrs is installed but its pipeline cannot be used ({type(e).__name__}: {e}); "
            "reading with zarr-python's.",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    _registered = True
    return True


def _serial_here() -> bool:
    """Whether this process must not hand zarrs work to rayon's pool (it was forked from a
    process that had set the pool up: the pool's threads do not exist here)."""
    return _pool_pid is not None and _pool_pid != os.getpid()


_CHECKSUMS = ("crc32", "adler32", "fletcher32", "lookup3")


def _has_data_checksum(node: Any, key: str = "") -> bool:
    """Whether array metadata (as a dict) has a checksum codec on its chunk data (shard
    indices excepted: zarrs validates those)."""
    if key == "index_codecs":
        return False
    if isinstance(node, dict):
        name = str(node.get("name", node.get("id", ""))).lower()
        if any(c in name for c in _CHECKSUMS):
            return True
        return any(_has_data_checksum(v, str(k)) for k, v in node.items())
    if isinstance(node, list | tuple):
        return any(_has_data_checksum(v) for v in node)
    return False


def _make_impl(metadata: Any, store: Any, serial: bool) -> Any:
    """zarrs' Rust pipeline object for an array, or ``None`` (zarr-python decodes)."""
    from zarr.core.config import config
    from zarrs._internal import CodecPipelineImpl

    meta = metadata.to_dict()
    global _pool_pid
    if _pool_pid is None:
        # building the Rust object sets up rayon's pool (measured: a child forked after it,
        # without any read, hangs on its first parallel read)
        _pool_pid = os.getpid()
    validate = config.get("codec_pipeline.validate_checksums", True)
    try:
        return CodecPipelineImpl(
            json.dumps(meta),
            store_config=store,
            validate_checksums=True if validate is None else bool(validate),
            chunk_concurrent_minimum=1 if serial else config.get(
                "codec_pipeline.chunk_concurrent_minimum", None),
            chunk_concurrent_maximum=1 if serial else config.get(
                "codec_pipeline.chunk_concurrent_maximum", None),
            num_threads=1 if serial else config.get("threading.max_workers", None),
            direct_io=False,
        )
    except Exception:  # codec, data type or store zarrs does not support
        return None


def _before_fork() -> None:
    # zarrs used outside annbatch_torch (zarr.config pointing at it) may have set up the
    # pool: children must then be serial too
    global _pool_pid
    if _pool_pid is not None or "zarrs" not in sys.modules:
        return
    try:
        import zarr

        path = str(zarr.config.get("codec_pipeline.path", ""))
    except Exception:
        return
    if path.startswith("zarrs"):
        _pool_pid = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork)


def _define_pipeline() -> None:
    import zarr
    from zarrs import ZarrsCodecPipeline
    from zarrs.pipeline import get_codec_pipeline_fallback

    class ZarrsReadPipeline(ZarrsCodecPipeline):  # type: ignore[misc]
        """zarrs' codec pipeline bound to the process that built it (see module doc)."""

        _pid: int
        _serial: bool

        @classmethod
        def from_array_metadata_and_store(cls, array_metadata: Any, store: Any) -> Any:
            pipe = cls(
                metadata=array_metadata,
                store=store,
                impl=None,
                python_impl=get_codec_pipeline_fallback(array_metadata, strict=False),
            )
            pipe._bind()
            return pipe

        def _bind(self) -> None:
            self._pid = os.getpid()
            self._serial = _serial_here()
            self.checksummed = _has_data_checksum(self.metadata.to_dict())
            self.impl = _make_impl(self.metadata, self.store, self._serial)

        def __setstate__(self, state: Any) -> None:
            self.metadata = state["metadata"]
            self.store = state["store"]
            self.python_impl = get_codec_pipeline_fallback(self.metadata, strict=False)
            self._bind()

        def _check_process(self) -> None:
            if self._pid != os.getpid():  # inherited through fork: rebuild for this process
                self._bind()

        async def read(self, batch_info: Any, out: Any, drop_axes: tuple[int, ...] = ()) -> None:
            self._check_process()
            if self.checksummed:
                batch_info = list(batch_info)
                # zarrs skips checksum validation when it decodes part of a chunk (measured:
                # 70 of 177 one-byte flips in a Blosc+crc32c chunk read back as wrong values,
                # no error): parts of chunks go to zarr-python, which validates every read;
                # whole chunks (ChunkAligned reads) to zarrs, which validates those
                if not all(item[-1] is True for item in batch_info):
                    await self.python_impl.read(batch_info, out, drop_axes)
                    return
            await super().read(batch_info, out, drop_axes)

        async def write(self, batch_info: Any, value: Any, drop_axes: tuple[int, ...] = ()) -> None:
            self._check_process()
            await super().write(batch_info, value, drop_axes)

    ZarrsReadPipeline.__module__ = __name__
    ZarrsReadPipeline.__qualname__ = "ZarrsReadPipeline"
    globals()["ZarrsReadPipeline"] = ZarrsReadPipeline
    zarr.registry.register_pipeline(ZarrsReadPipeline)
