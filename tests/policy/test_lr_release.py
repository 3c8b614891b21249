"""The LR guard's release never multiplies the effective LR at once (issue 24, item 7).

A multiplied LR that fades out along a cosine schedule comes back inside the guard's band while
the requested LR is still far above the effective LR the guard let through: the release ramps
from the effective LR instead of jumping to the requested one.  A fault that ends abruptly (the
requested LR falls back to the healthy one) is released at once.
"""

from __future__ import annotations

import math

from stability.policy.policy import Policy
from stability.types import Control


def cosine_lr(s: int, total: int = 1000, peak: float = 1e-3) -> float:
    """Healthy LR: 20 warm-up steps, then a cosine decay to 0."""
    if s < 20:
        return peak * (s + 1) / 20
    return peak * 0.5 * (1 + math.cos(math.pi * (s - 20) / (total - 20)))


def effective_lrs(mult, total: int = 1000) -> list[float]:
    """Effective LR (requested x the policy's factor) of each step, with ``mult(s)`` the fault."""
    pol, out = Policy(), []
    for s in range(total):
        lr = cosine_lr(s, total) * mult(s)
        ctl = Control()
        pol.track(s, lr, 1.0, ctl)
        pol.step(s, (), ctl)
        out.append(lr * ctl.lr_factor)
    return out


def test_a_fading_fault_is_released_gradually():
    """x30 from step 500 on: the guard divides it out, then releases near the end."""
    eff = effective_lrs(lambda s: 30.0 if s >= 500 else 1.0)
    ratios = [b / a for a, b in zip(eff[499:-1], eff[500:], strict=True) if a > 0]
    # the guard did act (the effective LR stayed near the healthy one for a while) ...
    assert eff[700] < 2 * cosine_lr(700)
    # ... and the release raises the effective LR by at most a modest factor per step
    assert max(ratios) < 2.0, max(ratios)


def test_an_abrupt_end_is_released_at_once():
    """x30 for steps 300..399: the requested LR falls back to the healthy one; no ramp."""
    eff = effective_lrs(lambda s: 30.0 if 300 <= s < 400 else 1.0)
    assert eff[350] < 2 * cosine_lr(350)  # divided out
    for s in (400, 401, 450):
        assert eff[s] == cosine_lr(s)  # healthy LR, exactly, from the first step after


def test_the_ramp_survives_a_state_round_trip():
    """A snapshot taken during the ramp gives the same factors afterwards."""
    def run(snap_at: int | None) -> list[float]:
        pol, out = Policy(), []
        for s in range(1000):
            if s == snap_at:
                sd = pol.state_dict()
                pol = Policy()
                pol.load_state_dict(sd)
            lr = cosine_lr(s) * (30.0 if s >= 500 else 1.0)
            ctl = Control()
            pol.track(s, lr, 1.0, ctl)
            pol.step(s, (), ctl)
            out.append(ctl.lr_factor)
        return out
    base = run(None)
    release = next(s for s in range(501, 1000) if base[s] > base[s - 1] * 1.01)
    assert run(release + 3) == base
