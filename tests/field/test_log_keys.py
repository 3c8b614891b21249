"""``log_keys`` for the trainer callbacks: core by default, "all", or a list (issue 26, item 4)."""

from __future__ import annotations

import pytest

from stability.monitor.monitor import Monitor
from stability.outputs.feedback import CORE_KEYS, key_selector


def test_key_selector() -> None:
    core = key_selector("core")
    assert all(core(k) for k in CORE_KEYS) and not core("stability/score/nan")
    assert key_selector("all")("stability/score/nan")
    pick = key_selector(["lr_factor", "stability/score/*"])
    assert pick("stability/lr_factor") and pick("stability/score/x")
    assert not pick("stability/level")
    assert not key_selector([])("stability/lr_factor")
    for bad in ("some", 3, ["ok", 2], None):
        with pytest.raises(ValueError, match="log_keys"):
            key_selector(bad)


@pytest.mark.parametrize("log_keys", ["core", "all", ["lr_factor"]])
def test_hf_logs_follow_log_keys(tmp_path, log_keys) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    from stability.adapters.hf import StabilityTrainerCallback
    from tests.adapters.test_hf import _trainer

    cb = StabilityTrainerCallback(Monitor("small"), log_keys=log_keys)
    tr = _trainer(tmp_path, cb, steps=4, eval_strategy="no")
    tr.train()
    keys = {k for h in tr.state.log_history if "learning_rate" in h for k in h
            if k.startswith("stability/")}
    if log_keys == "core":
        assert keys and keys <= set(CORE_KEYS) and len(keys) <= 9
    elif log_keys == "all":
        assert any(k.startswith("stability/score/") for k in keys) and len(keys) > 20
    else:
        assert keys == {"stability/lr_factor"}


def test_bad_log_keys_fail_at_construction() -> None:
    pytest.importorskip("lightning")
    from stability.adapters.lightning import StabilityCallback

    with pytest.raises(ValueError, match="log_keys"):
        StabilityCallback(Monitor("small"), log_keys="everything")
