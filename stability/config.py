"""Monitor configuration: dataclasses, loading (TOML / JSON / dict / preset) and validation.

The schema (``docs/CONTRACTS.md``)::

    preset = "llm_pretrain"          # optional base preset; the rest overrides it
    [monitor]
    aliases = { "train/loss" = "loss" }   # merged over stability.binding.DEFAULT_ALIASES
    log_only = false                 # decide and record, but Control stays neutral
    strict = false                   # raise on bad input / handler errors instead of recording
    max_series = 4096                # distinct series per detector bank; new names past it skipped
    handler_budget_s = 1.0           # seconds per step for all on_alarm/on_intervention/sink calls

    [[detectors]]                    # one binding = one detector bank
    name = "grad_spike_layers"       # unique; appears in Alarm.detector
    detector = "ewma_z"              # registry name (stability.registry)
    inputs = ["grad_norm/*"]         # one pattern per detector input
    kind = "grad_explosion"          # optional; default from the detector / bound signals
    severity = "warning"             # base severity ('critical' above critical_factor*threshold)
    critical_factor = 3.0
    params = { alpha = 0.02, threshold = 6.0 }

    [policy]                         # passed to stability.policy.Policy as a dict

    [alerts]                         # alert sinks (stability.alerts.sinks_from_config)
    log = true                       # Python logging, logger "stability.alerts" (default on)
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
stability.registry.ConfigError: config: unknown key 'detector' (did you mean 'detectors'?); ...
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

from . import presets as _presets
from .registry import (
    ConfigError,
    DetectorUnavailableError,
    default_kind,
    detector_class,
    detector_target,
    did_you_mean,
    make_detector,
)
from .types import ALARM_KINDS, SEVERITIES

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
_ALERT_KEYS = ("log", "file", "min_severity", "webhook")
_WEBHOOK_KEYS = ("url", "url_env", "format", "max_per_window", "window_s", "escalate", "mention",
                 "min_severity", "timeout", "max_queue")
_EVENT_LOG_KEYS = ("path", "fsync", "goodput_every")
WEBHOOK_FORMATS = ("slack", "plain")
FSYNC_MODES = ("critical", "always", "never")
_MONITOR_KEYS = ("aliases", "log_only", "strict", "max_series", "handler_budget_s")
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


def _check_keys(d: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for k in d:
        if k not in allowed:
            raise ConfigError(
                f"{where}: unknown key {k!r}{did_you_mean(k, allowed)}; "
                f"allowed: {', '.join(allowed)}"
            )


def _table(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, Mapping):
        raise ConfigError(f"{where}: must be a table/dict; got {type(v).__name__} {v!r}.")
    for k in v:
        if not isinstance(k, str):
            raise ConfigError(f"{where}: keys must be strings; got {k!r}.")
    return dict(v)


def _bool(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{where}: must be true or false; got {v!r}.")
    return v


def _str(v: Any, where: str) -> str:
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{where}: must be a non-empty string; got {v!r}.")
    return v


def _plain(v: Any, where: str) -> Any:
    """Check that ``v`` is plain config data (no objects) and deep-copy it."""
    if isinstance(v, Mapping):
        return {_str(k, where): _plain(x, f"{where}.{k}") for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise ConfigError(
        f"{where}: must be plain data (number, string, bool, list, table); got {v!r}."
    )


@dataclass(frozen=True)
class MonitorSettings:
    """The ``[monitor]`` table."""

    aliases: dict[str, str] = field(default_factory=dict)
    log_only: bool = False
    strict: bool = False
    #: distinct series one detector bank may hold; names past the cap are skipped and recorded
    max_series: int = 4096
    #: seconds per step shared by every handler and alert-sink call (see stability.handlers)
    handler_budget_s: float = 1.0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "monitor") -> MonitorSettings:
        d = _table(d, where)
        _check_keys(d, _MONITOR_KEYS, where)
        aliases = _table(d.get("aliases", {}), f"{where}.aliases")
        for k, v in aliases.items():
            _str(k, f"{where}.aliases")
            _str(v, f"{where}.aliases.{k!r}")
            if k.endswith("/*") != v.endswith("/*"):
                raise ConfigError(
                    f"{where}.aliases.{k!r}: a prefix alias must map 'a/*' to 'b/*'; got {v!r}."
                )
        return cls(
            aliases=aliases,
            log_only=_bool(d.get("log_only", False), f"{where}.log_only"),
            strict=_bool(d.get("strict", False), f"{where}.strict"),
            max_series=_pos_int(d.get("max_series", 4096), f"{where}.max_series"),
            handler_budget_s=_number(d.get("handler_budget_s", 1.0), f"{where}.handler_budget_s",
                                     0.0, True),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"aliases": dict(self.aliases), "log_only": self.log_only, "strict": self.strict,
                "max_series": self.max_series, "handler_budget_s": self.handler_budget_s}


def _number(v: Any, where: str, low: float, low_open: bool = False) -> float:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or v < low or (low_open and v == low):
        rel = ">" if low_open else ">="
        raise ConfigError(f"{where}: must be a finite number {rel} {low}; got {v!r}.")
    return float(v)


def _severity(v: Any, where: str) -> str:
    if v not in SEVERITIES:
        raise ConfigError(f"{where}: must be one of {', '.join(SEVERITIES)}; got {v!r}.")
    return str(v)


def _pos_int(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{where}: must be an int >= 1; got {v!r}.")
    return int(v)


@dataclass(frozen=True)
class WebhookConfig:
    """The ``[alerts.webhook]`` table (see :class:`stability.alerts.WebhookSink`)."""

    url: str | None = None
    url_env: str | None = None
    format: str = "slack"
    max_per_window: int = 5
    window_s: float = 60.0
    escalate: bool = True
    mention: str = ""
    min_severity: str = "warning"
    timeout: float = 5.0
    max_queue: int = 100

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "alerts.webhook") -> WebhookConfig:
        d = _table(d, where)
        _check_keys(d, _WEBHOOK_KEYS, where)
        url = d.get("url")
        url_env = d.get("url_env")
        if url is None and url_env is None:
            raise ConfigError(f"{where}: needs 'url' or 'url_env' (the name of an environment "
                              "variable holding the URL, which keeps secrets out of the file).")
        if url is not None and not (isinstance(url, str)
                                    and url.startswith(("http://", "https://"))):
            raise ConfigError(f"{where}.url: must be an http(s) URL; got {url!r}.")
        if url_env is not None:
            _str(url_env, f"{where}.url_env")
        fmt = d.get("format", "slack")
        if fmt not in WEBHOOK_FORMATS:
            raise ConfigError(f"{where}.format: must be one of {', '.join(WEBHOOK_FORMATS)}; "
                              f"got {fmt!r}.")
        mention = d.get("mention", "")
        if not isinstance(mention, str):
            raise ConfigError(f"{where}.mention: must be a string; got {mention!r}.")
        return cls(url=url, url_env=url_env, format=str(fmt),
                   max_per_window=_pos_int(d.get("max_per_window", 5), f"{where}.max_per_window"),
                   window_s=_number(d.get("window_s", 60.0), f"{where}.window_s", 0.0, True),
                   escalate=_bool(d.get("escalate", True), f"{where}.escalate"),
                   mention=mention,
                   min_severity=_severity(d.get("min_severity", "warning"),
                                          f"{where}.min_severity"),
                   timeout=_number(d.get("timeout", 5.0), f"{where}.timeout", 0.0, True),
                   max_queue=_pos_int(d.get("max_queue", 100), f"{where}.max_queue"))

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in _WEBHOOK_KEYS}
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class AlertsConfig:
    """The ``[alerts]`` table: where :class:`~stability.types.Alert` interventions go.

    >>> AlertsConfig.from_dict({"file": "a.log", "webhook": {"url_env": "HOOK"}}).webhook.format
    'slack'
    >>> AlertsConfig().log  # the logging sink is on by default
    True
    """

    log: bool = True
    file: str | None = None
    min_severity: str = "warning"
    webhook: WebhookConfig | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "alerts") -> AlertsConfig:
        d = _table(d, where)
        _check_keys(d, _ALERT_KEYS, where)
        file = d.get("file")
        if file is not None:
            _str(file, f"{where}.file")
        hook = d.get("webhook")
        return cls(log=_bool(d.get("log", True), f"{where}.log"), file=file,
                   min_severity=_severity(d.get("min_severity", "warning"),
                                          f"{where}.min_severity"),
                   webhook=None if hook is None else WebhookConfig.from_dict(
                       hook, f"{where}.webhook"))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"log": self.log, "min_severity": self.min_severity}
        if self.file is not None:
            out["file"] = self.file
        if self.webhook is not None:
            out["webhook"] = self.webhook.to_dict()
        return out


@dataclass(frozen=True)
class EventLogConfig:
    """The ``[event_log]`` table (see :class:`stability.events.EventLog`); no path: no log.

    >>> EventLogConfig.from_dict({"path": "ev.jsonl", "fsync": "always"}).fsync
    'always'
    """

    path: str | None = None
    fsync: str = "critical"
    #: append the monitor's goodput ledger every this many steps (0: only at ``close()``)
    goodput_every: int = 1000

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "event_log") -> EventLogConfig:
        d = _table(d, where)
        _check_keys(d, _EVENT_LOG_KEYS, where)
        path = d.get("path")
        if path is not None:
            _str(path, f"{where}.path")
        fsync = d.get("fsync", "critical")
        if fsync not in FSYNC_MODES:
            raise ConfigError(f"{where}.fsync: must be one of {', '.join(FSYNC_MODES)}; "
                              f"got {fsync!r}.")
        every = d.get("goodput_every", 1000)
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ConfigError(f"{where}.goodput_every: must be an int >= 0 (0: never); "
                              f"got {every!r}.")
        return cls(path=path, fsync=str(fsync), goodput_every=int(every))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"fsync": self.fsync, "goodput_every": self.goodput_every}
        if self.path is not None:
            out["path"] = self.path
        return out


#: largest accepted value of a detector's size parameter (window, bins, points, features): state
#: memory grows linearly with it, per series, and is allocated when the config is validated
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
        :class:`~stability.monitor.Monitor` then raises a clear error.
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
        """Let :class:`stability.policy.Policy` validate ``[policy]``."""
        from .policy import Policy  # policy imports config

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
        """A bundled preset (see :func:`stability.presets.list_presets`)."""
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
    stability.registry.ConfigError: preset: unknown preset 'no_such_preset'; ...
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
