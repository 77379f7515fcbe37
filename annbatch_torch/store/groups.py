"""A shard's hierarchy opened for reading: raw arrays, zarr arrays, mirrored arrays.

:func:`open_fast_group` opens a zarr v3 group as a :class:`FastGroup`, whose arrays are
:class:`~annbatch_torch.store.rawzarr.RawZarrArray` where their chunks are raw (the fast path)
and zarr arrays otherwise; in the local mirror of a collection on an object store
(:class:`~annbatch_torch.store.remote.mirror.Mirror`) the raw arrays' chunks come through the
chunk cache and the others through zarr-python reading the mirror as a store.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CollectionError
from .rawstrings import RawStringArray, open_raw_strings
from .rawzarr import RawZarrArray, chunk_key_layout, open_raw

if TYPE_CHECKING:
    from .remote.mirror import Mirror

__all__ = ["FastGroup", "open_fast_group"]

#: what a damaged shard's message ends with ("Fix:": a reader wrapping it adds no other)
_DAMAGE_FIX = ("the collection is damaged. Fix: copy it again, or rewrite it with "
               "create_anndata_collection(..., overwrite=True).")


def _read_meta(node: Path, root: Path) -> dict[str, Any]:
    """The ``zarr.json`` of the zarr v3 node at ``node`` (in the shard at ``root``).

    Raises
    ------
    FileNotFoundError, NotADirectoryError
        If the node has no ``zarr.json`` (it is absent).
    CollectionError
        If its ``zarr.json`` is not a JSON object (truncated or corrupted): the message names
        the shard, the element and the fix.
    """
    file = node / "zarr.json"
    try:
        with open(file, "rb") as f:
            meta = json.loads(f.read())
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        why: Exception | None = e
        what = f"not valid JSON ({type(e).__name__}: {e})"
    else:
        if isinstance(meta, dict):
            return meta
        why, what = None, f"not a JSON object but {type(meta).__name__} {meta!r:.40}"
    element = node.relative_to(root).as_posix() if node != root else "."
    raise CollectionError(
        f"{root}: the metadata of {element!r} ({file}) is {what}: the file is truncated or "
        f"corrupted; {_DAMAGE_FIX}"
    ) from why


class FastGroup:
    """Read-only navigation of a zarr v3 hierarchy on the local filesystem that hands out
    :class:`RawZarrArray` for raw arrays and falls back to ``zarr.open_array`` for others.

    Supports what :mod:`annbatch_torch.store.elements` needs: ``group[key]``, ``key in group``,
    ``keys()``, ``attrs``.
    """

    def __init__(self, path: str | os.PathLike[str], mirror: Mirror | None = None,
                 root: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path)
        self.mirror = mirror
        #: the hierarchy's top (the shard folder), for messages
        self.root = self.path if root is None else Path(root)
        try:
            meta = _read_meta(self.path, self.root)
        except FileNotFoundError:
            raise KeyError(str(self.path)) from None
        if meta.get("node_type") != "group":
            raise ValueError(f"{self.path} is not a zarr v3 group")
        self.attrs: dict[str, Any] = meta.get("attributes", {})
        # subgroups and raw arrays handed out once: a flag a reader sets on an array
        # (``require_chunks``) holds for whoever asks for it next
        self._children: dict[str, Any] = {}
        self._through_zarr: set[str] = set()  # children found to need zarr (see plain)

    def keys(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir() if (p / "zarr.json").is_file())

    def array_keys(self) -> list[str]:
        return [k for k in self.keys() if self._meta(k).get("node_type") == "array"]

    def _meta(self, key: str) -> dict[str, Any]:
        metas: dict[str, dict[str, Any]] = self.__dict__.setdefault("_metas", {})
        meta = metas.get(key)
        if meta is None:
            try:
                meta = metas[key] = _read_meta(self.path / key, self.root)
            except (FileNotFoundError, NotADirectoryError):
                raise KeyError(key) from None
        return meta

    def chunk_files(self, key: str) -> tuple[int, int] | None:
        """``(present, expected)`` chunk files of array ``key``, counted from its metadata
        and the folder, without opening it through zarr; ``None`` for a
        raw array (it counts its own, see :attr:`RawZarrArray.nchunks_initialized`), in
        a mirror, or for a layout this count does not know."""
        meta = self._meta(key)
        if self.mirror is not None or meta.get("node_type") != "array":
            return None
        child = self._children.get(key)
        if child is None:
            raw = open_raw(self.path / key)
            if raw is not None:  # kept: ``group[key]`` hands out this very array
                raw.attrs = meta.get("attributes", {})
                child = self._children.setdefault(key, raw)
        if isinstance(child, RawZarrArray):
            return None
        grid = meta.get("chunk_grid")
        layout = chunk_key_layout(meta)
        if not isinstance(grid, dict) or layout is None:
            return None
        try:
            shape = [int(n) for n in meta.get("shape", ())]
            chunks = [int(c) for c in grid["configuration"]["chunk_shape"]]
        except (KeyError, TypeError, ValueError):
            return None
        if grid.get("name") != "regular" or len(chunks) != len(shape) or min(chunks, default=1) < 1:
            return None
        prefix, sep = layout
        counts = [-(-n // c) for n, c in zip(shape, chunks)]
        expected = int(np.prod(counts)) if shape else 1
        base = self.path / key
        if not shape:  # one chunk, named "c" (v2 keys: "0")
            return int((base / ("c" if prefix else "0")).is_file()), expected
        present = sum((base / (prefix + sep.join(str(i) for i in idx))).is_file()
                      for idx in itertools.product(*(range(n) for n in counts)))
        return present, expected

    def strings(self, key: str) -> RawStringArray | None:
        """Array ``key`` as a :class:`~annbatch_torch.store.rawstrings.RawStringArray`
        (items read by position, a chunk's bytes kept rather than its str objects), or
        ``None`` when it is not a string array of raw ``vlen-utf8`` chunks."""
        if key not in self:
            raise KeyError(key)
        # in a mirror too: its obs arrays are local copies, made at open
        return open_raw_strings(self.path / key)

    def __iter__(self) -> Any:
        return iter(self.keys())

    def __contains__(self, key: str) -> bool:
        return (self.path / key / "zarr.json").is_file()

    def __getitem__(self, key: str) -> Any:
        if "/" in key:
            node: Any = self
            for part in key.split("/"):
                node = node[part]
            return node
        node = self._children.get(key)
        if node is None:
            node = self._open(key)
            if isinstance(node, FastGroup | RawZarrArray):  # a zarr array is opened anew:
                node = self._children.setdefault(key, node)  # the pipeline is bound then
        return node

    def plain(self, key: str) -> FastGroup | RawZarrArray | None:
        """``self[key]`` where zarr opens nothing for it: a subgroup or a raw array
        (``key`` may be a path ``a/b``); ``None`` where zarr would open the array (a
        compressed one, a layout the raw reader does not know). :class:`KeyError` where
        there is no such node."""
        node: Any = self
        for part in key.split("/"):
            if not isinstance(node, FastGroup):
                return None
            child = node._children.get(part)
            if child is None:
                if part in node._through_zarr:
                    return None
                child = node._open_plain(part)
                if child is None:
                    node._through_zarr.add(part)
                    return None
                child = node._children.setdefault(part, child)
            node = child
        return node  # a FastGroup's children are subgroups and raw arrays only

    def _open_plain(self, key: str) -> FastGroup | RawZarrArray | None:
        """Subgroup or raw array ``key`` (this group's child), else ``None``."""
        child = self.path / key
        try:
            meta = _read_meta(child, self.root)
        except (FileNotFoundError, NotADirectoryError):
            raise KeyError(key) from None
        if meta.get("node_type") == "group":
            return FastGroup(child, self.mirror, self.root)
        raw = open_raw(child, None if self.mirror is None else self.mirror.chunks())
        if raw is not None:
            raw.attrs = meta.get("attributes", {})
        return raw

    def _open(self, key: str) -> Any:
        plain = None if key in self._through_zarr else self._open_plain(key)
        if plain is not None:
            return plain
        child = self.path / key
        import zarr

        if self.mirror is not None:  # on a store: its chunk objects come through the cache
            from .remote.mirror import mirror_store

            # zarr-python's pipeline: zarrs would read the mirror's files behind the store
            with zarr.config.set({"codec_pipeline.path":
                                  "zarr.core.codec_pipeline.BatchedCodecPipeline"}):
                return zarr.open_array(store=mirror_store(self.mirror),
                                       path=self.mirror.key_of(child), mode="r")
        return zarr.open_array(str(child), mode="r")


def open_fast_group(path: str | os.PathLike[str], mirror: Mirror | None = None) -> Any:
    """A :class:`FastGroup` for a zarr v3 group, else ``zarr.open_group`` (v2 stores);
    ``mirror``: ``path`` is in the local mirror of a collection on an object store."""
    p = Path(path)
    if (p / "zarr.json").is_file():
        return FastGroup(p, mirror)
    import zarr

    return zarr.open_group(str(p), mode="r")
