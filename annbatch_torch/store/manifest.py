"""The collection's ``manifest.json``: schema, validation and (de)serialisation.

The manifest is plain JSON (never pickle). It is written last, after every shard is
complete, so a folder without a valid manifest is never mistaken for a collection.

Layout (format version 2; 1 when no shard stores a narrower dtype, see below)::

    {
      "format": "annbatch_torch.collection",
      "format_version": 1,
      "created_by": "annbatch_torch 0.1.0",
      "n_obs": 100000, "n_vars": 20000,
      "var_names_file": "var_names.json",      # JSON list of strings beside the manifest
      "var_names_sha256": "…",
      "shards": [{"path": "shard_00000.zarr", "n_obs": 65536,
                  "stored": {"X/data": "uint8", "X/indices": "uint16"}}, …],
      "fields": {
        "X":             {"kind": "csr",         "dtype": "float32", "shape": [null, 20000]},
        "layers/counts": {"kind": "csr",         "dtype": "float32", "shape": [null, 20000]},
        "obsm/X_pca":    {"kind": "dense",       "dtype": "float32", "shape": [null, 50]},
        "obs/cell_type": {"kind": "categorical", "dtype": "int16",   "shape": [null],
                          "categories": ["B", "T", …], "ordered": false},
        "obs/n_counts":  {"kind": "numeric",     "dtype": "float32", "shape": [null]},
        "obs/is_doublet":{"kind": "bool",        "dtype": "bool",    "shape": [null]}
      },
      "shuffle": true, "seed": 0, "var_join": "inner",
      "inputs": [{"path": "/abs/a.h5ad", "size": 123, "mtime": 1.7e9, "n_obs": 50000}, …],
      "all_chunks_written": true,              # optional; then a missing chunk is damage
      "raw_var_names_file": "raw_var_names.json",  # with field "raw/X": raw's genes
      "unavailable": {"obs/barcode": "why"}    # optional; input fields left out, and why
    }

Each shard is an AnnData zarr store; field ``"obs/c"`` of kind categorical lives at
``obs/c/codes`` and its codes index the manifest's global ``categories``.
A CSR field's ``dtype`` is what readers deliver; a shard's ``stored`` says what its
``data`` and ``indices`` arrays hold (the narrowest lossless dtype the writer found,
``annbatch_torch/write/narrow.py``), and readers widen them. Shards without ``stored``
hold ``dtype`` and int32 (collections written before).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CollectionError

__all__ = [
    "field_name_problem",
    "looks_like_collection",
    "unfinished_collection",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "VAR_NAMES_NAME",
    "RAW_VAR_NAMES_NAME",
    "RAW_X",
    "FieldInfo",
    "ShardInfo",
    "Manifest",
    "read_manifest",
    "write_manifest",
    "var_names_digest",
]

FORMAT = "annbatch_torch.collection"
#: the newest format this package reads and writes. 2: shards may store a CSR field's values
#: in a narrower dtype than the field's and its column indices as uint16 (``ShardInfo.stored``);
#: a collection is written as version 1 when no shard does, so older readers still open it
FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
VAR_NAMES_NAME = "var_names.json"
RAW_VAR_NAMES_NAME = "raw_var_names.json"
FIELD_KINDS = ("csr", "dense", "categorical", "numeric", "bool")
#: the field of AnnData's ``raw`` matrix (its genes: :attr:`Manifest.raw_var_names`)
RAW_X = "raw/X"


@dataclass(frozen=True)
class FieldInfo:
    """Schema of one stored field.

    Attributes
    ----------
    kind
        ``"csr"`` (sparse matrix), ``"dense"`` (2-D array), ``"categorical"``,
        ``"numeric"`` or ``"bool"`` (1-D obs columns).
    dtype
        numpy dtype name of the stored values (codes for categoricals).
    shape
        ``[None, n_cols]`` for matrices, ``[None]`` for obs columns.
    categories
        Global categories of a categorical column (codes index into them).
    """

    kind: str
    dtype: str
    shape: tuple[int | None, ...]
    categories: tuple[Any, ...] | None = None
    ordered: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "dtype": self.dtype, "shape": list(self.shape)}
        if self.kind == "categorical":
            out["categories"] = list(self.categories or ())
            out["ordered"] = self.ordered
        return out

    @classmethod
    def from_json(cls, name: str, obj: Any, where: str) -> FieldInfo:
        if not isinstance(obj, dict) or obj.get("kind") not in FIELD_KINDS:
            raise CollectionError(
                f"{where}: field {name!r} has no valid 'kind' (one of {list(FIELD_KINDS)}); "
                "the manifest is damaged, rewrite the collection."
            )
        def bad(what: str) -> CollectionError:
            return CollectionError(f"{where}: field {name!r} has {what}; the manifest is "
                                   "damaged, rewrite the collection.")

        cats = obj.get("categories")
        if cats is not None and not isinstance(cats, list):
            raise bad(f"'categories' {cats!r}, not a JSON list")
        shape = obj.get("shape", [None])
        if not isinstance(shape, list) or not shape or not all(
                v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)
                for v in shape):
            raise bad(f"'shape' {shape!r}, not a list of sizes (null for the rows)")
        ordered = obj.get("ordered", False)
        if not isinstance(ordered, bool):
            raise bad(f"'ordered' {ordered!r}, not true or false")
        dtype = obj.get("dtype", "float32")
        try:
            ok = isinstance(dtype, str) and np.dtype(dtype).kind in "biuf"
        except TypeError:
            ok = False
        if not ok:
            raise bad(f"'dtype' {dtype!r}, not a numeric numpy dtype")
        return cls(
            kind=obj["kind"],
            dtype=dtype,
            shape=tuple(shape),
            categories=tuple(cats) if cats is not None else None,
            ordered=ordered,
        )


@dataclass(frozen=True)
class ShardInfo:
    """One shard: its folder name relative to the collection root, its row count, and the
    write that made it (``generation``, a random id; ``None`` in collections written before
    it was recorded): a reader sees whether a shard it reads was replaced since it opened
    the collection."""

    path: str
    n_obs: int
    generation: str | None = None
    #: the stored dtype of each CSR field's ``data`` and ``indices`` arrays in this shard
    #: (``{"X/data": "uint8", "X/indices": "uint16"}``); readers widen them to the field's
    #: dtype. Empty in collections written before: ``dtype`` and int32.
    stored: dict[str, str] = field(default_factory=dict, hash=False)
    #: the obs column by which this shard's rows are sorted (``group_by``), ``None``: not
    #: sorted (or written by a version that did not record it)
    grouped_by: str | None = None


@dataclass
class Manifest:
    """In-memory form of ``manifest.json``."""

    n_obs: int
    n_vars: int
    shards: list[ShardInfo]
    fields: dict[str, FieldInfo]
    var_names: list[str]
    seed: int | None = 0
    shuffle: bool = True
    var_join: str = "inner"
    inputs: list[dict[str, Any]] = field(default_factory=list)
    #: the version it was read as (written: at least :meth:`version_needed`)
    format_version: int = 1
    created_by: str = ""
    #: every chunk of every array was written (zarr ``write_empty_chunks=True``), so a
    #: missing chunk file is damage, not an implicit fill value; readers then check
    all_chunks_written: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    #: the genes of ``raw/X`` (AnnData's ``raw``), when the collection carries it
    raw_var_names: list[str] | None = None

    def grouped_by(self) -> str | None:
        """The obs column by which every shard's rows are sorted (each shard records it),
        else ``None``."""
        got = self.shards[0].grouped_by if self.shards else None
        if got is None or any(s.grouped_by != got for s in self.shards):
            return None
        return got

    def version_needed(self) -> int:
        """The format version readers need: 2 when a shard stores a CSR field's values in
        another dtype than the field's or its indices other than int32, else 1."""
        for s in self.shards:
            for key, dtype in s.stored.items():
                name, _, part = key.rpartition("/")
                info = self.fields.get(name)
                wide = "int32" if part == "indices" else (info.dtype if info else dtype)
                if dtype != wide:
                    return 2
        return 1

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": max(self.format_version, self.version_needed()),
            "created_by": self.created_by,
            "n_obs": self.n_obs,
            "n_vars": self.n_vars,
            "var_names_file": VAR_NAMES_NAME,
            "var_names_sha256": var_names_digest(self.var_names),
            "shards": [{"path": s.path, "n_obs": s.n_obs,
                        **({"generation": s.generation} if s.generation else {}),
                        **({"stored": s.stored} if s.stored else {}),
                        **({"grouped_by": s.grouped_by} if s.grouped_by else {})}
                       for s in self.shards],
            "fields": {k: v.to_json() for k, v in self.fields.items()},
            "shuffle": self.shuffle,
            "seed": self.seed,
            "var_join": self.var_join,
            "inputs": self.inputs,
            "all_chunks_written": self.all_chunks_written,
            **({"raw_var_names_file": RAW_VAR_NAMES_NAME,
                "raw_var_names_sha256": var_names_digest(self.raw_var_names)}
               if self.raw_var_names is not None else {}),
            **({"extra": self.extra} if self.extra else {}),
        }


