"""A shard's hierarchy opened for reading: raw arrays, zarr arrays, mirrored arrays.

:func:`open_fast_group` opens a zarr v3 group as a :class:`FastGroup`, whose arrays are
:class:`~annbatch_torch.store.rawzarr.RawZarrArray` where their chunks are raw (the fast path)
and zarr arrays otherwise; in the local mirror of a collection on an object store
(:class:`~annbatch_torch.store.remote.mirror.Mirror`) the raw arrays' chunks come through the
chunk cache and the others through zarr-python reading the mirror as a store.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .rawzarr import open_raw

if TYPE_CHECKING:
    from .remote.mirror import Mirror

__all__ = ["FastGroup", "open_fast_group"]


class FastGroup:
    """Read-only navigation of a zarr v3 hierarchy on the local filesystem that hands out
    :class:`RawZarrArray` for raw arrays and falls back to ``zarr.open_array`` for others.

    Supports what :mod:`annbatch_torch.store.elements` needs: ``group[key]``, ``key in group``,
    ``keys()``, ``attrs``.
    """

    def __init__(self, path: str | os.PathLike[str], mirror: Mirror | None = None) -> None:
        self.path = Path(path)
        self.mirror = mirror
        try:
            with open(self.path / "zarr.json") as f:
                meta = json.load(f)
        except FileNotFoundError:
            raise KeyError(str(self.path)) from None
        if meta.get("node_type") != "group":
            raise ValueError(f"{self.path} is not a zarr v3 group")
        self.attrs: dict[str, Any] = meta.get("attributes", {})

    def keys(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir() if (p / "zarr.json").is_file())

    def array_keys(self) -> list[str]:
        return [k for k in self.keys() if not isinstance(self[k], FastGroup)]

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
        child = self.path / key
        try:
            with open(child / "zarr.json") as f:
                meta = json.load(f)
        except (FileNotFoundError, NotADirectoryError):
            raise KeyError(key) from None
        if meta.get("node_type") == "group":
            return FastGroup(child, self.mirror)
        raw = open_raw(child, None if self.mirror is None else self.mirror.chunks())
        if raw is not None:
            raw.attrs = meta.get("attributes", {})
            return raw
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
