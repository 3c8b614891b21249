"""A bad-data window that was skipped leaves nothing to undo (invariant 6, issue 24).

A step's loss is measured before its update: the loss of a step skipped for its data shows what
the batch is like, not what the model became.  It leaves the policy's loss levels
(``LossTracker.retract``), so an 8-batch garbage window skipped whole is not "measurably worse"
afterwards and no rollback undoes it (benchmarks/bench_rescue.py ``data_corrupt_window``: it used
to lose 40-48 steps to such a rollback), while damage that does persist after a window is still
undone.  Scripted alarm streams on the real :class:`~stability.policy.policy.Policy`.
"""

from __future__ import annotations

import json
import math

from stability.policy.loss_tracker import LossTracker
from stability.policy.policy import Policy
from stability.run.checkpoints import CheckpointLedger
from stability.types import Alarm, Control


def spike(step: int) -> Alarm:
    return Alarm(step, "loss_spike", "loss", 9.0, 6.0, "critical", "tail_z")


def run(after: float, window: range, steps: int = 400) -> tuple[Policy, list[str]]:
    """Loss 1.0, a garbage window (loss 1000, critical spikes), then loss ``after``; returns the
    policy and its interventions as ``"step:type"``."""
    pol, ledger = Policy(), CheckpointLedger()
    ledger.add(100, "memory:100")
    ctx = {"grad_norm_recent_median": 0.5, "healthy_checkpoints": ledger}
    out: list[str] = []
    for s in range(steps):
        ctl = Control()
        bad = s in window
        loss = 1000.0 if bad else (1.0 if s < window.start else after)
        ivs = pol.track(s, 1e-3, loss, ctl)
        ivs += pol.step(s, [spike(s)] if bad else [], ctl, ctx)
        out += [f"{s}:{iv.type}" for iv in ivs]
        if ctl.rollback_to is not None:
            break
    return pol, out


def test_a_bad_window_skipped_whole_is_not_rolled_back() -> None:
    """8 garbage batches, all skipped, the loss back at its level after them: no rollback, no
    LR cut, and the loss levels are those of the clean steps alone."""
    window = range(150, 158)
    pol, got = run(1.0, window)
    assert [x for x in got if x.endswith(":skip_step")] == [f"{s}:skip_step" for s in window]
    assert not any(x.endswith((":rollback", ":reduce_lr", ":stop")) for x in got), got
    assert pol.worse() is False
    assert math.isclose(pol.loss.fast, 0.0, abs_tol=1e-12)  # log(1.0): the garbage left
    assert math.isclose(pol.loss.base, 0.0, abs_tol=1e-12)


def test_damage_that_outlives_a_skipped_window_is_still_undone() -> None:
    """The same window followed by a loss 20x its level (the model is damaged): the aftermath
    still rolls back to the healthy checkpoint before the onset."""
    _, got = run(20.0, range(150, 158))
    assert any(x.endswith(":rollback") for x in got), got


def test_an_overflow_step_keeps_its_loss() -> None:
    """Non-finite gradients with a finite loss (an overflow): the step is skipped, but its loss is
    the model's and stays in the levels."""
    pol = Policy()
    for s in range(50):
        pol.track(s, 1e-3, 1.0, Control())
        pol.step(s, [], Control(), {})
    ctl = Control()
    pol.track(50, 1e-3, 2.0, ctl)
    fast = pol.loss.fast
    nf = Alarm(50, "nonfinite", "grad_norm", math.inf, 0.0, "critical", "nonfinite")
    pol.step(50, [nf], ctl, {"grad_norm_recent_median": 0.5})
    assert ctl.skip_step and pol.loss.fast == fast > 0.0


def test_the_retractable_loss_survives_a_state_dict_round_trip() -> None:
    """A snapshot taken between ``track`` and ``step`` of a skipped step: the restored policy
    retracts the same loss and ends in the same state."""
    a, b = Policy(), Policy()
    for s in range(60):
        a.track(s, 1e-3, 1.0, Control())
        a.step(s, [], Control(), {})
    a.track(60, 1e-3, 1000.0, Control())
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for pol in (a, b):
        ctl = Control()
        pol.step(60, [spike(60)], ctl, {"grad_norm_recent_median": 0.5})
        assert ctl.skip_step
    assert a.state_dict() == b.state_dict()
    assert math.isclose(a.loss.fast, 0.0, abs_tol=1e-12)


def test_retract_only_takes_back_the_marked_step() -> None:
    t = LossTracker()
    t.mark(5)
    t.update(3.0, quiet=True)
    assert not t.retract(6) and t.fast == math.log(3.0)
    t2 = LossTracker()
    t2.load_state_dict(json.loads(json.dumps(t.state_dict())))
    assert t2.retract(5) and math.isnan(t2.fast) and math.isnan(t2.base)
