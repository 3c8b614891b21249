"""The project's own outputs are never inputs: a guarded run's trainer logs replay clean.

Issue 26, item 1: the guard logs ``stability/*`` feedback into the trainer's logs; replaying or
watching those logs must never read them as training signals (the non-finite catch-all ``*``
alarmed on every NaN "none"), and "none" is a missing key, never NaN.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from stability.config.config import ConfigError, MonitorConfig
from stability.monitor.monitor import Monitor
from stability.outputs.feedback import feedback_metrics

NAN = math.nan


def _own_keys(step: int) -> dict[str, float]:
    return {"stability/clip_norm": NAN, "stability/score/nan": NAN,
            "stability/lr_factor": 1.0 + 0.5 * (step == 30),
            "train/stability/score/loss_spike": NAN,      # HF's TensorBoard tag
            "stability/lr_effective": 1e-3 * (1 + 1000 * (step == 30))}


def test_own_prefix_is_never_bound_not_even_by_the_catch_all() -> None:
    mon = Monitor("default")
    decisions = [mon.observe(s, {"loss": 2.0 - 0.01 * s, **_own_keys(s)}) for s in range(40)]
    assert not [a for d in decisions for a in d.alarms]
    assert not [n for n in mon.signals if "stability/" in n]
    assert mon.signals  # the loss is bound


def test_a_configured_prefix_is_never_bound_either() -> None:
    cfg = {"preset": "default", "monitor": {"own_prefixes": ["guard/"]}}
    mon = Monitor(cfg)
    d = mon.observe(0, {"loss": 2.0, "guard/clip": NAN, "rank0/guard/x": NAN})
    assert not d.alarms
    assert Monitor("default").observe(0, {"loss": 2.0, "guard/clip": NAN}).alarms  # not by default
    assert MonitorConfig.from_dict(cfg).monitor.own_prefixes == ("guard/",)
    assert MonitorConfig.from_dict(MonitorConfig.from_dict(cfg).to_dict()) == \
        MonitorConfig.from_dict(cfg)
    with pytest.raises(ConfigError, match="own_prefixes"):
        MonitorConfig.from_dict({"monitor": {"own_prefixes": [3]}})


def test_other_names_still_alarm() -> None:
    d = Monitor("default").observe(0, {"loss": NAN, "my_stability/x": 1.0})
    assert [a.signal for a in d.alarms] == ["loss"]


def test_feedback_has_no_nan_for_none() -> None:
    mon = Monitor("default")
    d = mon.observe(0, {"loss": 2.0})  # most bindings saw no input; no clip in force
    m = feedback_metrics(mon, d, extra={"lr_base": NAN, "rollbacks": 0})
    assert m and not [k for k, v in m.items() if math.isnan(v)]
    assert "stability/clip_norm" not in m and "stability/lr_base" not in m
    assert "stability/score/grad_explosion" not in m and m["stability/rollbacks"] == 0.0


def test_guard_metrics_have_no_nan() -> None:
    torch = pytest.importorskip("torch")
    from stability.torch import attach

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = attach(model, opt, monitor=Monitor("default"), log_interventions=False)
    assert not [k for k, v in guard.metrics().items() if math.isnan(v)]  # before any step
    model(torch.ones(2, 3)).sum().backward()
    guard.step(model(torch.ones(2, 3)).sum())
    m = guard.metrics()
    assert not [k for k, v in m.items() if math.isnan(v)] and "stability/clip_norm" not in m


# ---------------------------------------------------------------- the logs of clean runs
def _field_logs() -> Any:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "field_logs.py"
    spec = importlib.util.spec_from_file_location("field_logs", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["field_logs"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("stack", ["torch", "hf", "lightning"])
def test_clean_guarded_runs_replay_and_watch_without_alarms(stack: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    if stack == "hf":
        pytest.importorskip("transformers")
    if stack == "lightning":
        pytest.importorskip("lightning")
    pytest.importorskip("tensorboard")
    field_logs = _field_logs()
    logs = field_logs.MAKERS[stack](str(tmp_path), "clean")
    for name, row in field_logs.judge_logs(logs).items():
        assert row["steps"] >= 18 and row["watch_steps"] >= 18, (name, row)
        assert row["replay_alarms"] == row["watch_alarms"] == 0, (name, row)
        assert row["replay_acting"] == row["watch_acting"] == 0, (name, row)
    text = "".join(Path(p).read_text(errors="replace") for p in logs.values()
                   if Path(p).is_file())
    assert "stability/" in text and "NaN" not in text and "nan," not in text


def test_hf_fp16_logs_with_scaler_skipped_steps_replay_and_watch_as_the_run_decided(
        tmp_path: Path) -> None:
    """fp16 with start-up overflows (the scaler skips the first steps), logged every step: the
    log's replay and watch raise exactly the live run's alarms (the warm-up LR HF held during
    the skipped steps resumes: ``lr_jump`` warnings, live too) and nothing acting; no NaN."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("tensorboard")
    field_logs = _field_logs()
    logs = field_logs.MAKERS["hf_fp16"](str(tmp_path), "clean")
    live = field_logs.live_alarms(str(tmp_path))
    for name, row in field_logs.judge_logs(logs).items():
        assert row["steps"] >= 18 and row["watch_steps"] >= 18, (name, row)
        assert row["replay_alarm_keys"] == row["watch_alarm_keys"] == live, (name, row)
        assert row["replay_acting"] == row["watch_acting"] == 0, (name, row)
    state = Path(logs["trainer_state"]).read_text()
    assert '"amp_overflow": 1.0' in state and "NaN" not in state


# ---------------------------------------------------------------- one event schema
def test_replay_events_and_the_live_event_log_share_one_schema(tmp_path: Path) -> None:
    from replay.reader import read_run
    from replay.replay import replay_run
    from replay.report import split_events
    from stability.outputs.events import EventLog, read_events

    run = Path(__file__).resolve().parents[2] / "data" / "runs" / "bitflip"
    if not run.exists():
        pytest.skip("data/runs not in this checkout")
    replayed = tmp_path / "replayed.jsonl"
    replay_run(run, "default", events=replayed)
    live = tmp_path / "live.jsonl"
    cols = read_run(str(run)).to_pydict()
    steps = cols.pop("step")
    with EventLog(live) as log:
        mon = Monitor("default", event_log=log, alert_sinks=[])
        for i, s in enumerate(steps):
            mon.observe(int(s), {k: v[i] for k, v in cols.items() if v[i] is not None})

    def facts(path: Path) -> list[tuple]:
        return sorted((r["type"], r["step"], r.get("kind") or r.get("intervention"))
                      for r in read_events(path) if r["type"] in ("alarm", "intervention"))

    assert facts(replayed) and facts(replayed) == facts(live)
    for path in (replayed, live):  # and the report reads both the same way
        alarms, ivs, _ = split_events(read_events(path))
        assert len(alarms) + len(ivs) == len(facts(path))
