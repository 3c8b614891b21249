"""Tests of the escalation-ladder policy (stability/policy/policy.py, policy_config.py,
lr_schedule.py)."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stability.policy.config import PolicyConfig
from stability.policy.lr_schedule import adaptive_clip, lr_factor_at
from stability.policy.policy import Policy
from stability.run.checkpoints import CheckpointLedger
from stability.types import (
    Alarm,
    Control,
    Intervention,
    ReduceLR,
    Rollback,
    SetClip,
    Stop,
)


def alarm(step: int, kind: str = "loss_spike", severity: str = "warning",
          signal: str = "loss") -> Alarm:
    return Alarm(step, kind, signal, 9.0, 6.0, severity, "det")


def types_(ivs: list[Intervention]) -> list[str]:
    return [i.type for i in ivs]


def ledger_with(*steps: int, margin: int = 0) -> CheckpointLedger:
    led = CheckpointLedger(margin=margin)
    for s in steps:
        led.add(s, f"ckpt-{s}")
    return led


# the ladder mechanics below are tested without the skip-storm limit (tested on its own)
BASE = {"cooldown": 10, "escalation_window": 100, "quiet_steps": 300,
        "rewind_on_rollback": False, "recovery": {"max_consecutive_skips": 10_000}}


# --------------------------------------------------------------------------- escalation ladder
def test_escalation_order_clip_lr_rollback_stop() -> None:
    pol = Policy({**BASE, "max_rollbacks": 1})
    led = ledger_with(200, 400, 600, 800, 950)
    ctx = {"grad_norm_recent_median": 0.4, "healthy_checkpoints": led}
    ctl = Control()
    seen: dict[int, list[str]] = {}
    stop_reason = ""
    restored = None
    # a loss spike at 1000 that keeps recurring every 30 steps, alarms in between are merged
    for step in range(990, 1150):
        ctl.reset_step()
        al = [alarm(step)] if step >= 1000 and (step - 1000) % 30 in (0, 1, 2) else []
        ivs = pol.step(step, al, ctl, ctx)
        if ivs:
            seen[step] = types_(ivs)
        if ctl.stop and not stop_reason:
            stop_reason, restored = ctl.stop_reason, ctl.rollback_to
    # the rollback ends the episode (a fresh one starts at level 1); the run is stopped only
    # when the ladder is exhausted (rollback limit reached) and the reason says what was tried
    assert seen == {
        1000: ["alert", "set_clip"],
        1030: ["alert", "reduce_lr"],
        1060: ["alert", "checkpoint", "rollback"],
        1061: ["alert", "set_clip"],
        1090: ["alert", "reduce_lr"],
        1120: ["alert", "checkpoint", "rollback", "stop"],
    }
    assert "rollback limit (1) reached" in stop_reason
    assert "cause: outlier; tried: 1 rollback(s)" in stop_reason
    # the stop restores the latest healthy checkpoint before the episode and says which
    assert restored == 950 and "the weights of step 950" in stop_reason


def test_rollback_request_fields_and_control() -> None:
    pol = Policy({**BASE, "ladder": [["checkpoint", "rollback"]]})
    led = ledger_with(100, 200, 300)
    ctl = Control()
    ivs = pol.step(305, [alarm(305)], ctl, {"healthy_checkpoints": led})
    rb = next(i for i in ivs if isinstance(i, Rollback))
    assert (rb.to_step, rb.skip_from, rb.skip_to) == (300, 305, 305)
    assert ctl.save_checkpoint and ctl.rollback_to == 300 and ctl.skip_batches == (305, 305)
    assert types_(ivs) == ["checkpoint", "rollback"]


def test_rollback_target_is_latest_healthy_before_onset() -> None:
    led = CheckpointLedger(margin=5)
    led.add(100, "a")
    led.add(200, "b")
    led.add(300, "c", healthy=False, reason="emergency")   # flagged unhealthy
    led.add(350, "d")                                       # an alarm at 353 taints it
    led.add(398, "e")                                       # within margin of the onset
    led.add(420, "f")                                       # after the onset
    led.note_alarm(353)
    pol = Policy({**BASE, "ladder": [["alert", "clip"], ["alert", "checkpoint", "rollback"]]})
    ctx = {"healthy_checkpoints": led, "grad_norm_recent_median": 1.0}
    ctl = Control()
    assert "set_clip" in types_(pol.step(400, [alarm(400)], ctl, ctx))   # onset = 400
    ivs = pol.step(430, [alarm(430)], ctl, ctx)
    rb = next(i for i in ivs if isinstance(i, Rollback))
    assert rb.to_step == 200
    assert (rb.skip_from, rb.skip_to) == (400, 430)


def test_no_healthy_checkpoint_alerts_instead_of_rolling_back() -> None:
    pol = Policy({**BASE, "ladder": [["alert", "checkpoint", "rollback"]]})
    ctl = Control()
    ivs = pol.step(10, [alarm(10)], ctl, {"healthy_checkpoints": CheckpointLedger()})
    assert types_(ivs) == ["alert", "checkpoint"]
    assert "cannot roll back" in ivs[0].message and ctl.rollback_to is None


def test_max_rollbacks_turns_rollback_into_stop() -> None:
    pol = Policy({**BASE, "ladder": [["rollback"]], "max_rollbacks": 1})
    led = ledger_with(0)
    ctl = Control()
    assert types_(pol.step(10, [alarm(10)], ctl, {"healthy_checkpoints": led})) == ["rollback"]
    ivs = pol.step(50, [alarm(50)], ctl, {"healthy_checkpoints": led})
    assert "stop" in types_(ivs) and ctl.stop and "rollback limit" in ctl.stop_reason


def test_rewind_on_rollback_rebases_timers_and_ledger() -> None:
    cfg = {"cooldown": 10, "escalation_window": 100, "quiet_steps": 300,
           "ladder": [["alert", "reduce_lr"], ["alert", "checkpoint", "rollback"], ["stop"]]}
    pol = Policy(cfg)
    led = ledger_with(500, 900)
    ctx = {"healthy_checkpoints": led}
    ctl = Control()
    pol.step(1000, [alarm(1000)], ctl, ctx)                      # LR cut at 1000
    ivs = pol.step(1050, [alarm(1050)], ctl, ctx)
    assert next(i for i in ivs if isinstance(i, Rollback)).to_step == 900
    assert [r.step for r in led.records] == [500, 900]         # nothing after 900 kept
    # the trainer resumes at 901: the LR cut made 50 steps before the rollback is 50 steps old
    assert pol.control_at(901).lr_factor == pytest.approx(lr_factor_at(51, 0, 0.5, 100, 50))
    ctl.reset_step()
    # the rollback ended the episode: one alarm afterwards starts a fresh one at level 1 (it
    # neither stops the run nor inherits the old escalation)
    assert types_(pol.step(905, [alarm(905)], ctl, ctx)) == ["alert", "reduce_lr"]
    assert pol.level_at(905) == 1 and not ctl.stop


# --------------------------------------------------------------------------- cooldown, storm
def test_cooldown_holds() -> None:
    pol = Policy(BASE)
    ctl = Control()
    assert pol.step(100, [alarm(100)], ctl, {"grad_norm_recent_median": 1.0})
    for s in range(101, 110):
        assert pol.step(s, [alarm(s)], ctl) == []
    assert types_(pol.step(110, [alarm(110)], ctl)) == ["alert", "reduce_lr"]
    assert pol.n_merged == 9 and pol.n_responses == 2


def test_skip_still_applies_inside_cooldown() -> None:
    pol = Policy(BASE)
    ctl = Control()
    pol.step(100, [alarm(100, severity="critical")], ctl, {"grad_norm_recent_median": 1.0})
    assert ctl.skip_step
    ctl.reset_step()
    assert types_(pol.step(101, [alarm(101, severity="critical")], ctl)) == ["skip_step"]
    assert ctl.skip_step
    ctl.reset_step()
    assert pol.step(102, [alarm(102, severity="warning")], ctl) == [] and not ctl.skip_step


def test_storm_gives_one_response() -> None:
    pol = Policy(BASE)
    ctl = Control()
    storm = [alarm(500, kind, sev, f"{kind}/blk{i}")
             for i in range(20)
             for kind, sev in (("loss_spike", "warning"), ("grad_explosion", "critical"),
                               ("activation_shift", "warning"))]
    ivs = pol.step(500, storm, ctl, {"grad_norm_recent_median": 2.0})
    assert types_(ivs) == ["alert", "skip_step", "set_clip"]
    assert ivs[0].severity == "critical"
    assert "activation_shift" in ivs[0].reason and "+17" in ivs[0].reason
    for s in range(501, 510):
        ctl.reset_step()
        ivs = pol.step(s, storm, ctl)
        assert types_(ivs) == ["skip_step"]


def test_info_alarms_are_ignored_by_default() -> None:
    pol = Policy(BASE)
    assert pol.step(3, [alarm(3, severity="info")], Control()) == []
    assert pol.level_at(3) == 0


# --------------------------------------------------------------------------- hysteresis
def test_hysteresis_deescalates_one_level_per_quiet_period() -> None:
    pol = Policy(BASE)
    ctl = Control()
    ctx = {"grad_norm_recent_median": 1.0}
    pol.step(1000, [alarm(1000)], ctl, ctx)
    pol.step(1050, [alarm(1050)], ctl, ctx)
    assert pol.level_at(1050) == 2
    assert pol.level_at(1349) == 2 and pol.level_at(1350) == 1 and pol.level_at(1650) == 0
    # after one quiet period the level is 1 and a recurrence (outside the window) repeats it
    assert types_(pol.step(1400, [alarm(1400)], ctl, ctx)) == ["alert", "set_clip"]
    # ... and one within the window escalates again, but only to 2
    assert types_(pol.step(1450, [alarm(1450)], ctl, ctx)) == ["alert", "reduce_lr"]


def test_fresh_episode_after_full_quiet_resets_onset() -> None:
    pol = Policy({**BASE, "ladder": [["alert"], ["rollback"]]})
    led = ledger_with(100, 1500)
    ctx = {"healthy_checkpoints": led}
    pol.step(1000, [alarm(1000)], Control(), ctx)
    pol.step(2000, [alarm(2000)], Control(), ctx)        # level decayed to 0: new onset 2000
    ivs = pol.step(2050, [alarm(2050)], Control(), ctx)
    rb = next(i for i in ivs if isinstance(i, Rollback))
    assert (rb.to_step, rb.skip_from) == (1500, 2000)


# --------------------------------------------------------------------------- per-kind rules
def test_nonfinite_skips_then_rolls_back_when_persistent() -> None:
    pol = Policy(BASE)
    led = ledger_with(50)
    ctx = {"healthy_checkpoints": led, "grad_norm_recent_median": 1.0}
    ctl = Control()
    out = []
    for s in (100, 101, 102):
        ctl.reset_step()
        out.append(types_(pol.step(s, [alarm(s, "nonfinite", "critical", "loss")], ctl, ctx)))
        assert ctl.skip_step
    assert out[0] == ["alert", "skip_step", "set_clip"]
    assert out[1] == ["skip_step"]
    assert out[2] == ["alert", "skip_step", "checkpoint", "rollback"]


def test_train_val_divergence_alert_only() -> None:
    """A warning alone does not act (invariant 1): no emergency checkpoint either."""
    pol = Policy(BASE)
    ctl = Control()
    for s in (100, 150, 200, 250):
        ctl.reset_step()
        assert types_(pol.step(s, [alarm(s, "train_val_divergence")], ctl)) == ["alert"]
        assert not ctl.save_checkpoint and ctl.lr_factor == 1.0
    assert pol.level_at(250) == 0
    # its own cooldown does not hide a loss spike
    ctl.reset_step()
    ivs = pol.step(251, [alarm(251), alarm(251, "train_val_divergence")], ctl,
                   {"grad_norm_recent_median": 1.0})
    assert types_(ivs) == ["alert", "set_clip"]


def test_lr_loss_anomaly_reduces_lr() -> None:
    pol = Policy(BASE)
    ctl = Control()
    assert types_(pol.step(7, [alarm(7, "lr_loss_anomaly")], ctl)) == ["alert", "reduce_lr"]
    assert ctl.lr_factor == 0.5


def test_custom_kind_rule_merges_over_defaults() -> None:
    cfg = PolicyConfig.from_dict({"kinds": {"nonfinite": {"patience": 5}}})
    assert cfg.rule("nonfinite").skip == "always" and cfg.rule("nonfinite").patience == 5
    assert cfg.rule("loss_spike").skip == "critical"


def test_critical_start_level() -> None:
    pol = Policy({**BASE, "kinds": {"grad_explosion": {"critical_start_level": 2}}})
    ivs = pol.step(5, [alarm(5, "grad_explosion", "critical")], Control())
    assert types_(ivs) == ["alert", "skip_step", "reduce_lr"]


# --------------------------------------------------------------------------- LR ramp, clip
def test_lr_ramp_values_in_control() -> None:
    pol = Policy({**BASE, "ladder": [["reduce_lr"]],
                  "lr": {"factor": 0.2, "duration": 3, "restore_steps": 4}})
    ctl = Control()
    got = []
    for s in range(10, 20):
        ctl.reset_step()
        pol.step(s, [alarm(s)] if s == 10 else [], ctl)
        got.append(round(ctl.lr_factor, 6))
    assert got == [0.2, 0.2, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0, 1.0]


def test_lr_cuts_compound_and_are_floored() -> None:
    pol = Policy({**BASE, "ladder": [["reduce_lr"]], "cooldown": 0,
                  "lr": {"factor": 0.1, "min_factor": 0.05}})
    ctl = Control()
    f = [next(i for i in pol.step(s, [alarm(s)], ctl) if isinstance(i, ReduceLR)).factor
         for s in (1, 2, 3)]
    assert f == pytest.approx([0.1, 0.05, 0.05])


@pytest.mark.parametrize("shape", ["linear", "cosine", "step"])
def test_lr_factor_ramp_is_monotone_and_ends_at_one(shape: str) -> None:
    vals = [lr_factor_at(s, 0, 0.25, 5, 10, shape) for s in range(-2, 20)]
    assert vals[:2] == [1.0, 1.0] and vals[2:7] == [0.25] * 5
    assert all(b >= a for a, b in zip(vals[2:], vals[3:], strict=False))
    assert vals[-1] == 1.0 and lr_factor_at(14, 0, 0.25, 5, 10, shape) == 1.0


def test_adaptive_clip_from_context() -> None:
    pol = Policy({**BASE, "ladder": [["clip"]], "cooldown": 0})
    ctl = Control()
    (c1,) = pol.step(1, [alarm(1)], ctl, {"grad_norm_recent_median": 0.3})
    assert isinstance(c1, SetClip) and c1.max_norm == pytest.approx(0.6)
    assert ctl.clip_norm == pytest.approx(0.6)
    # a larger median never loosens the clip in force
    (c2,) = pol.step(2, [alarm(2)], ctl, {"grad_norm_recent_median": 5.0})
    assert isinstance(c2, SetClip) and c2.max_norm == pytest.approx(0.6)
    # the trainer's own clip caps a fresh policy's value
    pol2 = Policy({**BASE, "ladder": [["clip"]]})
    (c3,) = pol2.step(1, [alarm(1)], Control(), {"grad_norm_recent_median": 1.0, "clip_norm": 0.5})
    assert isinstance(c3, SetClip) and c3.max_norm == 0.5
    # no statistics and no clip: nothing to derive from -> a note in the alert, no SetClip
    pol3 = Policy({**BASE, "ladder": [["alert", "clip"]]})
    ivs = pol3.step(1, [alarm(1)], Control(), {"grad_norm_recent_median": math.nan})
    assert types_(ivs) == ["alert"] and "no gradient statistics" in ivs[0].message
    assert adaptive_clip(None, 2.0, 1.0, tighten=0.25) == 0.25


def test_clip_expires() -> None:
    pol = Policy({**BASE, "ladder": [["clip"]], "clip": {"duration": 5}})
    ctl = Control()
    pol.step(10, [alarm(10)], ctl, {"grad_norm_recent_median": 1.0})
    assert [pol.control_at(s).clip_norm for s in (9, 10, 14, 15)] == [None, 2.0, 2.0, None]
    ctl.reset_step()
    pol.step(15, [], ctl)
    assert ctl.clip_norm is None


# --------------------------------------------------------------------------- log_only
def _run(pol: Policy, events: dict[int, list[Alarm]], steps: range, every_step: bool = True,
         ledger: CheckpointLedger | None = None) -> tuple[list[tuple[int, list[dict]]],
                                                          list[tuple[int, float, float | None]]]:
    ctl = Control()
    out = []
    controls = []
    for s in steps:
        ctl.reset_step()
        al = events.get(s, [])
        ctx = {"grad_norm_recent_median": 1.0 + (s % 7) / 10, "healthy_checkpoints": ledger}
        if al or every_step:
            ivs = pol.step(s, al, ctl, ctx)
            if ivs:
                out.append((s, [i.to_dict() for i in ivs]))
            controls.append((s, ctl.lr_factor, ctl.clip_norm))
        else:
            c = pol.control_at(s)
            controls.append((s, c.lr_factor, c.clip_norm))
    return out, controls


def _events(seed: int, n: int = 2000, p: float = 0.02) -> dict[int, list[Alarm]]:
    rng = np.random.default_rng(seed)
    kinds = ["loss_spike", "grad_explosion", "nonfinite", "train_val_divergence",
             "lr_loss_anomaly", "activation_shift"]
    ev: dict[int, list[Alarm]] = {}
    for s in range(n):
        if rng.random() < p:
            k = int(rng.integers(1, 4))
            ev[s] = [alarm(s, kinds[int(rng.integers(len(kinds)))],
                           ["warning", "critical"][int(rng.integers(2))], f"sig{j}")
                     for j in range(k)]
    return ev


def test_log_only_leaves_control_neutral_and_records_same_decisions() -> None:
    ev = _events(1)
    cfg = {**BASE, "max_rollbacks": 100}
    act, _ = _run(Policy(cfg), ev, range(2000), ledger=ledger_with(0, 300, 600))
    pol = Policy({**cfg, "mode": "log_only"})
    ctl = Control()
    ledger = ledger_with(0, 300, 600)
    dry = []
    for s in range(2000):
        ctl.reset_step()
        ivs = pol.step(s, ev.get(s, []), ctl, {"grad_norm_recent_median": 1.0 + (s % 7) / 10,
                                               "healthy_checkpoints": ledger})
        if ivs:
            dry.append((s, [i.to_dict() for i in ivs]))
        assert ctl == Control(), s
        assert pol.control_at(s) == Control()
    assert dry == act
    # 100 rollbacks allowed: the ladder is never exhausted, so the run is never stopped
    assert {t["type"] for _, ivs in dry for t in ivs} >= {"set_clip", "reduce_lr", "rollback"}
    assert "stop" not in {t["type"] for _, ivs in dry for t in ivs}


# --------------------------------------------------------------------------- purity, round trip
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_quiet_step_purity(seed: int) -> None:
    ev = _events(seed, p=0.03)
    cfg = {"cooldown": 5, "escalation_window": 60, "quiet_steps": 150, "max_rollbacks": 100,
           "clip": {"duration": 40}, "lr": {"duration": 30, "restore_steps": 20}}
    dense = _run(Policy(cfg), ev, range(2000), True, ledger_with(0, 100, 700))
    sparse = _run(Policy(cfg), ev, range(2000), False, ledger_with(0, 100, 700))
    assert dense == sparse
    assert dense[0]


@settings(deadline=None, max_examples=60)
@given(st.lists(st.tuples(st.integers(0, 400), st.sampled_from(
    ["loss_spike", "nonfinite", "train_val_divergence", "lr_loss_anomaly", "level_shift"]),
    st.sampled_from(["info", "warning", "critical"])), max_size=40),
    st.integers(0, 15), st.integers(1, 80), st.booleans())
def test_quiet_step_purity_property(raw: list[tuple[int, str, str]], cooldown: int,
                                    quiet: int, rewind: bool) -> None:
    ev: dict[int, list[Alarm]] = {}
    for s, k, sev in raw:
        ev.setdefault(s, []).append(alarm(s, k, sev))
    cfg = {"cooldown": cooldown, "escalation_window": 30, "quiet_steps": quiet,
           "rewind_on_rollback": rewind, "clip": {"duration": 20},
           "lr": {"duration": 10, "restore_steps": 7}}
    assert _run(Policy(cfg), ev, range(420), True, ledger_with(0, 50)) == _run(
        Policy(cfg), ev, range(420), False, ledger_with(0, 50))


@pytest.mark.parametrize("seed", [0, 5])
def test_state_round_trip_mid_sequence(seed: int) -> None:
    ev = _events(seed, p=0.03)
    cfg = {"cooldown": 5, "escalation_window": 60, "quiet_steps": 150, "max_rollbacks": 100}
    ref = Policy(cfg)
    led_ref = ledger_with(0, 100, 700)
    full, _ = _run(ref, ev, range(2000), ledger=led_ref)
    for cut in (333, 1000, 1501):
        a = Policy(cfg)
        led_a = ledger_with(0, 100, 700)
        first, _ = _run(a, ev, range(cut), ledger=led_a)
        sd = json.loads(json.dumps(a.state_dict()))
        assert sd["version"] == 2
        b = Policy(cfg)
        b.load_state_dict(sd)
        led_b = CheckpointLedger.from_state_dict(json.loads(json.dumps(led_a.state_dict())))
        rest, _ = _run(b, ev, range(cut, 2000), ledger=led_b)
        assert first + rest == full


def test_load_state_tolerates_missing_later_fields_and_rejects_future_versions() -> None:
    pol = Policy()
    pol.load_state_dict({"version": 1})
    assert pol.level_at(10) == 0
    with pytest.raises(ValueError, match="newer"):
        pol.load_state_dict({"version": 99})


def test_interventions_round_trip_as_json() -> None:
    pol = Policy({**BASE, "ladder": [["alert", "skip", "clip", "reduce_lr", "checkpoint",
                                      "rollback", "stop"]]})
    ivs = pol.step(9, [alarm(9)], Control(), {"grad_norm_recent_median": 1.0,
                                             "healthy_checkpoints": ledger_with(1)})
    # a stop is turned into the rollback still available (the ladder is not exhausted)
    assert types_(ivs) == ["alert", "skip_step", "set_clip", "reduce_lr", "checkpoint",
                           "rollback"]
    assert all(iv.cause == "outlier" for iv in ivs)
    ivs.append(Stop(9, "why", cause="corruption"))
    for iv in ivs:
        assert Intervention.from_dict(json.loads(json.dumps(iv.to_dict()))) == iv


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize("cfg, match", [
    ({"cooldwn": 3}, r"policy: unknown key 'cooldwn'"),
    ({"cooldown": -1}, r"policy.cooldown: must be an int"),
    ({"cooldown": 2.5}, r"policy.cooldown"),
    ({"mode": "dry"}, r"policy.mode: must be one of act, log_only"),
    ({"lr": {"factor": 1.5}}, r"policy.lr.factor"),
    ({"lr": {"factr": 0.5}}, r"policy.lr: unknown key 'factr'"),
    ({"lr": {"factor": 0.1, "min_factor": 0.5}}, r"policy.lr.min_factor"),
    ({"lr": {"shape": "zigzag"}}, r"policy.lr.shape"),
    ({"clip": {"factor": 0}}, r"policy.clip.factor"),
    ({"clip": "tight"}, r"policy.clip: must be a table"),
    ({"ladder": [["clip", "explode"]]}, r"policy.ladder\[0\]: unknown action 'explode'"),
    ({"ladder": []}, r"policy.ladder"),
    ({"ladder": ["clip"]}, r"policy.ladder\[0\]"),
    ({"kinds": {"loss_spikes": {}}}, r"policy.kinds: unknown key 'loss_spikes'"),
    ({"kinds": {"nonfinite": {"skip": "sometimes"}}}, r"policy.kinds.nonfinite.skip"),
    ({"kinds": {"nonfinite": {"persist_level": 9}}}, r"policy.kinds.nonfinite.persist_level"),
    ({"quiet_steps": 0}, r"policy.quiet_steps"),
    ({"rewind_on_rollback": "yes"}, r"policy.rewind_on_rollback"),
    ({"min_severity": "loud"}, r"policy.min_severity"),
])
def test_bad_config(cfg: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Policy(cfg)


def test_config_round_trip_and_no_input_mutation() -> None:
    raw = {"cooldown": 3, "kinds": {"nonfinite": {"patience": 2}}, "lr": {"factor": 0.25}}
    before = copy.deepcopy(raw)
    cfg = PolicyConfig.from_dict(raw)
    assert raw == before
    assert PolicyConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert Policy(cfg).config is cfg


# --------------------------------------------------------------------------- LR jumps
def jalarm(step: int, score: float = 460.0, severity: str = "critical") -> Alarm:
    """An alarm of the ``lr_jump`` binding (LRJump: score = dlog(lr) / 0.01 on a flat LR)."""
    return Alarm(step, "lr_loss_anomaly", "lr", score, 10.0, severity, "lr_jump")


JUMP = {**BASE, "lr_jump": {"hold": 5, "restore_steps": 4}}


def test_lr_jump_cut_is_sized_to_the_jump_and_held() -> None:
    pol = Policy(JUMP)
    ctl = Control()
    ivs = pol.step(100, [jalarm(100)], ctl)
    assert types_(ivs) == ["alert", "reduce_lr"]
    cut = ivs[1]
    assert isinstance(cut, ReduceLR)
    assert cut.factor == pytest.approx(math.exp(-4.6)) and (cut.duration, cut.restore_steps) == (
        5, 4)
    assert "LR jumped x99.5" in ivs[0].message
    got = [round(pol.control_at(s).lr_factor, 4) for s in range(99, 110)]
    f = round(math.exp(-4.6), 4)
    assert got[:6] == [1.0] + [f] * 5 and got[-2:] == [1.0, 1.0]
    assert got[6:9] == sorted(got[6:9]) and f < got[6] < 1.0


def test_lr_jump_ratio_from_context_and_min_factor() -> None:
    pol = Policy(JUMP)
    ivs = pol.step(10, [jalarm(10, score=80.0)], Control(), {"lr": 3e-2, "lr_prev": 1e-3})
    assert next(i for i in ivs if isinstance(i, ReduceLR)).factor == pytest.approx(1 / 30)
    # a jump beyond 1 / min_factor is floored; a small critical jump still gets lr.factor
    pol = Policy(JUMP)
    ivs = pol.step(10, [jalarm(10, score=1e4)], Control())
    assert next(i for i in ivs if isinstance(i, ReduceLR)).factor == pytest.approx(0.01)
    pol = Policy(JUMP)
    ivs = pol.step(10, [jalarm(10, score=40.0)], Control())
    assert next(i for i in ivs if isinstance(i, ReduceLR)).factor == pytest.approx(0.5)


def test_lr_jump_warning_gets_the_ordinary_ladder() -> None:
    pol = Policy(JUMP)
    ivs = pol.step(10, [jalarm(10, score=20.0, severity="warning")], Control())
    cut = next(i for i in ivs if isinstance(i, ReduceLR))
    assert (cut.factor, cut.duration) == (0.5, 100)
    pol = Policy({**JUMP, "lr_jump": {"enabled": False}})
    cut = next(i for i in pol.step(10, [jalarm(10)], Control()) if isinstance(i, ReduceLR))
    assert (cut.factor, cut.duration) == (0.5, 100)


def test_lr_jump_acts_inside_a_cooldown() -> None:
    pol = Policy(JUMP)
    ctl = Control()
    assert types_(pol.step(100, [alarm(100)], ctl, {"grad_norm_recent_median": 1.0})) == [
        "alert", "set_clip"]
    ivs = pol.step(103, [jalarm(103)], ctl)
    assert "reduce_lr" in types_(ivs) and ctl.lr_factor == pytest.approx(math.exp(-4.6))


def test_lr_jump_realarms_rearm_the_hold_without_compounding() -> None:
    pol = Policy(JUMP)
    ctl = Control()
    pol.step(100, [jalarm(100)], ctl)
    f = ctl.lr_factor
    for s in range(101, 120):          # a frozen LRJump alarms on every step of the jump
        ctl.reset_step()
        assert pol.step(s, [jalarm(s, score=455.0)], ctl) == [], s
        assert ctl.lr_factor == f
    assert pol.n_merged == 19 and pol.level_at(119) == 1
    assert [pol.control_at(s).lr_factor == f for s in (123, 124)] == [True, False]
    assert pol.control_at(128).lr_factor == 1.0
    # a much larger jump on top of the held one compounds
    ivs = pol.step(121, [jalarm(121, score=230.0 + 460.0)], ctl)
    assert next(i for i in ivs if isinstance(i, ReduceLR)).factor == pytest.approx(0.01)


def test_lr_jump_after_damage_rolls_back() -> None:
    pol = Policy(JUMP)
    led = ledger_with(50, 90)
    ctl = Control()
    pol.step(95, [alarm(95)], ctl, {"grad_norm_recent_median": 1.0, "healthy_checkpoints": led})
    ivs = pol.step(100, [jalarm(100)], ctl, {"healthy_checkpoints": led})
    assert types_(ivs) == ["alert", "reduce_lr", "checkpoint", "rollback"]
    rb = next(i for i in ivs if isinstance(i, Rollback))
    # the cause is the LR, not the data: the batches are not skipped (empty range)
    assert (rb.to_step, rb.skip_from, rb.skip_to) == (90, 95, 94) and rb.cause == "lr"
    assert ctl.rollback_to == 90 and ctl.skip_batches is None
    assert ctl.lr_factor == pytest.approx(math.exp(-4.6))
    # without damage: no rollback
    pol = Policy(JUMP)
    assert types_(pol.step(100, [jalarm(100)], Control(), {"healthy_checkpoints": led})) == [
        "alert", "reduce_lr"]


def test_lr_jump_rollback_rewinds_the_hold() -> None:
    pol = Policy({**JUMP, "rewind_on_rollback": True})
    led = ledger_with(50, 90)
    ctl = Control()
    pol.step(99, [alarm(99, "grad_explosion")], ctl, {"healthy_checkpoints": led})
    pol.step(100, [jalarm(100)], ctl, {"healthy_checkpoints": led})
    # the trainer goes back to step 90 and continues at 91: the hold is rebased onto 90
    f = math.exp(-4.6)
    assert ctl.rollback_to == 90 and ctl.lr_factor == pytest.approx(f)
    assert [pol.control_at(s).lr_factor for s in (89, 90, 94)] == pytest.approx([1.0, f, f])
    assert f < pol.control_at(95).lr_factor < 1.0


def _jump_events(seed: int, n: int = 1500) -> dict[int, list[Alarm]]:
    ev = _events(seed, n, p=0.02)
    rng = np.random.default_rng(seed + 100)
    for s in range(n):
        if rng.random() < 0.02:
            ev.setdefault(s, []).append(jalarm(s, float(rng.uniform(20, 800)),
                                               ["warning", "critical"][int(rng.integers(2))]))
    return ev


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lr_jump_quiet_step_purity_round_trip_and_log_only(seed: int) -> None:
    ev = _jump_events(seed)
    cfg = {"cooldown": 5, "escalation_window": 60, "quiet_steps": 150, "max_rollbacks": 100,
           "lr": {"duration": 30, "restore_steps": 20},
           "lr_jump": {"hold": 15, "restore_steps": 6}}
    dense = _run(Policy(cfg), ev, range(1500), True, ledger_with(0, 100, 700))
    sparse = _run(Policy(cfg), ev, range(1500), False, ledger_with(0, 100, 700))
    assert dense == sparse
    assert any(t["type"] == "reduce_lr" and t["duration"] == 15
               for _, ivs in dense[0] for t in ivs)
    # state round trip mid-sequence
    a = Policy(cfg)
    led_a = ledger_with(0, 100, 700)
    first, _ = _run(a, ev, range(777), ledger=led_a)
    b = Policy(cfg)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    led_b = CheckpointLedger.from_state_dict(json.loads(json.dumps(led_a.state_dict())))
    rest, _ = _run(b, ev, range(777, 1500), ledger=led_b)
    assert first + rest == dense[0]
    # log_only: same decisions, neutral control
    cfg["rewind_on_rollback"] = False  # a log_only policy never rewinds
    acted, _ = _run(Policy(cfg), ev, range(1500), True, ledger_with(0, 100, 700))
    dry, controls = _run(Policy({**cfg, "mode": "log_only"}), ev, range(1500), True,
                         ledger_with(0, 100, 700))
    assert dry == acted
    assert all(c[1:] == (1.0, None) for c in controls)


@pytest.mark.parametrize("cfg, match", [
    ({"lr_jump": {"hold": 0}}, r"policy.lr_jump.hold"),
    ({"lr_jump": {"detectors": "lr_jump"}}, r"policy.lr_jump.detectors: must be a list"),
    ({"lr_jump": {"damage_kinds": ["loss_spikes"]}}, r"policy.lr_jump.damage_kinds: unknown"),
    ({"lr_jump": {"log_unit": 0}}, r"policy.lr_jump.log_unit"),
    ({"lr_jump": {"min_severity": "loud"}}, r"policy.lr_jump.min_severity"),
    ({"lr_jump": {"holdd": 3}}, r"policy.lr_jump: unknown key 'holdd'"),
])
def test_bad_lr_jump_config(cfg: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Policy(cfg)


def test_lr_jump_config_round_trip() -> None:
    cfg = PolicyConfig.from_dict({"lr_jump": {"hold": 7, "detectors": ["a", "b"]}})
    assert PolicyConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.lr_jump.detectors == ("a", "b")


# --------------------------------------------------------------------------- typed seams
def test_policy_context_from_a_mapping_and_as_a_mapping() -> None:
    from stability.policy.policy import PolicyContext

    led = ledger_with(0)
    ctx = PolicyContext.coerce({"lr": "0.2", "lr_prev": 0.1, "clip_norm": math.inf,
                                "grad_norm": "n/a", "grad_norm_recent_median": np.float32(0.5),
                                "healthy_checkpoints": led, "unknown": 1})
    assert (ctx.lr, ctx.lr_prev, ctx.clip_norm, ctx.grad_norm) == (0.2, 0.1, None, None)
    assert ctx.grad_norm_recent_median == 0.5 and ctx.healthy_checkpoints is led
    # old readers of the dict keep working: only the fields that are set
    assert dict(ctx) == {"healthy_checkpoints": led, "lr": 0.2, "lr_prev": 0.1,
                         "grad_norm_recent_median": 0.5}
    assert ctx.get("clip_norm") is None and "lr" in ctx and "clip_norm" not in ctx
    with pytest.raises(KeyError):
        ctx["grad_norm"]
    assert PolicyContext.coerce(ctx) is ctx
    assert dict(PolicyContext.coerce(None)) == {} == dict(PolicyContext.coerce({}))


def _ctx_stream(seed: int, typed: bool) -> tuple[list[tuple[int, list[dict]]], dict]:
    """A random alarm stream (LR jumps included) with every context field varying."""
    from stability.policy.policy import PolicyContext

    rng = np.random.default_rng(seed)
    ev = _events(seed, n=1500, p=0.03)
    for s in rng.choice(1500, 15, replace=False).tolist():
        ev.setdefault(s, []).append(jalarm(s, float(rng.uniform(50, 500))))
    pol = Policy({**JUMP, "max_rollbacks": 20, "rewind_on_rollback": bool(seed % 2)})
    led, ctl, out = ledger_with(0, 200, 600, 1000), Control(), []
    for s in range(1500):
        ctl.reset_step()
        raw = {"healthy_checkpoints": led, "lr": float(rng.uniform(0.01, 2.0)),
               "lr_prev": [None, 0.05, math.nan][s % 3], "clip_norm": [None, 2.0][s % 2],
               "grad_norm": float(rng.uniform(0.5, 3)),
               "grad_norm_recent_median": [None, float(rng.uniform(0.5, 3))][s % 5 != 0]}
        ctx = (PolicyContext(**raw) if typed
               else {k: v for k, v in raw.items() if v is not None})
        ivs = pol.step(s, ev.get(s, []), ctl, ctx)
        if ivs:
            out.append((s, [i.to_dict() for i in ivs]))
    return out, pol.state_dict()


@pytest.mark.parametrize("seed", [0, 1])
def test_typed_and_mapping_context_decide_identically(seed: int) -> None:
    typed = _ctx_stream(seed, typed=True)
    assert typed == _ctx_stream(seed, typed=False)
    kinds = {iv["type"] for _, ivs in typed[0] for iv in ivs}
    assert {"set_clip", "reduce_lr", "rollback"} <= kinds


def test_checkpoint_ledger_is_a_policy_ledger() -> None:
    from stability.policy.policy import Ledger

    assert isinstance(CheckpointLedger(), Ledger)
    assert not isinstance(object(), Ledger)


def test_version2_snapshot_loads_into_named_records_and_writes_back_unchanged() -> None:
    from stability.policy.policy import STATE_VERSION, ClipHold, JumpHold, LRCut, Probation
    from stability.policy.state import read_state

    # a version-2 snapshot as the positional-tuple implementation wrote it
    sd = {"version": 2, "level": 2, "last_alarm": 100, "last_response": 100,
          "kind_last": {"stall": 90}, "onset": 95, "hist": {"nonfinite": [97, 100]},
          "lr": [100, 0.25, 10, 10], "clip": [1.5, 100, 50], "jump": [8.0, 99, 0.125],
          "damage_last": 98, "n_rollbacks": 1, "n_responses": 4, "n_merged": 2,
          "episode": {"consec": 3, "last_seen": 100, "skip_run": 0, "adapt_start": 96,
                      "adapt_fast": "nan", "cause": "shift"},
          "probation": [80, 60, 1, "shift"]}
    assert STATE_VERSION == 2
    snap = read_state(sd, PolicyConfig.from_dict(None))
    assert snap.lr == LRCut(start=100, factor=0.25, duration=10, restore=10)
    assert snap.clip == ClipHold(norm=1.5, start=100, duration=50)
    assert snap.jump == JumpHold(ratio=8.0, last=99, factor=0.125)
    assert snap.probation == Probation(resume=80, target=60, n_worse=1, cause="shift")
    pol = Policy()
    pol.load_state_dict(sd)
    assert pol.lr_factor_at(105) == 0.25 and pol.clip_norm_at(149) == 1.5
    assert pol.clip_norm_at(150) is None and pol.cause == "shift"
    out = json.loads(json.dumps(pol.state_dict()))
    assert {k: out[k] for k in sd if k != "episode"} == {k: sd[k] for k in sd if k != "episode"}
    # (fields added later are written beside the old ones)
    assert {k: out["episode"][k] for k in sd["episode"]} == sd["episode"]


def test_monitor_hands_the_policy_a_typed_context() -> None:
    from stability.monitor.monitor import Monitor
    from stability.policy.policy import PolicyContext

    mon = Monitor()
    seen: list[object] = []
    orig = mon.policy.step

    def spy(step, alarms, control, context=None):
        if alarms:
            seen.append(context)
        return orig(step, alarms, control, context)

    mon.policy.step = spy
    rng = np.random.default_rng(0)
    for s in range(400):
        loss = 2.0 + 0.01 * rng.standard_normal() + (50.0 if s in (300, 301) else 0.0)
        mon.observe(s, {"loss": loss, "grad_norm": 1.0 + 0.05 * rng.standard_normal(),
                        "lr": 0.1})
    assert seen and all(isinstance(c, PolicyContext) for c in seen)
    c = seen[0]
    assert isinstance(c, PolicyContext)
    assert c.healthy_checkpoints is mon.checkpoints
    assert c.lr == c.lr_prev == 0.1 and c.clip_norm is None
    assert c.grad_norm_recent_median is not None and 0.8 < c.grad_norm_recent_median < 1.2
