"""PairedSampler's stream (issue 34, first part): every perturbed row once per epoch, each
followed by controls of its match group; sets; missing controls; a training split."""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

import annbatch_torch as abt
from annbatch_torch.sampling.pairing import MissingControlWarning, PairedSampler
from annbatch_torch.sampling.samplers import ObsColumn
from annbatch_torch.torch_sampler import bind_sampler

GENES = ("ctrl", "g1", "g2", "g3")
LINES = ("K562", "RPE1")
PLATES = ("p1", "p2", "p3")


def _screen(n: int, seed: int = 0, controls_everywhere: bool = True) -> dict[str, ObsColumn]:
    """Random screen codes: target (0 = ctrl), line, plate; a control in every
    (line, plate) unless told otherwise."""
    rng = np.random.default_rng(seed)
    target = rng.integers(0, len(GENES), n)
    line = rng.integers(0, len(LINES), n)
    plate = rng.integers(0, len(PLATES), n)
    if controls_everywhere:
        k = 0
        for a in range(len(LINES)):
            for b in range(len(PLATES)):
                target[k], line[k], plate[k] = 0, a, b
                k += 1
    return {"target": ObsColumn(target, GENES), "line": ObsColumn(line, LINES),
            "plate": ObsColumn(plate, PLATES)}


def _bound(cols: dict[str, ObsColumn], **kw: object) -> PairedSampler:
    n = len(cols["target"].codes)
    s = PairedSampler("target", "ctrl", match=("line", "plate"), **kw)
    return s.bind(n, cols)  # type: ignore[return-value]


def _check_epoch(s: PairedSampler, cols: dict[str, ObsColumn], stream: np.ndarray) -> None:
    t, line, plate = (cols[c].codes for c in ("target", "line", "plate"))
    draws = stream.reshape(-1, s.draw_size)
    pert, ctrl = draws[:, 0], draws[:, 1:]
    assert (t[pert] != 0).all()
    assert (t[ctrl] == 0).all()
    assert (line[ctrl] == line[pert][:, None]).all()
    assert (plate[ctrl] == plate[pert][:, None]).all()


@settings(max_examples=40, deadline=None)
@given(st.integers(20, 400), st.integers(0, 2**20), st.integers(1, 3), st.integers(0, 5),
       st.sampled_from([None, 16]))
def test_every_perturbed_row_once_with_matched_controls(n: int, seed: int, n_controls: int,
                                                        epoch: int, runs: int | None) -> None:
    cols = _screen(n, seed)
    s = _bound(cols, n_controls=n_controls, chunk_size=runs)
    stream = s.rows(seed, epoch, 0, len(s))
    assert len(stream) == len(s)
    _check_epoch(s, cols, stream)
    perturbed = np.flatnonzero(cols["target"].codes != 0)
    assert sorted(stream[:: s.draw_size].tolist()) == perturbed.tolist()  # each once
    # a pure function of (seed, epoch), another epoch another order
    np.testing.assert_array_equal(stream, _bound(cols, n_controls=n_controls,
                                                 chunk_size=runs).rows(seed, epoch, 0, len(s)))
    if len(perturbed) > 5 and (runs is None or n > 6 * runs):  # several runs to reorder
        assert not np.array_equal(stream, s.rows(seed, epoch + 1, 0, len(s)))


def test_controls_are_drawn_uniformly_from_the_group() -> None:
    cols = _screen(3000, 1)
    s = _bound(cols, n_controls=2)
    t, line, plate = (cols[c].codes for c in ("target", "line", "plate"))
    hits = np.zeros(3000)
    for epoch in range(30):
        draws = s.rows(0, epoch, 0, len(s)).reshape(-1, 3)
        np.add.at(hits, draws[:, 1:].reshape(-1), 1)
    g = line * len(PLATES) + plate
    for k in range(len(LINES) * len(PLATES)):
        got = hits[(t == 0) & (g == k)]
        assert got.min() > 0.5 * got.mean()  # every control of the group drawn alike


def test_a_group_without_control_is_named_or_skipped() -> None:
    cols = _screen(300, 2, controls_everywhere=False)
    t, line, plate = (cols[c].codes for c in ("target", "line", "plate"))
    t[(line == 1) & (plate == 2)] = np.where(t[(line == 1) & (plate == 2)] == 0, 1,
                                              t[(line == 1) & (plate == 2)])
    t[:2] = 0  # controls elsewhere
    line[:2], plate[:2] = 0, 0
    with pytest.raises(abt.SamplerError, match=r"match group\(s\) with no control "
                                               r"\(line='RPE1', plate='p3'.*on_missing_"
                                               r"control='skip'"):
        _bound(cols)
    with pytest.warns(MissingControlWarning, match=r"left out \d+ perturbed rows in 1 match"):
        s = _bound(cols, on_missing_control="skip")
    stream = s.rows(0, 0, 0, len(s))
    pert = stream[:: s.draw_size]
    assert not ((line[pert] == 1) & (plate[pert] == 2)).any()
    _check_epoch(s, cols, stream)


