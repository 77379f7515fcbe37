"""Disk reads for the raw array reader: ``preadv`` into the caller's buffers, and the
process-wide disk gate.

:func:`preadv_full` reads any number of buffers (``IOV_MAX`` at a time). Under
:func:`io_gate` a reading thread holds one of the reader's :class:`CpuSlots` while it copies
and checks bytes, but gives it back while a read waits for the disk: a first
``preadv(RWF_NOWAIT)`` copies what the page cache holds, the rest is read without the slot.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import numpy as np

__all__ = [
    "IOV_MAX", "CpuSlots", "OpenFile", "count_warm", "fast_flags", "io_gate", "preadv_full",
    "split_at",
]

#: most buffers one ``preadv`` call takes (Linux's ``IOV_MAX``)
IOV_MAX = 1024


class OpenFile:
    """The descriptor of the file one call reads now: opened when the file changes, closed
    when the next is opened or at :meth:`close`."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.fd = -1

    def open(self, path: str) -> int:
        if path != self.path:
            self.close()
            self.fd = os.open(path, os.O_RDONLY)
            self.path = path
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.path, self.fd = None, -1


class CpuSlots:
    """At most ``n`` reads copying and checking bytes at once (a semaphore), and counts of
    the reads made under it (``reads``) and of those that waited for the disk
    (``waits``; approximate under threads: a hint, not an account)."""

    def __init__(self, n: int) -> None:
        self._sem = threading.BoundedSemaphore(max(1, int(n)))
        self.reads = 0
        self.waits = 0

    def acquire(self) -> None:
        self._sem.acquire()

    def release(self) -> None:
        self._sem.release()

    def note(self, waited: bool, n: int = 1) -> None:
        """Count ``n`` reads (``waited``: part of each had to come from the disk)."""
        self.reads += n
        self.waits += n if waited else 0
        _GATE.noted = True

    def take_counts(self) -> tuple[int, int]:
        """``(reads, waits)`` since the last call (then zero again)."""
        counts = (self.reads, self.waits)
        self.reads = self.waits = 0
        return counts


class _Gate(threading.local):
    """This thread's CPU slots, if a reader gave it some (:func:`io_gate`)."""

    slot: CpuSlots | None = None
    noted = False  # a read under the slot was counted


_GATE = _Gate()


_NOWAIT = getattr(os, "RWF_NOWAIT", None)  # Linux: fail instead of waiting for the disk


#: a page read taking longer came from the disk (a cached one takes microseconds)
_DISK_WAIT_S = 1e-3


@contextlib.contextmanager
def io_gate(slots: CpuSlots) -> Any:
    """Read in this thread holding one of ``slots`` (acquired here), but give it back while
    a read waits for the disk.

    Reads try ``preadv(RWF_NOWAIT)`` first: what is in the page cache is copied at once,
    holding the slot; only the bytes that need the disk are read after releasing it (and
    the slot is taken again before the checksum). So a reader may keep many reads waiting
    on the disk (cold data: the disk's queue is what bounds throughput) while no more than
    the slots' count copy and check bytes (warm data: the CPUs are). Without
    ``RWF_NOWAIT`` (not Linux) every read simply holds the slot.
    """
    slots.acquire()
    _GATE.slot, _GATE.noted = slots, False
    try:
        yield
    finally:
        if not _GATE.noted:  # no raw read here (e.g. zarr decoding): nothing waited
            slots.note(False)
        _GATE.slot = None
        slots.release()


def _preadv_all(fd: int, bufs: list[Any], offset: int, flags: int = 0) -> int:
    """``os.preadv`` over any number of buffers, ``IOV_MAX`` at a time; returns the bytes
    read (short at EOF or, with ``RWF_NOWAIT`` in ``flags``, where the cache ends)."""
    total = 0
    for k in range(0, len(bufs), IOV_MAX):
        part = bufs[k : k + IOV_MAX]
        try:
            n = os.preadv(fd, part, offset + total, flags)
        except BlockingIOError:  # RWF_NOWAIT: the rest is not in the page cache
            return total
        total += n
        if n < sum(len(b) for b in part):
            break
    return total


def split_at(bufs: list[np.ndarray], n: int) -> tuple[list[Any], list[Any]]:
    """The buffers' first ``n`` bytes and the rest (views)."""
    head: list[Any] = []
    rest: list[Any] = []
    for b in bufs:
        size = len(b)
        if n >= size:
            head.append(b)
        elif n > 0:
            head.append(memoryview(b)[:n])
            rest.append(memoryview(b)[n:])
        else:
            rest.append(b)
        n -= size
    return head, rest


