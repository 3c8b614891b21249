"""stability.ranks.ranks without torch: robust cross-rank z, non-finite attribution, health
ledger."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stability.ranks.ranks import (
    RANK_SIGNALS,
    RankFinding,
    RankHealthLedger,
    RankMonitor,
    RankOutlierDetector,
    format_ranks,
)
from stability.types import ALARM_KINDS, Alarm

COL = {s: i for i, s in enumerate(RANK_SIGNALS)}


def clean_matrix(rng: np.random.Generator, world: int, spread: float = 0.1) -> np.ndarray:
    """One step of healthy ranks: similar losses, grad norms, times; no data wait."""
    m = np.empty((world, len(RANK_SIGNALS)))
    m[:, COL["loss"]] = 2.0 * np.exp(spread * rng.standard_normal(world))
    m[:, COL["grad_norm"]] = 1.5 * np.exp(spread * rng.standard_normal(world))
    m[:, COL["step_time"]] = 0.2 * np.exp(0.5 * spread * rng.standard_normal(world))
    m[:, COL["data_wait"]] = 0.001 * rng.random(world)
    m[:, COL["nonfinite"]] = 0.0
    return m


def ref_z(values: list[float], log: bool, offset: float, floor: float,
          rel_floor: float) -> list[float]:
    """Plain-Python robust z of one step (no history)."""
    t = [math.log(v + offset) if log else v for v in values]
    med = statistics.median(t)
    mad = 1.4826 * statistics.median([abs(v - med) for v in t])
    scale = max(floor, rel_floor * abs(med), mad)
    return [(v - med) / scale for v in t]


def test_first_step_scores_match_the_reference() -> None:
    rng = np.random.default_rng(0)
    det = RankOutlierDetector()
    for name in ("loss", "grad_norm", "step_time", "data_wait"):
        for world in (3, 4, 7, 64):
            x = rng.lognormal(0.0, 0.7, world)
            spec = det.specs[name]
            z, _, _ = det.scores(name, x)
            want = ref_z(list(x), spec.log, spec.offset, spec.floor, spec.rel_floor)
            np.testing.assert_allclose(z, want, rtol=1e-12)


@pytest.mark.parametrize("world", [3, 4, 8, 256])
@pytest.mark.parametrize("factor", [5.0, 0.1])
def test_grad_norm_outlier_names_the_rank(world: int, factor: float) -> None:
    rng = np.random.default_rng(world)
    mon = RankMonitor([f"host-{r // 2}" for r in range(world)])
    for step in range(30):
        assert mon.observe(step, clean_matrix(rng, world)) == ()
    m = clean_matrix(rng, world)
    bad = world - 1
    m[bad, COL["grad_norm"]] *= factor
    (alarm,) = mon.observe(30, m)
    assert alarm.kind == "rank_outlier" and alarm.kind in ALARM_KINDS
    assert alarm.signal == f"rank{bad}/grad_norm" and alarm.severity == "critical"
    assert alarm.message.startswith(f"grad_norm outlier on rank {bad} / host-{bad // 2}: ")
    assert alarm.score > alarm.threshold
    assert Alarm.from_dict(json.loads(json.dumps(alarm.to_dict()))) == alarm


def test_nonfinite_on_some_ranks_only_names_them() -> None:
    det = RankOutlierDetector()
    m = clean_matrix(np.random.default_rng(1), 6)
    m[2, COL["loss"]] = math.nan
    m[4, COL["grad_norm"]] = math.inf
    m[5, COL["nonfinite"]] = 1.0
    got = [(f.rank, f.signal) for f in det.update(0, m)]
    assert got == [(2, "nonfinite"), (4, "nonfinite"), (5, "nonfinite")]


def test_nonfinite_everywhere_or_missing_everywhere_names_nobody() -> None:
    det = RankOutlierDetector()
    m = clean_matrix(np.random.default_rng(2), 4)
    m[:, COL["loss"]] = math.nan  # the fault is global: nobody to blame
    assert det.update(0, m) == []
    m = clean_matrix(np.random.default_rng(3), 4)
    m[:, COL["grad_norm"]] = math.nan  # not measured on any rank
    m[1, COL["loss"]] = math.nan
    assert [(f.rank, f.signal) for f in det.update(1, m)] == [(1, "nonfinite")]


def test_two_ranks_only_attribute_nonfinite() -> None:
    det = RankOutlierDetector()
    m = clean_matrix(np.random.default_rng(4), 2)
    m[1, COL["grad_norm"]] *= 100.0  # which of two is the odd one? unknowable
    assert det.update(0, m) == []
    m[0, COL["loss"]] = math.nan
    assert [(f.rank, f.signal) for f in det.update(1, m)] == [(0, "nonfinite")]


def test_slow_rank_needs_warmup_and_two_steps_fast_rank_is_fine() -> None:
    rng = np.random.default_rng(5)
    det = RankOutlierDetector()
    m = clean_matrix(rng, 4)
    m[3, COL["step_time"]] *= 5.0
    assert det.update(0, m) == [] and det.update(1, m) == []  # warm-up
    for step in range(2, 20):
        det.update(step, clean_matrix(rng, 4))
    fast = clean_matrix(rng, 4)
    fast[0, COL["step_time"]] /= 5.0
    assert det.update(20, fast) == [] and det.update(21, fast) == []
    slow = clean_matrix(rng, 4)
    slow[2, COL["step_time"]] *= 5.0
    assert det.update(22, slow) == []  # one slow step is jitter
    assert [(f.rank, f.signal) for f in det.update(23, slow)] == [(2, "step_time")]
    slow[2, COL["data_wait"]] = 1.0
    assert [(f.rank, f.signal) for f in det.update(24, slow)] == [(2, "step_time")]
    assert [(f.rank, f.signal) for f in det.update(25, slow)] == [(2, "data_wait"),
                                                                   (2, "step_time")]


def test_clean_ranks_are_never_accused() -> None:
    rng = np.random.default_rng(6)
    for world in (3, 4, 16):
        mon = RankMonitor([""] * world)
        for step in range(1500):
            assert mon.observe(step, clean_matrix(rng, world, spread=0.15)) == ()
        assert mon.ledger.suspects() == []


@settings(deadline=None, max_examples=60)
@given(st.integers(0, 2**31 - 1), st.floats(1.0, 10.0), st.integers(3, 9))
def test_a_lower_threshold_never_names_fewer_ranks(seed: int, threshold: float,
                                                    world: int) -> None:
    rng = np.random.default_rng(seed)
    m = clean_matrix(rng, world, spread=0.5)
    m[int(rng.integers(world)), int(rng.integers(2))] *= float(rng.choice([0.1, 3.0, 20.0]))
    def named(t: float) -> set[tuple[int, str]]:  # without the minority rule
        return {(f.rank, f.signal)
                for f in RankOutlierDetector(threshold=t, max_fraction=1.0).update(0, m)}

    assert named(threshold) <= named(0.8 * threshold)


def test_state_round_trip_gives_the_same_future() -> None:
    rng = np.random.default_rng(7)
    mats = [clean_matrix(rng, 4) for _ in range(120)]
    for i in (15, 40, 41, 42, 70, 90, 91):  # a slow rank (2) is named from its 2nd slow step
        mats[i][i % 4 if i < 60 else 2, COL["grad_norm"] if i < 60 else COL["step_time"]] *= 8.0
    a = RankMonitor(["a", "b", "c", "d"], suspect_at=2.0)
    full = [a.observe(i, m) for i, m in enumerate(mats)]
    b = RankMonitor(["a", "b", "c", "d"], suspect_at=2.0)
    for i, m in enumerate(mats[:60]):
        b.observe(i, m)
    sd = json.loads(json.dumps(b.state_dict()))
    c = RankMonitor(["a", "b", "c", "d"], suspect_at=2.0)
    c.load_state_dict(sd)
    rest = [c.observe(i, m) for i, m in enumerate(mats[60:], start=60)]
    assert rest == full[60:]
    assert any(rest) and c.ledger.records(119) == a.ledger.records(119)


def _warm_monitor() -> tuple[RankMonitor, list[np.ndarray]]:
    rng = np.random.default_rng(3)
    mats = [clean_matrix(rng, 4) for _ in range(80)]
    for i in (20, 21, 22, 23, 24):
        mats[i][1, COL["grad_norm"]] *= 8.0
    mon = RankMonitor(["a", "b", "c", "d"], suspect_at=2.0)
    for i, m in enumerate(mats[:40]):
        mon.observe(i, m)
    return mon, mats


@pytest.mark.parametrize(("where", "key", "bad", "message"), [
    ("ledger", "score", [0.0] * 3, r"RankHealthLedger.load_state_dict\(\): 'score' must be a "
     r"list of 4 items; got \[0\.0, 0\.0, 0\.0\]\."),
    ("ledger", ("score", 1), -1.0, r"'score\[1\]' must be a finite float in the range "
     r"\[0\.0, inf\); got -1\.0\."),
    ("ledger", ("at", 0), True, r"'at\[0\]' must be an int .*; got True\."),
    ("ledger", ("by_signal", 1), {"grad_norm": -1}, r"'by_signal\[1\]\.grad_norm' must be an "
     r"int in the range \[0, \d+\]; got -1\."),
    ("ledger", ("recent", 1), ["x"], r"'recent\[1\]\[0\]' must be an int .*; got 'x'\."),
    ("ledger", ("suspect", 3), "yes", r"'suspect\[3\]' must be a bool; got 'yes'\."),
    ("ledger", ("peak_z", 0), "nan", r"'peak_z\[0\]' must be a float; got 'nan'\."),
    ("detector", ("typical", "loss"), -1.0, r"RankOutlierDetector.load_state_dict\(\): "
     r"'typical\.loss' must be a finite float in the range \[0\.0, inf\) or nan; got -1\.0"),
    ("detector", ("seen", "loss"), 2.5, r"'seen\.loss' must be an int .*; got 2\.5\."),
    ("detector", ("run", "grad_norm"), [0, "x", 0, 0],
     r"'run\.grad_norm\[1\]' must be an int .*; got 'x'\."),
    ("detector", "version", 99, r"state version 99 is newer"),
])
def test_a_bad_snapshot_is_refused_and_changes_nothing(where: str, key: object, bad: object,
                                                       message: str) -> None:
    mon, mats = _warm_monitor()
    good = json.loads(json.dumps(mon.state_dict()))
    sd = json.loads(json.dumps(good))
    target = sd[where]
    if isinstance(key, tuple):
        for k in key[:-1]:
            target = target[k]
        key = key[-1]
    target[key] = bad  # type: ignore[index]
    other, _ = _warm_monitor()
    for i, m in enumerate(mats[40:50], start=40):
        other.observe(i, m)  # a different state, which a refused load must leave as it is
    before = json.dumps(other.state_dict())
    with pytest.raises(ValueError, match=message):
        other.load_state_dict(sd)
    assert json.dumps(other.state_dict()) == before
    other.load_state_dict(good)
    assert [other.observe(i, m) for i, m in enumerate(mats[40:], start=40)] == \
        [mon.observe(i, m) for i, m in enumerate(mats[40:], start=40)]


def test_ledger_suspects_repeat_offenders_and_forgives() -> None:
    led = RankHealthLedger(4, hosts=["a", "a", "b", "b"], half_life=10.0, suspect_at=2.5)
    assert led.update(100, [RankFinding(100, 1, "grad_norm", 9.0, 1.0, 0.1)]) == []
    assert led.update(101, [RankFinding(101, 1, "grad_norm", -12.0, 1.0, 0.1),
                            RankFinding(101, 1, "loss", 7.0, 1.0, 0.1)]) == []
    (rec,) = led.update(102, [RankFinding(102, 1, "step_time", 8.0, 1.0, 0.1)])
    assert rec["type"] == "rank_health" and rec["status"] == "suspect" and rec["host"] == "a"
    assert rec["outlier_steps"] == 3 and rec["recent_steps"] == [100, 101, 102]
    assert rec["signals"] == {"grad_norm": 2, "loss": 1, "step_time": 1}
    assert rec["peak_z"] == -12.0 and rec["peak_signal"] == "grad_norm"
    assert led.suspects() == [1]
    assert led.update(110, []) == []  # still a suspect: count ~1.6 > 1.25
    (back,) = led.update(115, [])
    assert back["status"] == "ok" and led.suspects() == []
    assert [r["rank"] for r in led.records(115)] == [1]
    assert len(led.records(115, all_ranks=True)) == 4


def test_single_outlier_step_is_not_a_suspect() -> None:
    led = RankHealthLedger(8)
    for step in range(0, 8000, 400):  # rare blips, two half-lives apart
        led.update(step, [RankFinding(step, 3, "loss", 7.0, 1.0, 0.1)])
    assert led.suspects() == [] and led.outlier_steps[3] == 20
    for step in range(8000, 9000, 100):  # one every half half-life: a repeat offender
        led.update(step, [RankFinding(step, 3, "loss", 7.0, 1.0, 0.1)])
    assert led.suspects() == [3]


def test_format_ranks_table() -> None:
    assert "every rank looked like the others" in format_ranks([{"type": "alarm"}])
    mon = RankMonitor(["h0", "h1", "h2", "h3"], suspect_at=1.5)
    rng = np.random.default_rng(8)
    events: list[dict[str, object]] = []
    for step in range(30):
        m = clean_matrix(rng, 4)
        if step in (20, 21):
            m[2, COL["loss"]] = math.nan
        events += [{"type": "alarm", **a.to_dict()} for a in mon.observe(step, m)]
        events += mon.changes
    text = format_ranks(events + mon.records(29))
    assert "suspects: rank 2 / h2" in text and "2 rank-outlier alarm(s)" in text
    assert "nonfinite:2" in text


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match=r"^The 'threshold' parameter of RankOutlierDetector "
                       r"must be a float in the range \[0\.0, inf\)\. Got -1\.0 instead\.$"):
        RankOutlierDetector(threshold=-1.0)
    with pytest.raises(ValueError, match=r"'min_ranks' parameter of RankOutlierDetector must be "
                       r"an int in the range \[3, inf\)\. Got 2 instead"):
        RankOutlierDetector(min_ranks=2)
    with pytest.raises(ValueError, match=r"'min_ranks' parameter of RankOutlierDetector .* Got "
                       r"True instead"):
        RankOutlierDetector(min_ranks=True)
    with pytest.raises(ValueError, match=r"'hosts' parameter of RankHealthLedger must be None or "
                       r"a sequence of 3 host names \(one per rank\)\. Got \['a'\] instead"):
        RankHealthLedger(3, hosts=["a"])
    with pytest.raises(ValueError, match=r"'alpha' parameter of RankMonitor .* Got 1\.5 instead"):
        RankMonitor(["a", "b", "c"], alpha=1.5)
    with pytest.raises(ValueError, match=r"'hosts' parameter of RankMonitor must be a non-empty "
                       r"sequence .* Got \[\] instead"):
        RankMonitor([])
    with pytest.raises(ValueError, match="rows"):
        RankMonitor(["a", "b", "c"]).observe(0, np.zeros((4, 5)))
    with pytest.raises(ValueError, match="matrix"):
        RankOutlierDetector().update(0, np.zeros((4, 3)))


def test_a_global_event_names_nobody() -> None:
    rng = np.random.default_rng(9)
    det = RankOutlierDetector()
    for step in range(20):
        det.update(step, clean_matrix(rng, 8))
    m = clean_matrix(rng, 8)
    m[:3, COL["loss"]] *= 10.0  # three of eight ranks at once: not one machine's fault
    assert det.update(20, m) == []
    m = clean_matrix(rng, 8)
    m[5, COL["loss"]] *= 10.0
    assert [(f.rank, f.signal) for f in det.update(21, m)] == [(5, "loss")]


def test_cli_ranks_prints_the_health_table(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from replay.cli import main
    from stability.outputs.events import EventLog

    path = tmp_path / "ev.jsonl"
    with EventLog(path) as log:
        log.append({"type": "alarm", "step": 5, "kind": "rank_outlier",
                    "signal": "rank1/grad_norm", "score": 40.0})
        log.append({"type": "rank_health", "step": 9, "rank": 1, "host": "b",
                    "status": "suspect", "suspicion": 3.0, "outlier_steps": 3,
                    "signals": {"grad_norm": 3}, "peak_z": 40.0, "peak_signal": "grad_norm",
                    "recent_steps": [5, 7, 9]})
    assert main(["ranks", str(path)]) == 0
    assert "suspects: rank 1 / b" in capsys.readouterr().out


def test_monitor_records_rank_alarms_without_the_policy_acting(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from stability import EventLog, Monitor, read_events
    from stability.types import Alarm

    seen: list[Alarm] = []
    path = tmp_path / "ev.jsonl"
    with EventLog(path) as log:
        mon = Monitor("default", event_log=log, on_alarm=seen.append)
        for s in range(3):
            mon.observe(s, {"loss": 1.0})
        a = Alarm(3, "rank_outlier", "rank2/grad_norm", 41.0, 6.0, "warning", "rank_mad",
                  "grad_norm outlier on rank 2 / host-c: 41.0 sigma")
        d = mon.report_alarms(3, [a])
        assert mon.report_alarms(3, []) is None
    assert d is not None and d.control.lr_factor == 1.0 and not d.control.skip_step
    assert seen == [a]
    recs = read_events(path)
    assert any(r["type"] == "alarm" and r["signal"] == "rank2/grad_norm" for r in recs)
    assert any(r.get("intervention") == "alert" and "rank 2 / host-c" in r["reason"]
               for r in recs)
