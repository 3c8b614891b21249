"""Severity reflects recovery: a step whose alarms are all ``recovering`` gets at most an alert.

An excursion already returning to trend (``Alarm.recovering``, set by
:mod:`stability.monitor.recovery`) is reported and never escalated: no skip, clip, LR cut,
checkpoint, rollback or stop, and an open episode whose alarms turn recovering does not climb the
escalation ladder (invariants 1 and 3 of docs/policy.md).  Scripted alarm streams pin the rule;
real PyTorch runs on CPU show a run that recovers by itself untouched and real faults still
handled.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from stability.policy.policy import Policy
from stability.types import Alarm, Control

ACTING = {"skip_step", "set_clip", "reduce_lr", "checkpoint", "rollback", "stop"}


def spike(step: int, recovering: bool, severity: str = "warning",
          kind: str = "loss_spike") -> Alarm:
    return Alarm(step, kind, "loss", 9.0, 6.0, severity, "tail_z", "", recovering)


def types(ivs: list) -> list[str]:
    return [i.type for i in ivs]


def stream(pol: Policy, recovering: bool, steps: range) -> tuple[list[str], Control]:
    """A fresh (non-recovering) alarm at ``steps[0]``, then one alarm per step of ``steps``
    with the given flag; returns every intervention as ``"step:type"`` and the last control."""
    ctx = {"grad_norm_recent_median": 0.5}
    out: list[str] = []
    ctl = Control()
    for s in steps:
        ctl = Control()
        first = s == steps[0]
        ivs = pol.step(s, [spike(s, recovering and not first)], ctl, ctx)
        out += [f"{s}:{t}" for t in types(ivs)]
    return out, ctl


# ------------------------------------------------------------------ scripted alarm streams
def test_an_episode_whose_alarms_turn_recovering_does_not_climb_the_ladder() -> None:
    """One response to the fresh alarm (level 1: alert + clip); the 150 recovering alarm steps
    after it get alerts only and the level never rises.  The same stream without the flag
    climbs to an LR cut and a rollback attempt: the flag is what holds it."""
    pol = Policy()
    got, ctl = stream(pol, True, range(100, 250))
    assert [x for x in got if x.split(":")[1] != "alert"] == ["100:set_clip"]
    assert pol.level_at(249) <= 1
    assert ctl.lr_factor == 1.0 and not (ctl.skip_step or ctl.stop or ctl.save_checkpoint)
    assert ctl.rollback_to is None
    alerts = [x for x in got if x.endswith(":alert")]
    assert 1 < len(alerts) <= 1 + 150 // pol.config.cooldown  # reported, once per cooldown

    ordinary, _ = stream(Policy(), False, range(100, 250))
    assert {"reduce_lr"} <= {x.split(":")[1] for x in ordinary}


def test_recovering_alarms_alone_never_act_whatever_their_severity() -> None:
    """From a fresh policy: recovering alarms of every escalating kind, warning or critical,
    give an alert (or nothing inside its cooldown) and leave the control untouched."""
    pol = Policy()
    for s in range(10, 400, 3):
        ctl = Control()
        kinds = ("loss_spike", "grad_explosion", "activation_shift", "lr_loss_anomaly")
        alarms = [spike(s, True, sev, k) for k in kinds for sev in ("warning", "critical")]
        ivs = pol.step(s, alarms, ctl, {"grad_norm_recent_median": 0.5})
        assert set(types(ivs)) <= {"alert"}, (s, types(ivs))
        assert all(i.severity == "warning" and "recovering" in i.message for i in ivs)
        assert ctl == Control(), s
    assert pol.level_at(400) == 0 and pol.n_rollbacks == 0


def test_a_step_with_one_fresh_alarm_is_handled_as_before() -> None:
    """The rule is about steps whose alarms are *all* recovering: a fresh critical alarm beside
    a recovering one gets the ordinary response (here the skip of a critical spike)."""
    a, b = Policy(), Policy()
    ca, cb = Control(), Control()
    ctx = {"grad_norm_recent_median": 0.5}
    mixed = [spike(50, True), spike(50, False, "critical", "grad_explosion")]
    ivs = a.step(50, mixed, ca, ctx)
    ref = b.step(50, [mixed[1]], cb, ctx)
    assert types(ivs) == types(ref) and "skip_step" in types(ivs)
    assert ca == cb


def test_state_round_trip_mid_recovery_gives_the_same_decisions() -> None:
    """A snapshot taken while an episode is recovering restores the same future decisions."""
    a = Policy()
    stream(a, True, range(100, 160))
    b = Policy()
    b.load_state_dict(a.state_dict())
    for s in list(range(160, 200)) + list(range(230, 260, 5)):
        alarms = [spike(s, s < 200)]
        ca, cb = Control(), Control()
        ia = a.step(s, alarms, ca, {"grad_norm_recent_median": 0.5})
        ib = b.step(s, alarms, cb, {"grad_norm_recent_median": 0.5})
        assert [dataclasses.asdict(i) for i in ia] == [dataclasses.asdict(i) for i in ib]
        assert ca == cb


# ------------------------------------------------------------------ real PyTorch on CPU
torch = pytest.importorskip("torch")

from tests.policy.test_invariants import STEPS, acting, train  # noqa: E402


def shifted_inputs(i: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From data position 300 on the inputs are 3x larger: the loss jumps and the model
    adapts to the new scale by itself (a transient excursion)."""
    return (x * 3.0 if i >= 300 else x), y


