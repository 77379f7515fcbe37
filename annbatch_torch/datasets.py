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

__all__ = ["synthetic", "synthetic_screen", "write_synthetic_atlas", "write_synthetic_h5ads",
           "CELL_TYPE_NAMES", "CELL_LINE_NAMES", "CONTROL"]

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
    if len(sub) > 32:  # many cell types (an atlas): a sample of groups is as good an estimate
        sub = sub[np.sort(rng.choice(len(sub), size=32, replace=False))]
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


#: names given to the first cell lines of :func:`synthetic_screen` (more get ``line_<k>``)
CELL_LINE_NAMES = ("K562", "RPE1", "HepG2", "Jurkat", "HEK293T", "A549")
#: the ``target_gene`` of control cells in :func:`synthetic_screen`
CONTROL = "non-targeting"


def synthetic_screen(
    n_obs: int,
    n_vars: int,
    *,
    n_perturbations: int = 20,
    control_fraction: float = 0.2,
    n_cell_lines: int = 2,
    n_gem_groups: int = 4,
    knockdown: float = 0.2,
    density: float = 0.092,
    seed: int = 0,
) -> Any:
    """A Perturb-seq-like screen as an AnnData: :func:`synthetic` counts with CRISPRi
    perturbations.

    Each cell carries one guide: ``control_fraction`` of the cells a non-targeting one
    (``target_gene == CONTROL``), the others one of ``n_perturbations`` target genes
    (uniformly), whose counts in that cell are scaled by ``knockdown`` (rounded down).
    The target genes are the most expressed genes, so the knock-down shows.

    Parameters
    ----------
    n_obs, n_vars
        Number of cells and genes.
    n_perturbations
        Target genes (at most ``n_vars``).
    control_fraction
        Fraction of control cells, in ``[0, 1)``.
    n_cell_lines, n_gem_groups
        Cell lines (each with its own gene program, :func:`synthetic`'s cell types) and
        GEM groups (its batches).
    knockdown
        What a perturbation leaves of its target gene's counts, in ``[0, 1]``.
    density, seed
        As in :func:`synthetic`.

    Returns
    -------
    anndata.AnnData
        X holds float32 counts; obs has categorical ``target_gene`` (``CONTROL`` first),
        ``cell_line`` and ``gem_group``, and :func:`synthetic`'s ``n_counts`` and
        ``n_genes`` (after the knock-down).
    """
    if not 1 <= int(n_perturbations) <= n_vars:
        raise ValueError(f"n_perturbations must be in [1, n_vars={n_vars}], got "
                         f"{n_perturbations!r}")
    if not 0.0 <= float(control_fraction) < 1.0:
        raise ValueError(f"control_fraction must be in [0, 1), got {control_fraction!r}")
    if not 0.0 <= float(knockdown) <= 1.0:
        raise ValueError(f"knockdown must be in [0, 1], got {knockdown!r}")
    adata = synthetic(n_obs, n_vars, n_cell_types=n_cell_lines, n_batches=n_gem_groups,
                      density=density, seed=seed)
    rng = np.random.default_rng([seed, 0x53435245])  # "SCRE"
    x = adata.X
    top = np.argsort(-np.asarray(x.sum(axis=0)).ravel(), kind="stable")[:n_perturbations]
    targets = np.asarray(adata.var_names)[top]
    guide = np.where(rng.random(n_obs) < control_fraction, 0,
                     1 + rng.integers(0, n_perturbations, n_obs))
    row = np.repeat(np.arange(n_obs), np.diff(x.indptr))
    hit = (guide[row] > 0) & (x.indices == np.concatenate([[-1], top])[guide[row]])
    x.data[hit] = np.floor(x.data[hit] * knockdown)
    x.eliminate_zeros()
    lines = list(CELL_LINE_NAMES) + [f"line_{k}" for k in range(len(CELL_LINE_NAMES),
                                                                n_cell_lines)]
    obs = adata.obs
    obs["target_gene"] = pd.Categorical.from_codes(guide, [CONTROL, *targets])
    obs["cell_line"] = pd.Categorical.from_codes(obs.pop("cell_type").cat.codes,
                                                 lines[:n_cell_lines])
    obs["gem_group"] = pd.Categorical.from_codes(
        obs.pop("batch").cat.codes, [f"gem_{b}" for b in range(n_gem_groups)])
    obs["n_counts"] = np.asarray(x.sum(axis=1)).ravel().astype(np.float32)
    obs["n_genes"] = np.diff(x.indptr).astype(np.int32)
    del obs["is_doublet"]
    adata.obs = obs[["target_gene", "cell_line", "gem_group", "n_counts", "n_genes"]]
    return adata


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


