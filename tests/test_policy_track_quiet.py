"""``Policy.track_quiet`` (the monitor's inlined quiet tracking, issue 17) leaves the policy,
its LR guard and loss tracker exactly as ``Policy.track`` does, and declines every step where
``track`` could request something."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from stability import Monitor
from stability.policy.policy import Policy


def _lr_loss(n: int, seed: int) -> list[tuple[float, float]]:
    """Warmup, a cosine decay, an LR fault, a restart, odd losses (NaN, inf, 0, negative)."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(n):
        lr = 1e-3 * min(1.0, (s + 1) / 40) * (0.5 + 0.5 * math.cos(s / n * math.pi))
        if 150 <= s < 170:
            lr *= 25.0  # an LR fault: the guard opens, then releases
        if s == 260:
            lr = float("nan")
        if s == 261:
            lr = 0.0
        if 300 <= s < 310:
            lr = 1e-3 * (s - 299)  # a warm restart: a rise
        loss = float(np.exp(rng.normal(0.7 - s / 400, 0.03)))
        if s in (50, 51, 220):
            loss = (float("nan"), float("inf"), -1.0)[(s == 51) + 2 * (s == 220)]
        if s == 80:
            loss = 0.0
        out.append((lr, loss))
    return out


def _state(p: Policy) -> bytes:
    g, lt = p.guard, p.loss
    return pickle.dumps((p.state_dict(), vars(g), lt.fast, lt.base, lt.nonfinite_run,
                         vars(p.val)))


@pytest.mark.parametrize("cfg", [{}, {"lr_guard": {"allow_restarts": True, "min_steps": 3}},
                                 {"lr_guard": {"enabled": False}}], ids=["default", "restarts",
                                                                          "disabled"])
def test_track_quiet_equals_track(cfg) -> None:  # type: ignore[no-untyped-def]
    slow, fast = Policy(cfg), Policy(cfg)
    taken = declined = 0
    for s, (lr, loss) in enumerate(_lr_loss(400, seed=1)):
        val = None if s % 9 else loss * (1.0 + 0.01 * (s % 5)) + 0.001 * (s > 200) * s
        ref = slow.track(s, lr, loss, None, val)
        if fast.track_quiet(s, lr, loss, val):
            assert ref == []  # track_quiet takes only steps that request nothing
            taken += 1
        else:
            assert fast.track(s, lr, loss, None, val) == ref
            declined += 1
        assert _state(fast) == _state(slow), s
    if cfg.get("lr_guard", {}).get("enabled", True):
        assert taken > 300
        assert declined >= 20  # the fault, its release, the unprimed start, the bad LRs
    else:
        assert declined == 400  # never primed: always the general path


def test_monitor_quiet_tracking_decides_alike(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A monitor whose quiet tracking always declines (the general path on every step) makes
    the same decisions and ends in the same state, through alarms, an LR fault and NaNs."""
    fast = Monitor("llm_pretrain", alert_sinks=[], handler_timeout=None)
    slow = Monitor("llm_pretrain", alert_sinks=[], handler_timeout=None)
    n = 0

    def never(*args: object) -> bool:
        nonlocal n
        n += 1
        return False

    monkeypatch.setattr(slow.policy, "track_quiet", never)
    rng = np.random.default_rng(5)
    for s, (lr, loss) in enumerate(_lr_loss(400, seed=2)):
        if s in (120, 121, 330):
            loss *= 30.0  # loss spikes: alarms, an episode, its cooldown
        m = {"loss": loss, "lr": lr, "grad_norm": float(np.exp(rng.normal(0, 0.05)))}
        if s % 25 == 0:
            m["val_loss"] = loss * 1.01
        da, db = fast.observe(s, m), slow.observe(s, m)
        assert da == db, s
    assert n > 300
    assert fast.state_dict() == slow.state_dict()
    assert fast.counters == slow.counters
    assert (fast._lr_now, fast._lr_prev) == (slow._lr_now, slow._lr_prev)


def test_goodput_from_control_equals_update() -> None:
    """``update_from_control`` (inlined ``update`` with the clock off) counts as ``update``."""
    from stability.run.goodput import GoodputTracker
    from stability.types import Control

    a, b = GoodputTracker(auto_start=False), GoodputTracker(auto_start=False)
    for s in range(60):
        c = Control(skip_step=s % 7 == 3, lr_factor=0.5 if 20 <= s < 30 else 1.0,
                    clip_norm=1.0 if s == 40 else None)
        a.update_from_control(s, c)
        b.update(s, skipped=c.skip_step, degraded=c.lr_factor < 1.0 or c.clip_norm is not None)
        if s == 50:
            a.update_from_control(s + 1, Control(rollback_to=45))
            b.update(s + 1)
            b.note_rollback(s + 1, 45, _requested=True)
            break
    assert a.state_dict() == b.state_dict() and a.summary() == b.summary()
    assert list(a._history) == list(b._history) and a._requested == b._requested
    assert a.cancel_rollback(51) and b.cancel_rollback(51) and a.state_dict() == b.state_dict()
