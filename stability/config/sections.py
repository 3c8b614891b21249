"""The plain sections of a monitor config: ``[monitor]``, ``[alerts]`` (+ webhook) and
``[event_log]``, and the small value checks every config section uses (errors name the key path).

The checks read values with the project's one validation dialect
(:mod:`detectors.validation`: what counts as an int or a finite float, and the rule text), so a
config error reads ``"policy.cooldown: must be an int in the range [0, inf); got -1."``.

:mod:`stability.config.config` assembles them with the detector bindings into a ``MonitorConfig``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from detectors.validation import as_bool, as_float, as_int, float_rule, int_rule, short_repr
from stability.config.registry import ConfigError, did_you_mean
from stability.types import SEVERITIES

__all__ = ["AlertsConfig", "EventLogConfig", "FSYNC_MODES", "MonitorSettings", "WEBHOOK_FORMATS",
           "WebhookConfig"]

_ALERT_KEYS = ("log", "file", "min_severity", "webhook")
_WEBHOOK_KEYS = ("url", "url_env", "format", "max_per_window", "window_s", "escalate", "mention",
                 "min_severity", "timeout", "max_queue")
_EVENT_LOG_KEYS = ("path", "fsync", "goodput_every")
WEBHOOK_FORMATS = ("slack", "plain")
FSYNC_MODES = ("critical", "always", "never")
_MONITOR_KEYS = ("aliases", "log_only", "strict", "max_series", "handler_budget_s",
                 "own_prefixes")


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
    b = as_bool(v)
    if b is None:
        raise ConfigError(f"{where}: must be true or false; got {short_repr(v)}.")
    return b


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


def _known(v: Any, allowed: tuple[str, ...], where: str) -> dict[str, Any]:
    """:func:`_table` and :func:`_check_keys` in one: a table of known keys only."""
    d = _table(v, where)
    _check_keys(d, allowed, where)
    return d


def _prefixes(v: Any, where: str) -> tuple[str, ...]:
    """A string or list of non-empty strings (metric-name prefixes), as a tuple."""
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, (list, tuple)):
        raise ConfigError(f"{where}: must be a string or a list of strings; got {v!r}.")
    return tuple(_str(x, f"{where}[{i}]") for i, x in enumerate(items))


def _choice(v: Any, where: str, choices: tuple[str, ...]) -> str:
    if v not in choices:
        raise ConfigError(f"{where}: must be one of {', '.join(choices)}; got {v!r}.")
    return str(v)


def _severity(v: Any, where: str) -> str:
    return _choice(v, where, SEVERITIES)


def _int(v: Any, where: str, low: int = 1, high: float = math.inf, note: str = "") -> int:
    """An int (``bool`` excluded) in ``[low, high]``; ``note`` is appended to the rule."""
    i = as_int(v, low, high)
    if i is None:
        raise ConfigError(f"{where}: must be {int_rule(low, high)}{note}; got {short_repr(v)}.")
    return i


def _number(v: Any, where: str, low: float, low_open: bool = False,
            high: float = math.inf) -> float:
    """A finite float ``>= low`` (``> low`` with ``low_open``) and ``<= high``."""
    x = as_float(v, low, high, low_open=low_open, finite=True)
    if x is None:
        rule = float_rule(low, high, low_open=low_open, finite=True)
        raise ConfigError(f"{where}: must be {rule}; got {short_repr(v)}.")
    return x


@dataclass(frozen=True)
class MonitorSettings:
    """The ``[monitor]`` table."""

    aliases: dict[str, str] = field(default_factory=dict)
    log_only: bool = False
    strict: bool = False
    #: distinct series one detector bank may hold; names past the cap are skipped and recorded
    max_series: int = 4096
    #: seconds per step shared by every handler and alert-sink call (see stability.outputs.handlers)
    handler_budget_s: float = 1.0
    #: metric-name prefixes of the guard's own logs besides ``stability/`` (never bound)
    own_prefixes: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "monitor") -> MonitorSettings:
        d = _known(d, _MONITOR_KEYS, where)
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
            max_series=_int(d.get("max_series", 4096), f"{where}.max_series"),
            handler_budget_s=_number(d.get("handler_budget_s", 1.0), f"{where}.handler_budget_s",
                                     0.0, True),
            own_prefixes=_prefixes(d.get("own_prefixes", ()), f"{where}.own_prefixes"),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"aliases": dict(self.aliases), "log_only": self.log_only, "strict": self.strict,
                "max_series": self.max_series, "handler_budget_s": self.handler_budget_s,
                "own_prefixes": list(self.own_prefixes)}


@dataclass(frozen=True)
class WebhookConfig:
    """The ``[alerts.webhook]`` table (see :class:`stability.outputs.alerts.WebhookSink`)."""

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
        d = _known(d, _WEBHOOK_KEYS, where)
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
        fmt = _choice(d.get("format", "slack"), f"{where}.format", WEBHOOK_FORMATS)
        mention = d.get("mention", "")
        if not isinstance(mention, str):
            raise ConfigError(f"{where}.mention: must be a string; got {mention!r}.")
        return cls(url=url, url_env=url_env, format=fmt,
                   max_per_window=_int(d.get("max_per_window", 5), f"{where}.max_per_window"),
                   window_s=_number(d.get("window_s", 60.0), f"{where}.window_s", 0.0, True),
                   escalate=_bool(d.get("escalate", True), f"{where}.escalate"),
                   mention=mention,
                   min_severity=_severity(d.get("min_severity", "warning"),
                                          f"{where}.min_severity"),
                   timeout=_number(d.get("timeout", 5.0), f"{where}.timeout", 0.0, True),
                   max_queue=_int(d.get("max_queue", 100), f"{where}.max_queue"))

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
        d = _known(d, _ALERT_KEYS, where)
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
    """The ``[event_log]`` table (see :class:`stability.outputs.events.EventLog`); no path: no log.

    >>> EventLogConfig.from_dict({"path": "ev.jsonl", "fsync": "always"}).fsync
    'always'
    """

    path: str | None = None
    fsync: str = "critical"
    #: append the monitor's goodput ledger every this many steps (0: only at ``close()``)
    goodput_every: int = 1000

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "event_log") -> EventLogConfig:
        d = _known(d, _EVENT_LOG_KEYS, where)
        path = d.get("path")
        if path is not None:
            _str(path, f"{where}.path")
        fsync = _choice(d.get("fsync", "critical"), f"{where}.fsync", FSYNC_MODES)
        every = _int(d.get("goodput_every", 1000), f"{where}.goodput_every", 0, note=" (0: never)")
        return cls(path=path, fsync=fsync, goodput_every=every)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"fsync": self.fsync, "goodput_every": self.goodput_every}
        if self.path is not None:
            out["path"] = self.path
        return out

