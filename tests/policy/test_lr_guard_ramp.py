"""The LR guard catches a slow ramp after warm-up (a re-warm-up to a too-high peak).

After warm-up a training schedule does not rise, so the guard's reference is the lowest healthy
LR since warm-up: a ramp whose every step stays inside the band cannot climb it step by step.
Healthy schedules (cosine, linear, step decay, constant), a rewind to an earlier (higher) LR and
a warm-restart schedule with ``allow_restarts`` are never a fault.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from stability.policy.lr_guard import LRGuard, LRGuardConfig


def schedule(kind: str, s: int, total: int = 2000, peak: float = 1e-3) -> float:
    if s < 50:
        return peak * (s + 1) / 50
    f = (s - 50) / (total - 50)
    if kind == "cosine":
        return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * f)))
    if kind == "linear":
        return peak * (1 - 0.9 * f)
    if kind == "step":
        return peak * (1.0 if f < 0.6 else 0.3 if f < 0.85 else 0.09)
    return peak


def rewarmup(s: int, onset: int = 1000, k: float = 10.0, ramp: int = 300) -> float:
    """make_runs-style re-warm-up: the multiplier rises linearly to ``k`` over ``ramp`` steps."""
    return 1.0 if s < onset else 1.0 + (k - 1.0) * min(1.0, (s - onset + 1) / ramp)


@pytest.mark.parametrize("kind", ["cosine", "linear", "step", "constant"])
def test_healthy_schedules_are_never_a_fault(kind: str) -> None:
    g = LRGuard()
    for s in range(2000):
        g.observe(s, schedule(kind, s))
        assert not g.active, s


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_a_slow_rewarmup_is_caught_and_capped(kind: str) -> None:
    g = LRGuard()
    eff, active = [], []
    for s in range(2000):
        lr = schedule(kind, s) * rewarmup(s)
        f = g.observe(s, lr)
        eff.append(lr * f)
        active.append(g.active)
    # each step of the ramp rises by < 3 %: inside the band, yet it is caught ...
    assert max(rewarmup(s + 1) / rewarmup(s) for s in range(1000, 1300)) < 1.03
    # ... within the steps it takes to climb tolerance (1.25x) above the floor, and capped
    assert max(eff[1000:1400]) <= 1.25 * schedule(kind, 999)
    assert all(active[1100:1400])


def test_a_rewind_to_a_higher_lr_is_not_a_fault() -> None:
    """A rollback rewinds the scheduler to an earlier, higher LR of a decaying schedule."""
    g = LRGuard()
    for s in range(1500):
        g.observe(s, schedule("cosine", s))
    g.rewind()
    for s in range(1000, 1500):
        g.observe(s, schedule("cosine", s))
        assert not g.active, s


def test_restarts_allowed_rise_to_the_peak() -> None:
    """SGDR-like restarts every 400 steps are healthy with ``allow_restarts``."""
    g = LRGuard(LRGuardConfig(allow_restarts=True))
    for s in range(2000):
        c = (s % 400) / 400
        g.observe(s, 1e-3 * 0.5 * (1 + math.cos(math.pi * c)) + 1e-5)
        assert not g.active, s


def test_bulk_equals_the_loop_on_a_ramp() -> None:
    """``observe_healthy`` (the Numba kernel) agrees with the ``observe`` loop on the floor."""
    lrs = np.array([schedule("cosine", s) * rewarmup(s) for s in range(2000)])
    a, b = LRGuard(), LRGuard()
    a.observe(0, lrs[0])
    b.observe(0, lrs[0])
    k = b.observe_healthy(lrs[1:])
    for s in range(1, k + 1):
        a.observe(s, lrs[s])
    assert 1000 <= k < 1300
    assert a.state_dict() == b.state_dict()


def test_after_the_ramp_peaks_the_effective_lr_follows_the_schedule() -> None:
    """A re-warm-up to 10x that then decays along the cosine: once the requested LR has
    peaked, the effective LR is the requested one divided by the largest ratio seen -- it keeps
    annealing with the schedule instead of staying at the reference."""
    g = LRGuard()
    eff, active = {}, {}
    for s in range(2000):
        lr = schedule("cosine", s) * rewarmup(s)
        eff[s] = lr * g.observe(s, lr)
        active[s] = g.active
    assert eff[1800] < 0.6 * eff[1300]  # it anneals (the healthy cosine falls ~4x here)
    held = [s for s in range(1300, 1999) if active[s + 1]]
    assert len(held) > 400
    for s in held:  # never rises while the schedule decays (the release: the policy's ramp)
        assert eff[s + 1] <= eff[s] * (1 + 1e-9)
