"""A cheap content fingerprint of an input file or folder, to tell a touched input from a
changed one.

``touch a.h5ad``, a ``cp`` without ``-p`` or a checkout changes an input's modification
time but not its content; rewriting a collection for that costs hours at atlas scale. The
writer records :func:`fingerprint` of every input next to its size and mtime; the staleness
check (:mod:`annbatch_torch.write.staleness`) computes it again only when the size is
unchanged and the mtime is not, and takes the input as unchanged when it matches.

What it reads, so that it stays cheap for a 100 GB file (a few MiB at most):

* a file: its size, its first and last MiB, and 64 blocks of 64 KiB spread evenly over
  the rest (an HDF5 file's superblock, its metadata near the end and a sample of its data);
* a folder (an AnnData zarr store): every file's relative path and size, the full content
  of every metadata file (``zarr.json``, ``.zarray``, ``.zattrs``, ``.zgroup``,
  ``.zmetadata``), and a file fingerprint of the largest files' samples (at most 64 files).

A change that keeps the size and touches none of the sampled bytes (rewriting a few values
in the middle of an uncompressed matrix in place) is not seen: rewrite the collection with
``overwrite=True`` after such an edit.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path

__all__ = ["fingerprint", "Fingerprints", "FINGERPRINT_VERSION"]

#: Part of every fingerprint: a change in what is read gives a different value.
FINGERPRINT_VERSION = "fp1"

_EDGE = 1 << 20  # bytes read at each end of a file
_BLOCK = 1 << 16  # bytes per sampled block
_N_BLOCKS = 64  # sampled blocks between the two ends
_MAX_FOLDER_FILES = 64  # data files of a folder sampled (the largest)
_METADATA = {"zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata"}


def _file_digest(h: hashlib._Hash, path: Path, size: int) -> None:
    with path.open("rb") as f:
        if size <= 2 * _EDGE + _N_BLOCKS * _BLOCK:
            h.update(f.read())
            return
        h.update(f.read(_EDGE))
        span = size - 2 * _EDGE - _BLOCK
        for i in range(_N_BLOCKS):
            f.seek(_EDGE + span * i // max(1, _N_BLOCKS - 1))
            h.update(f.read(_BLOCK))
        f.seek(size - _EDGE)
        h.update(f.read(_EDGE))


def fingerprint(path: str | os.PathLike[str]) -> str:
    """A short hex digest of ``path``'s content sample (see the module docstring).

    Parameters
    ----------
    path
        An input file (``.h5ad``) or folder (AnnData zarr store).

    Returns
    -------
    str
        ``"fp1:<sha256 hex>"``; equal for equal content, whatever the mtimes.
    """
    p = Path(path)
    h = hashlib.sha256(FINGERPRINT_VERSION.encode())
    if not p.is_dir():
        size = p.stat().st_size
        h.update(str(size).encode())
        _file_digest(h, p, size)
        return f"{FINGERPRINT_VERSION}:{h.hexdigest()}"
    files: list[tuple[str, Path, int]] = []
    for root, dirs, names in os.walk(p):
        dirs.sort()
        for name in sorted(names):
            f = Path(root) / name
            files.append((f.relative_to(p).as_posix(), f, f.stat().st_size))
    data = []
    for rel, f, size in files:
        h.update(f"{rel}\0{size}\n".encode())
        if f.name in _METADATA:
            h.update(f.read_bytes())
        else:
            data.append((size, rel, f))
    for size, rel, f in sorted(data, reverse=True)[:_MAX_FOLDER_FILES]:
        h.update(rel.encode())
        _file_digest(h, f, size)
    return f"{FINGERPRINT_VERSION}:{h.hexdigest()}"


class Fingerprints:
    """:func:`fingerprint` of each of ``paths``, computed in a thread of its own while the
    caller goes on (SHA-256 lets go of the GIL): a writer starts it when it has opened its
    inputs and asks for the values when it writes its manifest.

    :meth:`get` waits for the thread; a path whose fingerprint failed gives ``None``, for
    the caller to compute it again and meet the error itself.
    :meth:`close` stops after the path being read and waits.
    """

    def __init__(self, paths: Sequence[str | os.PathLike[str]]) -> None:
        self._done: dict[str, str] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, args=(list(paths),),
                                        name="annbatch-fingerprint", daemon=True)
        self._thread.start()

    def _run(self, paths: list[str | os.PathLike[str]]) -> None:
        for p in paths:
            if self._stop:
                return
            try:
                self._done[os.fspath(p)] = fingerprint(p)
            except Exception:  # computed again by the caller, who meets the error
                continue

    def get(self, path: str | os.PathLike[str]) -> str | None:
        """The fingerprint of ``path`` (waits until every path is done)."""
        self._thread.join()
        return self._done.get(os.fspath(path))

    def close(self) -> None:
        """Stop after the path being read; wait for the thread."""
        self._stop = True
        self._thread.join()
