"""Bundled monitor presets (TOML files next to this module).

* ``default`` -- used when no config is given: every detector family, moderate thresholds.
* ``llm_pretrain`` -- long LLM pre-training runs: long memories, loss spikes and grad explosions
  are the main failure modes, rollback is worth its cost.
* ``finetune`` -- short fine-tuning runs: shorter warm-ups, lower thresholds on val divergence.
* ``small`` -- vision / small models: noisy per-batch loss, so higher spike thresholds.

Examples
--------
>>> list_presets()
['default', 'finetune', 'llm_pretrain', 'small']
>>> load_preset("default")["detectors"][0]["detector"]
'nonfinite'
"""

from __future__ import annotations

import sys
from importlib import resources
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["list_presets", "load_preset"]


def list_presets() -> list[str]:
    """Names of the bundled presets, sorted."""
    root = resources.files(__name__)
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


def load_preset(name: str) -> dict[str, Any]:
    """The parsed (unvalidated) preset document; raises ``ConfigError`` for unknown names."""
    from stability.config.registry import ConfigError, did_you_mean

    known = list_presets()
    if name not in known:
        raise ConfigError(
            f"preset: unknown preset {name!r}{did_you_mean(name, known)}; known: {', '.join(known)}"
        )
    text = resources.files(__name__).joinpath(f"{name}.toml").read_text(encoding="utf-8")
    data = tomllib.loads(text)
    return data
