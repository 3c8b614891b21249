"""Stall watchdog: a step loop that stops beating is reported, stacks dumped, recovery noted."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest

from stability.outputs.events import EventLog, read_events
from stability.run.goodput import GoodputTracker
from stability.run.watchdog import StallEvent, StallWatchdog
from stability.types import ALARM_KINDS, Alert


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def beats(wd: StallWatchdog, clock: FakeClock, n: int, dt: float, first: int = 0) -> int:
    for s in range(first, first + n):
        clock.t += dt
        wd.beat(s)
    return first + n


# ---------------------------------------------------------------------------- real thread
def fake_training_loop(wd: StallWatchdog, hang: threading.Event, resume: threading.Event,
                       steps: int) -> None:
    for s in range(steps):
        if hang.is_set():
            resume.wait(30)          # the "hung collective"
            hang.clear()
        threading.Event().wait(0.01)
        wd.beat(s)


def _watchdog_threads() -> int:
    """Live watchdog threads (other tests' background threads come and go in a full run)."""
    return sum(t.name == "stability-watchdog" and t.is_alive() for t in threading.enumerate())


def test_hang_is_reported_within_twice_the_threshold(tmp_path: Path) -> None:
    stalled, recovered = threading.Event(), threading.Event()
    events: list[StallEvent] = []

    def on_stall(ev: StallEvent) -> None:
        events.append(ev)
        stalled.set()

    def on_recover(ev: StallEvent) -> None:
        events.append(ev)
        recovered.set()

    dump = tmp_path / "stacks.txt"
    wd = StallWatchdog(k=3.0, min_timeout_s=0.5, warmup_steps=3, dump_path=dump,
                       on_stall=on_stall, on_recover=on_recover)
    hang, resume = threading.Event(), threading.Event()
    trainer = threading.Thread(target=fake_training_loop, args=(wd, hang, resume, 40),
                               name="trainer")
    trainer.start()
    while wd._beats < 10:
        threading.Event().wait(0.01)
    hang.set()
    assert stalled.wait(30), "no stall reported"
    # detection latency (time since the last beat when reported) <= 2 x the threshold
    ev = events[0]
    assert ev.kind == "stall" and ev.timeout_s == pytest.approx(0.5)
    assert ev.timeout_s <= ev.duration_s <= 2 * ev.timeout_s
    threading.Event().wait(2 * ev.timeout_s)     # still hung: reported once, not repeatedly
    assert len(wd.stalls) == 1 and wd.stalled
    text = dump.read_text()
    assert "stability watchdog: no step" in text and "fake_training_loop" in text
    resume.set()
    assert recovered.wait(30), "no recovery reported"
    trainer.join(30)
    rec = events[1]
    assert rec.kind == "recovered" and rec.step == ev.step
    assert rec.duration_s >= 3 * ev.timeout_s and 0 < rec.excess_s < rec.duration_s
    assert not wd.stalled and len(wd.recoveries) == 1
    wd.stop()
    assert _watchdog_threads() == 0                        # the watchdog thread is gone
    wd.beat(99)                                            # a beat after stop: no new thread
    assert _watchdog_threads() == 0


def test_start_stop_cycles_keep_thread_count() -> None:
    for _ in range(3):
        with StallWatchdog(min_timeout_s=0.1):
            assert _watchdog_threads() == 1
        assert _watchdog_threads() == 0


# ---------------------------------------------------------------------------- fake clock
def make(clock: FakeClock, **kw: object) -> tuple[StallWatchdog, list[StallEvent]]:
    got: list[StallEvent] = []
    args: dict[str, object] = {"k": 4.0, "min_timeout_s": 1.0, "warmup_steps": 3,
                               "on_stall": got.append, "on_recover": got.append,
                               "dump_stacks": False, "autostart": False, "clock": clock}
    args.update(kw)
    return StallWatchdog(**args), got  # type: ignore[arg-type]


def test_warmup_floor_and_median() -> None:
    c = FakeClock()
    wd, got = make(c)
    wd.beat(0)
    c.t += 100.0                      # long first step (compile): no stall before warm-up
    wd.poll()
    assert not got and math.isinf(wd.timeout_s)
    beats(wd, c, 2, 0.1, first=1)
    assert not wd.armed
    beats(wd, c, 1, 0.1, first=3)
    assert wd.armed and wd.timeout_s == 1.0                 # floor: 4 x 0.1 < 1.0
    beats(wd, c, 20, 2.0, first=4)
    assert wd.median_step_s == 2.0 and wd.timeout_s == 8.0  # k x median
    c.t += 7.9
    wd.poll()
    assert not got
    c.t += 0.2
    wd.poll()
    assert [e.kind for e in got] == ["stall"] and got[0].step == 23


def test_one_report_per_stall_and_recovery() -> None:
    c = FakeClock()
    log: list[dict[str, object]] = []

    class Sink:
        def __init__(self) -> None:
            self.alerts: list[Alert] = []

        def send(self, a: Alert) -> None:
            self.alerts.append(a)

    class Log:
        def append(self, r: dict[str, object]) -> None:
            log.append(r)

    sink, gp = Sink(), GoodputTracker(clock=c)
    wd, got = make(c, sinks=[sink], event_log=Log(), goodput=gp)
    nxt = beats(wd, c, 10, 0.5)
    for _ in range(5):
        c.t += 1.0
        wd.poll()
    assert [e.kind for e in got] == ["stall"]           # once, however long it lasts
    assert got[0].duration_s == pytest.approx(2.0)       # reported at the first poll past 2 s
    c.t += 0.5
    wd.beat(nxt)
    assert [e.kind for e in got] == ["stall", "recovered"]
    assert got[1].duration_s == pytest.approx(5.5) and got[1].excess_s == pytest.approx(5.0)
    assert gp.time_stall == pytest.approx(5.0) and gp.stalls == 1
    # the stall gap does not enter the step-time median
    assert wd.median_step_s == 0.5
    # a second stall is a new report
    nxt = beats(wd, c, 3, 0.5, first=nxt + 1)
    c.t += 3.0
    wd.poll()
    assert [e.kind for e in got][-1] == "stall" and len(wd.stalls) == 2
    assert [a.severity for a in sink.alerts] == ["critical", "info", "critical"]
    assert [r["type"] for r in log] == ["stall", "stall_recovered", "stall"]
    alarm = got[0].to_alarm()
    assert alarm.kind == "stall" and alarm.kind in ALARM_KINDS and alarm.score >= alarm.threshold


def test_recovery_seen_by_the_thread_when_a_beat_raced_the_report() -> None:
    c = FakeClock()
    wd, got = make(c)
    beats(wd, c, 5, 0.1)
    c.t += 2.0
    wd.poll()
    wd._beats += 1                 # a beat that landed between the check and the report
    wd.poll()
    assert [e.kind for e in got] == ["stall", "recovered"] and not wd.stalled


def test_failing_callback_is_contained(caplog: pytest.LogCaptureFixture) -> None:
    c = FakeClock()

    def boom(ev: StallEvent) -> None:
        raise RuntimeError("pager down")

    wd, _ = make(c, on_stall=boom)
    beats(wd, c, 5, 0.1)
    c.t += 2.0
    wd.poll()
    assert wd.stalled and "pager down" in caplog.text


def test_stacks_to_stderr_by_default(capfd: pytest.CaptureFixture[str]) -> None:
    c = FakeClock()
    wd, got = make(c, dump_stacks=True)
    beats(wd, c, 5, 0.1)
    c.t += 2.0
    wd.poll()
    err = capfd.readouterr().err
    assert "stability watchdog: no step" in err and "test_stacks_to_stderr_by_default" in err
    assert got[0].stacks_path is None


def test_metrics_throughput_and_mfu() -> None:
    c = FakeClock()
    wd, _ = make(c, tokens_per_step=4096.0, flops_per_step=1e12, peak_flops=1e13)
    assert wd.metrics() == {}
    beats(wd, c, 3, 0.25)
    m = wd.metrics()
    assert m == {"step_time": 0.25, "throughput": 16384.0, "mfu": pytest.approx(0.4)}


def test_event_log_records(tmp_path: Path) -> None:
    c = FakeClock()
    with EventLog(tmp_path / "ev.jsonl") as log:
        wd, _ = make(c, event_log=log)
        nxt = beats(wd, c, 5, 0.1)
        c.t += 2.0
        wd.poll()
        wd.beat(nxt)
    recs = read_events(tmp_path / "ev.jsonl")
    assert [r["type"] for r in recs] == ["stall", "stall_recovered"]
    assert recs[0]["step"] == 4 and "no step completed" in str(recs[0]["message"])


@pytest.mark.parametrize("kw", [{"k": 0.5}, {"min_timeout_s": -1.0}, {"warmup_steps": 0},
                                {"window": 1.5}, {"peak_flops": 0.0}])
def test_bad_arguments(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="parameter of StallWatchdog"):
        StallWatchdog(**kw)  # type: ignore[arg-type]


def test_for_monitor_reports_through_its_sinks_and_event_log(tmp_path: Path) -> None:
    from stability import Monitor

    class Sink:
        def __init__(self) -> None:
            self.alerts: list[Alert] = []

        def send(self, a: Alert) -> None:
            self.alerts.append(a)

    sink = Sink()
    with EventLog(tmp_path / "ev.jsonl") as log:
        mon = Monitor("small", alert_sinks=[sink], event_log=log)
        c = FakeClock()
        wd = StallWatchdog.for_monitor(mon, min_timeout_s=1.0, dump_stacks=False,
                                       autostart=False, clock=c)
        nxt = beats(wd, c, 5, 0.1)
        c.t += 2.0
        wd.poll()
        wd.beat(nxt)
    assert [a.severity for a in sink.alerts] == ["critical", "info"]
    assert [r["type"] for r in read_events(tmp_path / "ev.jsonl")] == ["stall", "stall_recovered"]


def test_a_clock_stepping_back_gives_no_negative_step_time(
        caplog: pytest.LogCaptureFixture) -> None:
    """A wall clock set back between two beats: that interval is left out (warned once), the
    step time is never negative."""
    c = FakeClock()
    wd, _ = make(c)
    beats(wd, c, 5, 0.5)
    with caplog.at_level("WARNING", logger="stability.watchdog"):
        c.t -= 30.0
        wd.beat(5)
        c.t -= 30.0
        wd.beat(6)
    assert wd.metrics()["step_time"] == 0.5 and wd.median_step_s == 0.5
    assert sum("stepped back" in r.getMessage() for r in caplog.records) == 1
    beats(wd, c, 1, 0.25, first=7)
    assert wd.metrics()["step_time"] == 0.25