#: assays and tissues of the synthetic atlas (each input holds one to three of each)
ATLAS_ASSAYS = (
    "10x 3' v2", "10x 3' v3", "10x 5' v1", "10x 5' v2", "Smart-seq2", "Drop-seq", "Seq-Well",
    "sci-RNA-seq3", "CEL-seq2", "inDrop",
)
ATLAS_TISSUES = (
        "blood", "bone marrow", "lung", "liver", "kidney", "heart", "brain", "spleen",
        "lymph node", "skin", "colon", "small intestine", "stomach", "pancreas", "breast",
        "prostate", "testis", "ovary", "uterus", "adipose", "muscle", "thymus", "tonsil",
        "retina", "placenta", "bladder", "esophagus", "trachea", "adrenal gland", "thyroid",
)


def _input_sizes(n_obs: int, n_inputs: int, rng: np.random.Generator,
                 largest: int = 10**6) -> np.ndarray:
    """Heavy-tailed input sizes (Pareto, a few large inputs, many small) summing to
    ``n_obs``, each within ``[min(100, n_obs // n_inputs), largest]``."""
    if n_inputs < 1 or n_obs < n_inputs:
        raise ValueError(f"write_synthetic_atlas: n_obs ({n_obs:,}) must be at least "
                         f"n_inputs ({n_inputs:,}), and n_inputs at least 1.")
    if n_obs > largest * n_inputs:
        raise ValueError(f"write_synthetic_atlas: inputs hold at most {largest:,} cells: use "
                         f"n_inputs >= {-(-n_obs // largest):,} for {n_obs:,} cells.")
    lo = max(1, min(100, n_obs // n_inputs))
    w = rng.pareto(1.1, n_inputs) + 1.0
    sizes = np.clip(np.floor(w / w.sum() * n_obs), lo, largest).astype(np.int64)
    for _ in range(200):  # move the rounding and clipping remainder where there is room
        diff = n_obs - int(sizes.sum())
        if diff == 0:
            break
        room = (largest - sizes) if diff > 0 else (sizes - lo)
        share = np.floor(room / room.sum() * abs(diff)).astype(np.int64)
        if not share.sum():
            share[int(np.argmax(room))] = min(abs(diff), int(room.max()))
        sizes += share if diff > 0 else -share
    return sizes


def _atlas_block(model: _GeneModel, levels: tuple[np.ndarray, ...], types: np.ndarray,
                 scale: np.ndarray, local: np.ndarray, n_local: int,
                 rng: np.random.Generator, pool: ThreadPoolExecutor) -> sp.csr_matrix:
    """CSR counts of one block of cells over an input's genes (``local[g]``: gene ``g`` of
    the universe's column in the input, -1 where the input lacks it), sorted per row; runs
    of 256 cells drawn on ``pool``'s threads, each with a generator of its own."""
    seed = int(rng.integers(2**63))

    def run(a: int) -> sp.csr_matrix:
        b = min(len(types), a + 256)
        d, g, p = _sample_block(np.random.default_rng([seed, a]), model.lam, levels,
                                types[a:b], scale[a:b])
        rows = np.repeat(np.arange(b - a, dtype=np.int64), np.diff(p))
        col = local[g]
        keep = col >= 0
        m = sp.csr_matrix((d[keep], (rows[keep], col[keep])), shape=(b - a, n_local))
        m.sort_indices()
        return m

    return sp.vstack(list(pool.map(run, range(0, len(types), 256))), format="csr")


def write_synthetic_atlas(
    out_dir: str | os.PathLike[str],
    n_obs: int,
    n_inputs: int = 100,
    *,
    seed: int = 0,
    n_genes: int = 30_000,
    n_cell_types: int = 500,
    genes_per_cell: int = 250,
    block_obs: int = 20_000,
    progress: bool = True,
) -> list[Path]:
    """Write a realistic many-input atlas of ``n_obs`` cells, streamed in bounded memory.

    Real atlases (CELLxGENE Census, scBaseCount) are hundreds of files that differ in size,
    genes, formats and categories; this writes ``n_inputs`` such inputs into ``out_dir``,
    block by block (``block_obs`` cells at a time: memory follows the block and the largest
    input's obs, never ``n_obs``):

    * input sizes heavy-tailed (Pareto: a few large inputs, many small; 100 to 10**6 cells);
    * a universe of ``n_genes`` genes (``ENSG...`` ids); 60% of them (a core) are in every
      input, each input keeps its own share of the rest (60-100% of the universe in all),
      in an order of its own;
    * integer counts: a rate per (cell type, gene) with Zipf gene popularity and a program
      of up-regulated genes per type, a lognormal library size per cell (sigma 0.8), a
      count given non-zero drawn overdispersed (negative-binomial-like); about
      ``genes_per_cell`` non-zeros per cell (median);
    * most inputs CSR float32 (every tenth int32), the two smallest dense (up to 1,000
      cells), the next two CSC (up to 50,000 cells), and one (a middle-sized one) an AnnData
      zarr store;
    * obs: ``cell_type`` (``n_cell_types`` categories, Zipf shares; each input holds its own
      subset, so the categories of a column differ between inputs), ``donor_id`` (about one
      donor per 1,000 cells, unique to its input), ``assay`` (10 in all, 1-2 per input),
      ``tissue`` (30 in all, 1-3 per input) and a numeric ``n_counts``; obs_names are
      unique across inputs, and across atlases of other seeds (``s{seed}_a{input}_c{row}``:
      an atlas of another seed can be appended to a collection of this one).

    Parameters
    ----------
    out_dir
        Folder to write into (created if missing): ``input_{i:03d}.h5ad`` (or ``.zarr``) and
        ``atlas.json`` (each input's path, cells, genes and format), written last.
    n_obs
        Cells in all.
    n_inputs
        Number of inputs.
    seed
        Seed of everything; the same arguments give the same files.
    n_genes, n_cell_types, genes_per_cell
        Size of the gene universe, of the cell-type vocabulary and the median number of
        non-zero genes per cell.
    block_obs
        Cells generated and written at a time (memory bound).
    progress
        Show a progress bar (tqdm) over cells.

    Returns
    -------
    list of Path
        The inputs, in order.
    """
    import json

    import anndata as ad
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if n_genes < 10 or n_cell_types < 1 or genes_per_cell < 1 or block_obs < 1:
        raise ValueError("write_synthetic_atlas: n_genes >= 10, n_cell_types, "
                         "genes_per_cell and block_obs >= 1 are needed.")
    rng = np.random.default_rng(seed)
    sizes = _input_sizes(n_obs, n_inputs, rng)
    # expected genes kept by an input: 0.6 + 0.4 * U(0, 1) on average 0.8 of the universe
    density = min(0.5, genes_per_cell / (0.8 * n_genes))
    model = _gene_model(n_genes, n_cell_types, 1, density, "ENSG", rng)
    model.var_names = np.array([f"ENSG{i:011d}" for i in range(n_genes)], dtype=object)
    levels = _levels(model.lam)
    zipf = 1.0 / np.arange(1, n_cell_types + 1) ** 1.1
    type_names = np.array(list(CELL_TYPE_NAMES)[:n_cell_types] + [
        f"type_{k}" for k in range(len(CELL_TYPE_NAMES), n_cell_types)], dtype=object)
    core = rng.permutation(n_genes)
    n_core = int(0.6 * n_genes)
    order = np.argsort(sizes, kind="stable")
    fmt = ["csr"] * n_inputs
    fmt[int(order[n_inputs // 2])] = "zarr"
    small = [int(i) for i in order if fmt[i] == "csr"]
    for i in [i for i in small if sizes[i] <= 1_000][:2]:  # built whole: small ones only
        fmt[i] = "dense"
    for i in [i for i in small if fmt[i] == "csr" and sizes[i] <= 50_000][:2]:
        fmt[i] = "csc"
    paths, records = [], []
    bar = tqdm(total=n_obs, unit="cells", desc="synthetic atlas", disable=not progress)
    pool = ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)))
    for i, n in enumerate(int(s) for s in sizes):
        irng = np.random.default_rng([seed, i])
        extra = core[n_core:][irng.random(n_genes - n_core) < irng.uniform(0.0, 1.0)]
        genes = irng.permutation(np.concatenate([core[:n_core], extra]))
        local = np.full(n_genes, -1, dtype=np.int64)
        local[genes] = np.arange(len(genes))
        present = np.sort(irng.choice(n_cell_types, size=min(n_cell_types, int(
            irng.integers(30, 301))), replace=False))
        p = zipf[present] / zipf[present].sum()
        types = present[irng.choice(len(present), size=n, p=p)]
        scale = irng.lognormal(0.0, 0.8, size=n)
        n_donors = max(1, round(n / 1000))
        donors = irng.zipf(1.5, size=n) % n_donors
        assays = irng.choice(len(ATLAS_ASSAYS), size=int(irng.integers(1, 3)), replace=False)
        tissues = irng.choice(len(ATLAS_TISSUES), size=int(irng.integers(1, 4)),
                              replace=False)
        dtype = np.int32 if i % 10 == 9 else np.float32
        var = pd.DataFrame(index=pd.Index(model.var_names[genes].astype(str)))
        path = out / f"input_{i:03d}.{'zarr' if fmt[i] == 'zarr' else 'h5ad'}"
        n_counts = np.zeros(n, dtype=np.float32)
        blocks = []
        for a in range(0, n, block_obs):
            b = min(n, a + block_obs)
            m = _atlas_block(model, levels, types[a:b], scale[a:b], local, len(genes), irng,
                             pool)
            m.data = np.rint(m.data).astype(dtype)
            n_counts[a:b] = np.asarray(m.sum(axis=1)).ravel()
            if fmt[i] in ("csr", "zarr"):  # streamed: one block in memory at a time
                _append_x(path, m, first=a == 0)
            else:  # dense and CSC inputs are small ones, built whole
                blocks.append(m)
            bar.update(b - a)
        obs = pd.DataFrame({
            "cell_type": pd.Categorical(type_names[types]),
            "donor_id": pd.Categorical(np.char.add(f"s{seed}_d{i}_", donors.astype(str))),
            "assay": pd.Categorical(np.asarray(ATLAS_ASSAYS, dtype=object)[
                assays[irng.integers(0, len(assays), size=n)]]),
            "tissue": pd.Categorical(np.asarray(ATLAS_TISSUES, dtype=object)[
                tissues[irng.integers(0, len(tissues), size=n)]]),
            "n_counts": n_counts,
        }, index=pd.Index([f"s{seed}_a{i}_c{j}" for j in range(n)]))
        if fmt[i] in ("csr", "zarr"):
            _finish_streamed(path, obs, var)
        else:
            x = sp.vstack(blocks, format="csr")
            x = x.toarray() if fmt[i] == "dense" else x.tocsc()
            ad.AnnData(X=x, obs=obs, var=var).write_h5ad(path)
        del blocks
        paths.append(path)
        records.append({"path": path.name, "n_obs": n, "n_vars": len(genes),
                        "format": fmt[i], "dtype": np.dtype(dtype).name})
    bar.close()
    pool.shutdown()
    (out / "atlas.json").write_text(json.dumps(
        {"n_obs": n_obs, "n_inputs": n_inputs, "seed": seed, "n_genes": n_genes,
         "n_cell_types": n_cell_types, "genes_per_cell": genes_per_cell,
         "inputs": records}, indent=1))
    return paths


def _open_store(path: Path, mode: str) -> Any:
    if path.suffix == ".zarr":
        import zarr

        return zarr.open_group(path, mode=mode, zarr_format=2)
    import h5py

    return h5py.File(path, mode)


def _append_x(path: Path, m: sp.csr_matrix, first: bool) -> None:
    """Write (``first``) or append one block of CSR rows to ``path``'s X."""
    import anndata as ad

    if first:
        if path.exists():
            import shutil

            shutil.rmtree(path) if path.is_dir() else path.unlink()
        f = _open_store(path, "w")
        ad.io.write_elem(f, "X", m)
    else:
        f = _open_store(path, "r+")
        ad.io.sparse_dataset(f["X"]).append(m)
    if hasattr(f, "close"):
        f.close()


def _finish_streamed(path: Path, obs: pd.DataFrame, var: pd.DataFrame) -> None:
    """The rest of an AnnData store whose X was streamed: obs, var, empty mappings and
    the root's encoding (what ``anndata`` writes)."""
    import anndata as ad

    f = _open_store(path, "r+")
    for key, value in (("obs", obs), ("var", var)):
        ad.io.write_elem(f, key, value)
    for key in ("obsm", "varm", "obsp", "varp", "layers", "uns"):
        ad.io.write_elem(f, key, {})
    f.attrs["encoding-type"] = "anndata"
    f.attrs["encoding-version"] = "0.1.0"
    if hasattr(f, "close"):
        f.close()
