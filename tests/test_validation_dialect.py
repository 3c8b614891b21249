"""One validation dialect: every constructor argument the runtime checks is refused in one wording.

``The '<argument>' parameter of <Owner> must be <rule>. Got <value> instead.`` -- scikit-learn's
wording, produced by :mod:`detectors.validation` (``check_int`` / ``check_float`` /
``check_opt_float`` / ``check_bool`` / ``check_choice`` / ``param_error``).  Each case below
passes one bad value for one argument and checks that the message names the class (or
function) called, the argument, the rule and the bad value -- and that ``bool`` is never taken
for a number.  The detector classes are covered generically, from their signatures: each
``int`` / ``float`` argument gets ``True`` and an out-of-kind value, each ``bool`` ``1``, each
``str`` an unknown choice.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from detectors.validation import short_repr
from replay.recorder import RunRecorder
from stability.config.registry import REGISTRY, detector_class
from stability.monitor.calibrate import calibrate
from stability.outputs.events import EventLog, iter_events, read_events
from stability.outputs.handlers import HandlerRegistry
from stability.policy.lr_schedule import lr_factor_at
from stability.ranks.health import RankHealthLedger
from stability.ranks.outliers import RankOutlierDetector
from stability.ranks.ranks import RankMonitor
from stability.run.cadence import CadenceAdvisor, advise
from stability.run.watchdog import StallWatchdog

MESSAGE = re.compile(r"The '(?P<arg>\w+)' parameter of (?P<owner>[\w.]+) must be (?P<rule>.+?)\. "
                     r"Got (?P<value>.+) instead\.(?P<hint>  .+)?", re.S)

Factory = Callable[[Path, dict[str, Any]], Any]


def _monitor_calibrate(tmp: Path, kw: dict[str, Any]) -> Any:
    from stability.monitor.monitor import Monitor

    return calibrate(Monitor("default", alert_sinks=[]), **kw)


#: owner -> a call that passes ``kw`` on (good values for everything else)
FACTORIES: dict[str, Factory] = {
    "StallWatchdog": lambda tmp, kw: StallWatchdog(**{"autostart": False} | kw),
    "CadenceAdvisor": lambda tmp, kw: CadenceAdvisor(**kw),
    "advise": lambda tmp, kw: advise(**{"save_cost_s": 60.0, "mtbf_s": 3600.0} | kw),
    "HandlerRegistry": lambda tmp, kw: HandlerRegistry(**kw),
    "HandlerRegistry.on_alarm": lambda tmp, kw: HandlerRegistry().on_alarm(
        kw.get("fn", print)),
    "HandlerRegistry.on_intervention": lambda tmp, kw: HandlerRegistry().on_intervention(
        kw.get("fn", print)),
    "RankOutlierDetector": lambda tmp, kw: RankOutlierDetector(**kw),
    "RankHealthLedger": lambda tmp, kw: RankHealthLedger(**{"world_size": 4} | kw),
    "RankMonitor": lambda tmp, kw: RankMonitor(**{"hosts": ["a", "a", "b", "b"]} | kw),
    "EventLog": lambda tmp, kw: EventLog(tmp / "events.jsonl", **kw),
    "read_events": lambda tmp, kw: read_events(tmp / "events.jsonl", **kw),
    "iter_events": lambda tmp, kw: list(iter_events(tmp / "events.jsonl", **kw)),
    "lr_factor_at": lambda tmp, kw: lr_factor_at(**{"step": 12, "start": 10, "factor": 0.5,
                                                   "duration": 2, "restore_steps": 4} | kw),
    "calibrate": _monitor_calibrate,
    "RunRecorder": lambda tmp, kw: RunRecorder(tmp / "run", **kw),
}

NAN, INF = math.nan, math.inf
POS = "a float in the range (0.0, inf)"
POS_OR_NONE = "a float in the range (0.0, inf) or None"

#: (owner, argument, bad values, the rule the message states)
CASES: list[tuple[str, str, list[Any], str]] = [
    ("StallWatchdog", "k", [True, 0.5, NAN, INF], "a float in the range [1.0, inf)"),
    ("StallWatchdog", "min_timeout_s", [True, -1.0, "60"], "a float in the range [0.0, inf)"),
    ("StallWatchdog", "poll_max_s", [True, 0.0], "a float in the range [0.001, inf)"),
    ("StallWatchdog", "warmup_steps", [True, 0, 2.0], "an int in the range [1, inf)"),
    ("StallWatchdog", "window", [True, 1.5], "an int in the range [1, inf)"),
    ("StallWatchdog", "tokens_per_step", [True, 0.0, NAN], POS_OR_NONE),
    ("StallWatchdog", "samples_per_step", [True, -1.0], POS_OR_NONE),
    ("StallWatchdog", "flops_per_step", [True, INF], POS_OR_NONE),
    ("StallWatchdog", "peak_flops", [True, 0.0], POS_OR_NONE),
    ("StallWatchdog", "dump_stacks", [1, "yes"], "a bool"),
    ("StallWatchdog", "autostart", [0], "a bool"),
    ("CadenceAdvisor", "prior_mtbf_s", [True, 0.0, "3600"], POS),
    ("CadenceAdvisor", "restart_s", [True, -1.0, NAN], "a float in the range [0.0, inf)"),
    ("CadenceAdvisor", "step_time_s", [True, 0.0], POS_OR_NONE),
    ("CadenceAdvisor", "open_hazard", [True, INF], POS),
    ("advise", "save_cost_s", [True, 0.0], POS),
    ("advise", "mtbf_s", [True, INF], POS),
    ("advise", "restart_s", [True, -1.0], "a float in the range [0.0, inf)"),
    ("advise", "hazard", [True, 0.0], POS),
    ("advise", "step_time_s", [True, 0.0], POS_OR_NONE),
    ("HandlerRegistry", "strict", [1], "a bool"),
    ("HandlerRegistry", "timeout", [True, 0.0, NAN, INF], POS_OR_NONE),
    ("HandlerRegistry", "max_errors_kept", [True, -1], "an int in the range [0, inf)"),
    ("HandlerRegistry.on_alarm", "fn", [42], "a callable"),
    ("HandlerRegistry.on_intervention", "fn", ["x"], "a callable"),
    ("RankOutlierDetector", "threshold", [True, -1.0, NAN, INF],
     "a float in the range [0.0, inf)"),
    ("RankOutlierDetector", "min_ranks", [True, 2, 3.0], "an int in the range [3, inf)"),
    ("RankOutlierDetector", "alpha", [True, 1.0, -0.1], "a float in the range [0.0, 1.0)"),
    ("RankOutlierDetector", "max_fraction", [True, 1.5], "a float in the range [0.0, 1.0]"),
    ("RankOutlierDetector", "history", [True, -1], "an int in the range [0, inf)"),
    ("RankHealthLedger", "world_size", [True, 0], "an int in the range [1, inf)"),
    ("RankHealthLedger", "hosts", [["a"], "abcd"],
     "None or a sequence of 4 host names (one per rank)"),
    ("RankHealthLedger", "half_life", [True, 0.0], "a float in the range [1e-09, inf)"),
    ("RankHealthLedger", "suspect_at", [True, NAN], "a float in the range [1e-09, inf)"),
    ("RankHealthLedger", "keep_steps", [True, -1], "an int in the range [0, inf)"),
    ("RankMonitor", "hosts", [[], "abcd"], "a non-empty sequence of host names (one per rank)"),
    ("RankMonitor", "threshold", [True, -1.0], "a float in the range [0.0, inf)"),
    ("RankMonitor", "min_ranks", [True, 2], "an int in the range [3, inf)"),
    ("RankMonitor", "alpha", [True, 1.5], "a float in the range [0.0, 1.0)"),
    ("RankMonitor", "half_life", [True, -1.0], "a float in the range [1e-09, inf)"),
    ("RankMonitor", "suspect_at", [True, 0.0], "a float in the range [1e-09, inf)"),
    ("EventLog", "fsync", ["sometimes", None], "one of ['always', 'critical', 'never']"),
    ("EventLog", "strict", [1, "yes"], "a bool"),
    ("read_events", "errors", ["ignore"], "one of ['raise', 'skip']"),
    ("iter_events", "errors", ["ignore"], "one of ['raise', 'skip']"),
    ("lr_factor_at", "shape", ["zig"], "one of ['cosine', 'linear', 'step']"),
    ("calibrate", "data", [3, "run.parquet"],
     "a table (dict of arrays or pyarrow Table) or an iterable of tables"),
    ("RunRecorder", "part_steps", [True, 0, 10.0], "an int in the range [1, inf)"),
    ("RunRecorder", "max_buffer_bytes", [True, -1], "an int in the range [0, inf)"),
    ("RunRecorder", "max_metrics", [True, 0], "an int in the range [1, inf)"),
    ("RunRecorder", "flush_seconds", [True, 0.0, NAN], "a float in the range (0.0, inf] or None"),
]

#: calls that raise TypeError (a wrong kind of object, not a wrong value)
TYPE_ERRORS = {"calibrate", "HandlerRegistry.on_alarm", "HandlerRegistry.on_intervention"}


def assert_dialect(exc: BaseException, owner: str, arg: str, value: Any,
                   rule: str | None = None) -> str:
    """The message is the dialect's and names ``owner``, ``arg``, the rule and ``value``."""
    m = MESSAGE.fullmatch(str(exc))
    assert m is not None, f"not the dialect: {exc}"
    assert (m["owner"], m["arg"]) == (owner, arg), str(exc)
    assert m["value"] == short_repr(value), str(exc)
    if rule is not None:
        assert m["rule"] == rule, str(exc)
    return m["rule"]


