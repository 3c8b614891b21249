"""Fused signal collection against slow per-parameter references."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from stability.adapters.torch_ops.signals import SignalCollector, activation_stats, layer_of  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8),
                               torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_grad_norms_match_reference() -> None:
    m = _model()
    col = SignalCollector(m, update_ratio_every=0)
    loss = m(torch.randn(16, 5)).pow(2).mean()
    loss.backward()
    s = col.collect(loss, {"lr": 0.1})
    ref = {}
    for n, p in m.named_parameters():
        ref.setdefault(layer_of(n), 0.0)
        ref[layer_of(n)] += float(p.grad.pow(2).sum())
    assert col.layer_names == ["0", "2", "4"]
    want = [math.sqrt(ref[k]) for k in ["0", "2", "4"]]
    np.testing.assert_allclose(s.families["grad_norm"], want, rtol=1e-5)
    total = float(torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]))
    assert s.scalars["grad_norm"] == pytest.approx(total, rel=1e-5)
    assert s.scalars["loss"] == pytest.approx(loss.item())
    assert s.scalars["lr"] == 0.1
    weights = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    assert s.scalars["param_norm"] == pytest.approx(float(weights.norm()), rel=1e-5)
    flat = s.flat(col.layers)
    assert set(flat) == {"loss", "lr", "grad_norm", "param_norm", "grad_norm/0", "grad_norm/2",
                         "grad_norm/4"}


def test_layer_depth_and_missing_grads() -> None:
    m = _model()
    col = SignalCollector(m, layer_depth=0, update_ratio_every=0)
    assert col.layer_names == ["root"]
    m(torch.randn(2, 5)).sum().backward()
    m[0].weight.grad = None  # a parameter without gradient this step
    s = col.collect()
    g = float(torch.nn.utils.get_total_norm([p.grad for p in m.parameters() if p.grad is not None]))
    assert s.families["grad_norm"][0] == pytest.approx(g, rel=1e-5)


def test_update_ratio_reported_next_step() -> None:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    col = SignalCollector(m, update_ratio_every=1)
    for step in range(2):
        m(torch.randn(4, 5)).sum().backward()
        s = col.collect()
        if step == 0:
            assert "update_ratio" not in s.families
            w0 = {n: p.detach().clone() for n, p in m.named_parameters()}
        col.before_step(step)
        opt.step()
        col.after_step()
        if step == 0:
            w1 = {n: p.detach().clone() for n, p in m.named_parameters()}
        opt.zero_grad()
    ref = []
    for layer in col.layer_names:
        d = sum(float((w1[n] - w0[n]).pow(2).sum()) for n in w0 if layer_of(n) == layer)
        w = sum(float(w0[n].pow(2).sum()) for n in w0 if layer_of(n) == layer)
        ref.append(math.sqrt(d) / math.sqrt(w))
    np.testing.assert_allclose(s.families["update_ratio"], ref, rtol=1e-4)


def test_activation_hooks_every_k_steps_and_train_only() -> None:
    m = _model()
    col = SignalCollector(m, activations=["1", "3"], activation_every=2, update_ratio_every=0)
    seen = []
    for step in range(4):
        col.begin_step(step)
        x = torch.randn(32, 5)
        loss = m(x).sum()
        loss.backward()
        s = col.collect(loss)
        seen.append("act_mean" in s.families)
        if step == 0:
            h = torch.relu(m[0](x))
            ref = activation_stats(h).tolist()
            np.testing.assert_allclose([s.families[k][0] for k in
                                        ("act_mean", "act_std", "act_absmax", "act_kurtosis")],
                                       ref, rtol=1e-5)
    assert seen == [True, False, True, False]
    col.begin_step(0)
    m.eval()
    with torch.no_grad():
        m(torch.randn(3, 5))
    assert col._act == {}  # eval forwards are ignored
    col.remove()


def test_activation_stats_reference() -> None:
    x = torch.randn(1000, dtype=torch.float64)
    got = activation_stats(x).tolist()
    xn = x.numpy()
    c = xn - xn.mean()
    kurt = (c**4).mean() / (c**2).mean() ** 2 - 3
    np.testing.assert_allclose(got, [xn.mean(), xn.std(), np.abs(xn).max(), kurt], rtol=1e-5)


def test_bad_parameters() -> None:
    with pytest.raises(ValueError, match="update_ratio_every"):
        SignalCollector(_model(), update_ratio_every=-1)
    with pytest.raises(ValueError, match="activation_every"):
        SignalCollector(_model(), activation_every=0)
