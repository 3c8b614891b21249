"""Host cost of a guarded step: the dispatched torch ops do not grow with the tensor count.

On an accelerator a short step is bounded by the host, whose cost per eager op (dispatch and
kernel launch) is about constant; so the guard's op count per step is its host cost.  Counted
with a ``TorchDispatchMode`` (every ATen op, each ``_foreach_*`` call once), the optimizer's own
step and ``zero_grad`` excluded.  Deterministic: no timing.

The cached lists (:class:`~stability.adapters.torch_ops.param_lists.ParamLists`) must not change a
value:
the signals are compared bit for bit with the per-tensor computation they replaced.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from stability.adapters.torch import TorchGuard  # noqa: E402
from stability.adapters.torch_ops.param_lists import sample_index  # noqa: E402
from stability.adapters.torch_ops.signals import SignalCollector  # noqa: E402
from stability.monitor.monitor import Monitor  # noqa: E402


class _Ops(TorchDispatchMode):
    """ATen ops dispatched while ``on`` (by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.on = True
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if self.on:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _stack(n_layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(n_layers):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


class _Wide(torch.nn.Module):
    """``n`` weight matrices of 512 x 64, each above the 4096-element update-ratio sample."""

    def __init__(self, n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ws = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(512, 64) / 8)
                                         for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(torch.tanh(x @ w.T).mean(1, keepdim=True) for w in self.ws)  # type: ignore


def _guard_ops(n_layers: int, sync: str, width: int = 8, steps: int = 8,
               model: torch.nn.Module | None = None, act: bool = True) -> list[Counter[str]]:
    """The guard's own ops in each of ``steps`` steps (after 4 warm-up steps).

    ``act=False``: the monitor decides in log-only mode, so the count is the guard's
    measurement alone -- two models whose losses differ may otherwise get different decisions
    (a clip is one ``_foreach_mul_`` more), which says nothing about the measurement's cost.
    """
    model = _stack(n_layers, width) if model is None else model
    # fused AdamW: with sync="deferred" non-finite gradients are then kept from the weights
    # by the optimizer's found_inf (one op); other optimizers get a torch.where per gradient
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    monitor = Monitor("default" if act else {"preset": "default", "monitor": {"log_only": True}})
    guard = TorchGuard(model, opt, monitor=monitor, log_interventions=False,
                       checkpoint_every=0, sync=sync)
    mode = _Ops()
    opt.register_step_pre_hook(lambda *_: setattr(mode, "on", False))
    opt.register_step_post_hook(lambda *_: setattr(mode, "on", True))
    zero_grad = opt.zero_grad

    def quiet_zero_grad(*a: Any, **k: Any) -> None:
        mode.on = False
        zero_grad(*a, **k)
        mode.on = True

    opt.zero_grad = quiet_zero_grad  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(4 + steps):
        x = torch.randn(4, width, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        mode.ops = Counter()
        with mode:
            guard.step(loss)
        if i >= 4:
            out.append(mode.ops)
    guard.detach()
    return out


@pytest.mark.parametrize("sync", ["step", "deferred"])
def test_guard_ops_per_step_do_not_grow_with_the_tensor_count(sync: str) -> None:
    few, many = _guard_ops(10, sync), _guard_ops(100, sync)  # 21 and 201 parameter tensors
    assert [sum(c.values()) for c in few] == [sum(c.values()) for c in many]
    assert few == many  # the same ops, step by step (param norms, update ratios included)
    # every step measures the gradients with one foreach call; the weights every 2nd step
    assert [c["aten._foreach_norm.Scalar"] for c in many][:4] == [3, 1, 2, 1]
    assert max(sum(c.values()) for c in many) < 60


def test_large_tensors_sampled_as_strided_views_add_no_ops() -> None:
    """A GPT's weight matrices (a multiple of 256 rows): the sample is one or two strided views
    per tensor, copied for all of them with one ``_foreach_copy_`` before and after the update.

    Counted with a log-only monitor: the 8-matrix model's loss jumps x2.3 at step 3, the
    default preset's loss_spike (with its prior, live from the third step) alarms and the
    acting policy clips there -- a ``_foreach_mul_`` the 2-matrix run does not get."""
    few, many = (_guard_ops(0, "step", width=64, model=_Wide(n), act=False) for n in (2, 8))
    assert few == many
    acting = [_guard_ops(0, "step", width=64, model=_Wide(n)) for n in (2, 8)]
    extra = sum((b - a for a, b in zip(*acting, strict=True)), Counter())
    assert set(extra) <= {"aten._foreach_mul_.Scalar"}  # the clip's op, not the measurement's
    assert sum(c["aten._foreach_copy_.default"] for c in many) == 2 * 2  # 2 ratio steps
    assert not any(c["aten.take.default"] for c in many)


def test_other_large_tensors_add_two_gathers_on_ratio_steps_only() -> None:
    """A tensor above the 4096-element sample that no strided view covers is gathered
    (``torch.take``) before and after the update on the ratio steps (every 4th): there is no
    multi-tensor gather in PyTorch."""
    few, many = _guard_ops(2, "step", width=80), _guard_ops(6, "step", width=80)
    for step, (a, b) in enumerate(zip(few, many, strict=True)):
        extra = b - a
        if step % 4 == 0:  # the steps s % 4 == 0 (counted from the 4th)
            assert extra == Counter({"aten.take.default": 2 * 4})
        else:
            assert not extra and not (a - b)


def _reference_ratio(params: list[torch.Tensor], group: list[int], n_layers: int,
                     before: list[torch.Tensor], wnorms: torch.Tensor) -> torch.Tensor:
    """The per-tensor computation the cached lists replaced (detach, take or clone per tensor,
    norms in the parameters' order)."""
    views, scale = [], []
    for p in params:
        idx = sample_index(p.shape, 4096)
        views.append(p.detach() if idx is None else torch.take(p.detach(), idx))
        scale.append(1.0 if idx is None else p.numel() / idx.numel())
    diffs = torch._foreach_sub(before, views)
    sq = torch.stack(torch._foreach_norm(diffs))
    idx_t = torch.tensor(group)
    dsq = torch.zeros(n_layers).index_add_(0, idx_t, sq.square() * torch.tensor(scale))
    wsq = torch.zeros(n_layers).index_add_(0, idx_t, wnorms.square())
    return dsq.sqrt() / wsq.sqrt().clamp_min(1e-12)


def test_signals_are_bit_identical_to_the_per_tensor_computation() -> None:
    torch.manual_seed(0)
    # large and small tensors interleaved, tensors of different sizes per layer group
    model = torch.nn.Sequential(torch.nn.Linear(96, 512), torch.nn.Tanh(),
                                torch.nn.Linear(512, 20), torch.nn.Tanh(),
                                torch.nn.Linear(20, 90), torch.nn.Tanh(),
                                torch.nn.Linear(90, 70))
    names = [n for n, _ in model.named_parameters()]
    col = SignalCollector(model, layer_fn=lambda n: "even" if names.index(n) % 2 else "odd",
                          update_ratio_every=1, param_norm_every=1)
    params = col.params
    lists = col._lists
    assert lists.large_pos and lists.small_pos and lists._reorder
    # strided views (two for the first weight: 256 blocks over 6 slots) and torch.take both
    assert lists._pieces and len(lists._pieces[0]) == 2 and len(lists.large) > lists.n_strided
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    group = col._group
    expect = None
    for step in range(3):
        x = torch.randn(16, 96, generator=gen)
        model(x).pow(2).mean().backward()
        s = col.collect()
        grads = [p.grad for p in params]
        gn = torch.stack(torch._foreach_norm(grads))
        layer = torch.zeros(2).index_add_(0, torch.tensor(group), gn * gn).sqrt()
        np.testing.assert_array_equal(s.families["grad_norm"], layer.double().numpy())
        assert s.scalars["grad_norm"] == float(layer.square().sum().sqrt())
        wn = torch.stack(torch._foreach_norm([p.detach() for p in params]))
        assert s.scalars["param_norm"] == float(wn.square().sum().sqrt())
        if expect is not None:
            np.testing.assert_array_equal(s.families["update_ratio"], expect.double().numpy())
        else:
            assert "update_ratio" not in s.families
        before = []
        for p in params:
            idx = sample_index(p.shape, 4096)
            before.append(p.detach().clone() if idx is None else torch.take(p.detach(), idx))
        col.before_step(step)
        opt.step()
        col.after_step()
        opt.zero_grad()
        expect = _reference_ratio(params, group, 2, before, wn)


def test_strided_views_follow_a_parameter_whose_storage_was_replaced() -> None:
    """``p.data = ...`` (a device move, a loader that assigns) gives the parameter new storage:
    the cached views of the sample are rebuilt, the ratios stay those of a fresh collector."""
    got = []
    for swap in (False, True):
        model = _Wide(2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        col = SignalCollector(model, update_ratio_every=1)
        assert col._lists.n_strided == 2
        gen = torch.Generator().manual_seed(1)
        ratios = []
        for step in range(3):
            model(torch.randn(4, 64, generator=gen)).sum().backward()
            ratios.append(col.collect().families.get("update_ratio"))
            if swap and step == 1:
                for p in model.parameters():
                    p.data = p.data.clone()
            col.before_step(step)
            opt.step()
            col.after_step()
            opt.zero_grad()
        got.append(ratios[1:] + [col.collect().families["update_ratio"]])
    for a, b in zip(*got, strict=True):
        assert np.all(a > 0)
        np.testing.assert_array_equal(a, b)
