from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detectors.jump import CoherentJump
from detectors.lr_jump import LRJump

from .generic import (
    check_split_batches,
    check_state_roundtrip,
    check_stream_equals_batch,
    stream,
)
from .naive import ref_coherent_jump

CFGS = [
    {},
    {"min_series": 1, "direction": "both", "clip": math.inf},
    {"min_series": 3, "direction": "down", "freeze_on_alarm": True, "min_delta": 0.0,
     "warmup": 5},
    {"threshold": 3.0, "freeze_on_alarm": True, "alpha": 0.2, "level_alpha": 0.3,
     "level_alpha_down": 0.3},
    {"level_alpha": 0.0, "direction": "both", "warmup": 0},
]


def bank(seed: int, t: int = 400, n: int = 4, offset: float = 1.0) -> np.ndarray:
    """Noisy positive per-layer norms with a trend, coherent and lone jumps, bad values."""
    rng = np.random.default_rng(seed)
    x = offset * np.exp(rng.normal(0.0, 0.1, (t, n))) * np.linspace(2.0, 1.0, t)[:, None]
    x[150, 0] *= 8.0                  # one layer alone
    x[250, :3] *= 6.0                 # three layers together
    x[320:, 1] *= 0.05                # one layer collapses for good
    x[60, 2] = np.nan
    x[90, 3] = np.inf
    x[110, 1] = 0.0
    x[111, 1] = -1.0
    return x


@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference_on_every_prefix(cfg, seed):
    x = bank(seed)
    miss = np.zeros_like(x, dtype=bool)
    miss[::13, 1] = True
    miss[200:210] = True
    s, a = CoherentJump(n_series=x.shape[1], **cfg).update_many(x, missing=miss)
    ref = ref_coherent_jump(x, miss, **cfg)
    np.testing.assert_allclose(s, ref, rtol=1e-12, atol=0.0)
    thr = cfg.get("threshold", 10.0)
    np.testing.assert_array_equal(a, np.isinf(ref) | (np.nan_to_num(ref, nan=-1) > thr))
    # a prefix gives the same scores as the start of the full run
    for k in (1, 57, 251):
        sk, _ = CoherentJump(n_series=x.shape[1], **cfg).update_many(x[:k], missing=miss[:k])
        np.testing.assert_array_equal(sk, s[:k])


def test_needs_min_series_together():
    x = bank(0)
    _, a = CoherentJump(n_series=4).update_many(x)
    steps = np.flatnonzero(a.any(axis=1)).tolist()
    assert 250 in steps and 150 not in steps
    assert sorted(np.flatnonzero(a[250]).tolist()) == [0, 1, 2]   # the layers that jumped
    _, a1 = CoherentJump(n_series=4, min_series=1).update_many(x)
    assert a1[150, 0]
    _, a4 = CoherentJump(n_series=4, min_series=4).update_many(x)
    assert not a4[250].any()


def test_single_series_equals_lr_jump():
    x = bank(2)[:, :1]
    cfg = {"alpha": 0.1, "warmup": 7, "direction": "both", "threshold": 5.0}
    s1, a1 = CoherentJump(level_alpha=0.0, **cfg).update_many(x)
    s2, a2 = LRJump(**cfg).update_many(x)
    np.testing.assert_array_equal(s1, s2)
    np.testing.assert_array_equal(a1, a2)


def test_coming_back_after_a_collapse_is_not_a_jump():
    """fp16 underflow: every layer's gradients x1e-8 for 75 steps, then back."""
    rng = np.random.default_rng(9)
    g = np.exp(rng.normal(0.0, 0.1, (300, 3)))
    g[150:225] *= 1e-8
    _, a = CoherentJump(n_series=3).update_many(g)
    assert not a.any()
    _, a0 = CoherentJump(n_series=3, level_alpha=0.0).update_many(g)
    assert a0[225].all()                 # measured from the previous value only: it jumps
    g[260, :2] *= 8.0                    # a real burst afterwards still alarms
    assert CoherentJump(n_series=3).update_many(g)[1][260].any()


def test_downward_collapse():
    x = bank(3)
    _, a = CoherentJump(n_series=4, min_series=1, direction="down").update_many(x)
    assert a[320, 1] and not a[319].any()


@pytest.mark.parametrize("cfg", CFGS)
def test_generic_checks(cfg):
    x = bank(4)
    miss = np.zeros_like(x, dtype=bool)
    miss[::7, 2] = True

    def make(n):
        return CoherentJump(n_series=n, **cfg)

    check_stream_equals_batch(make, x, missing=miss)
    check_split_batches(make, x)
    for split in (1, 150, 251):
        check_state_roundtrip(make, x, split=split)
        check_state_roundtrip(make, x, split=split, via_json=True)


def test_constant_and_offset_streams():
    c = np.full((100, 3), 2.5)
    s, a = CoherentJump(n_series=3, warmup=0).update_many(c)
    assert not a.any() and np.all(s[1:] == 0.0)
    x = bank(6)
    s_big, a_big = CoherentJump(n_series=4).update_many(x * 1e8)
    s_ref, a_ref = CoherentJump(n_series=4).update_many(x)
    np.testing.assert_allclose(s_big, s_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(a_big, a_ref)


def test_grow_keeps_existing_series():
    x = bank(7)
    det = CoherentJump(n_series=2)
    det.update_many(x[:100, :2])
    det.grow(2)
    s, _ = det.update_many(x[100:])
    assert np.all(s[:1, 2:] == 0.0)   # new series start without a previous value
    assert det.n_series == 4


def test_bad_state_rejected():
    det = CoherentJump(n_series=2)
    det.update_many(bank(8)[:50, :2])
    sd = det.state_dict()
    sd["state"] = np.array(sd["state"], dtype=float)
    sd["state"][1, 0] = 0.5
    with pytest.raises(ValueError, match="has"):
        CoherentJump(n_series=2).load_state_dict(sd)


@settings(deadline=None, max_examples=30)
@given(st.lists(st.floats(min_value=1e-3, max_value=1e3), min_size=30, max_size=120),
       st.integers(1, 3))
def test_property_stream_matches_reference(vals, k):
    x = np.array(vals).reshape(-1, 1) * np.array([1.0, 2.0, 0.5])
    x[::5, 1] *= 3.0
    det = CoherentJump(n_series=3, min_series=k, warmup=3)
    s, _ = stream(det, x)
    np.testing.assert_allclose(s, ref_coherent_jump(x, min_series=k, warmup=3), rtol=1e-12)