class _Refused(Exception):
    """``RWF_NOWAIT`` is refused here (the file system does not support it)."""


#: the devices (``st_dev``) whose file system refused ``RWF_NOWAIT`` in this process (tmpfs
#: does on Linux 6.18, memfd too: e.g. a remote collection's cache entries in ``/dev/shm``):
#: only their files are read without the first try, a refusal elsewhere changes nothing
_REFUSED_DEVICES: set[int] = set()


def _refused(fd: int) -> bool:
    """Whether ``fd``'s file system refused ``RWF_NOWAIT`` before (no ``fstat`` until one
    did)."""
    return bool(_REFUSED_DEVICES) and os.fstat(fd).st_dev in _REFUSED_DEVICES


def _nowait(fd: int, bufs: list[Any], offset: int) -> int:
    """Bytes ``preadv(RWF_NOWAIT)`` copies from the page cache (0 when none is there);
    :class:`_Refused` where the file system does not take the flag."""
    try:
        return _preadv_all(fd, bufs, offset, _NOWAIT)
    except OSError as e:
        _REFUSED_DEVICES.add(os.fstat(fd).st_dev)
        raise _Refused from e


def _without_slot(slot: CpuSlots, fd: int, bufs: list[Any], offset: int) -> tuple[int, float]:
    """A blocking read with ``slot`` given back meanwhile: ``(bytes, seconds)``."""
    slot.release()
    t0 = time.perf_counter()
    try:
        return _preadv_all(fd, bufs, offset), time.perf_counter() - t0
    finally:
        slot.acquire()


def fast_flags(device: int | None = None) -> int | None:
    """``preadv`` flags for a first try that copies only what is in the page cache
    (``RWF_NOWAIT`` under :func:`io_gate`, ``0`` without a gate), ``None`` where that try
    is not possible (no ``RWF_NOWAIT``, or refused by the file system of ``device``, an
    ``st_dev``; ``None``: not known, tried)."""
    if _GATE.slot is None:
        return 0
    if _NOWAIT is None or device in _REFUSED_DEVICES:
        return None
    return _NOWAIT


def count_warm(n: int = 1) -> None:
    """Count ``n`` reads copied from the page cache (what :func:`preadv_full` would note)."""
    slot = _GATE.slot
    if slot is not None and n > 0:
        slot.note(False, n)


def preadv_full(fd: int, bufs: list[np.ndarray], offset: int, nbytes: int,
                 need: int | None = None) -> int:
    """``os.preadv`` over any number of buffers (``nbytes`` in all); returns the bytes
    read (short at EOF). Under :func:`io_gate`, waits for the disk without the slot.

    ``need``: the bytes that must be there (default ``nbytes``); the rest is a probe past
    them (a chunk file one byte longer than its chunk is damage), read only if cached or
    while reading from the disk anyway.
    """
    need = nbytes if need is None else need
    slot = _GATE.slot
    if slot is None or _NOWAIT is None or _refused(fd):
        if slot is not None:
            slot.note(False)  # nothing to learn about the disk: count the read as warm
        return _preadv_all(fd, bufs, offset)
    try:
        return _gated_read(slot, fd, bufs, offset, nbytes, need)
    except _Refused:  # this file system does not take RWF_NOWAIT: read as usual
        slot.note(False)
        return _preadv_all(fd, bufs, offset)


def _gated_read(slot: CpuSlots, fd: int, bufs: list[np.ndarray], offset: int, nbytes: int,
                need: int) -> int:
    got = _nowait(fd, bufs, offset)
    if got >= need:
        slot.note(False)
        return got
    # RWF_NOWAIT also declines a cached page that marks where the kernel's read-ahead
    # starts: read one page without the slot (from the disk, this starts the read-ahead
    # of what follows), then try the rest again
    head, rest = split_at(split_at(bufs, got)[1], min(4096, nbytes - got))
    n, seconds = _without_slot(slot, fd, head, offset + got)
    got += n
    waited = seconds > _DISK_WAIT_S
    if n and got < need:
        more = _nowait(fd, rest, offset + got)
        got += more
        if got < need:  # still on disk: wait for the rest without the slot
            more, _ = _without_slot(slot, fd, split_at(rest, more)[1], offset + got)
            got += more
            waited = True
    slot.note(waited)
    return got
