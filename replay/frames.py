"""Alarms, interventions and alarm episodes as tables (Arrow; pandas on request).

One row per alarm (``step, kind, signal, detector, severity, score, threshold, cause, message``),
per intervention (``step, type, reason, cause, params``) or per episode (alarms merged like
:func:`replay.evaluate.alarm_episodes`).  Every function accepts what the monitor returns --
:class:`~stability.types.Decision` lists from ``Monitor.replay`` -- as well as bare
:class:`~stability.types.Alarm` / :class:`~stability.types.Intervention` objects or their dicts
(event-log records), so a notebook gets a dataframe in one call.

Examples
--------
>>> from stability.types import Alarm, Decision, SkipStep
>>> d = Decision(7, alarms=(Alarm(7, "loss_spike", "loss", 9.123456, 6.0, "warning", "ewma_z"),),
...              interventions=(SkipStep(7, cause="outlier"),))
>>> t = alarms_table([d])
>>> t.column("score").to_pylist(), t.column("cause").to_pylist()
([9.123456], ['outlier'])
>>> interventions_table([d]).column("type").to_pylist()
['skip_step']
>>> [e["kinds"] for e in episodes([d])]
[{'loss_spike': 1}]
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from .evaluate import DEFAULT_GAP, alarm_episodes

__all__ = ["alarms_table", "interventions_table", "episodes", "episodes_table", "to_pandas",
           "split_items"]

ALARM_SCHEMA = pa.schema([
    ("step", pa.int64()), ("kind", pa.string()), ("signal", pa.string()),
    ("detector", pa.string()), ("severity", pa.string()), ("score", pa.float64()),
    ("threshold", pa.float64()), ("cause", pa.string()), ("message", pa.string()),
])
INTERVENTION_SCHEMA = pa.schema([
    ("step", pa.int64()), ("type", pa.string()), ("reason", pa.string()),
    ("cause", pa.string()), ("params", pa.string()),
])
EPISODE_SCHEMA = pa.schema([
    ("first_step", pa.int64()), ("last_step", pa.int64()), ("alarm_steps", pa.int64()),
    ("alarms", pa.int64()), ("cause", pa.string()), ("kinds", pa.string()),
    ("signals", pa.string()), ("first_score", pa.float64()), ("peak_score", pa.float64()),
    ("peak_step", pa.int64()), ("peak_signal", pa.string()), ("interventions", pa.string()),
])
_IV_BASE = ("step", "type", "reason", "cause")


def _dict(x: Any) -> dict[str, Any]:
    if isinstance(x, Mapping):
        return dict(x)
    return dict(x.to_dict())


def _num(v: Any) -> float:
    """A score from an object or a JSON record (``"inf"``/``"nan"`` strings included)."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def split_items(items: Iterable[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Alarm and intervention dicts of decisions, alarms, interventions or their dicts.

    Decisions (objects or ``Decision.to_dict()`` records) give both; an alarm is recognised by
    ``kind`` + ``signal``, an intervention by ``type``.
    """
    alarms: list[dict[str, Any]] = []
    ivs: list[dict[str, Any]] = []
    events = getattr(items, "events", None)  # Monitor.replay's Decisions: skip the quiet steps
    if callable(events):
        items = events()
    for it in items:
        d = _dict(it)
        if "alarms" in d or "interventions" in d:  # a Decision
            alarms += [_dict(a) for a in d.get("alarms", ())]
            ivs += [_dict(i) for i in d.get("interventions", ())]
        elif "kind" in d and "signal" in d:
            alarms.append(d)
        elif "type" in d:
            ivs.append(d)
    return alarms, ivs


def _causes(ivs: Sequence[Mapping[str, Any]]) -> dict[int, str]:
    out: dict[int, str] = {}
    for i in ivs:
        if i.get("cause"):
            out.setdefault(int(i["step"]), str(i["cause"]))
    return out


def alarms_table(items: Iterable[Any],
                 interventions: Iterable[Any] = ()) -> pa.Table:
    """One row per alarm, sorted by step (stable); ``cause`` is the alarm's own ``cause`` field
    if it has one, else the attributed cause of the interventions requested at that step
    (empty when none).

    ``items``: decisions, alarms or dicts; ``interventions`` adds more interventions (e.g.
    ``ReplayResult.interventions``) for the cause column.
    """
    alarms, ivs = split_items(items)
    ivs += split_items(interventions)[1]
    cause = _causes(ivs)
    alarms.sort(key=lambda a: int(a["step"]))
    cols: dict[str, list[Any]] = {f.name: [] for f in ALARM_SCHEMA}
    for a in alarms:
        s = int(a["step"])
        cols["step"].append(s)
        for k in ("kind", "signal", "detector", "severity", "message"):
            cols[k].append(str(a.get(k, "") or ""))
        cols["score"].append(_num(a.get("score")))
        cols["threshold"].append(_num(a.get("threshold")))
        cols["cause"].append(str(a.get("cause") or cause.get(s, "")))
    return pa.table(cols, schema=ALARM_SCHEMA)


def interventions_table(items: Iterable[Any]) -> pa.Table:
    """One row per intervention, sorted by step; ``params`` is the JSON of its other fields
    (``{"factor": 0.5, "duration": 100, ...}``)."""
    ivs = split_items(items)[1]
    ivs.sort(key=lambda i: int(i["step"]))
    cols: dict[str, list[Any]] = {f.name: [] for f in INTERVENTION_SCHEMA}
    for i in ivs:
        cols["step"].append(int(i["step"]))
        for k in ("type", "reason", "cause"):
            cols[k].append(str(i.get(k, "") or ""))
        cols["params"].append(json.dumps({k: v for k, v in i.items() if k not in _IV_BASE},
                                         sort_keys=True, default=str))
    return pa.table(cols, schema=INTERVENTION_SCHEMA)


def episodes(items: Iterable[Any], interventions: Iterable[Any] = (),
             gap: int = DEFAULT_GAP) -> list[dict[str, Any]]:
    """Alarms merged into episodes (alarm steps closer than ``gap``), first episode first.

    Each episode: ``first_step``, ``last_step``, ``alarm_steps`` (distinct steps), ``alarms``,
    ``kinds`` / ``signals`` / ``interventions`` (name -> count, most frequent first),
    ``cause`` (the most frequent attributed cause of its interventions, else ``""``),
    ``first_score`` (the highest score at the first step), ``peak_score`` / ``peak_step`` /
    ``peak_signal`` (the highest score of the episode; infinite scores -- non-finite inputs --
    win).  Interventions count towards the episode whose steps they fall in.
    """
    alarms, ivs = split_items(items)
    ivs += split_items(interventions)[1]
    out: list[dict[str, Any]] = []
    if not alarms:
        return out
    alarms.sort(key=lambda a: int(a["step"]))
    ivs.sort(key=lambda i: int(i["step"]))
    iv_steps = [int(i["step"]) for i in ivs]
    bounds = alarm_episodes([int(a["step"]) for a in alarms], gap=gap)
    k = 0
    for lo, hi in bounds:
        group = []
        while k < len(alarms) and int(alarms[k]["step"]) <= hi:
            group.append(alarms[k])
            k += 1
        in_ep = ivs[bisect_left(iv_steps, lo):bisect_right(iv_steps, hi)]
        scores = [_num(a.get("score")) for a in group]
        ranked = [(-math.inf if math.isnan(s) else s, j) for j, s in enumerate(scores)]
        pj = max(ranked)[1]
        first = [s for a, s in zip(group, scores, strict=True) if int(a["step"]) == lo]
        causes = Counter(str(i["cause"]) for i in in_ep if i.get("cause"))
        out.append({
            "first_step": lo,
            "last_step": hi,
            "alarm_steps": len({int(a["step"]) for a in group}),
            "alarms": len(group),
            "cause": causes.most_common(1)[0][0] if causes else "",
            "kinds": dict(Counter(str(a.get("kind")) for a in group).most_common()),
            "signals": dict(Counter(str(a.get("signal")) for a in group).most_common()),
            "first_score": max(first, key=lambda s: -math.inf if math.isnan(s) else s),
            "peak_score": scores[pj],
            "peak_step": int(group[pj]["step"]),
            "peak_signal": str(group[pj].get("signal")),
            "interventions": dict(Counter(str(i.get("type")) for i in in_ep).most_common()),
        })
    return out


def _counts(d: Mapping[str, int]) -> str:
    return ", ".join(f"{k} x{v}" if v > 1 else k for k, v in d.items())


def episodes_table(items: Iterable[Any], interventions: Iterable[Any] = (),
                   gap: int = DEFAULT_GAP) -> pa.Table:
    """:func:`episodes` as a table (counts as ``"name xN"`` strings)."""
    eps = episodes(items, interventions, gap)
    cols: dict[str, list[Any]] = {f.name: [] for f in EPISODE_SCHEMA}
    for e in eps:
        for name in cols:
            v = e[name]
            cols[name].append(_counts(v) if isinstance(v, dict) else v)
    return pa.table(cols, schema=EPISODE_SCHEMA)


def to_pandas(table: pa.Table) -> Any:
    """``table.to_pandas()`` with a clear message when pandas is missing."""
    try:
        import pandas  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("to_pandas() needs pandas: pip install pandas "
                          "(or use to_arrow())") from exc
    return table.to_pandas()
