"""Compiled loops: numba's set-up for every compiled loop of the package, and many small
reads of one file in one compiled loop.

:func:`compiled` compiles a function with numba, releasing the GIL and cached on disk
(beside the module, else in the user's cache folder; compiled in each process where
neither is writable). Importing this module also keeps forked children from inheriting
numba's compiler lock while another thread holds it.

:func:`pread_segments` reads byte ranges of one file into one buffer by a compiled loop of
``preadv2`` calls (Linux): the reads of a pool of drawn rows whose chunks were verified
before, one short read per row and array. The loop holds no GIL, so the reader's threads
read in parallel, and a Python step per read (a loop of ``os.preadv``) is gone.
:func:`pread_widen` does the same through a small scratch, copying each segment on to its
place cast to a wider dtype (narrow stored counts and column indices into a pool's float32
and int32) while it is in the CPU's cache. :func:`pread_available` says whether the loops
can run here (Linux with ``preadv2`` and ``RWF_NOWAIT``, numba's JIT enabled); callers fall
back to ``os.preadv`` otherwise.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numba import types
from numba.core.compiler_lock import global_compiler_lock

__all__ = ["OutOfRange", "compiled", "compiled_started", "is_cached", "load_now",
           "forks_by_default", "pread_available", "pread_segments", "pread_widen",
           "start_numba"]

logger = logging.getLogger(__name__)

_COMPILED: list[Any] = []  # every loop made by compiled()
_UNCACHED: list[Any] = []  # those compiled in each process (no cache folder writable)
#: numba's start is paid in this process (or its parent): one of them compiled or loaded,
#: or start_numba ran
_started = False
_start_failed = False  # start_numba met an error: not tried again (a loop's call reports it)


def compiled(fn: Callable[..., Any]) -> Any:
    """``fn`` compiled by numba (``nogil``), cached on disk where a cache folder is
    writable."""
    try:  # numba's cache (__pycache__ beside the module, else the user's cache folder)
        loop = numba.njit(nogil=True, cache=True)(fn)
    except RuntimeError:  # nowhere writable to cache it (a read-only install, no home):
        loop = numba.njit(nogil=True)(fn)  # compiled in each process instead
        if not _UNCACHED:  # said once (at INFO: importing the package prints nothing)
            logger.info(
                "annbatch_torch: numba finds no writable folder to cache its compiled loops "
                "in (a read-only install without a writable home), so every process compiles "
                "them again (each DataLoader worker too). Set NUMBA_CACHE_DIR to a "
                "writable folder to compile them once.")
        _UNCACHED.append(loop)
    _COMPILED.append(loop)
    return loop


def is_cached(loop: Any) -> bool:
    """Whether ``loop`` was made by :func:`compiled` and is loaded from numba's disk cache
    rather than compiled in each process."""
    return (any(loop is other for other in _COMPILED)
            and not any(loop is other for other in _UNCACHED))


def compiled_started() -> bool:
    """Whether numba's start (~0.3 s) is paid in this process (a forked child's parent
    counts): a loop of :func:`compiled` has been compiled or loaded, or
    :func:`start_numba` ran. Another loop then costs only its own load from the cache."""
    global _started
    if not _started:
        _started = any(getattr(loop, "overloads", None) for loop in _COMPILED)
    return _started


def start_numba() -> None:
    """Pay numba's start now (its registries and runtime, ~0.3 s of Python and ~50 MB),
    once per process, unless it is paid here or in the parent already.

    For a process that forks readers: workers forked afterwards inherit what it loaded,
    where paid in each worker the start costs every worker its CPU before its first batch,
    and again every epoch without persistent workers. Once paid, callers with a slower
    path that needs no numba take their compiled loops at once (:func:`load_now`). Paid in
    the calling thread: a thread of its own would hold numba's compiler lock, which a fork
    waits for (above), while running Python whose garbage collection may need a lock that
    another library's fork handler takes first: the fork could wait forever. An error is
    not raised here (a loop's first call meets and reports it) and not tried again."""
    global _started, _start_failed
    if numba.config.DISABLE_JIT or _start_failed or compiled_started():
        return
    try:
        from numba.core.registry import cpu_target

        with global_compiler_lock:
            cpu_target.target_context.refresh()
    except Exception:
        _start_failed = True
        return
    _started = True


def forks_by_default() -> bool:
    """Whether new processes start by ``fork`` here unless a caller asks otherwise: the
    start method set for :mod:`multiprocessing`, else this platform's default (``fork``
    on Linux before Python 3.14), found without fixing the default."""
    import multiprocessing

    method = multiprocessing.get_start_method(allow_none=True)
    if method is None:
        return sys.platform.startswith("linux") and sys.version_info < (3, 14)
    return method == "fork"


def load_now(loop: Any, done_without: int, limit: int) -> bool:
    """Whether a caller with a slower path that needs no numba should use ``loop`` now:
    it is loaded already, or loading it costs only its read from the disk cache (another
    loop paid numba's start, ~0.3 s), or the caller took the slower path ``limit`` times
    (``done_without``) and goes on for long enough to pay that start back."""
    return (bool(getattr(loop, "overloads", None)) or done_without >= limit
            or (compiled_started() and is_cached(loop)))


# numba compiles under one process-wide lock, taken by whichever thread meets a new pair of
# dtypes first (a pool reader's thread, say); a child forked while another thread held it
# would wait on it forever. The forking thread takes it first (waiting for a compilation
# to end) and both sides let go after the fork. h5py's own fork handler takes h5py's lock,
# and handlers run in the reverse order of their registration: h5py is imported first, so
# that a fork takes numba's lock before h5py's. The other way round, a thread holding
# numba's lock whose garbage collection frees an h5py object (which takes h5py's lock)
# would wait on the fork, and the fork on it. (This orders these two locks only: a fork
# handler registered later that takes a lock such a thread needs is not covered.)
import h5py  # noqa: E402, F401  (its fork handler registered before the one below)

os.register_at_fork(before=global_compiler_lock.acquire,
                    after_in_parent=global_compiler_lock.release,
                    after_in_child=global_compiler_lock.release)

# ssize_t preadv2(int fd, const struct iovec *iov, int iovcnt, off_t offset, int flags): the
# iovec pointer passed as an address (uint64: the same register on every 64-bit ABI)
_preadv2 = types.ExternalFunction(
    "preadv2", types.int64(types.int32, types.uint64, types.int32, types.int64, types.int32))


def _pread_loop_py(fd, offsets, lengths, base, dests, flags, first):  # type: ignore[no-untyped-def]  # pragma: no cover
    iov = np.empty(2, np.uint64)  # one struct iovec: (address, length)
    at = iov.ctypes.data
    for i in range(first, offsets.shape[0]):
        iov[0] = base + dests[i]
        iov[1] = lengths[i]
        if _preadv2(fd, at, 1, offsets[i], flags) != lengths[i]:
            return i  # short, refused (RWF_NOWAIT: not all in the page cache) or failed
    return offsets.shape[0]


_pread_loop = compiled(_pread_loop_py)


def _pread_widen_loop_py(fd, offsets, counts, scratch, out, dests, flags, first, below, bad):  # type: ignore[no-untyped-def]  # pragma: no cover
    iov = np.empty(2, np.uint64)
    at = iov.ctypes.data
    iov[0] = scratch.ctypes.data
    item = scratch.itemsize
    for i in range(first, offsets.shape[0]):
        n = counts[i]
        iov[1] = n * item
        if _preadv2(fd, at, 1, offsets[i], flags) != n * item:
            return i
        d = np.uint64(dests[i])
        for j in range(np.uint64(n)):  # unsigned: no wrap-around test, a vector loop
            out[d + j] = scratch[j]
        if below >= 0 and n > 0:  # a second pass while the segment is in the CPU's cache
            lo = scratch[0]
            hi = scratch[0]
            for j in range(np.uint64(n)):
                lo = min(lo, scratch[j])
                hi = max(hi, scratch[j])
            if lo < 0 or hi >= below:
                bad[0] = i
                return i
    return offsets.shape[0]


_pread_widen_loop = compiled(_pread_widen_loop_py)
_state: dict[str, bool] = {}


def pread_available() -> bool:
    """Whether :func:`pread_segments` runs here: Linux on a 64-bit build, with ``preadv2``
    in the C library and ``RWF_NOWAIT``, and numba's JIT compiling the loop (checked once
    per process, by a read of ``/dev/zero``)."""
    ok = _state.get("ok")
    if ok is None:
        # no lock: probing twice is harmless, and a lock held by a probing thread would be
        # inherited, held, by a child forked meanwhile (the probe may compile, and a fork
        # waits for numba's compiler lock: it lands right after a compilation)
        ok = _state["ok"] = _probe()
    return ok


def _libc_has_preadv2() -> bool:
    """Whether the C library exports ``preadv2`` (the loop must never be called without
    it: numba would jump to a null address)."""
    try:
        return hasattr(ctypes.CDLL(None), "preadv2")
    except OSError:
        return False


def _probe() -> bool:
    if (numba.config.DISABLE_JIT or not sys.platform.startswith("linux")
            or sys.maxsize <= 2**32 or not hasattr(os, "RWF_NOWAIT")
            or not _libc_has_preadv2()):
        return False
    try:
        fd = os.open("/dev/zero", os.O_RDONLY)
    except OSError:
        return False
    try:
        out = np.ones(8, dtype=np.uint8)
        done = _pread_loop(fd, np.zeros(1, np.int64), np.full(1, 8, np.int64),
                           out.ctypes.data, np.zeros(1, np.int64), 0, 0)
        return done == 1 and not out.any()
    except Exception:  # no compiler: the os.preadv loop then
        return False
    finally:
        os.close(fd)


def pread_segments(fd: int, offsets: np.ndarray, lengths: np.ndarray, out: np.ndarray,
                   dests: np.ndarray, flags: int = 0, first: int = 0) -> int:
    """Read ``lengths[i]`` bytes of file ``fd`` at ``offsets[i]`` into ``out``'s bytes at
    ``dests[i]``, for ``i`` from ``first`` on, one ``preadv2(flags)`` each, until one reads
    fewer bytes than asked (short at the end of the file, refused by ``RWF_NOWAIT``, or
    failed).

    Returns
    -------
    int
        The first segment not read in full (``len(offsets)`` when all were): the caller
        reads it its own way and calls again from the next one.

    Raises
    ------
    ValueError
        If a segment would land outside ``out`` (checked before the compiled loop, which
        does not check), or ``out`` is not a writeable contiguous buffer.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    dests = np.asarray(dests, dtype=np.int64)
    if not (offsets.shape == lengths.shape == dests.shape and offsets.ndim == 1):
        raise ValueError("pread_segments: offsets, lengths and dests must be 1-D and of one "
                         "length")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("pread_segments reads into a writeable contiguous buffer")
    if first < 0:
        raise ValueError(f"pread_segments: first must not be negative, got {first}")
    if first >= len(offsets):
        return len(offsets)
    lengths_rest, dests_rest = lengths[first:], dests[first:]
    if (int(lengths_rest.min()) < 0 or int(dests_rest.min()) < 0
            or int(offsets[first:].min()) < 0
            or int(lengths_rest.max()) > out.nbytes or int(dests_rest.max()) > out.nbytes
            or int((dests_rest + lengths_rest).max()) > out.nbytes):
        raise ValueError(f"pread_segments: segments fall outside the buffer of {out.nbytes} "
                         "bytes")
    return int(_pread_loop(fd, offsets, lengths, out.ctypes.data, dests, int(flags),
                           int(first)))


def pread_widen(fd: int, offsets: np.ndarray, counts: np.ndarray, out: np.ndarray,
                dests: np.ndarray, scratch: np.ndarray, flags: int = 0, first: int = 0,
                below: int | None = None) -> int:
    """:func:`pread_segments` of items rather than bytes, cast on the way: ``counts[i]``
    items of ``scratch``'s dtype (the stored one) read at byte ``offsets[i]`` of file ``fd``
    into ``scratch``, then copied to ``out[dests[i]:]`` in ``out``'s dtype (the caller makes
    sure it holds every value). ``scratch`` holds the longest segment; it stays in the CPU's
    cache, so the bytes go from the page cache to their place in one pass. ``below`` (integer
    items): every item read is checked inside ``[0, below)`` while it is in that cache
    (column indices: no pass over the pool afterwards).

    Returns
    -------
    int
        The first segment not read in full, as :func:`pread_segments`.

    Raises
    ------
    OutOfRange
        If segment ``i`` (:attr:`OutOfRange.segment`, copied to ``out`` already) holds an
        item outside ``[0, below)``; the segments before it were read and checked.
    ValueError
        If a segment would land outside ``out`` or not fit in ``scratch``, or ``below`` is
        given for items that are not integers.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    dests = np.asarray(dests, dtype=np.int64)
    if not (offsets.shape == counts.shape == dests.shape and offsets.ndim == 1):
        raise ValueError("pread_widen: offsets, counts and dests must be 1-D and of one length")
    for a in (out, scratch):
        if a.ndim != 1 or not a.flags.c_contiguous or not a.flags.writeable or (
                a.dtype.kind not in "biuf" or not a.dtype.isnative):
            raise ValueError("pread_widen reads into writeable contiguous 1-D arrays of "
                             "numbers in native byte order")
    if first < 0:
        raise ValueError(f"pread_widen: first must not be negative, got {first}")
    if first >= len(offsets):
        return len(offsets)
    c, d = counts[first:], dests[first:]
    if (int(c.min()) < 0 or int(d.min()) < 0 or int(offsets[first:].min()) < 0
            or int(c.max()) > scratch.size or int((d + c).max()) > out.size):
        raise ValueError(f"pread_widen: segments fall outside the buffer of {out.size} items "
                         f"or exceed the scratch of {scratch.size}")
    if below is not None and (scratch.dtype.kind not in "iu" or int(below) < 0):
        raise ValueError(f"pread_widen: below={below} checks integer items, got "
                         f"{scratch.dtype} (and below must not be negative)")
    bad = np.full(1, -1, dtype=np.int64)
    got = int(_pread_widen_loop(fd, offsets, counts, scratch, out, dests, int(flags),
                                int(first), -1 if below is None else int(below), bad))
    if bad[0] >= 0:
        raise OutOfRange(int(bad[0]), int(below))  # type: ignore[arg-type]
    return got


class OutOfRange(ValueError):
    """A segment read by :func:`pread_widen` holds an item outside ``[0, below)``."""

    def __init__(self, segment: int, below: int) -> None:
        super().__init__(f"segment {segment} holds an item outside [0, {below})")
        self.segment = segment
        self.below = below
