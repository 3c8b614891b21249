"""Bulk paths of the replay's per-step tail: the goodput history counted in bulk
(:class:`stability.run.goodput.BulkTail`) and validation points followed in bulk
(``PolicyRecovery.track_many``) leave the state of the step-by-step loop, bit for bit."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stability.policy.loss_tracker import ValTracker
from stability.policy.policy import _val_many
from stability.run import goodput
from stability.run.goodput import GoodputTracker


def _events(seed: int, n_ops: int = 60) -> list[tuple[str, int, int]]:
    """Random ops over increasing steps: bulk runs, single steps, rollbacks, marks."""
    rng = np.random.default_rng(seed)
    ops, step = [], 0
    for _ in range(n_ops):
        kind = rng.choice(["bulk", "bulk", "one", "rollback", "skip", "cancel"])
        if kind == "bulk":
            k = int(rng.choice([1, 5, 300, 900, 2500]))
            ops.append(("bulk", step, k))
            step += k
        elif kind == "one":
            ops.append(("one", step, 1))
            step += 1
        elif kind == "rollback" and step > 0:
            ops.append(("rollback", step - 1, int(rng.integers(0, step))))
        elif kind == "skip" and step > 0:
            ops.append(("skip", step - 1, 0))
        elif kind == "cancel" and step > 0:
            ops.append(("cancel", step - 1, int(rng.integers(0, step))))
    return ops


def _play(g: GoodputTracker, ops: list[tuple[str, int, int]], bulk: bool) -> list[object]:
    seen: list[object] = []
    for kind, step, k in ops:
        if kind == "bulk":
            steps = np.arange(step, step + k, dtype=np.int64)
            if bulk:
                g.update_many(steps, degraded=k == 5)
                steps[:] = -1  # the tracker keeps its own copy
            else:
                for s in range(step, step + k):
                    g.update(s, degraded=k == 5)
        elif kind == "one":
            g.update(step, skipped=True)
        elif kind == "rollback":
            g.update_from_control(step + 1, _rollback_control(k))
        elif kind == "skip":
            seen.append(g.mark_skipped(step))
        else:
            seen.append(g.cancel_rollback(step + 1))
            g.note_rollback(step, k)
        seen.append((g.lost, g.time_lost, g.last_step, g.steps, g.degraded_steps))
    return seen


def _rollback_control(to: int):  # type: ignore[no-untyped-def]
    from stability.types import Control

    c = Control()
    c.rollback_to = to
    return c


@pytest.mark.parametrize("seed", range(6))
def test_bulk_history_is_the_loops(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(goodput, "HISTORY", 2000)  # runs longer and shorter than the history
    ops = _events(seed)
    a, b = GoodputTracker(auto_start=False), GoodputTracker(auto_start=False)
    assert _play(a, ops, bulk=True) == _play(b, ops, bulk=False)
    assert a.state_dict() == b.state_dict()
    assert list(a._history) == list(b._history)
    assert all(type(s) is int for s, _ in a._history)


def test_bulk_tail_drops_runs_out_of_the_history() -> None:
    g = GoodputTracker(auto_start=False)
    for lo in range(0, 200_000, 10_000):
        g.update_many(np.arange(lo, lo + 10_000))
    assert g._bulk.n <= goodput.HISTORY + 10_000
    assert [s for s, _ in g._history] == list(range(180_000, 200_000))
    g.load_state_dict(g.state_dict())
    assert not g._bulk and not g._history


def _val_loop(vt: ValTracker, steps: np.ndarray, v: np.ndarray, levels: np.ndarray) -> None:
    for s, x, lv in zip(steps.tolist(), v.tolist(), levels.tolist(), strict=True):
        vt.update(int(s), float(x), lv)


def _state(vt: ValTracker) -> tuple[object, ...]:
    return tuple(repr(x) for x in (vt.best, vt.best_step, vt.worse_points, vt.train_at_best))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("margin", [0.1, 0.0, -0.5])
def test_val_points_in_bulk_are_the_loops(seed: int, margin: float) -> None:
    rng = np.random.default_rng(seed)
    for start_best in (math.inf, 1.0):
        a, b = ValTracker(margin), ValTracker(margin)
        a.best = b.best = start_best
        a.worse_points = b.worse_points = 3
        for n in (1, 9, 50, 400):
            v = np.round(rng.normal(1.0, 0.3, n), 1)  # ties
            v[rng.random(n) < 0.1] = np.nan
            v[rng.random(n) < 0.05] = np.inf
            v[rng.random(n) < 0.05] = -np.inf
            if seed % 2:
                v[-3:] = np.nan  # ends worse
            steps = np.arange(n) * 7 + rng.integers(0, 1000)
            levels = rng.normal(size=n)
            _val_many(a, steps, v, levels)
            _val_loop(b, steps, v, levels)
            assert _state(a) == _state(b)
            assert type(a.best_step) is int and type(a.best) is float
