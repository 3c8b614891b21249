"""The checkpoint cadence advisor against a brute-force simulation of failures."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stability.run.cadence import (
    CadenceAdvisor,
    advise,
    daly_interval,
    goodput,
    optimal_interval,
    young_interval,
)

SAVE, RESTART = 60.0, 120.0
MTBFS = (600.0, 1800.0, 3600.0, 4 * 3600.0, 24 * 3600.0)


def simulate(tau: float, save: float, restart: float, mtbf: float, n: int,
             rng: np.random.Generator) -> float:
    """Goodput of ``n`` intervals of ``tau`` s of work + a ``save``, failures ~ Exp(mtbf).

    A failure during work or a save loses the interval and costs a restart; a failure during
    the restart starts the restart again.
    """
    span = tau + save
    wall = np.zeros(n)
    active = np.arange(n)
    while active.size:
        x = rng.exponential(mtbf, active.size)
        ok = x >= span
        wall[active] += np.where(ok, span, x)
        pending = active[~ok]
        while pending.size:                       # restart, itself interruptible
            y = rng.exponential(mtbf, pending.size)
            done = y >= restart
            wall[pending] += np.where(done, restart, y)
            pending = pending[~done]
        active = active[~ok]
    return float(n * tau / wall.sum())


@pytest.mark.parametrize("mtbf", MTBFS)
def test_advised_interval_within_5pct_of_best_simulated(mtbf: float) -> None:
    rng = np.random.default_rng(int(mtbf))
    a = advise(SAVE, mtbf, RESTART)
    grid = a.interval_s * np.array([0.2, 0.35, 0.5, 0.7, 0.85, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0])
    sims = {float(t): simulate(float(t), SAVE, RESTART, mtbf, 3000, rng) for t in grid}
    best = max(sims.values())
    assert sims[float(grid[5])] >= 0.95 * best
    # the exact curve is the simulation's expectation (not only near the optimum)
    for t, g in sims.items():
        assert g == pytest.approx(goodput(t, SAVE, mtbf, RESTART), rel=0.06)


def test_a_bad_interval_fails_the_same_criterion() -> None:
    # the 5 % criterion can fail: ten times the optimum at a short MTBF is far off
    rng = np.random.default_rng(7)
    mtbf = 600.0
    tau = optimal_interval(SAVE, mtbf)
    best = simulate(tau, SAVE, RESTART, mtbf, 3000, rng)
    assert simulate(10 * tau, SAVE, RESTART, mtbf, 3000, rng) < 0.95 * best


@pytest.mark.parametrize("mtbf", MTBFS)
def test_optimum_is_a_maximum_and_young_is_its_limit(mtbf: float) -> None:
    tau = optimal_interval(SAVE, mtbf)
    g = goodput(tau, SAVE, mtbf, RESTART)
    for f in (0.9, 0.99, 1.01, 1.1):
        assert goodput(f * tau, SAVE, mtbf, RESTART) <= g
    # Young / Daly approach the exact optimum as C / M -> 0
    rel = abs(young_interval(SAVE, mtbf) - tau) / tau
    assert rel < 2.5 * math.sqrt(SAVE / mtbf)
    assert abs(daly_interval(SAVE, mtbf) - tau) / tau < rel + 1e-12


def test_no_failures_means_overhead_only() -> None:
    assert goodput(1000.0, 10.0, 1e15) == pytest.approx(1000.0 / 1010.0)
    assert goodput(0.0, 10.0, 3600.0) == 0.0


def test_risk_adaptive_interval_is_shorter() -> None:
    calm = advise(SAVE, 3600.0, RESTART, step_time_s=0.5)
    risky = advise(SAVE, 3600.0, RESTART, step_time_s=0.5, hazard=4.0)
    assert risky.interval_s < calm.interval_s and risky.interval_steps is not None
    assert calm.interval_steps is not None and risky.interval_steps < calm.interval_steps
    assert risky.interval_s == pytest.approx(calm.interval_s / 2, rel=0.1)  # ~ sqrt(hazard)
    d = calm.to_dict()
    assert len(d["curve_tau_s"]) == len(d["curve_goodput"]) == 41
    assert max(d["curve_goodput"]) <= calm.expected_goodput + 1e-12


def test_online_advisor() -> None:
    adv = CadenceAdvisor(prior_mtbf_s=3600.0, restart_s=RESTART, step_time_s=1.0)
    assert not adv.should_checkpoint(1e9)
    with pytest.raises(ValueError, match="no save"):
        adv.advise()
    adv.note_save(50.0)
    adv.note_save(70.0)
    assert adv.save_cost_s == 60.0
    before = adv.advise().interval_s
    adv.note_time(3600.0)
    adv.note_failure()
    adv.note_failure()
    assert adv.mtbf_s == pytest.approx(2400.0)
    after = adv.advise().interval_s
    assert after < before
    assert adv.should_checkpoint(after + 1) and not adv.should_checkpoint(after - 1)
    assert adv.should_checkpoint(after - 1, warnings_open=True)


@pytest.mark.parametrize("kw", [{"save_cost_s": 0.0}, {"mtbf_s": -1.0}, {"restart_s": math.nan},
                                {"hazard": 0.0}, {"mtbf_s": True}, {"step_time_s": 0.0}])
def test_bad_arguments(kw: dict[str, float]) -> None:
    args = {"save_cost_s": 60.0, "mtbf_s": 3600.0, "restart_s": 0.0} | kw
    hazard = args.pop("hazard", 1.0)
    step_time_s = args.pop("step_time_s", None)
    (name, value), = kw.items()
    with pytest.raises(ValueError, match=rf"^The '{name}' parameter of advise must be a float "
                       rf"in the range .*\. Got {value!r} instead\.$"):
        advise(**args, hazard=hazard, step_time_s=step_time_s)
    with pytest.raises(ValueError, match=r"'step_time_s' parameter of CadenceAdvisor .* "
                       r"or None\. Got -1\.0 instead"):
        CadenceAdvisor(step_time_s=-1.0)
