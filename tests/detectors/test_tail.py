"""TailZScore: the kernel against a plain-Python reference, calibration and prior behaviour."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from detectors.tail import TailZScore

from .naive import ref_track_tail


def ref_tail_z(x, alpha=0.02, warmup=30, threshold=6.0, log_space=True, min_std=0.01,
               direction="up", clip=4.0, tail_q=0.999, tail_rate=1.0, tail_max=3.0,
               prior_std=0.0, prior_n=20.0, freeze_on_alarm=False, tail_gap=1):
    """Plain Python: one series, returns (scores, alarms)."""
    ref = NormalDist().inv_cdf(tail_q)
    mean = var = 0.0
    count, q, above = 0, ref, 0
    scores, alarms = [], []

    def std_of(v, m, c):
        if prior_std > 0 and c < warmup:
            v = (prior_n * prior_std**2 + c * v) / (prior_n + c)
        floor = min_std if log_space else min_std * abs(m)
        return max(math.sqrt(v), floor, 1e-300)

    for v in x:
        if not math.isfinite(v):
            scores.append(math.inf)
            alarms.append(True)
            continue
        y = math.log(max(v, 1e-30)) if log_space else v
        raw = s = 0.0
        if count > 0 and (count >= warmup or (prior_std > 0 and count >= 2)):
            z = (y - mean) / std_of(var, mean, count)
            raw = {"up": z, "down": -z, "both": abs(z)}[direction]
            s = raw / max(1.0, min(tail_max, q / ref))
        alarm = s > threshold
        scores.append(s)
        alarms.append(alarm)
        if alarm and freeze_on_alarm:
            if count >= warmup:  # the open event alarmed (it will not lift q)
                above = -tail_gap if above == 0 else -abs(above)
            continue
        if count == 0:
            mean, var, count, above = y, 0.0, 1, 0
            continue
        if count >= warmup:
            q, above = ref_track_tail(raw, alarm, q, above, tail_q, tail_rate, ref, tail_gap)
        if count >= warmup:
            sd = std_of(var, mean, count)
            y = min(max(y, mean - clip * sd), mean + clip * sd)
        a = max(alpha, 1.0 / (count + 1))
        d = y - mean
        mean, var = mean + a * d, (1 - a) * (var + d * a * d)
        count += 1
    return np.array(scores), np.array(alarms)


REFERENCES = {"tail_z": ref_tail_z}


def _stream(seed: int, n: int = 500, spikes: int = 0) -> np.ndarray:
    """Log-normal noise (log std 0.05) on a falling trend; with ``spikes``, a healthy 4.5-7
    sigma spike every ``spikes`` steps."""
    rng = np.random.default_rng(seed)
    x = np.exp(rng.normal(0.0, 0.05, n) + np.linspace(1.0, 0.5, n))
    if spikes:
        x[60::spikes] *= np.exp(rng.uniform(0.22, 0.35, len(x[60::spikes])))
    return x


@pytest.mark.parametrize("params", [
    {}, {"prior_std": 0.05}, {"direction": "both", "log_space": False, "min_std": 0.05},
    {"freeze_on_alarm": True, "threshold": 3.0}, {"tail_max": 1.0}, {"warmup": 0},
    {"tail_gap": 10}, {"tail_gap": 3, "tail_q": 0.99, "freeze_on_alarm": True},
])
def test_kernel_matches_the_reference(params: dict) -> None:
    x = _stream(1, spikes=17)
    x[[100, 300]] = [np.nan, np.inf]
    scores, alarms = TailZScore(**params).update_many(x)
    rs, ra = ref_tail_z(x, **params)
    np.testing.assert_allclose(scores[:, 0], rs, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(alarms[:, 0], ra)


def _wave(n: int = 500, spikes: int = 0) -> np.ndarray:
    """A smooth bounded wiggle (log amplitude 0.05: z never beyond ~1.5); with ``spikes``, a
    healthy 6-sigma spike every ``spikes`` steps."""
    x = np.exp(0.05 * np.sin(0.7 * np.arange(n)))
    if spikes:
        x[60::spikes] *= np.exp(0.3)
    return x


def test_the_same_z_counts_less_on_a_spiky_run() -> None:
    smooth, spiky = _wave(), _wave(spikes=20)
    smooth[480] = spiky[480] = np.exp(0.5)
    s_smooth = TailZScore().update_many(smooth)[0][480, 0]
    det = TailZScore()
    s_spiky = det.update_many(spiky)[0][480, 0]
    assert s_smooth > 6.0 > s_spiky
    assert det.tail_factor[0] > 1.5


def test_a_fault_does_not_raise_the_bar() -> None:
    x = _wave()
    det = TailZScore()
    det.update_many(x[:400])
    assert det.tail_factor[0] == 1.0
    assert det.update(1e6)[0]  # a fault spike alarms and is not a healthy score
    assert det.tail_factor[0] == 1.0
    det.update(x[400])  # back to normal
    det.update(np.exp(0.05 * 4))  # a fault's first, sub-threshold score opens an event ...
    assert det.update(1e6)[0]  # ... that then alarms: it never lifts q
    det.update_many(x[401:410])
    assert det.tail_factor[0] == 1.0
    det.update(np.exp(0.05 * 4))  # a healthy 4-sigma event (two scores above q) ...
    det.update(np.exp(0.05 * 4))
    assert det.tail_factor[0] == 1.0
    det.update(x[410])  # ... lifts q by tail_rate * tail_q once, when it closes
    ref = det.tail_ref
    assert det.tail_factor[0] == pytest.approx((ref + 0.999 - 0.001) / ref)


def test_calibration_is_capped_so_a_real_spike_still_alarms() -> None:
    x = _wave(spikes=5)
    x[490] = x[489] * 1e3
    det = TailZScore(tail_max=1.5)
    det.update_many(x[:490])
    assert det.tail_factor[0] == pytest.approx(1.5)  # the calibration reached its cap
    assert det.update(x[490])[0]


def test_a_prior_scores_from_the_third_value() -> None:
    x = np.array([2.20, 2.22, 2.24, 2.21, 5.0])
    blind, _ = TailZScore(warmup=40).update_many(x)
    primed, alarms = TailZScore(warmup=40, prior_std=0.05).update_many(x)
    assert not blind.any()
    assert primed[:2, 0].tolist() == [0.0, 0.0] and alarms[:, 0].tolist() == [0, 0, 0, 0, 1]




def test_version_1_snapshot_loads_its_spike_flag_as_an_event_that_will_not_lift_again() -> None:
    # version 1 lifted q at an event's first score and kept "previous score above q" (0/1);
    # version 2 lifts when the event is over: a version-1 snapshot taken inside a spike loads
    # as an open event that will not lift q again
    x = _wave()
    det = TailZScore()
    det.update_many(x[:300])
    assert not det.update(np.exp(0.05 * 4))[0]  # inside a healthy spike (above q, no alarm)
    sd = det.state_dict()
    assert sd["state_version"] == 2 and sd["state"][4, 0] > 0  # open, healthy so far
    old = {k: v for k, v in sd.items() if k != "state_version"}
    old["state"] = np.array(sd["state"], dtype=float)
    old["state"][4] = 1.0  # what version 1 wrote there
    loaded = TailZScore()
    loaded.load_state_dict(old)
    assert loaded.state_dict()["state"][4, 0] == -1.0
    q0 = loaded.tail_factor[0]
    loaded.update_many(x[301:320])
    assert loaded.tail_factor[0] <= q0  # only the sinking: no second lift for that spike
    with pytest.raises(ValueError, match="newer"):
        TailZScore().load_state_dict({**sd, "state_version": 3})
