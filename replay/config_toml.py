"""A monitor config written as TOML (or JSON): the output of ``stability tune``.

:func:`to_toml` writes the ``docs/CONTRACTS.md`` schema (``[monitor]``, ``[[detectors]]``,
``[policy]`` tables; NaN and infinities as TOML's ``nan`` / ``inf``); :func:`write_config`
picks TOML or JSON by the file suffix. :mod:`replay.tuning` re-exports both.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["to_toml", "write_config"]

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if _BARE.match(k) else json.dumps(k)


def _val(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        f = float(v)
        if math.isnan(f):
            return "nan"
        if math.isinf(f):
            return "inf" if f > 0 else "-inf"
        return repr(f)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, Mapping):
        if not v:
            return "{}"
        return "{ " + ", ".join(f"{_key(str(k))} = {_val(x)}" for k, x in v.items()) + " }"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_val(x) for x in v) + "]"
    if v is None:
        raise ValueError("TOML has no null; drop the key instead.")
    raise ValueError(f"cannot write {v!r} as TOML.")


def _table_lines(prefix: str, d: Mapping[str, Any]) -> list[str]:
    scalars = [(k, v) for k, v in d.items() if not isinstance(v, Mapping) and v is not None]
    subs = [(k, v) for k, v in d.items() if isinstance(v, Mapping)]
    lines = [f"[{prefix}]"] if prefix else []
    lines += [f"{_key(str(k))} = {_val(v)}" for k, v in scalars]
    for k, v in subs:
        lines.append("")
        lines += _table_lines(f"{prefix}.{_key(str(k))}" if prefix else _key(str(k)), v)
    return lines


def to_toml(cfg: Mapping[str, Any], header: str = "") -> str:
    """Write a monitor config (``docs/CONTRACTS.md`` schema) as TOML.

    >>> print(to_toml({"monitor": {"aliases": {"train/loss": "loss"}, "log_only": False},
    ...                "detectors": [{"name": "l", "detector": "ewma_z", "inputs": ["loss"],
    ...                               "params": {"threshold": 6.0}}]}))
    [monitor]
    aliases = { "train/loss" = "loss" }
    log_only = false
    <BLANKLINE>
    [[detectors]]
    name = "l"
    detector = "ewma_z"
    inputs = ["loss"]
    params = { threshold = 6.0 }
    """
    lines = [f"# {h}" for h in header.splitlines()] if header else []
    if "preset" in cfg:
        lines.append(f"preset = {_val(cfg['preset'])}")
    if "monitor" in cfg:
        m = dict(cfg["monitor"])
        lines.append("[monitor]")
        lines += [f"{_key(k)} = {_val(v)}" for k, v in m.items() if v is not None]
    for d in cfg.get("detectors", []):
        lines += ["", "[[detectors]]"]
        lines += [f"{_key(k)} = {_val(v)}" for k, v in d.items() if v is not None]
    if cfg.get("policy"):
        lines.append("")
        lines += _table_lines("policy", cfg["policy"])
    return "\n".join(lines)


def write_config(path: str | os.PathLike[str], cfg: Mapping[str, Any], header: str = "") -> None:
    """Write ``cfg`` as TOML (``.toml``) or JSON (``.json``)."""
    p = Path(path)
    if p.suffix == ".json":
        p.write_text(json.dumps(cfg, indent=2) + "\n")
    else:
        p.write_text(to_toml(cfg, header) + "\n")
