"""Monitor inputs at and past their bounds (issue 12, class 3).

Every input here must be a *recorded skip* (listed in ``Decision.skipped``; ``ValueError`` in
strict mode), never an exception of another type out of ``observe()``, and never a reason for the
monitor to stop watching: after it, a NaN loss still raises the ``nonfinite`` alarm.

* steps outside ``[0, 2**53)``: never become the last step (one such step used to make every
  later normal step "out of order" -- the monitor went blind);
* values whose conversion raises, NumPy / torch complex numbers (used to be cut to their real
  part), torch meta tensors, ``families`` that is not a mapping;
* a new metric name on every step: the ``"*"`` bank stops at ``[monitor] max_series`` series
  (one warning), the names past it are recorded skips and the name cache stays bounded.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import pytest

from stability.config.config import ConfigError, MonitorConfig
from stability.monitor.monitor import MAX_STEP, Monitor

torch = pytest.importorskip("torch")

NAN_ONLY = {"detectors": [{"name": "nonfinite", "detector": "nonfinite", "inputs": ["*"],
                           "kind": "nonfinite"}]}


def _still_watching(mon: Monitor, step: int) -> None:
    d = mon.observe(step, {"loss": math.nan})
    assert not d.skipped, d.skipped
    assert [(a.kind, a.signal) for a in d.alarms] == [("nonfinite", "loss")]


class _RaisingFloat:
    def __float__(self) -> float:
        raise RuntimeError("__float__ fails")


class _RaisingFloatAndArray:
    shape = ()

    def __float__(self) -> float:
        raise KeyError("no value")

    def __array__(self, *a: Any, **k: Any) -> Any:
        raise OSError("no array either")


@pytest.mark.parametrize("step", [2**53, 2**63 - 1, 2**63, 10**20, 10**30, 1e20, 2.0**60,
                                  np.uint64(2**64 - 1), np.int64(2**62), np.float64(1e300)],
                         ids=repr)
def test_absurd_step_is_a_recorded_skip_and_never_blinds_the_monitor(step: Any) -> None:
    mon = Monitor(NAN_ONLY, handler_timeout=None)
    for s in range(5):
        mon.observe(s, {"loss": 1.0})
    d = mon.observe(step, {"loss": math.nan})
    assert d.skipped and "largest accepted step" in d.skipped[0]
    assert not d.alarms and mon.last_step == 4
    assert mon.counters["skipped_steps"] == 1
    _still_watching(mon, 5)  # the next normal step is accepted and watched
    strict = Monitor({**NAN_ONLY, "monitor": {"strict": True}})
    with pytest.raises(ValueError, match="largest accepted step"):
        strict.observe(step, {"loss": 1.0})
    assert strict.last_step == -1


def test_largest_step_is_accepted() -> None:
    mon = Monitor(NAN_ONLY, handler_timeout=None)
    assert not mon.observe(MAX_STEP - 1, {"loss": 1.0}).skipped
    d = mon.observe(float(MAX_STEP), {"loss": math.nan})
    assert not d.skipped and d.step == MAX_STEP and d.alarms


def test_replay_with_absurd_steps_skips_them() -> None:
    mon = Monitor(NAN_ONLY, handler_timeout=None)
    steps = np.array([0, 1, 2**60, 3], dtype=np.int64)
    out = mon.replay({"step": steps, "loss": np.array([1.0, 1.0, 1.0, math.nan])})
    assert [bool(d.skipped) for d in out] == [False, False, True, False]
    assert out[-1].alarms and mon.last_step == 3


@pytest.mark.parametrize("steps", [np.array([0, 1, 1e300, 3.0]),
                                   np.array([0, 1, 2**64 - 1, 3], dtype=np.uint64)], ids=str)
def test_replay_never_wraps_huge_steps(steps: np.ndarray) -> None:
    mon = Monitor(NAN_ONLY, handler_timeout=None)
    out = mon.replay({"step": steps, "loss": np.array([1.0, 1.0, 1.0, math.nan])})
    assert [d.step for d in out] == [0, 1, 2**53, 3]
    assert "largest accepted step" in out[2].skipped[0]
    assert out[-1].alarms and mon.last_step == 3


BAD_VALUES = {
    "raising __float__": _RaisingFloat(),
    "raising __float__ and __array__": _RaisingFloatAndArray(),
    "numpy complex128": np.complex128(1 + 2j),
    "numpy complex64": np.complex64(1 + 0j),
    "numpy 0-d complex array": np.array(1 + 2j),
    "python complex": 1 + 2j,
}


def _torch_values() -> dict[str, Any]:
    return {
        "torch complex scalar": torch.tensor(1 + 2j),
        "torch complex 1-element": torch.ones(1, dtype=torch.complex64),
        "torch meta scalar": torch.empty((), device="meta"),
        "torch meta 1-element": torch.empty(1, device="meta"),
    }


@pytest.mark.parametrize("name", [*BAD_VALUES, *_torch_values()])
def test_unconvertible_values_are_recorded_skips(name: str) -> None:
    value = {**BAD_VALUES, **_torch_values()}[name]
    mon = Monitor(NAN_ONLY, handler_timeout=None)
    # alone, and beside plain floats (the fast path must not take it either)
    for i, metrics in enumerate(({"loss": value}, {"grad_norm": 1.0, "loss": value, "x": 2.0})):
        d = mon.observe(i, metrics)
        assert len(d.skipped) == 1 and "'loss'" in d.skipped[0], d.skipped
        assert not d.alarms
    _still_watching(mon, 2)
    strict = Monitor({**NAN_ONLY, "monitor": {"strict": True}})
    with pytest.raises(ValueError, match="loss"):
        strict.observe(0, {"loss": value})


def test_complex_is_never_cut_to_its_real_part() -> None:
    mon = Monitor({"detectors": [{"name": "spike", "detector": "ewma_z", "inputs": ["loss"],
                                  "params": {"warmup": 3, "alpha": 0.1}}]},
                  handler_timeout=None)
    for s in range(20):
        mon.observe(s, {"loss": 1.0 + 0.01 * (s % 3)})
    before = mon.detector("spike").state_dict()
    d = mon.observe(20, {"loss": np.complex128(1.0 + 1e6j)})
    assert d.skipped and "complex" in d.skipped[0]
    after = mon.detector("spike").state_dict()
    assert np.array_equal(np.asarray(before["state"]), np.asarray(after["state"]),
                          equal_nan=True)


@pytest.mark.parametrize("families", [[1.0, 2.0], ("grad_norm",), np.ones(2), "grad_norm", 3.0,
                                      [("grad_norm", np.ones(2))]], ids=repr)
def test_families_that_are_not_a_mapping_are_recorded_skips(families: Any) -> None:
    mon = Monitor(NAN_ONLY, handler_timeout=None)
    mon.declare_family("grad_norm", ["a", "b"])
    d = mon.observe(0, {"loss": 1.0}, families=families)
    assert d.skipped and "families: expected a mapping" in d.skipped[0]
    _still_watching(mon, 1)


@pytest.mark.parametrize("kind", ["complex", "meta"])
def test_torch_family_arrays_that_cannot_convert_are_recorded_skips(kind: str) -> None:
    mon = Monitor(NAN_ONLY, handler_timeout=None)
    mon.declare_family("grad_norm", ["a", "b"])
    arr = (torch.ones(2, dtype=torch.complex64) if kind == "complex"
           else torch.empty(2, device="meta"))
    d = mon.observe(0, {"loss": 1.0}, families={"grad_norm": arr})
    assert d.skipped and "families['grad_norm']" in d.skipped[0]
    assert mon.observe(1, {}, families={"grad_norm": np.array([1.0, math.nan])}).alarms


def test_metrics_that_are_an_array_are_a_recorded_skip() -> None:
    mon = Monitor(NAN_ONLY, handler_timeout=None)
    d = mon.observe(0, np.ones(3))  # type: ignore[arg-type]
    assert d.skipped and "metrics: expected a mapping" in d.skipped[0]
    _still_watching(mon, 1)


# ---------------------------------------------------------------------------- series cap
def test_series_cap_bounds_the_wildcard_bank(caplog: pytest.LogCaptureFixture) -> None:
    cap = 50
    mon = Monitor({**NAN_ONLY, "monitor": {"max_series": cap}}, handler_timeout=None)
    assert mon.max_series == cap
    n_skipped = 0
    with caplog.at_level(logging.WARNING, logger="stability.monitor"):
        for s in range(400):
            d = mon.observe(s, {"loss": 1.0, f"new_metric_{s}": 1.0})
            n_skipped += len(d.skipped)
            if s >= cap - 1:  # loss took one series: names from step cap-1 on are past the cap
                assert d.skipped and "max_series=50" in d.skipped[0], (s, d.skipped)
    assert len(mon.series("nonfinite")) == cap
    assert n_skipped == 400 - (cap - 1)
    assert mon.counters["skipped_values"] == n_skipped
    warnings = [r for r in caplog.records if "max_series" in r.getMessage()]
    assert len(warnings) == 1  # one warning per bank
    assert len(mon._cache) <= cap + 1  # names past the cap are not cached
    _still_watching(mon, 400)  # names already in the bank are still watched
    d = mon.observe(401, {"new_metric_3": math.nan})
    assert [a.signal for a in d.alarms] == ["new_metric_3"]


def test_series_cap_keeps_names_another_bank_takes() -> None:
    cfg = {"monitor": {"max_series": 3}, "detectors": [
        NAN_ONLY["detectors"][0],
        {"name": "grad_layers", "detector": "ewma_z", "inputs": ["grad_norm/*"],
         "params": {"warmup": 2}}]}
    mon = Monitor(cfg, handler_timeout=None)
    mon.observe(0, {"a": 1.0, "b": 1.0, "c": 1.0})  # the "*" bank is full
    d = mon.observe(1, {"grad_norm/l0": 1.0, "d": 1.0})
    assert mon.series("nonfinite") == ["a", "b", "c"]
    assert mon.series("grad_layers") == ["l0"]  # still bound by the bank with room
    assert [x for x in d.skipped if "'d'" in x] and not [x for x in d.skipped if "l0" in x]
    # a strict monitor records a full bank too (a resource limit, not bad input)
    strict = Monitor({**cfg, "monitor": {"max_series": 1, "strict": True}},
                     handler_timeout=None)
    strict.observe(0, {"a": 1.0})
    assert strict.observe(1, {"b": 1.0}).skipped


def test_series_cap_with_families() -> None:
    mon = Monitor({**NAN_ONLY, "monitor": {"max_series": 3}}, handler_timeout=None)
    mon.declare_family("grad_norm", [f"l{i}" for i in range(6)])
    assert len(mon.series("nonfinite")) == 3
    d = mon.observe(0, {}, families={"grad_norm": np.full(6, math.nan)})
    assert sorted(a.signal for a in d.alarms) == ["grad_norm/l0", "grad_norm/l1", "grad_norm/l2"]


def test_series_cap_bounds_unbound_names_too() -> None:
    mon = Monitor({"monitor": {"max_series": 10}, "detectors": [
        {"name": "loss", "detector": "ewma_z", "inputs": ["loss"]}]}, handler_timeout=None)
    for s in range(200):
        assert not mon.observe(s, {"loss": 1.0, f"other_{s}": 1.0}).skipped
    assert len(mon.unbound) == 10 and len(mon._cache) <= 11


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4096"])
def test_max_series_config_is_validated(bad: Any) -> None:
    with pytest.raises(ConfigError, match="monitor.max_series"):
        MonitorConfig.from_dict({"monitor": {"max_series": bad}})


def test_new_config_keys_round_trip() -> None:
    cfg = MonitorConfig.from_dict({"monitor": {"max_series": 128, "handler_budget_s": 0.25}})
    assert (cfg.monitor.max_series, cfg.monitor.handler_budget_s) == (128, 0.25)
    assert MonitorConfig.from_dict(cfg.to_dict()) == cfg
    default = MonitorConfig.from_dict({})
    assert (default.monitor.max_series, default.monitor.handler_budget_s) == (4096, 1.0)
