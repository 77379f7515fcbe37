"""Synthetic single-cell data with realistic structure, for the demo, tests and benchmarks.

:func:`synthetic` draws a cells x genes count matrix straight into CSR form (work and
memory scale with the number of non-zeros, never with ``n_obs * n_vars``):

* **library size**: each cell has a lognormal size factor ``s`` (sigma 0.6), so total
  counts and the number of detected genes vary between cells as in real data;
* **gene popularity**: Zipf-like (``rank ** -1.0``) with genes in random order, so a few
  genes are seen in almost every cell and most in a few percent of cells;
* **cell-type programs**: every cell type up-regulates its own set of genes (about
  ``n_vars / (4 * n_cell_types)`` genes, 8x), so a linear classifier learns the types;
* **batches**: a mild gene-specific multiplicative effect per batch.

A cell ``c`` of group ``k`` (cell type x batch) sees gene ``g`` with probability
``1 - exp(-s_c * lam[k, g])`` (a Poisson count is non-zero) and then holds a count of
``1 + G``, ``G`` geometric (overdispersed like negative-binomial UMI counts) with the mean
of a zero-truncated Poisson. ``lam`` is scaled so the expected fraction of non-zeros is
``density``.

Sampling: genes of each group are sorted by ``lam`` and cut in levels whose rates differ by
at most 2x; inside a level, candidate genes are drawn as a Bernoulli process at the level's
top rate (geometric gaps), then thinned to each gene's own rate. Every step is vectorised.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

__all__ = ["synthetic", "write_synthetic_h5ads", "CELL_TYPE_NAMES"]

#: names given to the first cell types (more types get ``type_<k>``)
CELL_TYPE_NAMES = (
    "T cell", "B cell", "NK cell", "monocyte", "dendritic cell", "erythrocyte", "platelet",
    "neutrophil", "fibroblast", "endothelial", "epithelial", "hepatocyte",
)
_N_LEVELS = 28
_SUPPORTED_LAYERS = ("counts", "log1p")


@dataclass
class _GeneModel:
    """Per-(cell type, batch) expected counts ``lam`` and the level tables for sampling."""

    lam: np.ndarray  # (n_groups, n_vars) float64, rate at size factor 1
    var_names: np.ndarray
    n_cell_types: int
    n_batches: int
    type_probs: np.ndarray

    def restrict(self, cols: np.ndarray) -> _GeneModel:
        return _GeneModel(self.lam[:, cols], self.var_names[cols], self.n_cell_types,
                          self.n_batches, self.type_probs)


def _gene_model(
    n_vars: int, n_cell_types: int, n_batches: int, density: float, var_prefix: str,
    rng: np.random.Generator,
) -> _GeneModel:
    if not 0 < density < 1:
        raise ValueError(f"density must be in (0, 1), got {density}.")
    if n_vars < 1 or n_cell_types < 1 or n_batches < 1:
        raise ValueError("n_vars, n_cell_types and n_batches must be >= 1.")
    base = 1.0 / np.arange(1, n_vars + 1, dtype=np.float64)  # Zipf popularity
    base = base[rng.permutation(n_vars)]
    n_prog = max(5, n_vars // (4 * n_cell_types))
    types = np.empty((n_cell_types, n_vars))
    for t in range(n_cell_types):
        fold = np.ones(n_vars)
        fold[rng.choice(n_vars, size=min(n_prog, n_vars), replace=False)] = 8.0
        types[t] = base * fold
    batch = rng.lognormal(0.0, 0.2, size=(n_batches, n_vars))
    lam = (types[:, None, :] * batch[None, :, :]).reshape(n_cell_types * n_batches, n_vars)
    # scale lam so that E[1 - exp(-s * lam)] == density over size factors and genes
    s_q = np.exp(0.6 * np.sqrt(2) * _erfinv_grid(16))
    sub = lam[:, rng.choice(n_vars, size=min(n_vars, 4000), replace=False)]
    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = (lo + hi) / 2
        d = -np.expm1(-np.exp(mid) * s_q[:, None, None] * sub[None]).mean()
        lo, hi = (mid, hi) if d < density else (lo, mid)
    lam *= np.exp((lo + hi) / 2)
    type_probs = rng.dirichlet(np.full(n_cell_types, 3.0))
    var_names = np.array([f"{var_prefix}{i}" for i in range(n_vars)], dtype=object)
    return _GeneModel(lam, var_names, n_cell_types, n_batches, type_probs)


def _erfinv_grid(n: int) -> np.ndarray:
    """``n`` standard-normal quantiles / sqrt(2) (midpoints), without scipy.special."""
    from statistics import NormalDist

    q = (np.arange(n) + 0.5) / n
    return np.array([NormalDist().inv_cdf(x) for x in q]) / np.sqrt(2)


def _levels(lam: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per group: genes ordered by (rate level, index), level starts, level top rates,
    and the rates as float32 (half the cache footprint for the random lookups).

    Level ``k`` holds the genes whose rate is within ``(top / 2**(k+1), top / 2**k]``.
    """
    top = float(lam.max())
    bounds = top * 2.0 ** -np.arange(_N_LEVELS)
    with np.errstate(divide="ignore"):
        lvl = np.floor(np.log2(top / np.maximum(lam, 1e-300)))
    lvl = np.clip(lvl, 0, _N_LEVELS - 1).astype(np.int64)
    order = np.argsort(lvl, axis=1, kind="stable").astype(np.int32)
    starts = np.stack([np.searchsorted(np.sort(row), np.arange(_N_LEVELS + 1)) for row in lvl])
    return order, starts, bounds, lam.astype(np.float32)


