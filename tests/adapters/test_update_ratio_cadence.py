"""Cadence of the weight signals: update ratios every ``update_ratio_every`` steps, ``param_norm``
every ``param_norm_every`` steps, missing ("not logged on this step") on the others.

A replay of the recorded run gives the live decisions.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from stability.adapters.torch import TorchGuard  # noqa: E402
from stability.adapters.torch_ops.signals import (  # noqa: E402
    PARAM_NORM_EVERY,
    UPDATE_RATIO_EVERY,
    SignalCollector,
)
from stability.monitor.monitor import Monitor  # noqa: E402

#: the small preset, decisions recorded but not carried out (the run's steps stay increasing,
#: so the recorded run can be replayed)
LOG_ONLY = {"preset": "small", "monitor": {"log_only": True}}


class _Rows:
    """In-memory recorder: ``log(step, metrics)`` keeps a copy of every row."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.append((step, dict(metrics)))

    def table(self) -> dict[str, Any]:
        """Columns ``step`` + one per metric, ``None`` where a row did not log it."""
        names = sorted({k for _, m in self.rows for k in m})
        out: dict[str, Any] = {"step": np.array([s for s, _ in self.rows])}
        for k in names:
            out[k] = [m.get(k) for _, m in self.rows]
        return out


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 128), torch.nn.Tanh(), torch.nn.Linear(128, 40),
                               torch.nn.Tanh(), torch.nn.Linear(40, 1))


def _run(steps: int, monitor: Any = None, corrupt_at: int | None = None,
         param_norm_every: int | None = None,
         **kw: Any) -> tuple[TorchGuard, _Rows, list[Any], list[list[float]]]:
    """A guarded AdamW loop; returns the guard, its records, the decisions and the true
    per-tensor weight norms before each step (``corrupt_at``: the first layer's weights x 4
    before that step)."""
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    rec = _Rows()
    guard = TorchGuard(m, opt, None, monitor, checkpoint_every=0, recorder=rec,
                       log_interventions=False, **kw)
    if param_norm_every is not None:  # (a collector setting, set on the guard's collector)
        guard.collector.param_norm_every = param_norm_every
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(steps, 16, 6, generator=gen)
    ys = xs[..., :1].sin() + 0.1 * torch.randn(steps, 16, 1, generator=gen)
    decisions, norms = [], []
    for i in guard.batches(steps):
        if i == corrupt_at:
            with torch.no_grad():
                m[0].weight.mul_(4.0)
        norms.append([float(p.detach().double().norm()) for p in m.parameters()])
        loss = torch.nn.functional.mse_loss(m(xs[i]), ys[i])
        loss.backward()
        decisions.append(guard.step(loss))
    return guard, rec, decisions, norms


def _steps_with(rec: _Rows, prefix: str) -> list[int]:
    return [s for s, m in rec.rows if any(k == prefix or k.startswith(prefix + "/") for k in m)]


def _total(norms: list[float]) -> float:
    return math.sqrt(sum(n * n for n in norms))


def test_default_cadences() -> None:
    guard, rec, _, norms = _run(13)
    k = guard.collector.update_ratio_every
    kp = guard.collector.param_norm_every
    assert k == UPDATE_RATIO_EVERY > 1 and kp == PARAM_NORM_EVERY > 1  # cheap by default
    steps = [s for s, _ in rec.rows]
    assert steps == list(range(13))
    assert _steps_with(rec, "grad_norm") == steps  # gradients: every step
    assert _steps_with(rec, "param_norm") == [s for s in steps if s % kp == 0]
    # the ratio of a due step s is measured after its optimizer step: reported with step s + 1
    assert _steps_with(rec, "update_ratio") == [s for s in steps if s % k == 1]
    ratios = [v for _, m in rec.rows for n, v in m.items() if n.startswith("update_ratio/")]
    assert ratios and all(0 < v < 1 for v in ratios)
    for s, m in rec.rows:  # a present param_norm is the exact weight norm of its step
        if "param_norm" in m:
            assert m["param_norm"] == pytest.approx(_total(norms[s]), rel=1e-5)


