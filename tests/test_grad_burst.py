"""The default preset's grad_burst_layers binding (coherent_jump on grad_norm/*), live."""

from __future__ import annotations

import numpy as np
import pytest

from stability.monitor.monitor import Monitor


def _burst_alarms(seen: list) -> list[int]:
    return sorted({a.step for a in seen if a.detector == "grad_burst_layers"})


@pytest.mark.parametrize("seed", [0, 1])
def test_an_activation_spike_in_a_real_mlp_is_a_grad_burst(seed: int) -> None:
    torch = pytest.importorskip("torch")
    from stability.testing.tinytrain import FaultSpec, train_run

    torch.set_num_threads(1)
    spike = FaultSpec("activation_spike", 150, duration=1, magnitude=5.0)
    seen: list = []
    train_run("mlp", 200, seed=seed, fault=spike, optimizer="sgd",
              monitor=Monitor("default", alert_sinks=[], on_alarm=seen.append))
    assert _burst_alarms(seen) == [150]
    clean: list = []
    train_run("mlp", 200, seed=seed, optimizer="sgd",
              monitor=Monitor("default", alert_sinks=[], on_alarm=clean.append))
    assert _burst_alarms(clean) == []


def test_two_layers_alarm_one_does_not_and_rewind_resets_the_bank() -> None:
    rng = np.random.default_rng(0)
    seen: list = []
    mon = Monitor("default", alert_sinks=[], on_alarm=seen.append)
    g = np.exp(rng.normal(0.0, 0.1, (120, 3)))
    g[60, 0] *= 8.0            # one layer alone
    g[100, :2] *= 8.0          # two layers together
    for s in range(120):
        mon.observe(s, {"loss": 2.0, **{f"grad_norm/l{i}": float(g[s, i]) for i in range(3)}})
    assert _burst_alarms(seen) == [100]
    assert {a.kind for a in seen if a.detector == "grad_burst_layers"} == {"grad_explosion"}
    det = mon.detector("grad_burst_layers")
    assert det.state_dict()["state"][3].min() > 0        # every layer has counted changes
    mon.rewind(80)
    assert not np.any(det.state_dict()["state"])         # a restore is not a jump: forget


def test_gradients_coming_back_after_an_fp16_underflow_are_not_a_burst() -> None:
    """bench_rescue's fp16_underflow run: grads x1e-8 for 75 iterations, then back.  Measured
    from the previous step alone, every layer 'jumped' x1e8 (a skip and a clip harmed it)."""
    torch = pytest.importorskip("torch")
    from stability.testing.tinytrain import FaultSpec, train_run

    torch.set_num_threads(1)
    seen: list = []
    under = FaultSpec("fp16_underflow", 146, duration=75, magnitude=1e-8)
    res = train_run("mlp", 240, seed=0, fault=under,
                    monitor=Monitor("small", alert_sinks=[], on_alarm=seen.append))
    assert any(a.kind == "grad_vanishing" for a in seen)        # the collapse is reported
    assert _burst_alarms(seen) == []
    assert not [i for i in res.interventions if i.type in ("skip_step", "set_clip")]
