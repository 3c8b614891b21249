"""Goodput is written at the end of training by the guard (issue 26, item 4): ``stability
goodput EVENTS`` works without ``Monitor.close()``."""

from __future__ import annotations

from pathlib import Path

import pytest

from stability.monitor.monitor import Monitor
from stability.outputs.events import read_events

torch = pytest.importorskip("torch")

from stability.torch import attach  # noqa: E402


def _guard(path: Path):  # type: ignore[no-untyped-def]
    net = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    mon = Monitor({"preset": "small", "event_log": {"path": str(path)}}, alert_sinks=[])
    return net, attach(net, opt, monitor=mon, log_interventions=False)


def _goodput_records(path: Path) -> list[dict]:
    return [r for r in read_events(path) if r["type"] == "goodput"]


def test_end_of_batches_records_goodput_and_the_cli_reads_it(tmp_path: Path, capsys) -> None:
    from replay.cli import main

    ev = tmp_path / "events.jsonl"
    net, guard = _guard(ev)
    for _ in guard.batches(12):
        loss = net(torch.ones(4, 3)).pow(2).mean()
        loss.backward()
        guard.step(loss)
    recs = _goodput_records(ev)  # no Monitor.close(), no detach()
    assert len(recs) == 1 and recs[0]["step"] == 11
    guard.detach()  # the same step: not recorded twice
    assert len(_goodput_records(ev)) == 1
    assert main(["goodput", str(ev)]) == 0
    assert "no goodput records" not in capsys.readouterr().out


def test_detach_records_goodput(tmp_path: Path) -> None:
    ev = tmp_path / "events.jsonl"
    net, guard = _guard(ev)
    for _ in range(5):
        loss = net(torch.ones(4, 3)).pow(2).mean()
        loss.backward()
        guard.step(loss)
    assert not _goodput_records(ev)
    guard.detach()
    assert [r["step"] for r in _goodput_records(ev)] == [4]