def test_a_run_that_recovers_by_itself_is_not_touched() -> None:
    """The excursion is reported (alarms, some of them recovering), but nothing changes
    training: the final weights are bit for bit those of the unguarded loop."""
    g, held, stopped, w = train(shifted_inputs)
    _, held0, _, w0 = train(shifted_inputs, monitor=False)
    assert stopped is None and acting(g) == []
    # the scenario exercises the rule: recovering alarms reached the policy and were reported
    assert any(i.message.split(": ")[1:2] == ["recovering"] for i in g.interventions
               if i.type == "alert")
    assert all(torch.equal(a, b) for a, b in zip(w[STEPS - 1], w0[STEPS - 1], strict=True))
    assert held == held0


def test_non_finite_gradients_are_still_skipped() -> None:
    """A real fault: three steps of infinite gradients are skipped (never recovering), the
    weights stay finite and the run goes on."""
    g, held, stopped, w = train(grad_fault=lambda t: 300 <= t < 303)
    assert stopped is None and math.isfinite(held)
    assert {300, 301, 302} <= {i.step for i in g.interventions if i.type == "skip_step"}
    assert all(bool(torch.isfinite(p).all()) for p in w[STEPS - 1])


def test_an_lr_x50_burst_is_still_cut() -> None:
    """A real fault: the scheduler's LR x50 for 10 steps is divided out (the effective LR never
    goes above 1.3x the healthy schedule) and the run is not stopped."""
    from tests.adapters.test_rescue_mechanisms import ONSET, run

    guard, eff, healthy, stopped = run(lambda s: 50.0 if ONSET <= s < ONSET + 10 else 1.0)
    assert stopped is None
    assert "reduce_lr" in {i.type for i in guard.interventions}
    assert max(eff[s] / healthy[s] for s in eff if s >= ONSET) <= 1.3


# ------------------------------------------------------------------ a rollback restarts the level
def test_the_loss_level_restarts_at_the_restored_weights_after_a_rollback() -> None:
    """The recent loss level describes the weights: after the aftermath's rollback of a data
    episode (garbage batches the run partly learned), the replayed steps train the restored
    healthy weights, so their loss is not "measurably worse" -- the level of the damaged weights
    is not carried into the replay, where its lagging fall would look like a return to the
    trajectory and restart the probation's count (tests/adapters/test_guard_deferred_gate.py:
    the garbage's recurrence after the rollback went unjudged)."""
    from stability.run.checkpoints import CheckpointLedger

    pol, ledger = Policy(), CheckpointLedger()
    ledger.add(100, "memory:100")
    ctx = {"grad_norm_recent_median": 0.5, "healthy_checkpoints": ledger}
    rollback = None
    for s in range(400):
        ctl = Control()
        loss = 1.0 if s < 150 else (100.0 if s < 160 else 20.0)  # the garbage, then damage
        ivs = pol.track(s, 1e-3, loss, ctl)
        if 150 <= s < 160:  # the garbage batches alarm
            ivs += pol.step(s, [spike(s, False, "critical")], ctl, ctx)
        else:
            ivs += pol.step(s, [], ctl, ctx)
        if ctl.rollback_to is not None:
            rollback = s
            break
    assert rollback is not None and ctl.rollback_to == 100  # the aftermath's undo
    assert pol.worse() is False  # the restored weights' level, not the damaged weights'
    pol.track(101, 1e-3, 1.0, Control())  # the first replayed step: healthy
    assert pol.worse() is False
