"""Monitor configuration: dataclasses, loading (TOML / JSON / dict / preset) and validation.

The schema (``docs/CONTRACTS.md``)::

    preset = "llm_pretrain"          # optional base preset; the rest overrides it
    [monitor]
    aliases = { "train/loss" = "loss" }   # merged over stability.monitor.binding.DEFAULT_ALIASES
    log_only = false                 # decide and record, but Control stays neutral
    strict = false                   # raise on bad input / handler errors instead of recording
    max_series = 4096                # distinct series per detector bank; new names past it skipped
    handler_budget_s = 1.0           # seconds per step for all on_alarm/on_intervention/sink calls
    own_prefixes = ["guard/"]        # more prefixes of the guard's own logs (never bound);
                                     # "stability/" always is one

    [[detectors]]                    # one binding = one detector bank
    name = "grad_spike_layers"       # unique; appears in Alarm.detector
    detector = "ewma_z"              # registry name (stability.config.registry)
    inputs = ["grad_norm/*"]         # one pattern per detector input
    kind = "grad_explosion"          # optional; default from the detector / bound signals
    severity = "warning"             # base severity ('critical' above critical_factor*threshold)
    critical_factor = 3.0
    params = { alpha = 0.02, threshold = 6.0 }

    [policy]                         # passed to stability.policy.policy.Policy as a dict

    [alerts]                         # alert sinks (stability.outputs.alerts.sinks_from_config)
    log = true                       # Python logging, logger "stability.alerts" (default
    on)
    file = "alerts.log"              # optional: one line per alert
    min_severity = "warning"         # for the log and file sinks
    [alerts.webhook]                 # optional: Slack-compatible incoming webhook
    url_env = "STABILITY_WEBHOOK_URL"   # or url = "https://hooks.slack.com/..."
    format = "slack"                 # "slack" (mrkdwn blocks) or "plain" ({"text": ...})
    max_per_window = 5               # rate limit: warnings per window, the rest coalesced
    window_s = 60.0
    escalate = true                  # critical alerts bypass the rate limit, jump the queue
    mention = "<!here>"              # escalation: prefixed to critical alerts
    min_severity = "warning"
    timeout = 5.0

    [event_log]                      # durable JSONL log of alarms and interventions
    path = "runs/stability-events.jsonl"   # none (default): no event log
    fsync = "critical"               # "critical" | "always" | "never"
    goodput_every = 1000             # goodput ledger record every N steps and at close (0: close)

Overriding a preset: ``[monitor]`` keys replace the preset's (``aliases`` are merged); a
``[[detectors]]`` entry whose ``name`` exists in the preset updates that entry (its ``params``
are merged key by key), other entries are appended; ``[policy]``, ``[alerts]`` and
``[event_log]`` are merged recursively.

Configs are data: TOML is read with :mod:`tomllib` (``tomli`` on 3.10), JSON with :mod:`json`;
nothing is evaluated or unpickled.  Every error names the offending key path.

Examples
--------
>>> cfg = MonitorConfig.from_dict({"detectors": [
...     {"name": "loss", "detector": "ewma_z", "inputs": ["loss"], "params": {"alpha": 0.05}}]})
>>> cfg.detectors[0].kind, cfg.detectors[0].severity
('loss_spike', 'warning')
>>> MonitorConfig.from_dict(cfg.to_dict()) == cfg
True
>>> MonitorConfig.from_dict({"detector": []})
Traceback (most recent call last):
...
stability.config.registry.ConfigError: config: unknown key 'detector' (did you mean ...
"""

from __future__ import annotations

import copy
import json
import math
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from stability.config import presets as _presets
from stability.config.registry import (
    ConfigError,
    DetectorUnavailableError,
    default_kind,
    detector_class,
    detector_target,
    did_you_mean,
    make_detector,
)
from stability.config.sections import (
    AlertsConfig,
    EventLogConfig,
    MonitorSettings,
    WebhookConfig,
    _check_keys,
    _plain,
    _str,
    _table,
)
from stability.types import ALARM_KINDS, SEVERITIES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "AlertsConfig",
    "ConfigError",
    "EventLogConfig",
    "WebhookConfig",
    "DetectorSpec",
    "MonitorSettings",
    "MonitorConfig",
    "ConfigSource",
    "load_config",
    "infer_kind",
]

_TOP_KEYS = ("preset", "monitor", "detectors", "policy", "alerts", "event_log")
_DETECTOR_KEYS = ("name", "detector", "inputs", "kind", "severity", "critical_factor", "params")


