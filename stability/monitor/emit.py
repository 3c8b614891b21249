"""The monitor's output side: decisions to the event log, the handlers and the alert sinks.

:class:`EmitMixin` is mixed into :class:`~stability.monitor.monitor.Monitor`; it needs the monitor's
``counters``, ``event_log``, ``handlers``, ``alert_sinks``, ``strict``, ``log_only`` and
``_sink_failed`` attributes and its ``_snapshot()``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from stability.monitor.layout import _SCRATCH, _Binding
from stability.monitor.recovery import RecoveryTracker
from stability.types import Alarm, Alert, Control, Decision, Intervention

__all__ = ["EmitMixin"]

logger = logging.getLogger("stability.monitor")

_new = object.__new__
_NF_NAMES = {1.0: "NaN", 2.0: "+inf", 3.0: "-inf"}  # the nonfinite kernel's scores


def _decision(step: int, alarms: tuple[Alarm, ...], ivs: tuple[Intervention, ...],
              control: Control, skipped: tuple[str, ...]) -> Decision:
    d = _new(Decision)  # frozen: the fields go straight into the instance dict
    f = d.__dict__
    f["step"] = step
    f["alarms"] = alarms
    f["interventions"] = ivs
    f["control"] = control
    f["skipped"] = skipped
    return d


class EmitMixin:
    """Alarms and interventions out: event log, ``on_alarm``/``on_intervention`` handlers, sinks."""

    counters: Any
    event_log: Any
    handlers: Any
    alert_sinks: Any
    strict: bool
    log_only: bool
    _sink_failed: set[int]
    _slot_names: list[str]
    _recovery: RecoveryTracker

    def _snapshot(self) -> Control:
        raise NotImplementedError

    def report_alarms(self, step: int, alarms: Sequence[Alarm]) -> Decision | None:
        """Record alarms raised outside the monitor's detectors (e.g. the rank outliers of
        :class:`~stability.adapters.distributed.ControlSync`, a stall watchdog's alarm).

        They go to the event log, the ``on_alarm`` handlers and, as one :class:`Alert`, to the
        alert sinks -- exactly like the monitor's own alarms -- but the policy does not act on
        them (the caller already did: e.g. every rank skipped the step).  Returns the recorded
        decision (``None`` when ``alarms`` is empty).
        """
        alarms = tuple(alarms)
        if not alarms:
            return None
        worst = max(alarms, key=lambda a: 2 if a.severity == "critical" else 1)
        text = "; ".join(a.message or f"{a.kind} on {a.signal}" for a in alarms[:4])
        alert = Alert(int(step), reason=text + (f" (+{len(alarms) - 4} more)"
                                                 if len(alarms) > 4 else ""),
                      severity=worst.severity, message=text)
        d = _decision(int(step), alarms, (alert,), self._snapshot(), ())
        self._emit(d)
        return d

    def _emit(self, d: Decision) -> None:
        self.counters["alarm_steps"] += bool(d.alarms)
        self.counters["alarms"] += len(d.alarms)
        self.counters["interventions"] += len(d.interventions)
        log = self.event_log
        hs = self.handlers
        hs.begin_step()  # one time budget for every handler and sink call of this step
        try:
            for a in d.alarms:
                if log is not None:
                    log.alarm(a)
                hs.alarm(a)
            for iv in d.interventions:
                if log is not None:
                    log.intervention(iv, log_only=self.log_only)
                if isinstance(iv, Alert):
                    for sink in self.alert_sinks:
                        self._send_alert(sink, iv)
                hs.intervention(iv)
        finally:
            hs.end_step()

    def _send_alert(self, sink: Any, alert: Alert) -> None:
        """``sink.send(alert)`` within the step's handler budget; a failure (or a sink that runs
        out of time) is logged once per sink and contained unless strict."""
        try:
            self.handlers.call(sink, sink.send, alert, f"alert sink {type(sink).__name__}")
        except Exception as e:
            self.counters["sink_errors"] += 1
            if self.strict:
                raise
            if id(sink) not in self._sink_failed:
                self._sink_failed.add(id(sink))
                logger.warning("alert sink %r failed (%s: %s); contained (strict=False). Further "
                               "failures of this sink are counted, not logged.", sink,
                               type(e).__name__, e, exc_info=e)

    def _make_alarms(self, step: int, rows: list[tuple[_Binding, Any, Any]]
                     ) -> tuple[Alarm, ...]:
        """The step's alarms from each binding's scores and alarm flags (``rows``).

        A non-finite value alarms once: the other detectors' alarms on that signal are dropped.
        """
        names = self._slot_names
        bad: set[str] = set()
        for b, _, a in rows:
            if b.nonfinite and a.any():
                for i in np.flatnonzero(a).tolist():
                    bad.update(names[b.slots[j][i]] for j in range(b.n_inputs)
                               if b.slots[j][i] > _SCRATCH)
        out: list[Alarm] = []
        for b, sc, a in rows:
            if not a.any():
                continue
            thr = float(b.det.threshold)
            items = []
            for i in np.flatnonzero(a).tolist():
                comps = [names[b.slots[j][i]] for j in range(b.n_inputs)
                         if b.slots[j][i] > _SCRATCH]
                if not b.nonfinite and bad.intersection(comps):
                    continue
                score = float(sc[i])
                signal = ",".join(comps) if comps else b.keys[i]
                rec = False
                if b.nonfinite:
                    sev = "critical"
                    msg = f"{signal} is {_NF_NAMES.get(score, 'non-finite')}"
                else:
                    sev, msg, rec = self._rated(b, step, signal, score, thr)
                items.append(Alarm(step, b.kind, signal, score, thr, sev, b.name, msg, rec))
            items.sort(key=lambda al: al.signal)
            out.extend(items)
        return tuple(out)

    def _rated(self, b: _Binding, step: int, signal: str, score: float, thr: float
               ) -> tuple[str, str, bool]:
        """Severity, message and the recovering flag of a detector alarm: critical above
        ``critical_factor`` x the threshold, never while recovering
        (:mod:`stability.monitor.recovery`)."""
        rec = self._recovery.update(b.name, signal, step, score, thr)
        msg = f"{b.spec.detector} score {score:.4g} > {thr:.4g} on {signal}"
        if rec:
            sev = "warning" if b.severity == "critical" else b.severity
            return sev, msg + " (recovering)", True
        sev = "critical" if (b.severity == "critical" or score > b.critical_factor * thr
                             ) else b.severity
        return sev, msg, False