def _sample_block(
    rng: np.random.Generator, lam: np.ndarray, levels: tuple[np.ndarray, ...],
    groups: np.ndarray, scale: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR ``(data, indices, indptr)`` of one block of cells, indices sorted per row.

    Small blocks on purpose: every temporary stays a few MB, so memory is reused instead
    of being page-faulted in again (which dominates the cost of large temporaries).
    """
    order, starts, bounds, lam32 = levels
    nc, n_vars = len(groups), lam.shape[1]
    pc = np.repeat(np.arange(nc, dtype=np.int64), _N_LEVELS)
    pk = np.tile(np.arange(_N_LEVELS), nc)
    grp = groups[pc]
    start = starts[grp, pk]
    nk = starts[grp, pk + 1] - start
    r = scale[pc] * bounds[pk]  # level top rate of each (cell, level) pair
    p = -np.expm1(-r)
    mu = nk * p
    m = np.where(nk > 0, np.minimum(np.ceil(mu + 4 * np.sqrt(mu) + 6), nk), 0).astype(np.int64)
    # Bernoulli(p) process over each level's genes: geometric gaps from exponentials
    gaps = rng.standard_exponential(int(m.sum()), dtype=np.float32)
    gaps *= np.repeat((1.0 / np.maximum(r, 1e-30)).astype(np.float32), m)
    np.minimum(gaps, 1e6, out=gaps)
    pos = np.cumsum(gaps.astype(np.int64) + 1)
    first = np.cumsum(m) - m
    base = pos[np.maximum(first - 1, 0)] if len(pos) else np.zeros(len(m), np.int64)
    base[first == 0] = 0
    pos -= np.repeat(base, m)
    seg = np.repeat(np.arange(len(m), dtype=np.int64), m)
    keep = pos <= nk[seg]
    seg, pos = seg[keep], pos[keep] - 1
    # thin each candidate from the level's top rate down to its gene's own rate
    cell = pc[seg]
    gene = order.ravel()[(grp[seg] * n_vars + start[seg]) + pos]
    rate = scale[cell].astype(np.float32) * lam32.ravel()[groups[cell] * n_vars + gene]
    pi = -np.expm1(-rate)
    acc = rng.random(len(seg), dtype=np.float32) * p[seg].astype(np.float32) < pi
    cell, gene, rate, pi = cell[acc], gene[acc], rate[acc], pi[acc]
    # value | non-zero: 1 + geometric (overdispersed, negative-binomial-like) whose mean is
    # the mean of a zero-truncated Poisson(rate)
    extra = np.maximum(rate / pi - 1.0, 1e-12, dtype=np.float32)
    value = rng.standard_exponential(len(extra), dtype=np.float32)
    value /= np.log1p(1.0 / extra)
    np.minimum(value, 2e9, out=value)
    # sort entries by (cell, gene), carrying the value in the key's low 32 bits
    key = ((cell * n_vars + gene) << 32) | (value.astype(np.int64) + 1)
    key.sort()
    data = (key & 0xFFFFFFFF).astype(np.float32)
    key >>= 32
    cell = key // n_vars
    gene = (key - cell * n_vars).astype(np.int32)
    indptr = np.zeros(nc + 1, dtype=np.int64)
    np.cumsum(np.bincount(cell, minlength=nc), out=indptr[1:])
    return data, gene, indptr


def _sample_cells(
    model: _GeneModel, n_obs: int, rng: np.random.Generator, grouped: bool, dtype: Any,
) -> tuple[sp.csr_matrix, np.ndarray, np.ndarray]:
    cell_type = rng.choice(model.n_cell_types, size=n_obs, p=model.type_probs)
    batch = rng.integers(0, model.n_batches, size=n_obs)
    if grouped:
        o = np.lexsort((batch, cell_type))
        cell_type, batch = cell_type[o], batch[o]
    groups = cell_type * model.n_batches + batch
    scale = rng.lognormal(0.0, 0.6, size=n_obs)
    levels = _levels(model.lam)
    n_vars = model.lam.shape[1]
    block = max(8, min(256, (1 << 16) // max(n_vars // 10, 1)))
    starts = range(0, n_obs, block)
    block_seed = int(rng.integers(2**63))

    def one(a: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # each block has its own generator: the result does not depend on thread timing
        brng = np.random.default_rng([block_seed, a])
        b = min(n_obs, a + block)
        return _sample_block(brng, model.lam, levels, groups[a:b], scale[a:b])

    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        parts = list(pool.map(one, starts))  # numpy releases the GIL in the heavy steps
    datas, inds, ptrs = [], [], [np.zeros(1, np.int64)]
    offset = 0
    for d, i, p in parts:
        datas.append(d.astype(dtype, copy=False))
        inds.append(i)
        ptrs.append(p[1:] + offset)
        offset += int(p[-1])
    del parts
    x = sp.csr_matrix(
        (np.concatenate(datas), np.concatenate(inds), np.concatenate(ptrs)),
        shape=(n_obs, n_vars),
    )
    x.has_sorted_indices = True
    return x, cell_type, batch


def _build(
    model: _GeneModel, n_obs: int, rng: np.random.Generator, *, grouped: bool = False,
    layers: Sequence[str] = (), obsm_pca: int = 0, obs_prefix: str = "cell_",
    dtype: Any = np.float32, sparse: bool = True, x: str = "counts",
) -> Any:
    import anndata as ad

    unknown = [k for k in (*layers, x) if k not in _SUPPORTED_LAYERS]
    if unknown:
        raise ValueError(f"layers {unknown} unknown; supported: {list(_SUPPORTED_LAYERS)}.")
    counts, cell_type, batch = _sample_cells(model, n_obs, rng, grouped, dtype)
    names = list(CELL_TYPE_NAMES) + [
        f"type_{k}" for k in range(len(CELL_TYPE_NAMES), model.n_cell_types)
    ]
    totals = np.asarray(counts.sum(axis=1)).ravel()
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical.from_codes(cell_type, names[: model.n_cell_types]),
            "batch": pd.Categorical.from_codes(
                batch, [f"batch_{b}" for b in range(model.n_batches)]
            ),
            "n_counts": totals.astype(np.float32),
            "n_genes": np.diff(counts.indptr).astype(np.int32),
            "is_doublet": rng.random(n_obs) < 0.03,
        },
        index=pd.Index([f"{obs_prefix}{i}" for i in range(n_obs)]),
    )
    lognorm = None
    if "log1p" in (*layers, x) or obsm_pca:
        lognorm = counts.copy()
        lognorm.data = np.log1p(
            lognorm.data / np.repeat(np.maximum(totals, 1), np.diff(counts.indptr)) * 1e4
        ).astype(dtype)
    obsm = {}
    if obsm_pca:
        proj = rng.standard_normal((counts.shape[1], obsm_pca)) / np.sqrt(counts.shape[1])
        obsm["X_pca"] = np.asarray(lognorm @ proj, dtype=np.float32)
    lay = {}
    for k in layers:
        m = counts.copy() if k == "counts" else lognorm.copy()
        lay[k] = m if sparse else m.toarray()
    xm = counts if x == "counts" else lognorm
    var = pd.DataFrame(index=pd.Index(model.var_names.astype(str)))
    return ad.AnnData(
        X=xm if sparse else xm.toarray(), obs=obs, var=var, layers=lay or None,
        obsm=obsm or None,
    )


def synthetic(
    n_obs: int,
    n_vars: int,
    *,
    n_cell_types: int = 8,
    n_batches: int = 2,
    density: float = 0.092,
    grouped: bool = False,
    seed: int = 0,
    layers: Sequence[str] = (),
    obsm_pca: int = 0,
    var_prefix: str = "gene_",
    obs_prefix: str = "cell_",
    dtype: Any = np.float32,
    sparse: bool = True,
    x: str = "counts",
) -> Any:
    """Generate a realistic synthetic count matrix as an AnnData.

    Parameters
    ----------
    n_obs, n_vars
        Number of cells and genes.
    n_cell_types, n_batches
        Number of cell types (each with its own up-regulated gene program) and batches.
    density
        Expected fraction of non-zero entries (0.092 ~ 1,840 genes per cell of 20,000).
    grouped
        Sort cells by cell type (then batch), as atlases are often written.
    seed
        Seed of everything; the same seed gives the same AnnData.
    layers
        Extra layers: ``"counts"`` (a copy of the counts in X) and/or ``"log1p"``
        (``log1p`` of counts normalised to 10,000 per cell).
    obsm_pca
        If > 0, add ``obsm["X_pca"]``: a random projection of log-normalised counts to this
        many dimensions (float32).
    var_prefix, obs_prefix
        var_names are ``f"{var_prefix}{j}"``, obs_names ``f"{obs_prefix}{i}"``.
    dtype
        dtype of X and layers.
    sparse
        Return X (and layers) as CSR (default) or dense arrays.
    x
        What X holds: ``"counts"`` (default) or ``"log1p"`` (log-normalised counts).

    Returns
    -------
    anndata.AnnData
        X holds counts (or log1p, see ``x``); obs has categorical ``cell_type`` and
        ``batch``, float ``n_counts``, int ``n_genes`` and bool ``is_doublet``.
    """
    rng = np.random.default_rng(seed)
    model = _gene_model(n_vars, n_cell_types, n_batches, density, var_prefix, rng)
    return _build(model, n_obs, rng, grouped=grouped, layers=layers, obsm_pca=obsm_pca,
                  obs_prefix=obs_prefix, dtype=dtype, sparse=sparse, x=x)


def write_synthetic_h5ads(
    directory: str | os.PathLike[str],
    n_files: int,
    n_obs_per_file: int | Sequence[int],
    n_vars: int,
    *,
    overlapping_genes: bool = False,
    seed: int = 0,
    prefix: str = "part",
    **kwargs: Any,
) -> list[Path]:
    """Write ``n_files`` synthetic h5ad files sharing one gene model.

    All files use the same cell-type programs, so a model trained on their union makes
    sense. obs_names are unique across files (``f"{prefix}{i}_cell_{j}"``).

    Parameters
    ----------
    directory
        Folder to write ``{prefix}{i}.h5ad`` into (created if missing).
    n_files, n_obs_per_file, n_vars
        Number of files, cells per file (an int or one per file) and genes per file.
    overlapping_genes
        If True, the files hold different but overlapping gene sets drawn from a pool of
        ``n_vars + n_vars // 4`` genes, in a different order for each file, so an inner
        join keeps fewer genes than an outer join. Otherwise all files share the same genes.
    seed
        Seed of the gene model and of the files (file ``i`` uses ``seed + 1 + i``).
    kwargs
        As in :func:`synthetic`: ``n_cell_types``, ``n_batches``, ``density``,
        ``var_prefix``, ``grouped``, ``layers``, ``obsm_pca``, ``dtype``, ``sparse``, ``x``.

    Returns
    -------
    list of Path
        The written files.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    sizes = [n_obs_per_file] * n_files if isinstance(n_obs_per_file, int) else list(
        n_obs_per_file)
    if len(sizes) != n_files:
        raise ValueError(f"n_obs_per_file has {len(sizes)} entries for {n_files} files.")
    pool = n_vars + (n_vars // 4 if overlapping_genes else 0)
    rng = np.random.default_rng(seed)
    model = _gene_model(
        pool, kwargs.pop("n_cell_types", 8), kwargs.pop("n_batches", 2),
        kwargs.pop("density", 0.092), kwargs.pop("var_prefix", "gene_"), rng,
    )
    paths = []
    for i, n in enumerate(sizes):
        frng = np.random.default_rng(seed + 1 + i)
        cols = np.arange(n_vars)
        if overlapping_genes:
            cols = np.sort(frng.choice(pool, size=n_vars, replace=False))
            if i % 2 == 1:
                cols = frng.permutation(cols)
        adata = _build(model.restrict(cols), n, frng, obs_prefix=f"{prefix}{i}_cell_", **kwargs)
        path = directory / f"{prefix}{i}.h5ad"
        adata.write_h5ad(path)
        paths.append(path)
    return paths
