"""The writer's memory budget: parse ``max_memory``, measure what the process already uses,
and size the pass-1 blocks, the pass-2 blocks, the shard layout and the CSC limit from
what is left.

``max_memory`` bounds the peak RSS of the whole process. The writer's buffers get
``max_memory`` minus the RSS measured once the inputs are opened and the schema resolved
(interpreter, torch, zarr, anndata, open files, anything the caller holds), minus the
permutation and a fixed reserve for zarr's thread pool and allocator slack. Pass-1 blocks
use half of that working memory, a CSC input held whole at most a quarter, a pass-2 block
and the shard it is appended to about 80%.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import numpy as np

from ..errors import InputError
from ..store.inputs.view import InputSource
from .schema import Schema

__all__ = ["parse_memory", "current_rss", "working_memory", "fit_layout", "block_size",
           "MIN_WORK_MEMORY", "RESERVE", "DEFAULT_WORK_MEMORY", "DEFAULT_SHARD_OBS",
           "release_memory"]

logger = logging.getLogger(__name__)

MAX_BLOCK_OBS = 1 << 20
#: rows per shard by default: one collection shard of the 100,000-cell benchmark, about
#: 8 per 10**6 cells (few files; see docs/format.md)
DEFAULT_SHARD_OBS = 1 << 17
MIN_WORK_MEMORY = 64 * 10**6  # below this the writer refuses to start
RESERVE = 48 * 10**6  # zarr's thread pool, its malloc arenas, allocator slack
#: working memory when max_memory is None: a fresh interpreter with torch (~300 MB) then
#: peaks at ~1 GB
DEFAULT_WORK_MEMORY = 640 * 10**6
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_memory(value: int | float | str) -> int:
    """Bytes from an int or a string like ``"512MB"``, ``"2GiB"`` or ``"1.5G"``.

    ``K/M/G/T`` (with or without ``B``) are powers of 1000, ``KiB/MiB/GiB/TiB`` of 1024;
    a number may have an exponent (``"1e9"``).
    """
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?)?b?\s*",
                     str(value).lower())
    if not m:
        raise InputError(
            f"max_memory={value!r} cannot be parsed; pass bytes (an int) or a string such as "
            "'512MB' or '2GiB'."
        )
    if float(m.group(1)) <= 0:
        raise InputError(f"max_memory={value!r} must be more than 0 bytes; pass a size such "
                         "as '2GB', or leave it out for the default budget.")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def _mb(n: int) -> str:
    """``n`` bytes as a ``max_memory`` string, e.g. ``"415MB"`` (``"0.0001MB"`` for 100)."""
    return f"{n / 1e6:.4g}MB"


def current_rss() -> int | None:
    """Resident set size of this process in bytes; ``None`` where it cannot be measured.

    Linux: ``/proc/self/statm``; elsewhere ``psutil`` when installed.
    """
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # not installed, or no access on this platform
        return None


def _preload() -> None:
    """Import what the passes use, so the baseline counts it (not the working memory)."""
    import anndata.io  # noqa: F401
    import tqdm.auto  # noqa: F401
    import zarr
    import zarr.codecs  # noqa: F401


def working_memory(max_memory: int | None, n_cells: int) -> int:
    """Bytes the writer's buffers may use (its working memory).

    ``max_memory`` minus the RSS in use now, the permutation of ``n_cells`` and
    :data:`RESERVE`. Raises :class:`InputError` when under :data:`MIN_WORK_MEMORY` is left.
    ``None`` (the writer's default): :data:`DEFAULT_WORK_MEMORY`, on top of whatever the
    process already uses (never refused; what the passes import is not loaded here then,
    as no baseline is counted: a parallel writer's caller, which writes no shard, never
    imports anndata).
    """
    if max_memory is not None:
        _preload()
        release_memory()
    rss = current_rss()
    if rss is None:
        logger.warning("Cannot measure this process' memory (no /proc, no psutil): "
                       "max_memory then bounds the writer's buffers, not the process.")
        rss = 0
    perm = n_cells * (4 if n_cells < 2**32 else 8)
    if max_memory is None:
        logger.info("max_memory=None: %.0f MB for the writer's buffers on top of the %.0f MB "
                    "this process uses.", DEFAULT_WORK_MEMORY / 1e6, rss / 1e6)
        return DEFAULT_WORK_MEMORY
    work = max_memory - rss - perm - RESERVE
    if work < MIN_WORK_MEMORY:
        need = -(-(rss + perm + RESERVE + MIN_WORK_MEMORY) // 10**6)
        raise InputError(
            f"max_memory={_mb(max_memory)!r} is too small: this process already uses "
            f"{rss / 1e6:.0f} MB (measured RSS: interpreter, libraries, open inputs, data in "
            f"memory), the permutation of {n_cells} cells takes {perm / 1e6:.0f} MB and "
            f"{RESERVE / 1e6:.0f} MB are reserved for zarr's threads, leaving "
            f"{max(work, 0) / 1e6:.0f} MB for the writer's buffers (at least "
            f"{MIN_WORK_MEMORY / 1e6:.0f} MB needed). Pass at least max_memory='{need}MB' "
            "(peak RSS of the whole process stays under it)."
        )
    logger.info("max_memory %.0f MB: baseline RSS %.0f MB, permutation %.0f MB, reserve "
                "%.0f MB, %.0f MB for the writer's buffers.", max_memory / 1e6, rss / 1e6,
                perm / 1e6, RESERVE / 1e6, work / 1e6)
    return work


# -- shard size ------------------------------------------------------------------------
def _avg_name_len(src: InputSource) -> float:
    n = min(src.n_obs, 1000)
    return float(np.mean([len(str(x).encode()) for x in src.names(0, n)])) if n else 16.0


def _nnz_per_row(src: InputSource, key: str) -> float:
    p = src.matrices[key]
    if p.nnz is not None:
        return p.nnz / max(src.n_obs, 1)
    n = min(src.n_obs, 1000)  # dense matrix: sample the first rows
    return float(np.count_nonzero(src.matrix_reader(key, 0).read(0, n))) / max(n, 1)


def _bucket_row_bytes(src: InputSource, schema: Schema) -> float:
    """Bytes one row of ``src`` takes in a bucket (and in memory in pass 2)."""
    b = 12 + _avg_name_len(src)
    for f in schema.fields:
        if f.kind == "csr":
            b += 4 + _nnz_per_row(src, f.key) * (4 + f.dtype.itemsize)
        elif f.kind == "dense":
            b += int(f.width) * f.dtype.itemsize
        else:
            b += max(4, f.dtype.itemsize)
    return b


def _mean(sources: list[InputSource], per_src: list[float]) -> float:
    n = np.array([s.n_obs for s in sources], dtype=np.float64)
    return float(np.dot(per_src, n) / n.sum()) if n.sum() else 0.0


def _mean_nnz(sources: list[InputSource], schema: Schema) -> dict[str, float]:
    """Non-zeros per row of every CSR field, averaged over the inputs (by cells)."""
    return {f.key: _mean(sources, [_nnz_per_row(s, f.key) for s in sources])
            for f in schema.fields if f.kind == "csr"}


def _shard_row_bytes(schema: Schema) -> float:
    """Bytes a shard holds per row until it is closed: its obs names (Python str, ~120 B)
    and obs columns, gathered block by block."""
    return 120.0 + sum(max(4, f.dtype.itemsize) for f in schema.fields
                       if f.kind not in ("csr", "dense"))


def fit_layout(sources: list[InputSource], schema: Schema, work: int, shard_obs: int | None,
               opts: dict[str, Any]) -> int:
    """Rows per shard (``shard_obs``, default :data:`DEFAULT_SHARD_OBS`) and zarr shard
    elements (``opts["shard_elems"]``, lowered in place) that fit the working memory.

    What a shard holds until it is closed (obs names and columns, the appenders' tails) may
    take 40% of ``work``: the default rows per shard are halved until it does, the zarr
    shard size too (an explicit ``shard_obs`` is kept, with a warning). Both are logged.
    """
    from .shardstore import carry_bytes

    sources = [s for s in sources if s.n_obs]
    n_total = sum(s.n_obs for s in sources)
    nnz = _mean_nnz(sources, schema)
    rows = min(int(shard_obs or DEFAULT_SHARD_OBS), max(n_total, 1))
    per_row = _shard_row_bytes(schema)

    def held(r: int) -> float:
        return r * per_row + carry_bytes(schema.fields, opts, nnz, r)

    asked = opts.get("shard_elems")
    while opts.get("shard_elems") and held(rows) > 0.4 * work and \
            opts["shard_elems"] > 2 * int(opts["chunk_elems"]):
        opts["shard_elems"] = int(opts["shard_elems"]) // 2
    if opts.get("shard_elems") and held(rows) > 0.4 * work:
        opts["shard_elems"] = None  # one file per chunk: the smallest tails
    if opts.get("shard_elems") != asked:
        logger.info("zarr_shard_elems=%s lowered to %s to fit the %.0f MB of working memory "
                    "(raise max_memory to keep it).", asked, opts.get("shard_elems"),
                    work / 1e6)
    first = rows
    while shard_obs is None and rows > 1024 and held(rows) > 0.4 * work:
        rows //= 2
    if rows != first:
        logger.info("%d rows per shard (not %d) to fit the %.0f MB of working memory (raise "
                    "max_memory for fewer shards).", rows, first, work / 1e6)
    if held(rows) > 0.4 * work:
        fix = ("lower n_obs_per_shard" if shard_obs is not None
               else f"pass n_obs_per_shard below {rows}")
        logger.warning("%d rows per shard hold about %.0f MB until each shard is written, "
                       "over 40%% of the %.0f MB of working memory; raise max_memory or %s.",
                       rows, held(rows) / 1e6, work / 1e6, fix)
    return rows


def block_size(sources: list[InputSource], schema: Schema, work: int, shuffle: bool,
               shard_obs: int, opts: dict[str, Any]) -> int:
    """Rows per pass-2 block: the block (its bucket and one sorted copy) in what 80% of
    ``work`` leaves once a shard's own state (see :func:`fit_layout`) is counted."""
    from .shardstore import carry_bytes

    sources = [s for s in sources if s.n_obs]  # inputs without cells take no part
    per_src = [_bucket_row_bytes(s, schema) for s in sources]
    row = _mean(sources, per_src) * 1.1 if shuffle else max(per_src) * 1.5
    nnz = _mean_nnz(sources, schema)
    held = shard_obs * _shard_row_bytes(schema) + carry_bytes(schema.fields, opts, nnz,
                                                              shard_obs)
    per_row = 2 * row
    size = int(max(0.8 * work - held, 0) / per_row)
    if size < 256:
        logger.warning("%d bytes of working memory hold only %d rows per block (%.0f "
                       "bytes/row); using 256. Raise max_memory.", work, size, per_row)
        size = 256
    size = min(size, MAX_BLOCK_OBS, shard_obs)
    return size - size % 1024 if size >= 2048 and size < shard_obs else size


def _load_trim() -> Any:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _load_trim()


def release_memory() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``; no-op elsewhere).

    Blocks and shards are large, short-lived arrays: without this, glibc keeps freed
    memory mapped in its arenas and RSS creeps above the ``max_memory`` budget.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
