"""A stop is decided once (issue 26, leftover).

When a log goes on past a stop (``replay`` / ``watch`` of a job that was not killed, a loop that
ignores the stop), the policy's state still says stop on every later step.  The monitor used to
answer a new ``Stop`` -- with its alert, and the restore of a stop that restores -- on each of
them (the bundled ``overfit`` run: 5 stops; public runs: thousands).  The first is the decision;
later steps report the run as stopped (:attr:`Monitor.stopped_at`, ``control.stop``) and request
nothing new.
"""

from __future__ import annotations

from replay.replay import replay_run
from stability.monitor.monitor import Monitor
from tests.shared_data import SAMPLE_RUNS


def _nan_storm(mon: Monitor, steps: range) -> list:  # type: ignore[type-arg]
    """A healthy loss, then NaN from step 100 on: the policy stops."""
    return [mon.observe(s, {"loss": 2.0 + 0.01 * (s % 7) if s < 100 else float("nan"),
                            "lr": 1e-3}) for s in steps]


def test_replay_of_a_log_that_goes_on_past_its_stop_has_one_stop() -> None:
    res = replay_run(SAMPLE_RUNS / "overfit")
    stops = [i.step for i in res.interventions if i.type == "stop"]
    assert len(stops) == 1  # (5 before: steps 320, 340, ... each answered the same stop)
    assert res.goodput["stop_step"] == stops[0]
    after = [i for i in res.interventions if i.step > stops[0]]
    assert not [i for i in after if i.type in ("stop", "rollback")
                or "-> stop" in (getattr(i, "message", "") or "")]  # nor its alert again
    assert any(a.step > stops[0] for a in res.alarms)  # the detectors still report the data


def test_a_standing_stop_is_state_not_a_new_decision() -> None:
    mon = Monitor("default", alert_sinks=[])
    ds = _nan_storm(mon, range(160))
    first = next(d for d in ds if any(i.type == "stop" for i in d.interventions))
    assert mon.stopped_at == first.step
    later = [d for d in ds if d.step > first.step]
    assert later and not [i for d in later for i in d.interventions if i.type != "alert"]
    assert not [i for d in later for i in d.interventions
                if "-> stop" in (getattr(i, "message", "") or "")]
    # where the policy answers the stop again, the control says stop -- and nothing else
    standing = [d.control for d in later if d.control.stop]
    assert standing and all(c.rollback_to is None and not c.skip_step
                            and not c.save_checkpoint for c in standing)


def test_the_stop_survives_a_state_round_trip_and_a_rewind_clears_it() -> None:
    a = Monitor("default", alert_sinks=[])
    _nan_storm(a, range(130))
    assert a.stopped_at is not None
    b = Monitor("default", alert_sinks=[])
    b.load_state_dict(a.state_dict())
    assert b.stopped_at == a.stopped_at
    da = _nan_storm(a, range(130, 160))
    db = _nan_storm(b, range(130, 160))
    assert [d.interventions for d in da] == [d.interventions for d in db]
    assert not [i for d in db for i in d.interventions if i.type != "alert"]
    b.rewind(a.stopped_at - 1)  # the job re-ran from before its stop: a new stop is news
    assert b.stopped_at is None
