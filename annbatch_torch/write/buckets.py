"""Pass 1's bucket files: frames, row names, writers and readers.

Pass 1 appends rows to the bucket of their destination. A bucket is one raw binary file (or
several: one per pass-1 task) made of frames; each frame holds a block of rows as a header
(magic, row count, byte length of every segment) followed by the segments, in a fixed order
given by :func:`bucket_segments`::

    pos (int64, row's position inside the shard) | name_len (int32) | name_bytes (uint8)
    then per field: CSR -> row nnz (int32), column indices (int32), values (dtype)
                    obsm -> values (dtype, width per row); obs -> codes / values

:class:`BucketWriter` appends frames (a bounded number of files open at once);
:func:`bucket_totals` reads the frame headers only; :func:`load_bucket` reads every frame
straight into one preallocated array per segment.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CollectionError

__all__ = [
    "BucketSegment", "BucketWriter", "bucket_files", "bucket_id", "bucket_segments",
    "bucket_totals", "decode_names", "encode_names", "load_bucket",
]

_MAGIC = 0x4142544F52434831  # frame marker


@dataclass(frozen=True)
class BucketSegment:
    """One array of a bucket frame: ``per_row`` elements per row (0: variable length);
    ``matrix`` ones are 2-D (``(rows, per_row)``, even with one column)."""

    name: str
    dtype: np.dtype
    per_row: int
    matrix: bool = False


def bucket_segments(fields: list[Any]) -> list[BucketSegment]:
    """Segments of a bucket frame for the output ``fields`` (``writer.OutField``)."""
    segs = [BucketSegment("pos", np.dtype(np.int64), 1),
            BucketSegment("name_len", np.dtype(np.int32), 1),
            BucketSegment("name_bytes", np.dtype(np.uint8), 0)]
    for f in fields:
        if f.kind == "csr":
            segs += [BucketSegment(f"{f.key}:len", np.dtype(np.int32), 1),
                     BucketSegment(f"{f.key}:idx", np.dtype(np.int32), 0),
                     BucketSegment(f"{f.key}:data", f.dtype, 0)]
        elif f.kind == "dense":
            segs.append(BucketSegment(f.key, f.dtype, int(f.width), matrix=True))
        elif f.kind == "categorical":
            segs.append(BucketSegment(f.key, np.dtype(np.int32), 1))
        else:
            segs.append(BucketSegment(f.key, f.dtype, 1))
    return segs


def encode_names(names: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """UTF-8 encode obs names: ``(lengths int32, concatenated bytes uint8)``."""
    if len(names) == 0:
        return np.zeros(0, np.int32), np.zeros(0, np.uint8)
    try:  # vectorised ASCII path
        fixed = np.asarray(names, dtype=str).astype("S")
        width = fixed.dtype.itemsize
        lens = np.char.str_len(fixed).astype(np.int32)
        grid = fixed.view(np.uint8).reshape(len(fixed), width)
        return lens, grid[np.arange(width)[None, :] < lens[:, None]]
    except UnicodeEncodeError:
        enc = [str(s).encode() for s in names]
        lens = np.fromiter((len(e) for e in enc), dtype=np.int32, count=len(enc))
        return lens, np.frombuffer(b"".join(enc), dtype=np.uint8)


def decode_names(lens: np.ndarray, data: np.ndarray) -> np.ndarray:
    n = len(lens)
    if n == 0:
        return np.zeros(0, dtype=object)
    offs = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=offs[1:])
    if not data.size or int(data.max()) < 128:  # ASCII: scatter into a fixed-width grid
        width = max(int(lens.max()), 1)
        grid = np.zeros((n, width), dtype=np.uint8)
        rows = np.repeat(np.arange(n), lens)
        cols = np.arange(len(data)) - np.repeat(offs[:-1], lens)
        grid[rows, cols] = data
        return grid.view(f"S{width}").ravel().astype(f"U{width}").astype(object)
    buf = data.tobytes()
    return np.array([buf[offs[i] : offs[i + 1]].decode() for i in range(n)], dtype=object)


def _write_all(f: Any, buf: memoryview) -> None:
    while len(buf):
        buf = buf[f.write(buf):]


class BucketWriter:
    """Append frames to bucket files ``folder/bucket_<i>.bin`` (unbuffered, LRU of fds)."""

    def __init__(self, folder: Path, segments: list[BucketSegment], max_open: int = 256) -> None:
        self.folder, self.segments, self.max_open = Path(folder), segments, max_open
        self._files: OrderedDict[int, Any] = OrderedDict()
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, bucket: int) -> Path:
        return self.folder / f"bucket_{bucket:05d}.bin"

    def _file(self, bucket: int) -> Any:
        f = self._files.pop(bucket, None)
        if f is None:
            if len(self._files) >= self.max_open:
                self._files.popitem(last=False)[1].close()
            f = open(self.path(bucket), "ab", buffering=0)  # noqa: SIM115 - cached handle
        self._files[bucket] = f
        return f

    def append(self, bucket: int, n_rows: int, arrays: list[np.ndarray]) -> None:
        """Append one frame of ``n_rows`` rows; ``arrays`` follow :attr:`segments`."""
        arrays = [np.ascontiguousarray(a, dtype=s.dtype) for a, s in zip(arrays, self.segments)]
        header = np.array([_MAGIC, n_rows, *[a.nbytes for a in arrays]], dtype=np.int64)
        f = self._file(bucket)
        _write_all(f, memoryview(header.tobytes()))
        for a in arrays:
            if a.nbytes:
                _write_all(f, memoryview(a).cast("B"))

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _frames(path: Path, f: Any, k: int) -> list[tuple[int, np.ndarray]]:
    """``(offset of the segments, byte length of each of the k segments)`` of every frame."""
    frames: list[tuple[int, np.ndarray]] = []
    size, off = os.fstat(f.fileno()).st_size, 0
    while off < size:
        f.seek(off)
        head = np.frombuffer(f.read(8 * (k + 2)), dtype=np.int64)
        if len(head) != k + 2 or head[0] != _MAGIC:
            raise CollectionError(f"{path}: damaged temporary bucket at byte {off}.")
        frames.append((off + 8 * (k + 2), head[2:].copy()))
        off += 8 * (k + 2) + int(head[2:].sum())
    return frames


def bucket_files(path: Path | Sequence[Path]) -> list[Path]:
    """The files of one bucket that exist (one per pass-1 task that wrote to it)."""
    paths = [path] if isinstance(path, Path) else list(path)
    return [p for p in paths if p.exists()]


def bucket_totals(path: Path | Sequence[Path], segments: list[BucketSegment]) -> dict[str, int]:
    """Elements of every segment in a bucket (from its frame headers; nothing else read),
    held in one file or in several. A bucket that was never written holds nothing."""
    totals = np.zeros(len(segments), dtype=np.int64)
    for p in bucket_files(path):
        with open(p, "rb", buffering=0) as f:
            for _, lens in _frames(p, f, len(segments)):
                totals += lens
    return {s.name: int(t) // s.dtype.itemsize for t, s in zip(totals, segments)}


def load_bucket(path: Path | Sequence[Path], segments: list[BucketSegment]
                ) -> dict[str, np.ndarray]:
    """Read every frame of a bucket (one file or several) into one preallocated array per
    segment (a bucket that was never written: empty arrays)."""
    k = len(segments)
    files = []
    for p in bucket_files(path):
        with open(p, "rb", buffering=0) as f:
            files.append((p, _frames(p, f, k)))
    totals = np.zeros(k, dtype=np.int64)
    for _, frames in files:
        for _, lens in frames:
            totals += lens
    out = [np.empty(int(t) // s.dtype.itemsize, dtype=s.dtype) for t, s in zip(totals, segments)]
    cursor = [0] * k
    for p, frames in files:
        with open(p, "rb", buffering=0) as f:
            for start, lens in frames:
                f.seek(start)
                for j, n in enumerate(lens):
                    n = int(n)
                    view = memoryview(out[j].view(np.uint8))[cursor[j] : cursor[j] + n]
                    while len(view):
                        view = view[f.readinto(view):]
                    cursor[j] += n
    arrays = {}
    n_rows = out[0].size if out else 0  # the first segment is "pos": one per row
    for s, a in zip(segments, out):
        arrays[s.name] = a.reshape(n_rows, s.per_row) if s.matrix else a
    return arrays


def bucket_id(shard: Any, block: Any, shard_obs: int, block_obs: int) -> Any:
    """Bucket of block ``block`` of shard ``shard`` (scalars or arrays)."""
    return shard * -(-shard_obs // block_obs) + block
