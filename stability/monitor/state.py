"""Monitor snapshots: :meth:`state_dict` / :meth:`load_state_dict` and their validation (the
state half of :class:`stability.monitor.monitor.Monitor`, a mixin).

A snapshot is JSON-compatible data with a ``"version"`` key; every field is checked through
:class:`~stability._state_check.Fields` before it is used, and a failed load leaves the monitor
as it was.
"""

from __future__ import annotations

import collections
import logging
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from stability._state_check import Fields
from stability.config.config import MonitorConfig
from stability.monitor.io import decode_state, encode_state
from stability.monitor.layout import LayoutMixin, _Binding
from stability.monitor.recovery import RecoveryTracker
from stability.run.goodput import GoodputTracker
from stability.types import Control

if TYPE_CHECKING:
    from stability.policy.policy import Policy
    from stability.run.checkpoints import CheckpointLedger

__all__ = ["GRAD_HISTORY", "STATE_VERSION", "StateMixin"]

logger = logging.getLogger("stability.monitor")

STATE_VERSION = 1
#: gradient norms kept for the policy's ``grad_norm_recent_median``
GRAD_HISTORY = 100


class StateMixin(LayoutMixin):
    """:meth:`state_dict` and :meth:`load_state_dict`."""

    config: MonitorConfig
    log_only: bool
    policy: Policy
    checkpoints: CheckpointLedger
    goodput: GoodputTracker
    control: Control
    last_step: int
    _policy_control: Control
    _policy_dirty: bool
    _ctrl_dirty: bool
    _snap: Control | None
    _grad_hist: collections.deque[float]
    _grad_last: float | None
    _lr_now: float | None
    _lr_prev: float | None
    _recovery: RecoveryTracker

    if TYPE_CHECKING:
        def _reset_runtime(self) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """Whole-monitor snapshot as JSON-compatible data (``json.dumps`` works, no NaN)."""
        sd = {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "slots": self._slot_names[2:],
            "unbound": sorted(self.unbound),
            "families": {k: list(v.layers) for k, v in self._families.items()},
            "bindings": [{"name": b.name, "keys": list(b.keys), "slots": [list(c) for c in b.slots],
                          "detector": b.det.state_dict()} for b in self._bindings],
            "policy": self.policy.state_dict(),
            "policy_dirty": self._policy_dirty,
            "control": self.control.to_dict(),
            "policy_control": self._policy_control.to_dict(),
            "checkpoints": self.checkpoints.state_dict(),
            "goodput": self.goodput.state_dict(),
            "last_step": self.last_step,
            "grad_history": list(self._grad_hist),
            "grad_last": self._grad_last,
            "lr_now": self._lr_now,
            "lr_prev": self._lr_prev,
            "counters": dict(self.counters),
            "recovery": self._recovery.state_dict(),
        }
        return encode_state(sd)

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True) -> None:
        """Restore a :meth:`state_dict` snapshot; the snapshot is checked before it is used.

        Precedence: **this monitor's config wins**.  Hyperparameters (thresholds, detector
        parameters, the policy) always come from :attr:`config`, never from the snapshot; the
        snapshot contributes state only -- the signal layout, each bank's statistics, the
        policy's incident state, the control, the checkpoint ledger, the goodput ledger and the
        counters -- and only where it is compatible with this config: same bindings, the same
        slot layout (re-derived from the snapshot's signal names, never trusted as indices),
        detector arrays of the right class, shapes and dtypes with ring positions and counts in
        range and finite statistics (see :meth:`detectors.BankDetector.validate_state_dict`).

        Parameters
        ----------
        state
            Output of :meth:`state_dict` (possibly through JSON).
        strict
            ``True`` (default): any incompatible part raises ``ValueError`` naming the field,
            and the monitor is left exactly as it was.  ``False``: each incompatible part
            (the layout, one bank, the policy, the control, the ledgers, the run history)
            *re-warms* -- it starts fresh -- with a ``UserWarning`` naming it; banks keep the
            statistics of the series the two layouts share.  A snapshot that is not a monitor
            snapshot at all (not a mapping, a newer version) raises in both modes.
        """
        backup = self.state_dict()
        try:
            self._load_state(state, strict)
        except Exception as exc:  # a hostile encoding may raise anything
            self._load_state(backup, True)  # a failed load changes nothing
            if isinstance(exc, ValueError):
                raise
            raise ValueError(f"Monitor.load_state_dict(): malformed snapshot "
                             f"({type(exc).__name__}: {exc}).") from exc

    def _load_state(self, state: Mapping[str, Any], strict: bool) -> None:
        try:
            sd = decode_state(state)
        except Exception as exc:
            raise ValueError(f"Monitor.load_state_dict(): cannot decode the snapshot "
                             f"({type(exc).__name__}: {exc}).") from None
        f = Fields("Monitor", sd)
        f.version(STATE_VERSION)
        live = [b.name for b in self._bindings]
        snap: dict[str, Fields] = {}
        for i, bd in enumerate(f.seq("bindings")):
            g = Fields("Monitor", bd, f"bindings[{i}].")
            snap[g.text("name", max_len=1000)] = g
        if list(snap) != live:
            msg = (f"Monitor.load_state_dict(): snapshot bindings {list(snap)} do not match "
                   f"this monitor's {live}.")
            if strict:
                raise ValueError(msg)
            _rewarm(msg + " Bindings missing from the snapshot start fresh.")
        if sd.get("config") is not None and sd.get("config") != self.config.to_dict():
            logger.info("Monitor.load_state_dict(): the snapshot was taken with another config; "
                        "this monitor's config (hyperparameters) wins.")

        def part(name: str, fn: Any, fresh: Any = None) -> Any:
            try:
                return fn()
            except ValueError as exc:
                if strict:
                    raise ValueError(f"{exc} (in {name})") from None
                _rewarm(f"{exc} (in {name}) Re-warming it.")
                return fresh() if callable(fresh) else fresh

        layout = part("the signal layout", lambda: _read_layout(f), ([], [], {}))
        # the goodput ledger is checked (into a scratch tracker) before anything changes
        gp = f.get("goodput", None)
        if gp is not None:
            gp = part("the goodput ledger", lambda: _checked_goodput(gp), {})
        self._reset_runtime()
        for b in self._bindings:
            b.keys, b.key_index, b.slots = [], {}, [[] for _ in b.patterns]
            b.det.n_series = 0
            b.det.reset()
        names, unbound, families = layout
        for name in names:
            if name not in self._slot_of:
                self._bind(name)
        self.unbound |= set(unbound[: max(self.max_series - len(self.unbound), 0)])
        for fam, layers in families.items():
            part(f"family {fam!r}", lambda fam=fam, layers=layers: self.declare_family(fam, layers))
        same_names = self._slot_names[2:] == names
        for b in self._bindings:  # re-binding left every bank fresh: that is the fallback
            bd = snap.get(b.name)
            if bd is not None:
                part(f"bank {b.name!r}",
                     lambda b=b, bd=bd: self._load_bank(b, bd, same_names, strict))
        pol = f.get("policy", None)
        if pol is not None:
            part("the policy", lambda: self.policy.load_state_dict(pol),
                 self.policy.reset)
        self._policy_dirty = part("the policy flag", lambda: f.flag("policy_dirty", False), False)
        ctl = part("the control", lambda: (_read_control(f, "control"),
                                           _read_control(f, "policy_control")),
                   lambda: (Control(), Control()))
        self.control = ctl[0]
        self._ctrl_dirty = True  # per-step requests of the snapshot's step end with it
        self._snap = None
        self._policy_control = ctl[1] if self.log_only else self.control
        led = f.get("checkpoints", None)
        if led is not None:
            part("the checkpoint ledger", lambda: self.checkpoints.load_state_dict(led),
                 lambda: self.checkpoints.load_state_dict({"records": [], "alarms": []}))
        if gp is not None:
            self.goodput.load_state_dict(gp)  # checked above ({} re-warms it)
        keys = set(self.counters)
        hist = part("the run history", lambda: _read_history(f, keys),
                    lambda: _read_history(Fields("Monitor", {}), keys))
        self.last_step, grad_hist, self._grad_last, self._lr_now, self._lr_prev, counters = hist
        self._grad_hist.extend(grad_hist)
        self.counters.update(counters)
        rec = f.get("recovery", None)
        if rec is not None:
            part("the recovery episodes", lambda: self._recovery.load_state_dict(rec))
        self._dirty = True

    def _load_bank(self, b: _Binding, g: Fields, same_names: bool, strict: bool) -> None:
        """Install one bank's snapshot: its series must be this layout's, else (not strict)
        the series both layouts share keep their statistics."""
        keys = [g.text(f"keys[{i}]", value=k, max_len=100_000)
                for i, k in enumerate(g.seq("keys"))]
        slots = g.seq("slots", b.n_inputs)
        same = same_names and keys == b.keys and all(
            isinstance(c, list) and c == b.slots[j] for j, c in enumerate(slots))
        checked = b.det.validate_state_dict(g.get("detector"))  # names the detector field
        if checked.n_series != len(keys):
            g.fail("detector", f"state for {len(keys)} series (one per key)",
                   f"{checked.n_series} series")
        if not same:
            msg = (f"Monitor.load_state_dict(): the series of bank {b.name!r} in the snapshot "
                   f"do not match the layout this config gives its signals.")
            if strict:
                raise ValueError(msg + " Pass strict=False to keep the shared series and "
                                 "re-warm the rest.")
            _rewarm(msg + " Shared series keep their statistics; the others start fresh.")
            pos = {k: i for i, k in enumerate(keys)}
            checked = b.det.select_series(checked, [pos.get(k) for k in b.keys])
        b.det.apply_state(checked)