def infer_kind(inputs: tuple[str, ...] | list[str]) -> str:
    """Alarm kind for spike detectors whose registry entry has no fixed kind.

    >>> infer_kind(["grad_norm/*"]), infer_kind(["loss"]), infer_kind(["act_std/*"])
    ('grad_explosion', 'loss_spike', 'activation_shift')
    """
    first = inputs[0] if inputs else ""
    if first.startswith(("grad", "update_ratio", "param_norm")):
        return "grad_explosion"
    if first.startswith(("act", "attn")):
        return "activation_shift"
    if first.startswith("val"):
        return "train_val_divergence"
    if first.startswith("lr"):
        return "lr_loss_anomaly"
    return "loss_spike"


MAX_DETECTOR_SIZE = 1_000_000
_SIZE_PARAMS = ("window", "n_bins", "n_points", "n_features")


def _check_sizes(params: Mapping[str, Any], where: str) -> None:
    """Reject size parameters too large to allocate (a ``window`` of 1e9 is 15 GB per series)."""
    for key in _SIZE_PARAMS:
        v = params.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > MAX_DETECTOR_SIZE:
            raise ConfigError(
                f"{where}.{key}: must be at most {MAX_DETECTOR_SIZE:,} (detector state grows "
                f"with it, per series); got {v!r}."
            )


@dataclass(frozen=True)
class DetectorSpec:
    """One ``[[detectors]]`` entry: a detector bank bound to signal patterns."""

    name: str
    detector: str
    inputs: tuple[str, ...]
    kind: str
    severity: str = "warning"
    critical_factor: float = 3.0
    params: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(
        cls, d: Mapping[str, Any], where: str = "detectors[0]", check_params: bool = True
    ) -> DetectorSpec:
        """Validate one entry; ``check_params`` instantiates the detector to check ``params``."""
        d = _table(d, where)
        _check_keys(d, _DETECTOR_KEYS, where)
        for req in ("name", "detector", "inputs"):
            if req not in d:
                raise ConfigError(f"{where}: missing required key {req!r}.")
        name = _str(d["name"], f"{where}.name")
        det = _str(d["detector"], f"{where}.detector")
        try:
            detector_target(det)
        except ConfigError as exc:
            raise type(exc)(f"{where}.detector: {exc}") from None
        raw_inputs = d["inputs"]
        if isinstance(raw_inputs, str):
            raw_inputs = [raw_inputs]
        if not isinstance(raw_inputs, (list, tuple)) or not raw_inputs:
            raise ConfigError(
                f"{where}.inputs: must be a non-empty list of patterns; got {raw_inputs!r}."
            )
        inputs = tuple(_str(p, f"{where}.inputs[{i}]") for i, p in enumerate(raw_inputs))
        wild = [any(c in p for c in "*?[") for p in inputs]
        if len(inputs) > 1 and any(wild) and not all(wild):
            raise ConfigError(
                f"{where}.inputs: patterns of a multi-input detector must all contain a wildcard "
                f"or none (series keys must match); got {list(inputs)}."
            )
        kind0 = default_kind(det) or infer_kind(inputs)
        kind = _str(d.get("kind", kind0), f"{where}.kind")
        if kind not in ALARM_KINDS:
            raise ConfigError(
                f"{where}.kind: unknown alarm kind {kind!r}{did_you_mean(kind, ALARM_KINDS)}; "
                f"known: {', '.join(ALARM_KINDS)}"
            )
        severity = _str(d.get("severity", "warning"), f"{where}.severity")
        if severity not in SEVERITIES:
            raise ConfigError(
                f"{where}.severity: must be one of {', '.join(SEVERITIES)}; got {severity!r}."
            )
        cf = d.get("critical_factor", 3.0)
        if isinstance(cf, bool) or not isinstance(cf, (int, float)) or math.isnan(cf) or cf < 1.0:
            raise ConfigError(f"{where}.critical_factor: must be a number >= 1; got {cf!r}.")
        params = _plain(_table(d.get("params", {}), f"{where}.params"), f"{where}.params")
        _check_sizes(params, f"{where}.params")
        spec = cls(name, det, inputs, kind, severity, float(cf), params)
        if check_params:
            spec.validate_params(where)
        return spec

    def validate_params(self, where: str) -> None:
        """Instantiate the detector once (``n_series=1``) to validate ``params``.

        Skipped silently while the detector's module is not importable; building a
        :class:`~stability.monitor.monitor.Monitor` then raises a clear error.
        """
        try:
            detector_class(self.detector)
        except DetectorUnavailableError:
            return
        make_detector(
            self.detector, self.params, n_series=1, n_inputs=len(self.inputs), where=where
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "detector": self.detector,
            "inputs": list(self.inputs),
            "kind": self.kind,
            "severity": self.severity,
            "critical_factor": self.critical_factor,
            "params": copy.deepcopy(self.params),
        }


