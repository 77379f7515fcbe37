"""``annbatch-torch info``: a summary of a collection (local or on an object store) or of an
AnnData input (.h5ad file or zarr store), opened read-only as the writer opens it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..errors import AnnBatchError
from .args import (
    PROG,
    CliError,
    CliParser,
)

__all__ = ["run_info"]


# -- info --------------------------------------------------------------------------------
def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def _categories(cats: list[Any], limit: int, ordered: bool = False,
                counts: Any = None) -> str:
    """``counts``: a pandas Series of cells per category (``Source.category_counts``)."""
    if counts is not None:
        missing = int(counts.iloc[len(cats):].sum()) if len(counts) > len(cats) else 0
        shown = ", ".join(f"{c} ({int(n):,})" for c, n in zip(cats[:limit], counts.iloc[:limit]))
        if missing:
            shown += f"; missing ({missing:,})"
    else:
        shown = ", ".join(map(str, cats[:limit]))
    head = f"{len(cats)} categories{' (ordered)' if ordered else ''}"
    if limit == 0:  # --max-categories 0: the count alone
        return head
    more = f", ... (+{len(cats) - limit})" if len(cats) > limit else ""
    return f"{head}: {shown}{more}"


def _first(names: Any, n: int = 5) -> str:
    names = list(names[:n + 1])
    return ", ".join(map(str, names[:n])) + (", ..." if len(names) > n else "")


def run_info(args: argparse.Namespace, parser: CliParser) -> int:
    from ..store.manifest import MANIFEST_NAME
    from ..store.remote.location import is_url

    if is_url(args.store):  # credentials and endpoint from the environment
        return _info_collection(args.store, args)
    path = Path(args.store).expanduser()
    if not (path.exists() or path.is_symlink()):
        raise CliError(f"{path}: no such file or folder.")
    if path.is_dir() and (path / MANIFEST_NAME).exists():
        return _info_collection(path, args)
    from ..store.inputs.open import open_store

    try:
        group = open_store(path)
    except AnnBatchError as e:
        if path.is_dir() and not any(path.iterdir()):
            raise CliError(f"{path}: an empty folder, neither a collection nor an AnnData "
                           "store. Write a collection there with: annbatch-torch shuffle "
                           f"INPUT ... -o {path} --overwrite") from e
        if path.is_dir():  # a folder: say what a collection folder lacks
            return _info_collection(path, args)
        raise CliError(f"{path}: a file, not a collection folder (a collection is a folder "
                       f"with a {MANIFEST_NAME}), and not an AnnData .h5ad file either: {e}"
                       ) from e
    if hasattr(group, "close"):  # h5py; a zarr group holds nothing open
        group.close()
    return _info_anndata(path, args)


def _info_collection(path: Path | str, args: argparse.Namespace) -> int:
    from ..store.collection import open_collection
    from ..store.inputs.open import disk_usage

    coll = open_collection(path)
    m = coll.manifest
    if args.json:
        print(json.dumps(m.to_json(), indent=1))
        return 0
    sizes = coll.shard_sizes
    print(f"collection  {coll.describe()}")
    print(f"format      {m.format_version} ({m.created_by or 'unknown writer'})")
    print(f"cells       {coll.n_obs:,}")
    print(f"genes       {coll.n_vars:,} (var_join={m.var_join}; first: "
          f"{_first(coll.var_names)})")
    if coll.raw_var_names is not None:
        print(f"raw genes   {len(coll.raw_var_names):,} (first: {_first(coll.raw_var_names)})")
    var_columns = list(coll.var.columns)
    print("var         " + (", ".join(map(str, var_columns)) if var_columns else "(no columns)"))
    raw_var = coll.raw_var
    if raw_var is not None:
        print("raw var     " + (", ".join(map(str, raw_var.columns)) if len(raw_var.columns)
                                else "(no columns)"))
    print(f"shards      {len(sizes)} of {min(sizes):,}-{max(sizes):,} rows" if sizes else
          "shards      0")
    if coll.group_by is not None:
        print(f"grouped by  {coll.group_by} (each shard's rows sorted by it)")
    if coll.mirror is not None:
        print(f"stored      {_human(sum(s for s, _ in coll.mirror.objects.values()))}")
    else:
        print(f"on disk     {_human(disk_usage(coll.path)[0])}")
    print(f"shuffle     {m.shuffle} (seed {m.seed})")
    print("fields")
    for name, f in coll.fields.items():
        dims = ["n" if s is None else str(s) for s in f.shape]
        shape = f"({dims[0]},)" if len(dims) == 1 else f"({', '.join(dims)})"
        line = f"  {name:<24} {f.kind:<12} {f.dtype:<8} {shape:<10}"
        if f.kind == "categorical":
            counts = coll.category_counts(name[4:]) if name.startswith("obs/") else None
            line += "  " + _categories(list(f.categories or ()), args.max_categories,
                                       bool(f.ordered), counts)
        if f.kind == "csr":
            line += "  " + _stored(m.shards, name, f.dtype)
        print(line.rstrip())
    for name, why in coll.unavailable.items():
        print(f"  {name:<24} (not available: {why})")
    print("inputs")
    for rec in m.inputs:
        where = rec.get("path") or rec.get("name") or "?"
        size = rec.get("size")
        size_txt = f", {_human(size)}" if isinstance(size, int | float) else ""
        n = rec.get("n_obs")
        cells = f"{n:,}" if isinstance(n, int) else "?"
        print(f"  {where} ({cells} cells{size_txt})")
    return 0


def _stored(shards: list[Any], name: str, dtype: str) -> str:
    """How the shards store a sparse field, e.g. ``stored as uint8 values / uint16 indices
    (3 shards), uint32 / uint16 (1)`` (shards without a record: the field's dtype and int32,
    as written before the narrow dtypes)."""
    counts: dict[tuple[str, str], int] = {}
    for s in shards:
        key = (s.stored.get(f"{name}/data", dtype), s.stored.get(f"{name}/indices", "int32"))
        counts[key] = counts.get(key, 0) + 1
    parts = []
    for k, ((values, indices), n) in enumerate(counts.items()):
        what = f"{values} values / {indices} indices" if k == 0 else f"{values} / {indices}"
        parts.append(f"{what} ({n}{' shard' if k == 0 else ''}{'s' if k == 0 and n != 1 else ''})")
    return "stored as " + ", ".join(parts)


def _info_anndata(path: Path, args: argparse.Namespace) -> int:
    """Summarise an .h5ad file or AnnData zarr store, opened read-only as the writer does."""
    from ..store.inputs.open import disk_usage
    from ..store.inputs.view import open_input

    kind = "an AnnData zarr store" if path.is_dir() else "an AnnData .h5ad file"
    try:
        src = open_input(path, 0)
    except AnnBatchError as e:
        raise CliError(f"{path}: {kind}, not a collection folder; it cannot be "
                       f"summarised: {e}") from e
    assert src.path is not None
    try:
        layers = {k[len("layers/"):]: p for k, p in src.matrices.items()
                  if k.startswith("layers/")}
        obsm = {k[len("obsm/"):]: p for k, p in src.obsm.items()}
        if args.json:
            def probe(p: Any) -> dict[str, Any]:
                return {"kind": p.kind, "dtype": str(p.dtype), "shape": list(p.shape)}

            print(json.dumps({
                "path": str(src.path), "kind": src.kind, "collection": False,
                "n_obs": src.n_obs, "n_vars": len(src.var_names),
                "X": probe(src.matrices["X"]) if "X" in src.matrices else None,
                "layers": {k: probe(p) for k, p in layers.items()},
                "obsm": {k: probe(p) for k, p in obsm.items()},
                "obs": {c: {"kind": p.kind, "dtype": str(p.dtype),
                            **({"categories": [str(x) for x in p.categories]}
                               if p.categories is not None else {})}
                        for c, p in src.obs.items()},
            }, indent=1))
            return 0

        def matrix(p: Any) -> str:
            cols = f", {p.shape[1]:,} columns" if len(p.shape) == 2 else ""
            return f"{p.kind} {p.dtype}{cols}"

        print(f"{src.path}: {kind}, not a collection folder. Shuffle it into one "
              f"with: {PROG} shuffle {src.path} -o STORE")
        print(f"cells       {src.n_obs:,}")
        print(f"genes       {len(src.var_names):,} (first: {_first(src.var_names)})")
        print(f"on disk     {_human(disk_usage(src.path)[0])}")
        print("X           " + (matrix(src.matrices["X"]) if "X" in src.matrices
                                   else "(none: X is None)"))
        if "raw/X" in src.matrices:  # its columns are its raw genes
            print(f"raw         {matrix(src.matrices['raw/X'])}")
        print("layers      " + (", ".join(f"{k} ({matrix(p)})" for k, p in layers.items())
                                or "(none)"))
        print("obsm        " + (", ".join(f"{k} ({matrix(p)})" for k, p in obsm.items())
                                or "(none)"))
        print(f"obs         {len(src.obs)} column{'' if len(src.obs) == 1 else 's'}")
        for c, p in src.obs.items():
            line = f"  {c:<24} {p.kind:<12} {p.dtype!s:<8}"
            if p.categories is not None:
                line += "  " + _categories(list(p.categories), args.max_categories, p.ordered)
            elif p.why:
                line += f"  ({p.why})"
            print(line.rstrip())
    finally:
        src.close()
    return 0
