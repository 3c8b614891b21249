"""``stability report --events``: every string from an event log is escaped (issue 27, item 7).

An event log is data written by a run (or by anyone who can write next to it): its alarm kinds,
signals, scores, goodput keys and steps must never become markup in the report page.
"""

from __future__ import annotations

import re

import pyarrow as pa

from replay.report import build_report

EVIL = "<script>alert(1)</script>"
EVIL_ATTR = "<img src=x onerror=alert(1)>"


def _events() -> list[dict]:
    alarm = {"event": "alarm", "step": 3, "kind": EVIL, "signal": EVIL_ATTR, "score": EVIL,
             "threshold": EVIL, "severity": EVIL, "detector": EVIL}
    return [alarm, {**alarm, "step": 4, "kind": "loss_spike"},
            {"event": "goodput", "goodput": {EVIL_ATTR: 1.0, "wall_time_s": EVIL}}]


def test_no_event_log_string_becomes_markup() -> None:
    table = pa.table({"step": list(range(10)), "loss": [1.0] * 10})
    page = build_report(table, events=_events(), title="run")
    assert "<script" not in page.lower()
    assert not re.search(r"<img[^>]*onerror", page, re.I)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # shown, as text
