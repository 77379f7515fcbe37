"""Selectors: which AnnData field a batch key holds, e.g. ``A.layers["counts"]``.

A :class:`Field` is an immutable description ``(kind, key, transform)``. Field strings
parse to fields and print back unchanged::

    >>> from annbatch_torch import A
    >>> str(A.obsm["X_pca"])
    'obsm/X_pca'
    >>> Field.parse("obs/cell_type") == A.obs["cell_type"]
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

__all__ = ["A", "Field", "FieldKind", "normalize_selector"]

FieldKind = Literal["X", "layers", "obsm", "obs", "raw"]
_KINDS: tuple[str, ...] = ("X", "layers", "obsm", "obs", "raw")


@dataclass(frozen=True)
class Field:
    """One AnnData field to put into a batch.

    Parameters
    ----------
    kind
        ``"X"``, ``"layers"``, ``"obsm"``, ``"obs"`` or ``"raw"`` (AnnData's ``raw``,
        whose only matrix is ``X``: ``A.raw.X``, ``"raw/X"``).
    key
        The layer / obsm / obs column name; ``"X"`` for ``raw``; ``None`` for ``X``.
    transform
        Optional callable applied in the worker to this field's batch value (a numpy
        array, or a ``scipy.sparse.csr_matrix`` for sparse fields) before conversion
        to tensors. It may return an array, a sparse matrix or a tensor.
    """

    kind: FieldKind
    key: str | None = None
    transform: Callable[[Any], Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Field kind {self.kind!r} is unknown; use one of {list(_KINDS)}.")
        if self.kind == "X" and self.key is not None:
            raise ValueError("A.X takes no key; use A.layers[...] for other matrices.")
        if self.kind == "raw" and self.key != "X":
            raise ValueError(f"raw holds one matrix, X: use A.raw.X ('raw/X'), not "
                             f"raw/{self.key}.")
        if self.kind != "X" and (not isinstance(self.key, str) or not self.key):
            raise ValueError(f"A.{self.kind}[...] needs a non-empty string key, got {self.key!r}.")

    def with_transform(self, fn: Callable[[Any], Any]) -> Field:
        """Return a copy of this field whose batch values pass through ``fn``."""
        if not callable(fn):
            raise TypeError(f"with_transform expects a callable, got {type(fn).__name__}.")
        return replace(self, transform=fn)

    @property
    def path(self) -> str:
        """The field string, e.g. ``"X"`` or ``"layers/counts"``."""
        return "X" if self.kind == "X" else f"{self.kind}/{self.key}"

    def __str__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        base = ("A.X" if self.kind == "X" else "A.raw.X" if self.kind == "raw"
                else f"A.{self.kind}[{self.key!r}]")
        return base + (".with_transform(...)" if self.transform is not None else "")

    @classmethod
    def parse(cls, spec: str | Field) -> Field:
        """Parse ``"X"``, ``"layers/NAME"``, ``"obsm/NAME"``, ``"obs/NAME"`` or
        ``"raw/X"``."""
        if isinstance(spec, Field):
            return spec
        if not isinstance(spec, str):
            raise TypeError(f"A field is a Field or a string like 'obsm/X_pca', got {spec!r}.")
        if spec == "X":
            return cls("X")
        kind, sep, key = spec.partition("/")
        if not sep or kind not in _KINDS[1:] or not key:
            raise ValueError(
                f"Cannot parse field string {spec!r}: use 'X', 'layers/NAME', 'obsm/NAME', "
                "'obs/NAME' or 'raw/X'."
            )
        return cls(kind, key)  # type: ignore[arg-type]


class _Namespace:
    def __init__(self, kind: FieldKind) -> None:
        self._kind = kind

    def __getitem__(self, key: str) -> Field:
        return Field(self._kind, key)

    def __repr__(self) -> str:
        return f"A.{self._kind}"


class _Raw:
    """``A.raw``: AnnData's ``raw``, whose one matrix is ``A.raw.X``."""

    X: Field = Field("raw", "X")

    def __repr__(self) -> str:
        return "A.raw"


class _Accessor:
    """Entry point for selectors: ``A.X``, ``A.layers[k]``, ``A.obsm[k]``, ``A.obs[k]``,
    ``A.raw.X``.

    Each names one field of the AnnData inputs or of the collection; a selector maps batch
    keys to them (``{"x": A.X, "y": A.obs["cell_type"]}``), optionally with a transform
    (``A.X.with_transform(fn)``). The same fields can be written as strings: ``"X"``,
    ``"layers/counts"``, ``"obsm/X_pca"``, ``"obs/cell_type"``, ``"raw/X"``.

    Attributes
    ----------
    X
        The main matrix (sparse or dense).
    raw
        AnnData's ``raw``: ``A.raw.X`` is its matrix, over raw's own genes.
    layers
        ``A.layers["counts"]``: a layer by name.
    obsm
        ``A.obsm["X_pca"]``: an obsm array by name (dense rows).
    obs
        ``A.obs["cell_type"]``: an obs column by name (categorical codes, numbers, bools).
    """

    X: Field = Field("X")
    raw = _Raw()
    layers = _Namespace("layers")
    obsm = _Namespace("obsm")
    obs = _Namespace("obs")

    def __repr__(self) -> str:
        return "A"


A = _Accessor()


def normalize_selector(selector: Mapping[str, Field | str] | None) -> dict[str, Field]:
    """Turn a user selector into ``{output key: Field}``; ``None`` means ``{"X": A.X}``."""
    if selector is None:
        return {"X": A.X}
    if not isinstance(selector, Mapping) or not selector:
        raise ValueError(
            f"selector must be a non-empty dict like {{'x': A.X}}, got {selector!r}."
        )
    out: dict[str, Field] = {}
    for key, spec in selector.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"selector keys must be non-empty strings, got {key!r}.")
        out[key] = Field.parse(spec)
    return out