@pytest.mark.parametrize("set_size", [1, 3, 8])
def test_sets_share_perturbation_and_match(set_size: int) -> None:
    cols = _screen(500, 3)
    s = _bound(cols, set_size=set_size)
    t, line, plate = (cols[c].codes for c in ("target", "line", "plate"))
    stream = s.rows(5, 1, 0, len(s))
    _check_epoch(s, cols, stream)
    sets = stream[:: s.draw_size].reshape(-1, set_size)
    for arr in (t, line, plate):
        assert (arr[sets] == arr[sets[:, :1]]).all()
    perturbed = np.flatnonzero(t != 0)
    drawn = sets.reshape(-1)
    assert set(drawn.tolist()) == set(perturbed.tolist())  # each at least once
    key = t * 100 + line * 10 + plate
    sizes = np.bincount(key[perturbed], minlength=400)
    assert len(drawn) == int((-(-sizes // set_size)).sum()) * set_size
    if set_size == 1:  # no fill: exactly once
        assert len(drawn) == len(perturbed)


def test_a_training_split_draws_its_rows_only() -> None:
    cols = _screen(600, 4)
    allowed = np.arange(0, 600, 2)
    allowed = np.union1d(allowed, np.arange(6))  # the controls of every group among them
    s = PairedSampler("target", ["ctrl"], match=("line", "plate")).bind(600, cols, allowed)
    stream = s.rows(0, 0, 0, len(s))
    assert np.isin(stream, allowed).all()
    t = cols["target"].codes
    assert sorted(stream[::2].tolist()) == [r for r in allowed.tolist() if t[r] != 0]


def test_bad_arguments_are_refused() -> None:
    cols = _screen(100, 5)
    with pytest.raises(abt.SamplerError, match=r"control value\(s\) \['nt'\] are not categ"):
        PairedSampler("target", "nt").bind(100, cols)
    with pytest.raises(abt.SamplerError, match="n_controls must be an integer >= 1"):
        PairedSampler("target", "ctrl", n_controls=0)
    with pytest.raises(abt.SamplerError, match="not the perturbation column"):
        PairedSampler("target", "ctrl", match=("target",))
    with pytest.raises(abt.SamplerError, match="on_missing_control must be"):
        PairedSampler("target", "ctrl", on_missing_control="drop")
    only = {"target": ObsColumn(np.zeros(10, dtype=np.int64), GENES)}
    with pytest.raises(abt.SamplerError, match="no perturbed row"):
        PairedSampler("target", "ctrl").bind(10, only)


def test_bound_to_a_collection_the_pairs_hold_in_its_obs(tmp_path: Path) -> None:
    n = 800
    cols = _screen(n, 6)
    obs = pd.DataFrame({c: pd.Categorical.from_codes(cols[c].codes, cols[c].categories)
                        for c in ("target", "line", "plate")},
                       index=[f"c{i}" for i in range(n)])
    a = ad.AnnData(sp.random(n, 5, density=0.4, format="csr", dtype=np.float32), obs=obs)
    a.write_h5ad(tmp_path / "screen.h5ad")
    coll = abt.create_anndata_collection([tmp_path / "screen.h5ad"], tmp_path / "s",
                                         progress=False)
    s = bind_sampler(coll, PairedSampler("target", "ctrl", match=("line", "plate"),
                                         n_controls=2))
    stream = np.asarray(s.rows(0, 0, 0, len(s)))
    frame = coll.obs_at(stream, ["target", "line", "plate"])
    draws = frame.to_numpy(dtype=str).reshape(-1, 3, 3)  # draw, row in draw, column
    assert (draws[:, 0, 0] != "ctrl").all()
    assert (draws[:, 1:, 0] == "ctrl").all()
    assert (draws[:, 1:, 1:] == draws[:, :1, 1:]).all()
    assert len(draws) == int((obs["target"] != "ctrl").sum())


@pytest.mark.parametrize("set_size", [None, 2])
def test_num_samples_subsamples_or_repeats_the_perturbed_rows(set_size: int | None) -> None:
    cols = _screen(300, 9)
    runs = {} if set_size else {"chunk_size": 16}  # runs of 16 rows (auto: 256, one run)
    full = _bound(cols, set_size=set_size, **runs)
    n_pass = len(full) // full.draw_size
    for num in (n_pass // 2 // 2 * 2, n_pass * 2 + 2):
        s = _bound(cols, set_size=set_size, num_samples=num, **runs)
        assert len(s) == num * s.draw_size
        for epoch in (0, 1):
            stream = np.asarray(s.rows(3, epoch, 0, len(s)))
            _check_epoch(s, cols, stream)
            pert = stream[:: s.draw_size]
            counts = np.bincount(pert, minlength=300)
            if set_size is None:  # each row once per pass: at most ceil(num / pass) times
                assert counts.max() <= -(-num // n_pass)
                assert counts[counts > 0].min() >= num // n_pass
        if num < n_pass:  # a new subsample each epoch
            first, second = (set(np.asarray(s.rows(3, e, 0, len(s)))[:: s.draw_size].tolist())
                             for e in (0, 1))
            assert first != second
    with pytest.raises(abt.SamplerError, match="multiple of set_size=2"):
        PairedSampler("target", "ctrl", set_size=2, num_samples=5)


@pytest.mark.parametrize("control", [np.array(["ctrl"]), pd.Index(["ctrl"]), {"ctrl"},
                                     ("ctrl",)])
def test_control_values_come_in_any_iterable(control: object) -> None:
    cols = _screen(200, 4)
    s = PairedSampler("target", control, match=("line", "plate")).bind(200, cols)
    assert s.control == ["ctrl"]
    _check_epoch(s, cols, np.asarray(s.rows(0, 0, 0, len(s))))
