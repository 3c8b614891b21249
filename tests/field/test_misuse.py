"""Misuse is never silent (issue 26, item 3): one clear warning per kind, or an error at once."""

from __future__ import annotations

import logging
import warnings

import pytest

from stability.monitor.monitor import Monitor

torch = pytest.importorskip("torch")

from stability.torch import attach  # noqa: E402


def _setup(scheduler: bool = True):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1000) if scheduler else None
    guard = attach(net, opt, sched, Monitor("small"), log_interventions=False)
    return net, sched, guard


def _loss(net):  # type: ignore[no-untyped-def]
    return net(torch.ones(4, 3)).pow(2).mean()


def _warnings(fn) -> list[str]:  # type: ignore[no-untyped-def]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fn()
    return [str(x.message) for x in w if "stability:" in str(x.message)]


def test_monitor_in_the_scheduler_slot_is_a_type_error_at_attach() -> None:
    net = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="monitor="):
        attach(net, opt, Monitor("small"))
    with pytest.raises(TypeError, match="step\\(\\) method"):
        attach(net, opt, "cosine")


def test_no_gradients_warned_once() -> None:
    net, _, guard = _setup()

    def run() -> None:
        for _ in range(3):
            guard.step(_loss(net))  # no backward()

    msgs = _warnings(run)
    assert len(msgs) == 1 and "loss.backward()" in msgs[0]
    assert guard.misuse.counts["no_gradients"] == 3


def test_double_step_per_batch_warned_once() -> None:
    net, _, guard = _setup()

    def run() -> None:
        for _ in range(3):
            loss = _loss(net)
            loss.backward()
            guard.step(loss)
            guard.step(loss)  # twice for one batch

    msgs = _warnings(run)
    assert len(msgs) == 1 and "twice for the same loss" in msgs[0]
    assert guard.misuse.counts["double_step"] == 3 and not guard.misuse.counts["no_gradients"]


def test_scheduler_stepped_by_the_loop_too_warned_once() -> None:
    net, sched, guard = _setup()

    def run() -> None:
        for _ in range(5):
            loss = _loss(net)
            loss.backward()
            guard.step(loss)
            sched.step()  # the guard already steps it

    msgs = _warnings(run)
    assert len(msgs) == 1 and "stepped by the training loop" in msgs[0]
    assert sched.last_epoch == 10  # (what the user did: the warning says so)


def test_correct_loop_warns_nothing() -> None:
    net, sched, guard = _setup()

    def run() -> None:
        for _ in range(5):
            loss = _loss(net)
            loss.backward()
            guard.step(loss)

    assert _warnings(run) == [] and not guard.misuse.counts
    assert sched.last_epoch == 5


def test_string_metrics_warned_once_per_kind(caplog) -> None:  # type: ignore[no-untyped-def]
    mon = Monitor("small")
    with caplog.at_level(logging.WARNING, logger="stability.monitor"):
        for s in range(4):
            d = mon.observe(s, {"loss": "2.31", "grad_norm": "high", "lr": 1e-3})
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2, msgs
    assert any("float('2.31')" in m for m in msgs)  # a numeric string says how to pass it
    assert any("'high' not accepted" in m for m in msgs)
    assert len(d.skipped) == 2  # every occurrence is still recorded


def test_steps_backwards_warned_once_and_rewind_accepted(caplog) -> None:  # type: ignore[no-untyped-def]
    mon = Monitor("small")
    for s in range(5):
        mon.observe(s, {"loss": 1.0})
    with caplog.at_level(logging.WARNING, logger="stability.monitor"):
        assert mon.observe(2, {"loss": 1.0}).skipped
        assert mon.observe(3, {"loss": 1.0}).skipped
        mon.rewind(1)
        assert not mon.observe(2, {"loss": 1.0}).skipped
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "Monitor.rewind" in msgs[0]
