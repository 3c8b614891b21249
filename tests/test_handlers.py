"""Tests of user handler dispatch (stability/outputs/handlers.py)."""

from __future__ import annotations

import logging
import math
import threading

import pytest

from stability.outputs.handlers import HandlerError, HandlerRegistry
from stability.types import Alarm, ReduceLR

A = Alarm(1, "loss_spike", "loss", 9.0, 6.0, "warning", "d")


def test_exceptions_are_contained_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    hub = HandlerRegistry()
    got: list[object] = []

    def bad(item: object) -> None:
        raise KeyError("oops")

    hub.on_alarm(bad)
    hub.on_alarm(got.append)
    hub.on_intervention(got.append)
    with caplog.at_level(logging.ERROR, logger="stability.handlers"):
        for _ in range(3):
            assert hub.alarm(A) == 1
    assert hub.intervention(ReduceLR(1)) == 1
    assert got == [A, A, A, ReduceLR(1)]
    assert hub.n_errors == 3 and len(hub.errors) == 3 and "KeyError" in hub.errors[0][2]
    assert sum("failed" in r.message for r in caplog.records) == 1
    hub.remove(bad)
    assert hub.alarm(A) == 1 and hub.n_errors == 3


def test_strict_reraises() -> None:
    hub = HandlerRegistry(strict=True)

    @hub.on_intervention
    def bad(iv: object) -> None:
        raise RuntimeError("strict")

    with pytest.raises(RuntimeError, match="strict"):
        hub.intervention(ReduceLR(2))


def test_timeout_abandons_slow_handler() -> None:
    release = threading.Event()
    hub = HandlerRegistry(timeout=0.1)
    hub.on_alarm(lambda a: release.wait(5))
    ok: list[object] = []
    hub.on_alarm(ok.append)
    assert hub.alarm(A) == 1 and ok == [A] and "still running" in hub.errors[0][2]
    release.set()
    strict = HandlerRegistry(timeout=0.1, strict=True)
    ev = threading.Event()
    strict.on_alarm(lambda a: ev.wait(5))
    with pytest.raises(HandlerError):
        strict.alarm(A)
    ev.set()
    # exceptions raised inside the worker thread still reach the caller
    boom = HandlerRegistry(timeout=1.0, strict=True)
    boom.on_alarm(lambda a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        boom.alarm(A)


def test_bad_registration() -> None:
    hub = HandlerRegistry()
    assert not hub
    with pytest.raises(TypeError, match=r"^The 'fn' parameter of HandlerRegistry\.on_alarm must "
                       r"be a callable\. Got 42 instead\.$"):
        hub.on_alarm(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'fn' parameter of HandlerRegistry\.on_intervention"):
        hub.on_intervention("x")  # type: ignore[arg-type]
    assert not hub


@pytest.mark.parametrize("timeout", [0, -1.0, math.nan, math.inf, True])
def test_bad_timeout(timeout: float) -> None:
    """inf is refused too: a worker wait of inf seconds raises OverflowError."""
    with pytest.raises(ValueError, match=r"^The 'timeout' parameter of HandlerRegistry must be a "
                       rf"float in the range \(0\.0, inf\) or None\. Got {timeout!r} instead"):
        HandlerRegistry(timeout=timeout)