@pytest.mark.parametrize(("owner", "arg", "value", "rule"), [
    pytest.param(owner, arg, v, rule, id=f"{owner}-{arg}-{v!r}")
    for owner, arg, values, rule in CASES for v in values])
def test_bad_argument_is_named_in_the_dialect(tmp_path: Path, owner: str, arg: str, value: Any,
                                              rule: str) -> None:
    error = TypeError if owner in TYPE_ERRORS else ValueError
    with pytest.raises(error) as info:
        FACTORIES[owner](tmp_path, {arg: value})
    assert type(info.value) is error
    assert_dialect(info.value, owner, arg, value, rule)
    assert not (tmp_path / "events.jsonl").exists() and not (tmp_path / "run").exists()


def test_every_case_is_for_a_real_argument() -> None:
    """No case tests an argument the call does not have (a typo would pass as a failure)."""
    targets = {"StallWatchdog": StallWatchdog, "CadenceAdvisor": CadenceAdvisor,
               "advise": advise, "HandlerRegistry": HandlerRegistry,
               "RankOutlierDetector": RankOutlierDetector, "RankHealthLedger": RankHealthLedger,
               "RankMonitor": RankMonitor, "EventLog": EventLog, "read_events": read_events,
               "iter_events": iter_events, "lr_factor_at": lr_factor_at,
               "calibrate": calibrate, "RunRecorder": RunRecorder,
               "HandlerRegistry.on_alarm": HandlerRegistry.on_alarm,
               "HandlerRegistry.on_intervention": HandlerRegistry.on_intervention}
    for owner, arg, _, _ in CASES:
        assert arg in inspect.signature(targets[owner]).parameters, (owner, arg)