def var_names_digest(var_names: list[str]) -> str:
    """SHA-256 of the var names joined by NUL: identifies a gene order."""
    h = hashlib.sha256()
    for v in var_names:
        h.update(v.encode())
        h.update(b"\0")
    return h.hexdigest()


def _safe_child(root: Path, rel: Any, what: str, where: str) -> Path:
    """Resolve ``rel`` under ``root`` and refuse anything that escapes it."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or "\\" in rel:
        raise CollectionError(
            f"{where}: {what} path {rel!r} must be a relative name inside the collection; "
            "the manifest is damaged or hostile, rewrite the collection."
        )
    resolved = (root / rel).resolve()
    if resolved.parent != root.resolve() and root.resolve() not in resolved.parents:
        raise CollectionError(
            f"{where}: {what} path {rel!r} points outside the collection root {root}; refusing "
            "to read it. Rewrite the collection with annbatch_torch.create_anndata_collection."
        )
    if ".." in Path(rel).parts:
        raise CollectionError(
            f"{where}: {what} path {rel!r} contains '..'; refusing to read outside the store."
        )
    return resolved


def field_name_problem(name: Any) -> str | None:
    """Why ``name`` cannot be a field, or ``None``. A field is ``X``, ``raw/X`` or
    ``layers|obsm|obs/<key>``; the key names one store node (no ``/``, ``\\``, NUL,
    ``.``/``..``, not empty): field names become paths inside shards."""
    if not isinstance(name, str):
        return f"{name!r} is not a string"
    kind, sep, key = name.partition("/")
    if name in ("X", RAW_X):
        return None
    if not sep or kind not in ("layers", "obsm", "obs"):
        return "it is not 'X', 'raw/X', 'layers/NAME', 'obsm/NAME' or 'obs/NAME'"
    if key in ("", ".", ".."):
        return f"the name {key!r} cannot name a folder"
    if kind == "obs" and key == "_index":
        return "'_index' is the name AnnData stores the obs index under"
    bad = [c for c in ("/", "\\", "\0") if c in key]
    if bad:
        return f"the name {key!r} holds {bad[0]!r}, which cannot be part of a folder name"
    return None


def _check_field_name(name: Any, where: str) -> None:
    if field_name_problem(name) is not None:
        raise CollectionError(
            f"{where}: field name {name!r} is not 'X' or 'layers/NAME', 'obsm/NAME', "
            "'obs/NAME' with a plain NAME; the manifest is damaged or hostile, rewrite the "
            "collection."
        )


def _stored(obj: Any) -> dict[str, str]:
    """A shard's ``stored`` entry: ``{"<field>/data" | "<field>/indices": numeric dtype}``."""
    if not isinstance(obj, dict):
        raise TypeError(f"shard 'stored' must be an object, got {obj!r}")
    for key, dtype in obj.items():
        part = key.rpartition("/")[2] if isinstance(key, str) else None
        try:
            ok = isinstance(dtype, str) and np.dtype(dtype).kind in "biuf"
        except TypeError:
            ok = False
        if part not in ("data", "indices") or not ok:
            raise TypeError(f"shard 'stored' entry {key!r}: {dtype!r} is not a "
                            "'<field>/data' or '<field>/indices' key with a numeric dtype")
    return dict(obj)


