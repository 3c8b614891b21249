from __future__ import annotations

import json

import pytest

from stability.config.config import ConfigError, MonitorConfig, load_config
from stability.config.presets import list_presets, load_preset
from stability.config.registry import (
    REGISTRY,
    UnknownDetectorError,
    detector_class,
    is_available,
    make_detector,
)

LOSS = {"name": "loss", "detector": "ewma_z", "inputs": ["loss"]}


def test_registry_lazy_and_unknown():
    assert detector_class("ewma_z").__name__ == "EWMAZScore"
    with pytest.raises(UnknownDetectorError, match="did you mean 'ewma_z'.*known: .*nonfinite"):
        detector_class("ewma_zz")
    for name in REGISTRY:
        assert is_available(name), name


@pytest.mark.parametrize("preset", list_presets())
def test_presets_load_and_build(preset):
    cfg = load_config(preset)
    assert cfg.preset == preset
    names = [d.detector for d in cfg.detectors]
    for det in ("nonfinite", "ewma_z", "robust_z", "activation_shift", "train_val", "val_spike",
                "lr_jump", "lr_loss_corr", "lr_level", "page_hinkley"):
        assert det in names
    assert cfg.detectors[0].inputs == ("*",)
    assert MonitorConfig.from_dict(cfg.to_dict()) == cfg
    assert MonitorConfig.from_dict(json.loads(cfg.to_json())) == cfg
    for d in cfg.detectors:
        make_detector(d.detector, d.params, n_inputs=len(d.inputs))


def test_presets_list():
    assert {"default", "llm_pretrain", "finetune", "small"} <= set(list_presets())
    assert load_config(None).preset == "default"


def test_preset_override_merges():
    cfg = MonitorConfig.from_dict({
        "preset": "default",
        "monitor": {"log_only": True, "aliases": {"my_loss": "loss"}},
        "detectors": [{"name": "loss_spike", "params": {"threshold": 9.0}},
                      {"name": "extra", "detector": "cusum" if "cusum" in REGISTRY else "ewma_z",
                       "inputs": ["param_norm"], "kind": "level_shift"}],
        "policy": {"cooldown": 7},
    })
    spike = next(d for d in cfg.detectors if d.name == "loss_spike")
    base = next(d for d in load_config("default").detectors if d.name == "loss_spike")
    assert spike.params["threshold"] == 9.0
    assert spike.params["alpha"] == base.params["alpha"]  # merged, not replaced
    assert cfg.detectors[-1].name == "extra"
    assert cfg.monitor.log_only and cfg.monitor.aliases == {"my_loss": "loss"}
    assert cfg.policy["cooldown"] == 7


def test_toml_and_json_files(tmp_path):
    p = tmp_path / "m.toml"
    p.write_text('preset = "small"\n[monitor]\nstrict = true\n\n[[detectors]]\nname = "x"\n'
                 'detector = "ewma_z"\ninputs = ["loss"]\nparams = { alpha = 0.1 }\n')
    cfg = load_config(str(p))
    assert cfg.monitor.strict and cfg.detectors[-1].params == {"alpha": 0.1}
    j = tmp_path / "m.json"
    j.write_text(json.dumps(cfg.to_dict()))
    assert load_config(j) == cfg


@pytest.mark.parametrize("bad, match", [
    ({"detector": []}, r"config: unknown key 'detector' \(did you mean 'detectors'\?\)"),
    ({"monitor": {"log_onyl": True}}, r"monitor: unknown key 'log_onyl' \(did you mean 'log_only'"),
    ({"monitor": {"log_only": "yes"}}, r"monitor.log_only: must be true or false"),
    ({"monitor": {"aliases": {"a/*": "b"}}}, r"monitor.aliases.'a/\*'"),
    ({"detectors": [{**LOSS, "input": ["x"]}]}, r"detectors\[0\]: unknown key 'input'"),
    ({"detectors": [{"name": "a", "detector": "ewma_z"}]},
     r"detectors\[0\]: missing required key 'inputs'"),
    ({"detectors": [LOSS, {**LOSS, "detector": "ewmaz"}]},
     r"detectors\[1\].detector: unknown detector 'ewmaz'"),
    ({"detectors": [LOSS, LOSS, {**LOSS, "name": "z", "params": {"alpha": 2.0}}]},
     r"detectors\[1\].name: duplicate"),
    ({"detectors": [LOSS, {**LOSS, "name": "b"}, {**LOSS, "name": "c", "params": {"alpha": 2.0}}]},
     r"detectors\[2\].params.alpha: The 'alpha' parameter of EWMAZScore"),
    ({"detectors": [{**LOSS, "params": {"alpah": 0.1}}]},
     r"detectors\[0\].params: unknown parameter 'alpah' for ewma_z \(did you mean 'alpha'\?\)"),
    ({"detectors": [{**LOSS, "params": {"n_series": 3}}]}, r"detectors\[0\].params.n_series"),
    ({"detectors": [{**LOSS, "kind": "spike"}]},
     r"detectors\[0\].kind: unknown alarm kind 'spike'"),
    ({"detectors": [{**LOSS, "severity": "high"}]}, r"detectors\[0\].severity"),
    ({"detectors": [{**LOSS, "critical_factor": 0.5}]}, r"detectors\[0\].critical_factor"),
    ({"detectors": [{**LOSS, "inputs": ["loss", "val_loss"]}]},
     r"detectors\[0\].inputs: ewma_z takes 1"),
    ({"detectors": [{**LOSS, "detector": "train_val", "inputs": ["loss", "x/*"]}]},
     r"detectors\[0\].inputs: patterns of a multi-input"),
    ({"detectors": [{**LOSS, "inputs": []}]}, r"detectors\[0\].inputs: must be a non-empty list"),
    ({"detectors": [{**LOSS, "params": {"alpha": object()}}]},
     r"detectors\[0\].params.alpha: must be plain"),
    ({"detectors": {"a": 1}}, r"detectors: must be a list"),
    ({"preset": "llm"}, r"preset: unknown preset 'llm' \(did you mean 'llm_pretrain'\?\)"),
    ({"policy": 3}, r"policy: must be a table"),
    ({"preset": "default", "detectors": [{"name": "loss_spike", "params": {"alpha": -1}}]},
     r"detectors\[0\].params.alpha"),
])
def test_config_errors_name_the_key(bad, match):
    with pytest.raises(ConfigError, match=match):
        MonitorConfig.from_dict(bad)


def test_policy_errors_are_prefixed():
    with pytest.raises(ConfigError, match=r"^policy"):
        MonitorConfig.from_dict({"policy": {"no_such_policy_key": 1}})


def test_bad_sources(tmp_path):
    with pytest.raises(ConfigError, match="invalid TOML"):
        p = tmp_path / "x.toml"
        p.write_text("[[detectors]\n")
        load_config(str(p))
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="expected a preset name"):
        load_config(42)  # type: ignore[arg-type]


def test_presets_extend_the_default_preset_only():
    for name in list_presets():
        base = load_preset(name).get("preset")
        assert base in (None, "default")
        if base:  # overrides only: every detector entry names a default binding
            names = {e["name"] for e in load_preset("default")["detectors"]}
            assert {e["name"] for e in load_preset(name).get("detectors", [])} <= names
