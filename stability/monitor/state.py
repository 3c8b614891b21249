"""Monitor snapshots: the readers that check :meth:`Monitor.state_dict` output field by field
(``state_dict`` / ``load_state_dict`` are :class:`stability.monitor.monitor.Monitor`'s own).

A snapshot is JSON-compatible data with a ``"version"`` key; every field is checked through
:class:`~stability._state_check.Fields` before it is used, and a failed load leaves the monitor
as it was.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from stability._state_check import Fields
from stability.run.goodput import GoodputTracker
from stability.types import Control

__all__ = ["GRAD_HISTORY", "STATE_VERSION", "PartLoader", "checked_goodput", "read_control",
           "read_history", "read_layout", "rewarm"]

logger = logging.getLogger("stability.monitor")

STATE_VERSION = 1
#: gradient norms kept for the policy's ``grad_norm_recent_median``
GRAD_HISTORY = 100


# ---------------------------------------------------------------------- state helpers
def rewarm(msg: str, stacklevel: int = 4) -> None:
    """Warn that a part of a snapshot re-warms (starts fresh) instead of failing the load."""
    warnings.warn(msg, UserWarning, stacklevel=stacklevel)


class PartLoader:
    """Load one part of a monitor snapshot.

    ``part(name, fn, fresh)`` returns ``fn()``; on a ``ValueError`` it re-raises it naming the
    part when ``strict``, else warns that the part re-warms and returns ``fresh`` (called when
    callable).
    """

    def __init__(self, strict: bool) -> None:
        self.strict = strict

    def __call__(self, name: str, fn: Callable[[], Any], fresh: Any = None) -> Any:
        try:
            return fn()
        except ValueError as exc:
            if self.strict:
                raise ValueError(f"{exc} (in {name})") from None
            rewarm(f"{exc} (in {name}) Re-warming it.")
            return fresh() if callable(fresh) else fresh


def checked_goodput(sd: Any) -> Mapping[str, Any]:
    """The snapshot's goodput ledger, validated by a scratch :class:`GoodputTracker`."""
    try:
        GoodputTracker().load_state_dict(sd)
    except ValueError as exc:
        raise ValueError(str(exc).replace("GoodputTracker.load_state_dict(): '",
                                          "Monitor.load_state_dict(): 'goodput.")) from None
    return sd


def read_layout(f: Fields) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """The snapshot's signal names (in slot order), unbound names and families, checked."""
    names = [f.text(f"slots[{i}]", value=x, max_len=100_000)
             for i, x in enumerate(f.seq("slots", None, f.get("slots", [])))]
    if len(set(names)) != len(names):
        f.fail("slots", "a list of distinct signal names", "duplicates")
    unbound = [f.text(f"unbound[{i}]", value=x, max_len=100_000)
               for i, x in enumerate(f.seq("unbound", None, f.get("unbound", [])))]
    families: dict[str, list[str]] = {}
    for fam, layers in f.mapping("families", {}).items():
        fam = f.text("families", value=fam, max_len=100_000)
        families[fam] = [f.text(f"families.{fam}[{i}]", value=x, max_len=100_000)
                         for i, x in enumerate(f.seq(f"families.{fam}", None, layers))]
    return names, unbound, families


def read_control(f: Fields, key: str) -> Control:
    """A :class:`Control` from the snapshot, every field checked."""
    g = f.sub(key, {})
    d: dict[str, Any] = {
        "lr_factor": g.number("lr_factor", g.get("lr_factor", 1.0), lo=0.0, low_open=True),
        "clip_norm": g.opt_number("clip_norm", lo=0.0, low_open=True),
        "rollback_to": g.opt_integer("rollback_to", lo=0),
    }
    for k in ("skip_step", "save_checkpoint", "stop", "keep_position"):
        d[k] = g.flag(k, False)
    for k in ("checkpoint_reason", "stop_reason"):
        d[k] = g.text(k, "")
    sb = g.opt_seq("skip_batches", 2)
    if sb is not None:
        lo, hi = g.integer("skip_batches[0]", sb[0]), g.integer("skip_batches[1]", sb[1])
        if hi < lo:
            g.fail("skip_batches", "[first, last] with first <= last", sb)
        d["skip_batches"] = (lo, hi)
    return Control.from_dict(d)


def read_history(f: Fields, counter_keys: set[str]) -> tuple[
        int, list[float], float | None, float | None, float | None, dict[str, int]]:
    """last_step, gradient-norm history, last gradient norm, LRs and counters, checked."""
    last_step = f.integer("last_step", f.get("last_step", -1), lo=-1)
    gh = f.seq("grad_history", None, f.get("grad_history", []))[-GRAD_HISTORY:]
    grad_hist = [f.number(f"grad_history[{i}]", x) for i, x in enumerate(gh)]
    grad_last = f.opt_number("grad_last")
    lr_now = f.opt_number("lr_now", nan=True, inf=True)
    lr_prev = f.opt_number("lr_prev", nan=True, inf=True)
    counters = {k: f.integer(f"counters.{k}", v, lo=0)
                for k, v in f.mapping("counters", {}).items() if k in counter_keys}
    return last_step, grad_hist, grad_last, lr_now, lr_prev, counters
