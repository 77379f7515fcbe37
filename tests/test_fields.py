"""Selectors: field strings parse and print back; bad specs fail with clear messages."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from annbatch_torch import A, Field
from annbatch_torch.fields import normalize_selector

keys = st.text(min_size=1, max_size=20).filter(lambda s: s.strip() == s and s)


@given(kind=st.sampled_from(["layers", "obsm", "obs"]), key=keys)
def test_field_strings_roundtrip(kind: str, key: str) -> None:
    f = getattr(A, kind)[key]
    assert str(f) == f"{kind}/{key}"
    assert Field.parse(str(f)) == f
    assert f.kind == kind
    assert f.key == key


def test_x_roundtrip_and_repr() -> None:
    assert str(A.X) == "X"
    assert Field.parse("X") == A.X
    assert repr(A.obsm["X_pca"]) == "A.obsm['X_pca']"
    assert repr(A.X.with_transform(np.log1p)).endswith(".with_transform(...)")


@pytest.mark.parametrize("bad", ["", "x", "obsm", "obsm/", "foo/bar", "layers"])
def test_bad_field_strings(bad: str) -> None:
    with pytest.raises(ValueError, match="Cannot parse field string"):
        Field.parse(bad)


def test_with_transform_is_a_copy_and_compares_by_location() -> None:
    f = A.layers["counts"]
    g = f.with_transform(np.log1p)
    assert f.transform is None
    assert g.transform is np.log1p
    assert f == g  # transforms do not change which data is read
    with pytest.raises(TypeError, match="callable"):
        f.with_transform(3)  # type: ignore[arg-type]


def test_normalize_selector() -> None:
    assert normalize_selector(None) == {"X": A.X}
    sel = normalize_selector({"x": "X", "pca": "obsm/X_pca", "y": A.obs["cell_type"]})
    assert sel == {"x": A.X, "pca": A.obsm["X_pca"], "y": A.obs["cell_type"]}
    with pytest.raises(ValueError, match="non-empty dict"):
        normalize_selector({})
    with pytest.raises(ValueError, match="Cannot parse"):
        normalize_selector({"x": "obsm"})
    with pytest.raises(ValueError, match=r"A\.X takes no key"):
        Field("X", "k")
