"""param_groups show the effective LR between steps; real schedulers are never disturbed."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from stability.adapters.interventions import LRMultiplier  # noqa: E402
from stability.adapters.torch import TorchGuard  # noqa: E402
from stability.types import Control, Decision  # noqa: E402

N = 24
CUT = range(5, 12)  # steps where the monitor holds lr_factor = 0.1


class _Factor:
    """Monitor stand-in: lr_factor 0.1 on the CUT steps, 1.0 elsewhere."""

    def observe(self, step: int, metrics=None, families=None) -> Decision:
        return Decision(step, control=Control(lr_factor=0.1 if step in CUT else 1.0))


def _scheds():
    return {
        "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + 0.1 * s)),
        "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=N + 2),
        "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=N),
        "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5),
        "exponential": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
    }


def _pair(kind: str):
    out = []
    for _ in range(2):
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9)
        out.append((m, opt, _scheds()[kind](opt)))
    return out


@pytest.mark.parametrize("kind", sorted(_scheds()))
def test_effective_lr_shown_and_schedule_unchanged(kind: str) -> None:
    (m0, o0, s0), (m1, o1, s1) = _pair(kind)
    guard = TorchGuard(m1, o1, s1, _Factor(), checkpoint_every=0, log_interventions=False)
    x = torch.randn(8, 3)
    for step in range(N):
        ref_lr = o0.param_groups[0]["lr"]  # the schedule's value for this step
        shown = o1.param_groups[0]["lr"]
        factor = 0.1 if (step - 1) in CUT else 1.0  # set at the previous step, shown since
        assert shown == pytest.approx(ref_lr * factor, rel=1e-12, abs=1e-15)
        for m, o, s in ((m0, o0, s0),):
            m(x).pow(2).mean().backward()
            o.step()
            s.step()
            o.zero_grad()
        loss = m1(x).pow(2).mean()
        loss.backward()
        guard.step(loss)
    # after the cut the schedule is exactly the uninterrupted one
    assert o1.param_groups[0]["lr"] == pytest.approx(o0.param_groups[0]["lr"], rel=1e-12)
    assert s1.get_last_lr() == pytest.approx(s0.get_last_lr(), rel=1e-12)
    assert s1.last_epoch == s0.last_epoch
    guard.detach()
    assert o1.param_groups[0]["lr"] == pytest.approx(o0.param_groups[0]["lr"], rel=1e-12)


@pytest.mark.parametrize("kind", ["step", "exponential", "cosine", "lambda"])
def test_epoch_scheduler_stepped_outside_the_guard(kind: str) -> None:
    """Per-epoch scheduler not given to the guard, stepped while a cut is active."""
    (m0, o0, s0), (m1, o1, s1) = _pair(kind)
    guard = TorchGuard(m1, o1, None, _Factor(), checkpoint_every=0, log_interventions=False)
    x = torch.randn(8, 3)
    for step in range(N):
        loss = m1(x).pow(2).mean()
        loss.backward()
        guard.step(loss)
        if step % 3 == 2:  # "epoch" end
            with guard.base_lr():
                s1.step()
            s0.step()
    assert o1.param_groups[0]["lr"] == pytest.approx(o0.param_groups[0]["lr"], rel=1e-12)


@pytest.mark.parametrize("kind", ["step", "exponential", "cosine", "lambda"])
def test_multiplier_resolves_a_scheduler_it_knows(kind: str) -> None:
    """Without the context manager: the multiplier recomputes the step from the base."""
    (m0, o0, s0), (m1, o1, s1) = _pair(kind)
    mult = LRMultiplier(o1, scheduler=s1)
    x = torch.randn(8, 3)
    for step in range(N):
        mult.factor = 0.1 if step in CUT else 1.0
        m1(x).pow(2).mean().backward()
        o1.step()
        mult.show()  # the groups show the cut value while the scheduler steps
        s1.step()
        o1.zero_grad()
        s0.step()
    mult.factor = 1.0
    mult.show()
    assert o1.param_groups[0]["lr"] == pytest.approx(o0.param_groups[0]["lr"], rel=1e-12)


def test_resume_does_not_compound_the_cut() -> None:
    """optimizer.state_dict() saved between steps holds the shown (cut) LR."""
    (m0, o0, s0), (m1, o1, s1) = _pair("lambda")
    guard = TorchGuard(m1, o1, s1, _Factor(), checkpoint_every=0, log_interventions=False)
    x = torch.randn(8, 3)
    for _ in range(7):  # inside the cut
        loss = m1(x).pow(2).mean()
        loss.backward()
        guard.step(loss)
    saved = copy.deepcopy({"opt": o1.state_dict(), "sched": s1.state_dict(),
                           "guard": guard.state_dict(), "model": m1.state_dict()})
    assert saved["opt"]["param_groups"][0]["lr"] == pytest.approx(0.1 * s1.get_last_lr()[0])
    # a fresh process
    torch.manual_seed(0)
    m2 = torch.nn.Linear(3, 1)
    m2.load_state_dict(saved["model"])
    o2 = torch.optim.SGD(m2.parameters(), lr=0.2, momentum=0.9)
    s2 = torch.optim.lr_scheduler.LambdaLR(o2, lambda s: 1.0 / (1 + 0.1 * s))
    o2.load_state_dict(saved["opt"])
    s2.load_state_dict(saved["sched"])
    g2 = TorchGuard(m2, o2, s2, _Factor(), checkpoint_every=0, log_interventions=False)
    g2.load_state_dict(saved["guard"])
    for _ in range(7, N):
        for g, m in ((guard, m1), (g2, m2)):
            loss = m(x).pow(2).mean()
            loss.backward()
            g.step(loss)
        assert o2.param_groups[0]["lr"] == pytest.approx(o1.param_groups[0]["lr"], rel=1e-12)
    assert torch.allclose(m1.weight, m2.weight)
    assert o2.param_groups[0]["lr"] == pytest.approx(s2.get_last_lr()[0], rel=1e-12)