# ---------------------------------------------------------------------- state helpers
def _rewarm(msg: str) -> None:
    warnings.warn(msg, UserWarning, stacklevel=4)


def _checked_goodput(sd: Any) -> Mapping[str, Any]:
    """The snapshot's goodput ledger, validated by a scratch :class:`GoodputTracker`."""
    try:
        GoodputTracker().load_state_dict(sd)
    except ValueError as exc:
        raise ValueError(str(exc).replace("GoodputTracker.load_state_dict(): '",
                                          "Monitor.load_state_dict(): 'goodput.")) from None
    return sd


def _read_layout(f: Fields) -> tuple[list[str], list[str], dict[str, list[str]]]:
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


def _read_control(f: Fields, key: str) -> Control:
    """A :class:`Control` from the snapshot, every field checked."""
    g = f.sub(key, {})
    d: dict[str, Any] = {
        "lr_factor": g.number("lr_factor", g.get("lr_factor", 1.0), lo=0.0, low_open=True),
        "clip_norm": g.opt_number("clip_norm", lo=0.0, low_open=True),
        "rollback_to": g.opt_integer("rollback_to", lo=0),
    }
    for k in ("skip_step", "save_checkpoint", "stop"):
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


def _read_history(f: Fields, counter_keys: set[str]) -> tuple[
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