def _json_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name!r} must be an integer, got {value!r}")
    return value


def write_manifest(root: str | os.PathLike[str], manifest: Manifest) -> None:
    """Write ``var_names.json`` (and ``raw_var_names.json``) then ``manifest.json`` (last)
    into ``root``, atomically."""
    root = Path(root)
    files: list[tuple[str, Any]] = [(VAR_NAMES_NAME, manifest.var_names)]
    if manifest.raw_var_names is not None:
        files.append((RAW_VAR_NAMES_NAME, manifest.raw_var_names))
    for name, obj in (*files, (MANIFEST_NAME, manifest.to_json())):
        tmp = root / (name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1 if name == MANIFEST_NAME else None)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / name)


def _ours(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and obj.get("format") == FORMAT


def unfinished_collection(root: str | os.PathLike[str]) -> bool:
    """Whether ``root`` lacks its ``manifest.json`` but holds this package's whole
    ``manifest.json.tmp``: a manifest written and never put in place (a write stopped
    between the two)."""
    root = Path(root)
    return not (root / MANIFEST_NAME).exists() and _ours(root / (MANIFEST_NAME + ".tmp"))


def looks_like_collection(root: str | os.PathLike[str]) -> bool:
    """Whether ``root`` holds a ``manifest.json`` whose ``format`` is this package's (it
    may still be damaged), or is :func:`unfinished_collection`: the test before a folder
    may be replaced with ``overwrite=True``, so a foreign folder that merely has a
    ``manifest.json`` is kept."""
    return _ours(Path(root) / MANIFEST_NAME) or unfinished_collection(root)


def read_manifest(root: str | os.PathLike[str]) -> Manifest:
    """Read and validate ``root/manifest.json``.

    Raises
    ------
    CollectionError
        If ``root`` is not a finished collection, the manifest is damaged, comes from a
        newer format version, or names shards outside the root.
    """
    root = Path(root)
    mpath = root / MANIFEST_NAME
    if root.is_file():
        raise CollectionError(
            f"{root}: a file, not a collection folder. An .h5ad file is read in place by "
            f"AnnBatchDataset({str(root)!r}), or shuffled into a collection once with "
            f"annbatch_torch.create_anndata_collection([{str(root)!r}], output_path) "
            "(open_collection opens that folder)."
        )
    if not root.is_dir():
        raise CollectionError(
            f"{root}: no such collection folder. Create one with "
            "annbatch_torch.create_anndata_collection(inputs, output_path)."
        )
    if not mpath.is_file():
        if unfinished_collection(root):
            raise CollectionError(
                f"{root}: not a finished annbatch_torch collection ({MANIFEST_NAME} is "
                f"missing beside a whole {MANIFEST_NAME}.tmp; a write may have been "
                "interrupted). Rewrite it with create_anndata_collection(..., "
                "overwrite=True)."
            )
        try:
            names = [p.name for p in root.iterdir()]
        except OSError:  # a folder this process may not list (or gone meanwhile)
            names = ["?"]
        if not names:
            what = ("the folder is empty). Write a collection into it with "
                    "create_anndata_collection(inputs, output_path, overwrite=True).")
        elif any(n.startswith("shard_") and n.endswith(".zarr") for n in names):
            what = ("the folder holds shard_*.zarr folders: a collection whose manifest was "
                    "lost, or a write stopped before it). Its rows cannot be read without "
                    "it: remove the folder yourself (overwrite=True replaces only a folder "
                    "with a manifest) and write the collection again with "
                    "create_anndata_collection(inputs, output_path).")
        else:
            what = ("the folder holds other files). Pass the folder "
                    "create_anndata_collection wrote (its output_path); to write a "
                    "collection, choose another output_path (overwrite=True replaces only a "
                    "collection or an empty folder, never this one).")
        raise CollectionError(
            f"{root}: not an annbatch_torch collection ({MANIFEST_NAME} is missing; {what}")
    try:
        with open(mpath) as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:
        raise CollectionError(
            f"{mpath}: cannot parse the manifest ({e}); rewrite the collection."
        ) from e
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CollectionError(
            f"{mpath}: 'format' is not {FORMAT!r}; this folder is not an annbatch_torch "
            "collection."
        )
    version = obj.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise CollectionError(f"{mpath}: 'format_version' {version!r} is invalid.")
    if version > FORMAT_VERSION:
        raise CollectionError(
            f"{mpath}: 'format_version' is {version}, newer than this annbatch_torch supports "
            f"({FORMAT_VERSION}); upgrade annbatch_torch (pip install -U annbatch-torch)."
        )
    try:
        raw_shards, raw_fields = obj["shards"], obj["fields"]
        n_obs, n_vars = _json_int(obj["n_obs"], "n_obs"), _json_int(obj["n_vars"], "n_vars")
        if not isinstance(raw_shards, list) or not isinstance(raw_fields, dict):
            raise TypeError("'shards' must be a list and 'fields' an object")
        shards, where_to = [], []
        for s in raw_shards:
            where_to.append(_safe_child(root, s["path"], "shard", str(mpath)))
            gen, grouped = s.get("generation"), s.get("grouped_by")
            for what, value in (("generation", gen), ("grouped_by", grouped)):
                if value is not None and not isinstance(value, str):
                    raise TypeError(f"shard {what} must be a string, got {value!r}")
            shards.append(ShardInfo(s["path"], _json_int(s["n_obs"], "n_obs"), gen,
                                    _stored(s.get("stored", {})), grouped))
    except (KeyError, TypeError, ValueError) as e:
        raise CollectionError(
            f"{mpath}: missing or malformed entry {e}; the manifest is damaged, rewrite the "
            "collection."
        ) from e
    if len(set(where_to)) != len(shards):  # also "./shard_0" beside "shard_0"
        raise CollectionError(
            f"{mpath}: a shard is listed twice; the manifest is damaged, rewrite the collection."
        )
    for s in shards:
        if s.n_obs < 0:
            raise CollectionError(
                f"{mpath}: shard {s.path!r} has a negative 'n_obs'; the manifest is damaged, "
                "rewrite the collection."
            )
    if sum(s.n_obs for s in shards) != n_obs:
        raise CollectionError(
            f"{mpath}: shard row counts add up to {sum(s.n_obs for s in shards)} but 'n_obs' "
            f"is {n_obs}; the manifest is damaged, rewrite the collection."
        )
    for k in raw_fields:
        _check_field_name(k, str(mpath))
    fields = {k: FieldInfo.from_json(k, v, str(mpath)) for k, v in raw_fields.items()}
    for s in shards:
        for key in s.stored:
            name = key.rpartition("/")[0]
            if name not in fields or fields[name].kind != "csr":
                raise CollectionError(
                    f"{mpath}: shard {s.path!r} records the stored dtype of {key!r}, but "
                    f"{name!r} is not a sparse field of the collection; the manifest is "
                    "damaged, rewrite the collection.")
    need = Manifest(n_obs, n_vars, shards, fields, []).version_needed()
    if version < need:
        raise CollectionError(
            f"{mpath}: 'format_version' is {version} but its shards store narrow dtypes "
            f"(format version {need}); the manifest is damaged, rewrite the collection.")
    vfile = _safe_child(root, obj.get("var_names_file", VAR_NAMES_NAME), "var names", str(mpath))
    try:
        with open(vfile) as f:
            var_names = json.load(f)
    except (OSError, ValueError) as e:
        raise CollectionError(f"{vfile}: cannot read the var names ({e}).") from e
    if not isinstance(var_names, list) or len(var_names) != n_vars:
        raise CollectionError(
            f"{vfile}: expected a JSON list of {n_vars} var names; rewrite the collection."
        )
    digest = obj.get("var_names_sha256")
    if digest is not None and digest != var_names_digest(var_names):
        raise CollectionError(
            f"{vfile}: var names do not match the manifest's digest; rewrite the collection."
        )
    raw_var_names = _read_raw_var_names(root, obj, fields, str(mpath))
    known = {
        "format", "format_version", "created_by", "n_obs", "n_vars", "var_names_file",
        "var_names_sha256", "shards", "fields", "shuffle", "seed", "var_join", "inputs", "extra",
        "all_chunks_written", "raw_var_names_file", "raw_var_names_sha256",
    }
    for key, kind, ok in (("extra", "a JSON object", isinstance(obj.get("extra", {}), dict)),
                          ("inputs", "a JSON list of objects",
                           isinstance(obj.get("inputs", []), list)
                           and all(isinstance(r, dict) for r in obj.get("inputs", []))),
                          ("seed", "an integer or null", obj.get("seed") is None or (
                              isinstance(obj.get("seed"), int)
                              and not isinstance(obj.get("seed"), bool))),
                          ("shuffle", "true or false", isinstance(obj.get("shuffle", True), bool))):
        if not ok:
            raise CollectionError(f"{mpath}: {key!r} must be {kind}, got {obj.get(key)!r}; the "
                                  "manifest is damaged, rewrite the collection.")
    extra = dict(obj.get("extra", {}))
    extra.update({k: v for k, v in obj.items() if k not in known})
    return Manifest(
        n_obs=n_obs,
        n_vars=n_vars,
        shards=shards,
        fields=fields,
        var_names=[str(v) for v in var_names],
        seed=obj.get("seed"),
        shuffle=bool(obj.get("shuffle", True)),
        var_join=str(obj.get("var_join", "inner")),
        inputs=list(obj.get("inputs", [])),
        format_version=version,
        created_by=str(obj.get("created_by", "")),
        all_chunks_written=obj.get("all_chunks_written") is True,
        extra=extra,
        raw_var_names=raw_var_names,
    )


def _read_raw_var_names(root: Path, obj: dict[str, Any], fields: dict[str, FieldInfo],
                        where: str) -> list[str] | None:
    """The genes of ``raw/X`` (``raw_var_names.json``), checked against its width."""
    if "raw_var_names_file" not in obj:
        if RAW_X in fields:
            raise CollectionError(f"{where}: field {RAW_X!r} has no 'raw_var_names_file'; the "
                                  "manifest is damaged, rewrite the collection.")
        return None
    rfile = _safe_child(root, obj["raw_var_names_file"], "raw var names", where)
    try:
        with open(rfile) as f:
            names = json.load(f)
    except (OSError, ValueError) as e:
        raise CollectionError(f"{rfile}: cannot read the raw var names ({e}).") from e
    width = fields[RAW_X].shape[1] if RAW_X in fields and len(fields[RAW_X].shape) > 1 else None
    if not isinstance(names, list) or (width is not None and len(names) != width):
        raise CollectionError(f"{rfile}: expected a JSON list of {width} raw var names; "
                              "rewrite the collection.")
    digest = obj.get("raw_var_names_sha256")
    if digest is not None and digest != var_names_digest([str(v) for v in names]):
        raise CollectionError(f"{rfile}: raw var names do not match the manifest's digest; "
                              "rewrite the collection.")
    return [str(v) for v in names]
