"""The monitor's goodput ledger, its event-log records and the per-step tail shared by
``observe()`` and ``replay()`` (issue 13)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stability import Monitor
from stability.config.config import ConfigError, load_config
from stability.outputs.events import EventLog, read_events
from stability.run.goodput import GoodputTracker
from stability.types import Control
from tests.shared_data import PUBLIC_RUNS

NAN_CFG = {"detectors": [
    {"name": "nan", "detector": "nonfinite", "inputs": ["*"]},
    {"name": "loss_spike", "detector": "ewma_z", "inputs": ["loss"],
     "params": {"warmup": 5, "alpha": 0.1}},
]}
BAD = (3, 7, 12)  # steps with a NaN loss: the policy skips them


def _metrics(s: int) -> dict[str, float]:
    return {"loss": float("nan") if s in BAD else 2.0 + 0.01 * (s % 3), "lr": 1e-3}


def _cfg(tmp_path, every: int) -> dict:  # type: ignore[no-untyped-def]
    return {**NAN_CFG, "event_log": {"path": str(tmp_path / "ev.jsonl"),
                                     "goodput_every": every}}


def test_goodput_records_every_n_steps_and_at_close(tmp_path) -> None:  # type: ignore[no-untyped-def]
    mon = Monitor(_cfg(tmp_path, 5), alert_sinks=[])
    for s in range(13):
        mon.observe(s, _metrics(s))
    mon.close()
    recs = [r for r in read_events(tmp_path / "ev.jsonl") if r["type"] == "goodput"]
    assert [r["step"] for r in recs] == [4, 9, 12]          # steps 5 and 10, then close()
    assert [r["steps"] for r in recs] == [5, 10, 13]
    assert [r["skipped"] for r in recs] == [1, 2, 3]        # the NaN steps were skipped
    assert recs[-1]["productive"] == 10
    assert mon.event_log._closed                             # opened from the config: closed
    mon.close()                                              # idempotent: no second record
    assert len([r for r in read_events(tmp_path / "ev.jsonl") if r["type"] == "goodput"]) == 3


def test_goodput_every_zero_logs_only_at_close_and_user_log_stays_open(tmp_path) -> None:  # type: ignore[no-untyped-def]
    log = EventLog(tmp_path / "mine.jsonl")
    mon = Monitor(_cfg(tmp_path, 0), event_log=log, alert_sinks=[])
    for s in range(30):
        mon.observe(s, _metrics(s))
    with mon:
        pass                                                 # __exit__ closes the monitor
    assert log.append({"type": "info", "step": 30})         # the caller's log is not closed
    log.close()
    types = [r["type"] for r in read_events(tmp_path / "mine.jsonl")]
    assert types.count("goodput") == 1 and types[-2:] == ["goodput", "info"]
    assert not (tmp_path / "ev.jsonl").exists()              # the config's path was not opened


@pytest.mark.parametrize("bad", [-1, True, 2.5, "10"])
def test_goodput_every_is_validated(bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="event_log.goodput_every"):
        load_config({**NAN_CFG, "event_log": {"goodput_every": bad}})
    assert load_config(NAN_CFG).event_log.goodput_every == 1000


def test_state_round_trip_keeps_the_ledger() -> None:
    a = Monitor(NAN_CFG, alert_sinks=[])
    for s in range(10):
        a.observe(s, _metrics(s))
    sd = json.loads(json.dumps(a.state_dict()))
    assert sd["goodput"]["steps"] == 10 and sd["goodput"]["skipped"] == 2
    b = Monitor(NAN_CFG, alert_sinks=[])
    b.load_state_dict(sd)
    assert b.goodput.summary() == a.goodput.summary()
    for s in range(10, 20):                                  # and it goes on counting alike
        assert a.observe(s, _metrics(s)) == b.observe(s, _metrics(s))
    assert b.goodput.summary() == a.goodput.summary() and b.goodput.skipped == 3


def test_bad_ledger_in_a_snapshot_is_rejected_or_rewarmed() -> None:
    a = Monitor(NAN_CFG, alert_sinks=[])
    for s in range(10):
        a.observe(s, _metrics(s))
    sd = a.state_dict()
    sd["goodput"]["skipped"] = -3
    b = Monitor(NAN_CFG, alert_sinks=[])
    b.observe(0, _metrics(0))
    before = json.dumps(b.state_dict())
    with pytest.raises(ValueError, match=r"'goodput\.skipped'.*in the goodput ledger"):
        b.load_state_dict(sd)
    assert json.dumps(b.state_dict()) == before              # a failed load changes nothing
    with pytest.warns(UserWarning, match="goodput"):
        b.load_state_dict(sd, strict=False)
    assert b.goodput.steps == 0 and b.last_step == 9         # the ledger alone re-warmed


def test_observe_and_replay_share_one_tail(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls: list[tuple[str, int]] = []
    orig = Monitor._finish_step

    def spy(self, s, *args):  # type: ignore[no-untyped-def]
        calls.append((self.name_for_test, s))
        return orig(self, s, *args)

    monkeypatch.setattr(Monitor, "_finish_step", spy)
    live, batch = Monitor(NAN_CFG, alert_sinks=[]), Monitor(NAN_CFG, alert_sinks=[])
    live.name_for_test, batch.name_for_test = "observe", "replay"  # type: ignore[attr-defined]
    n = 20
    got_live = [live.observe(s, _metrics(s)) for s in range(n)]
    cols = {"step": np.arange(n), "loss": np.array([_metrics(s)["loss"] for s in range(n)]),
            "lr": np.full(n, 1e-3)}
    got_batch = batch.replay(cols)
    assert calls[:n] == [("observe", s) for s in range(n)]
    # replay skips the tail on quiet steps (counted in bulk) and runs it on every other one
    eventful = [d.step for d in got_live if d.alarms or d.interventions]
    replayed = [s for who, s in calls[n:] if who == "replay"]
    assert set(eventful) <= set(replayed) and replayed == sorted(replayed)
    assert got_live == got_batch and any(d.interventions for d in got_live)
    assert live.goodput.summary() == batch.goodput.summary()  # the ledger is fed by the tail


def test_rollback_counted_once_requested_replaced_or_withdrawn() -> None:
    g = GoodputTracker(auto_start=False)
    for s in range(10):
        g.update_from_control(s, Control(rollback_to=4) if s == 9 else Control())
    assert (g.rollbacks, g.lost) == (1, 5)                  # as requested
    g.rollback_done(9, 2, seconds=0.0)                      # the trainer restored step 2
    assert (g.rollbacks, g.lost) == (1, 7)
    g.update(3)
    g.update_from_control(4, Control(rollback_to=1))
    mon = Monitor(NAN_CFG, alert_sinks=[], goodput=g)
    mon.rollback_failed(4, "no checkpoint")                 # refused: withdrawn
    assert (g.rollbacks, g.lost, g.steps) == (1, 7, 12)
    assert not g.cancel_rollback(4)                         # only once
    g.rollback_done(4, 0)                                   # e.g. another rank asked
    assert (g.rollbacks, g.lost) == (2, 11)


def test_default_ledger_counts_steps_without_the_clock() -> None:
    ticks = []
    g = GoodputTracker(clock=lambda: ticks.append(1) or float(len(ticks)), auto_start=False)
    mon = Monitor(NAN_CFG, alert_sinks=[], goodput=g)
    for s in range(5):
        mon.observe(s, _metrics(s))
    assert mon.goodput is g and g.steps == 5 and not ticks and g.wall_time == 0.0
    g.start()
    for s in range(5, 8):
        mon.observe(s, _metrics(s))
    assert g.wall_time == 3.0 and g.time_total == 3.0       # one tick per step once started


@pytest.mark.skipif(not PUBLIC_RUNS.exists(), reason="shared public runs not found")
def test_ledger_agrees_with_replay_goodput_on_runs_without_a_stop() -> None:
    from replay.replay import goodput, read_table

    checked = 0
    for path in sorted(PUBLIC_RUNS.glob("*.parquet")):  # the first three that skip, no stop
        table = read_table(str(path))
        mon = Monitor("default", alert_sinks=[])
        ivs = [i for d in mon.replay(table) for i in d.interventions]
        want = goodput(table.column("step").to_numpy().astype(np.int64), ivs)
        if want["stop_step"] is not None:
            continue  # the premise: runs the policy does not stop
        led = mon.goodput
        assert (led.steps, led.skipped, led.lost) == (
            want["executed_steps"], want["skipped_steps"], want["rollback_steps"]), path.stem
        checked += led.skipped > 0
        if checked == 3:
            break
    assert checked == 3


def test_record_goodput_logs_now_and_keeps_the_monitor_open(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from stability import EventLog, Monitor, read_events

    path = tmp_path / "ev.jsonl"
    with EventLog(path) as log:
        mon = Monitor("default", event_log=log)
        for s in range(5):
            mon.observe(s, {"loss": 1.0})
        mon.record_goodput()
        mon.observe(5, {"loss": 1.0})
        mon.record_goodput()
    recs = [r for r in read_events(path) if r["type"] == "goodput"]
    assert [r["steps"] for r in recs] == [5, 6]
