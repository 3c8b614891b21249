"""Sampled update ratios (no parameter copy) against the exact full-copy measurement."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from stability.adapters.torch import TorchGuard  # noqa: E402
from stability.adapters.torch_ops.signals import SignalCollector  # noqa: E402

#: relative tolerance of the sampled ratio against the exact one on dense updates
#: (about 1 / sqrt(2 m) with m = 4096 samples per tensor; 6 standard errors)
RTOL = 0.07


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(96, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 192), torch.nn.GELU(),
                               torch.nn.Linear(192, 10))


def _ratios(opt_name: str, mode: str) -> list[np.ndarray]:
    m = _model()
    opt: Any
    if opt_name == "sgd":
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    else:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.05)
    col = SignalCollector(m, update_ratio=mode, update_ratio_every=1)
    gen = torch.Generator().manual_seed(1)
    out = []
    for step in range(4):
        x = torch.randn(32, 96, generator=gen)
        y = torch.randint(0, 10, (32,), generator=gen)
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        s = col.collect(loss)
        if "update_ratio" in s.families:
            out.append(s.families["update_ratio"])
        col.before_step(step)
        opt.step()
        col.after_step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_sampled_agrees_with_exact(opt_name: str) -> None:
    exact = _ratios(opt_name, "exact")
    sampled = _ratios(opt_name, "sampled")
    assert len(exact) == len(sampled) == 3
    for e, s in zip(exact, sampled, strict=True):
        assert np.all(e > 0)
        np.testing.assert_allclose(s, e, rtol=RTOL)
    # the first layer's weight (96 x 256 = 24576 elements) really is sampled, not copied whole
    assert not np.array_equal(exact[0], sampled[0])


def test_small_tensors_are_exact() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.3)
    cols = {mode: SignalCollector(m, update_ratio=mode) for mode in ("sampled", "exact")}
    m(torch.randn(8, 4)).pow(2).mean().backward()
    for c in cols.values():
        c.collect()
        c.before_step(0)
    opt.step()
    got = {}
    for mode, c in cols.items():
        c.after_step()
        got[mode] = c.collect().families["update_ratio"]
    np.testing.assert_allclose(got["sampled"], got["exact"], rtol=1e-5)


class _CloneCounter:
    """Counts the elements of every tensor cloned or gathered (``torch.take``, and the
    sample's foreach copies: ``_foreach_mul`` by 1 of small tensors, ``_foreach_copy_`` of
    strided views) while active."""

    def __init__(self) -> None:
        self.numel = 0
        self.largest = 0

    def __enter__(self) -> _CloneCounter:
        self._orig = torch.Tensor.clone
        counter = self

        def clone(t: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
            counter.numel += t.numel()
            counter.largest = max(counter.largest, t.numel())
            return counter._orig(t, *a, **k)

        self._take = torch.take

        def take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
            counter.numel += idx.numel()
            counter.largest = max(counter.largest, idx.numel())
            return counter._take(t, idx)

        self._fmul, self._fcopy = torch._foreach_mul, torch._foreach_copy_

        def count_list(fn: Any, arg: int) -> Any:
            def wrapped(*a: Any, **k: Any) -> Any:
                for t in a[arg]:
                    counter.numel += t.numel()
                    counter.largest = max(counter.largest, t.numel())
                return fn(*a, **k)
            return wrapped

        torch.Tensor.clone = clone  # type: ignore[method-assign]
        torch.take = take
        torch._foreach_mul = count_list(self._fmul, 0)
        torch._foreach_copy_ = count_list(self._fcopy, 1)
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.clone = self._orig  # type: ignore[method-assign]
        torch.take = self._take
        torch._foreach_mul, torch._foreach_copy_ = self._fmul, self._fcopy


@pytest.mark.parametrize("mode", ["sampled", "exact"])
def test_default_guard_copies_no_full_parameter(mode: str) -> None:
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    n_params = sum(p.numel() for p in m.parameters())
    biggest = max(p.numel() for p in m.parameters())
    kw = {} if mode == "sampled" else {"update_ratio": "exact"}
    guard = TorchGuard(m, opt, checkpoint_every=0, log_interventions=False,
                       update_ratio_every=1, **kw)
    assert guard.collector.update_ratio == mode
    with _CloneCounter() as cc:
        for _ in range(3):
            loss = m(torch.randn(8, 96)).pow(2).mean()
            loss.backward()
            guard.step(loss)
            assert guard.collector._snapshot is None  # nothing held between steps
    if mode == "sampled":
        # before the step the sample is copied, after it gathered again to compare
        per_step = sum(p.numel() if p.numel() <= 4096 else 2 * 4096 for p in m.parameters())
        assert cc.largest <= 4096 < biggest
        assert 0 < cc.numel <= 3 * per_step < 3 * n_params
    else:
        assert cc.numel == 3 * n_params  # the opt-in exact mode: one full copy per step


def test_bad_update_ratio_arguments() -> None:
    with pytest.raises(ValueError, match="'update_ratio' parameter"):
        SignalCollector(_model(), update_ratio="approx")
    with pytest.raises(ValueError, match="update_ratio_samples"):
        SignalCollector(_model(), update_ratio_samples=0)


def test_sampled_follows_replaced_parameter_storage() -> None:
    """Cached sample views are rebuilt when a parameter gets new storage (e.g. a reload)."""
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    col = SignalCollector(m, update_ratio_every=1)
    ref = SignalCollector(m, update_ratio="exact", update_ratio_every=1)
    for step in range(3):
        m(torch.randn(16, 96)).pow(2).mean().backward()
        for c in (col, ref):
            c.collect()
            c.before_step(step)
        opt.step()
        for c in (col, ref):
            c.after_step()
        opt.zero_grad()
        with torch.no_grad():
            for p in m.parameters():
                p.data = p.data.clone()  # new storage, same values
    m(torch.randn(16, 96)).pow(2).mean().backward()
    got, want = col.collect().families["update_ratio"], ref.collect().families["update_ratio"]
    assert np.all(want > 0)
    np.testing.assert_allclose(got, want, rtol=RTOL)