def _merge_dicts(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge_dicts(dict(out[k]), v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _merge_detector_lists(
    base: list[dict[str, Any]], over: list[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Entries of ``over`` update the ``base`` entry of the same name (params merged key by key)
    or are appended."""
    out = [dict(b) for b in base]
    for e in over:
        for j, b in enumerate(out):
            if b.get("name") == e.get("name"):
                merged = {**b, **e}
                merged["params"] = _merge_dicts(
                    dict(b.get("params", {})), dict(e.get("params", {}))
                )
                out[j] = merged
                break
        else:
            out.append(dict(e))
    return out


def _resolve_presets(d: Mapping[str, Any], depth: int = 0) -> dict[str, Any]:
    """Flatten a document whose ``preset`` key names a base preset (presets may extend presets).

    Returns ``{"monitor": ..., "policy": ..., "detectors": [...]}`` with the base first.
    """
    if depth > 8:
        raise ConfigError("preset: presets extend each other in a cycle.")
    own: dict[str, Any] = {
        "monitor": dict(_table(d.get("monitor", {}), "monitor")),
        "policy": dict(_table(d.get("policy", {}), "policy")),
        "alerts": dict(_table(d.get("alerts", {}), "alerts")),
        "event_log": dict(_table(d.get("event_log", {}), "event_log")),
        "detectors": [dict(e) for e in d.get("detectors", [])],
    }
    name = d.get("preset")
    if name is None:
        return own
    base = _resolve_presets(_presets.load_preset(str(name)), depth + 1)
    return {
        "monitor": _merge_dicts(base["monitor"], own["monitor"]),
        "policy": _merge_dicts(base["policy"], own["policy"]),
        "alerts": _merge_dicts(base["alerts"], own["alerts"]),
        "event_log": _merge_dicts(base["event_log"], own["event_log"]),
        "detectors": _merge_detector_lists(base["detectors"], own["detectors"]),
    }


ConfigSource = Union["MonitorConfig", Mapping[str, Any], str, Path, None]


@dataclass(frozen=True)
class MonitorConfig:
    """A complete, validated monitor configuration (presets already resolved).

    ``preset`` records the base preset's name for information only; :meth:`to_dict` writes the
    fully resolved configuration without it, and it is ignored by ``==``.
    """

    monitor: MonitorSettings = field(default_factory=MonitorSettings)
    detectors: tuple[DetectorSpec, ...] = ()
    policy: dict[str, Any] = field(default_factory=dict)
    preset: str | None = field(default=None, compare=False)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    event_log: EventLogConfig = field(default_factory=EventLogConfig)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, check_params: bool = True) -> MonitorConfig:
        """Build from plain data (the parsed TOML/JSON document)."""
        try:
            return cls._from_dict(d, check_params)
        except RecursionError:
            raise ConfigError("config: nested too deeply.") from None

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any], check_params: bool) -> MonitorConfig:
        d = _table(d, "config")
        _check_keys(d, _TOP_KEYS, "config")
        preset = d.get("preset")
        raw_dets = d.get("detectors", [])
        if not isinstance(raw_dets, (list, tuple)):
            raise ConfigError(f"detectors: must be a list of tables; got {raw_dets!r}.")
        for i, e in enumerate(raw_dets):
            e = _table(e, f"detectors[{i}]")
            _check_keys(e, _DETECTOR_KEYS, f"detectors[{i}]")
            if "name" not in e:
                raise ConfigError(f"detectors[{i}]: missing required key 'name'.")
            _str(e["name"], f"detectors[{i}].name")
        if preset is not None:
            _str(preset, "preset")
        flat = _resolve_presets(d)
        mon = _table(flat.get("monitor", {}), "monitor")
        pol = _plain(_table(flat.get("policy", {}), "policy"), "policy")
        if "mode" in pol:  # the old second log-only switch: one switch, [monitor].log_only
            mode = pol.pop("mode")
            if mode not in ("act", "log_only"):
                raise ConfigError(f"policy.mode: must be one of act, log_only; got {mode!r}.")
            warnings.warn("[policy].mode is deprecated: use [monitor].log_only = true",
                          DeprecationWarning, stacklevel=3)
            mon = {**mon, "log_only": bool(mon.get("log_only", False)) or mode == "log_only"}
        user_index = {e["name"]: i for i, e in enumerate(raw_dets)}
        entries = [
            (
                f"detectors[{user_index[e['name']]}]"
                if e["name"] in user_index
                else f"preset {preset!r} detectors[{j}]",
                e,
            )
            for j, e in enumerate(flat["detectors"])
        ]
        specs: list[DetectorSpec] = []
        seen: set[str] = set()
        for where, e in entries:
            spec = DetectorSpec.from_dict(e, where, check_params=check_params)
            if spec.name in seen:
                raise ConfigError(f"{where}.name: duplicate binding name {spec.name!r}.")
            seen.add(spec.name)
            specs.append(spec)
        alerts = AlertsConfig.from_dict(_plain(flat.get("alerts", {}), "alerts"))
        event_log = EventLogConfig.from_dict(_plain(flat.get("event_log", {}), "event_log"))
        cfg = cls(MonitorSettings.from_dict(mon), tuple(specs), pol, preset, alerts, event_log)
        if check_params:
            cfg.validate_policy()
        return cfg

    def validate_policy(self) -> None:
        """Let :class:`stability.policy.policy.Policy` validate ``[policy]``."""
        from stability.policy.policy import Policy  # policy imports config

        try:
            Policy(copy.deepcopy(self.policy))
        except (ValueError, TypeError, KeyError) as exc:
            msg = str(exc)
            raise ConfigError(msg if msg.startswith("policy") else f"policy: {msg}") from None

    @classmethod
    def from_toml(cls, source: str | Path) -> MonitorConfig:
        """From a ``.toml`` path, or TOML text (when ``source`` is a str containing a newline)."""
        text, where = _read(source)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{where}: invalid TOML: {exc}") from None
        except RecursionError:
            raise ConfigError(f"{where}: invalid TOML: nested too deeply.") from None
        return cls._from_document(data, where)

    @classmethod
    def from_json(cls, source: str | Path) -> MonitorConfig:
        """From a ``.json`` path, or JSON text."""
        text, where = _read(source)
        try:
            data = json.loads(text)
        except ValueError as exc:  # JSONDecodeError, or an integer of more than 4300 digits
            raise ConfigError(f"{where}: invalid JSON: {exc}") from None
        except RecursionError:
            raise ConfigError(f"{where}: invalid JSON: nested too deeply.") from None
        return cls._from_document(data, where)

    @classmethod
    def _from_document(cls, data: Any, where: str) -> MonitorConfig:
        """:meth:`from_dict` on a parsed file; errors name the file (``where``) first."""
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            if where == "config":  # TOML/JSON text, not a file
                raise
            raise type(exc)(f"{where}: {exc}") from None

    @classmethod
    def from_preset(cls, name: str) -> MonitorConfig:
        """A bundled preset (see :func:`stability.config.presets.list_presets`)."""
        return cls.from_dict({"preset": name})

    @classmethod
    def load(cls, source: ConfigSource = None) -> MonitorConfig:
        """Preset name | ``.toml`` / ``.json`` path | dict | MonitorConfig | None (``default``)."""
        return load_config(source)

    # ------------------------------------------------------------------ output
    def to_dict(self) -> dict[str, Any]:
        """Fully resolved plain data; ``MonitorConfig.from_dict(cfg.to_dict()) == cfg``.

        ``alerts`` / ``event_log`` appear only when they differ from the defaults.
        """
        out: dict[str, Any] = {
            "monitor": self.monitor.to_dict(),
            "detectors": [s.to_dict() for s in self.detectors],
            "policy": copy.deepcopy(self.policy),
        }
        if self.alerts != AlertsConfig():
            out["alerts"] = self.alerts.to_dict()
        if self.event_log != EventLogConfig():
            out["event_log"] = self.event_log.to_dict()
        return out

    def to_json(self, **kwargs: Any) -> str:
        """JSON text of :meth:`to_dict`."""
        return json.dumps(self.to_dict(), **kwargs)


def _read(source: str | Path) -> tuple[str, str]:
    if isinstance(source, Path) or "\n" not in source:
        path = Path(source)
        try:
            return path.read_text(encoding="utf-8"), str(path)
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read config: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: cannot read config: not UTF-8 text ({exc})") from None
    return source, "config"


def load_config(source: ConfigSource = None) -> MonitorConfig:
    """Resolve any accepted config source into a :class:`MonitorConfig`.

    >>> load_config().preset
    'default'
    >>> load_config("no_such_preset")
    Traceback (most recent call last):
    ...
    stability.config.registry.ConfigError: preset: unknown preset 'no_such_preset'; ...
    """
    if source is None:
        return MonitorConfig.from_preset("default")
    if isinstance(source, MonitorConfig):
        return source
    if isinstance(source, Mapping):
        return MonitorConfig.from_dict(source)
    if isinstance(source, (str, Path)):
        s = str(source)
        if s.endswith(".toml"):
            return MonitorConfig.from_toml(Path(s))
        if s.endswith(".json"):
            return MonitorConfig.from_json(Path(s))
        if isinstance(source, str) and "/" not in s and "\n" not in s:
            return MonitorConfig.from_preset(s)
        raise ConfigError(f"config: {s!r} is neither a preset name nor a .toml/.json path.")
    raise ConfigError(
        "config: expected a preset name, a path, a dict or a MonitorConfig; "
        f"got {type(source).__name__}."
    )