@pytest.mark.parametrize("owner", sorted(set(FACTORIES) - {"read_events", "iter_events",
                                                          "calibrate"}))
def test_good_values_are_accepted(tmp_path: Path, owner: str) -> None:
    """The factories are sound: with good values (NumPy scalars too) nothing is refused."""
    good: dict[str, dict[str, Any]] = {
        "StallWatchdog": {"k": np.float32(3.0), "window": np.int64(8), "peak_flops": 1e15},
        "CadenceAdvisor": {"step_time_s": np.float64(2.0), "restart_s": 0},
        "advise": {"hazard": 2, "step_time_s": 1.0},
        "HandlerRegistry": {"timeout": 0.5, "strict": np.bool_(True)},
        "RankOutlierDetector": {"min_ranks": np.int32(4), "alpha": 0.0, "max_fraction": 1.0},
        "RankHealthLedger": {"hosts": ("a", "a", "b", "b"), "keep_steps": 0},
        "RankMonitor": {"threshold": 5, "suspect_at": 1.0},
        "EventLog": {"fsync": "never", "strict": False},
        "lr_factor_at": {"shape": "cosine"},
        "RunRecorder": {"flush_seconds": INF, "part_steps": np.int64(5)},
    }
    out = FACTORIES[owner](tmp_path, good.get(owner, {}))
    if hasattr(out, "close"):
        out.close()


# ---------------------------------------------------------------------------- detectors
DETECTORS = sorted({detector_class(name) for name in REGISTRY}, key=lambda c: c.__name__)


def _bad_values(annotation: str) -> tuple[list[Any], str]:
    """Bad values for an argument annotated ``annotation``, and how its rule starts."""
    kind = annotation.split("|")[0].strip()
    if kind == "bool":
        return [1, "yes"], "a bool"
    if kind == "int":
        return [True, 2.5], "an int"
    if kind == "float":
        return [True, NAN], "a float"
    if kind == "str":
        return ["no-such-choice", 3], "one of ["
    raise AssertionError(f"no bad values for an argument annotated {annotation!r}")


def _detector_cases() -> list[Any]:
    out = []
    for cls in DETECTORS:
        for arg, p in inspect.signature(cls).parameters.items():
            values, rule = _bad_values(str(p.annotation))
            out += [pytest.param(cls, arg, v, rule, id=f"{cls.__name__}-{arg}-{v!r}")
                    for v in values]
    return out


@pytest.mark.parametrize(("cls", "arg", "value", "rule"), _detector_cases())
def test_detector_argument_is_named_in_the_dialect(cls: type, arg: str, value: Any,
                                                   rule: str) -> None:
    with pytest.raises(ValueError) as info:
        cls(**{arg: value})
    assert assert_dialect(info.value, cls.__name__, arg, value).startswith(rule)


def test_numbers_are_never_bools() -> None:
    """Across every case above, ``True`` is refused wherever a number is expected."""
    numeric = [(o, a) for o, a, values, rule in CASES
               if rule.startswith(("a float", "an int"))]
    assert numeric and all(any(v is True for v in values) for o, a, values, rule in CASES
                           if (o, a) in numeric)