@pytest.mark.parametrize(("every", "pn_every"), [(1, 1), (3, 1), (0, 0), (2, 3)])
def test_explicit_cadences(every: int, pn_every: int) -> None:
    _, rec, _, norms = _run(11, update_ratio_every=every, param_norm_every=pn_every)
    assert _steps_with(rec, "param_norm") == [s for s in range(11)
                                              if pn_every and s % pn_every == 0]
    assert _steps_with(rec, "update_ratio") == [s for s in range(1, 11)
                                                if every and (s - 1) % every == 0]
    for s, m in rec.rows:
        if "param_norm" in m:
            assert m["param_norm"] == pytest.approx(_total(norms[s]), rel=1e-5)


def _ratios(rec: _Rows) -> dict[int, list[float]]:
    return {s: [v for n, v in sorted(m.items()) if n.startswith("update_ratio/")]
            for s, m in rec.rows}


@pytest.mark.parametrize("pn_every", [0, 3])
def test_ratio_on_a_step_without_param_norm_reads_the_weight_norms_itself(pn_every: int) -> None:
    _, exact, _, _ = _run(9, update_ratio_every=2, param_norm_every=1)
    _, sparse, _, _ = _run(9, update_ratio_every=2, param_norm_every=pn_every)
    assert _ratios(sparse)[3] and _ratios(sparse) == _ratios(exact)  # step 2: no param_norm


def test_collector_without_begin_step_counts_its_own_steps() -> None:
    """A loop that never calls ``begin_step`` gets the cadence from ``after_step``'s count."""
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    col = SignalCollector(m, update_ratio_every=2, param_norm_every=2)
    seen = []
    for step in range(5):
        m(torch.randn(4, 6)).sum().backward()
        s = col.collect()
        seen.append(("param_norm" in s.scalars, "update_ratio" in s.families))
        col.before_step(step)
        opt.step()
        col.after_step()
        opt.zero_grad()
    assert seen == [(True, False), (False, True), (True, False), (False, True), (True, False)]


@pytest.mark.parametrize(("pn_every", "at"), [(1, 41), (2, 41), (2, 44)])
def test_sparse_weight_signals_replay_to_the_live_decisions(pn_every: int, at: int) -> None:
    # a weight corruption after the weight_jump detector's warm-up (20 values)
    _, rec, live, _ = _run(at + 12, monitor=Monitor(LOG_ONLY), corrupt_at=at,
                           param_norm_every=pn_every)
    assert sum(any(n.startswith("update_ratio/") for n in m) for _, m in rec.rows) < len(live) / 2
    corrupted = [d for d in live if any(a.kind == "weight_corruption" for a in d.alarms)]
    # seen on the first step that measures param_norm: at most k - 1 steps later
    assert corrupted and corrupted[0].step == at + (-at) % pn_every
    replayed = Monitor(LOG_ONLY).replay(rec.table())
    assert len(replayed) == len(live)
    for got, want in zip(replayed, live, strict=True):
        assert got.step == want.step
        assert [(a.kind, a.signal, a.score) for a in got.alarms] == [
            (a.kind, a.signal, a.score) for a in want.alarms]
        assert [i.to_dict() for i in got.interventions] == [
            i.to_dict() for i in want.interventions]


def test_the_guard_passes_param_norm_every_to_its_collector() -> None:
    import torch

    from stability.adapters.torch import TorchGuard

    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    assert TorchGuard(m, opt, param_norm_every=3).collector.param_norm_every == 3
    assert TorchGuard(m, opt).collector.param_norm_every == 2
    with pytest.raises(ValueError, match="param_norm_every"):
        TorchGuard(m, opt, param_norm_every=-1)
