"""What the monitor is doing, as plain ``stability/*`` metrics for the trainer's own logs.

Framework-free (no torch): the plain-torch guard (``guard.metrics()``), the HF callback
(``on_log``) and the Lightning callback (``log_dict``) all build their dict here, so TensorBoard,
W&B, CSV loggers and ``trainer.state.log_history`` show the same keys:

==================================  ===========================================================
key                                 meaning
==================================  ===========================================================
``stability/lr_factor``             LR multiplier in force (1.0 = untouched)
``stability/clip_norm``             gradient clip in force set by the monitor (absent: none)
``stability/level``                 escalation level of the policy (0 = no incident)
``stability/alarms``                alarms of the step
``stability/alarms_total``          alarms since the start of the run
``stability/alarm_steps_total``     steps with at least one alarm
``stability/interventions_total``   interventions since the start (alerts included)
``stability/score/<binding>``       highest detector score of the binding on the step
                                    (absent: the binding saw no input)
``stability/interventions/<type>``  interventions of that type (counts passed in ``extra`` by
                                    an :class:`InterventionTally`)
``stability/<name>``                anything else passed in ``extra``: ``steps_skipped``,
                                    ``rollbacks``, ``steps_lost``, ``checkpoints``,
                                    ``lr_effective``, ...
==================================  ===========================================================

"None" is a missing key, never a ``nan`` value: a NaN in a trainer log reads as a fault to
anything that watches it.  (The monitor never binds ``stability/*`` names either, see
:class:`stability.monitor.binding.OwnNames`, so replaying or watching a guarded run's own logs
raises no alarm.)

Only public attributes of the monitor are read (``control``, ``counters``, ``last_step``,
``config.detectors``, ``detector(binding).score``, ``policy.level_at``).

:func:`describe` and :func:`log_interventions` write one INFO line per *acting* intervention on
the ``stability.adapters`` logger, like Keras' ``ReduceLROnPlateau(verbose=1)``.

Examples
--------
>>> from stability.monitor.monitor import Monitor
>>> mon = Monitor({"detectors": [{"name": "nan", "detector": "nonfinite", "inputs": ["*"]}]})
>>> d = mon.observe(0, {"loss": float("nan")})
>>> m = feedback_metrics(mon, d, extra={"steps_skipped": 1})
>>> m["stability/alarms"], m["stability/score/nan"], m["stability/steps_skipped"]
(1.0, 1.0, 1.0)
>>> "stability/clip_norm" in m    # no clip in force: missing, not nan
False
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from stability._state_check import Fields
from stability.types import INTERVENTION_TYPES

__all__ = [
    "ACTING",
    "CORE_KEYS",
    "PREFIX",
    "InterventionTally",
    "describe",
    "feedback_metrics",
    "is_acting",
    "key_selector",
    "log_interventions",
    "skipping",
]

PREFIX = "stability/"
#: Intervention types that change training (an :class:`~stability.types.Alert` does not).
ACTING = frozenset({"set_clip", "reduce_lr", "skip_step", "checkpoint", "rollback", "stop"})

log = logging.getLogger("stability.adapters")

#: The handful of keys the trainer callbacks log by default (``log_keys="core"``).
CORE_KEYS = tuple(PREFIX + k for k in (
    "lr_factor", "lr_base", "lr_effective", "clip_norm", "level", "alarms",
    "interventions/acting", "steps_skipped", "rollbacks", "amp_overflow", "loss_scale"))


def key_selector(log_keys: Any, where: str = "log_keys") -> Callable[[str], bool]:
    """Which ``stability/*`` keys a trainer callback logs: ``"core"``, ``"all"`` or a list.

    ``"core"``: :data:`CORE_KEYS` (what the run is doing: LR factor and LR, clip, level, alarms,
    acting interventions, skipped steps, rollbacks, AMP overflow / loss scale).  ``"all"``:
    every key of :func:`feedback_metrics` (detector scores, interventions by type, goodput
    counters).  A list: those names (``"stability/"`` may be left out) or fnmatch patterns
    such as ``"score/*"``.  Anything else is a ``ValueError`` naming ``where``.

    >>> keep = key_selector(["lr_factor", "score/*"])
    >>> keep("stability/lr_factor"), keep("stability/score/nan"), keep("stability/level")
    (True, True, False)
    >>> key_selector("core")("stability/score/nan"), key_selector("all")("stability/score/nan")
    (False, True)
    """
    if isinstance(log_keys, str):
        if log_keys == "all":
            return lambda key: True
        if log_keys == "core":
            core = frozenset(CORE_KEYS)
            return core.__contains__
    elif isinstance(log_keys, (list, tuple, set, frozenset)) and all(
            isinstance(k, str) and k for k in log_keys):
        pats = [k if k.startswith(PREFIX) else PREFIX + k for k in log_keys]
        return lambda key: any(fnmatch.fnmatchcase(key, p) for p in pats)
    raise ValueError(f"The {where!r} parameter must be 'core', 'all' or a list of key names "
                     f"(e.g. ['lr_factor', 'score/*']). Got {log_keys!r} instead.")


def is_acting(iv: Any) -> bool:
    """Whether an intervention (object or ``to_dict()`` dict) changes training.

    >>> from stability.types import Alert, SkipStep
    >>> is_acting(SkipStep(3)), is_acting(Alert(3))
    (True, False)
    """
    t = iv.get("type") if isinstance(iv, Mapping) else getattr(iv, "type", "")
    return t in ACTING


def _nanmax(values: Any) -> float:
    best = math.nan
    try:
        it = values.tolist() if hasattr(values, "tolist") else list(values)
    except Exception:
        return best
    for v in it:
        f = float(v)
        if not math.isnan(f) and (math.isnan(best) or f > best):
            best = f
    return best


def _binding_names(monitor: Any) -> list[str]:
    cfg = getattr(monitor, "config", None)
    dets = getattr(cfg, "detectors", None) or ()
    return [str(getattr(s, "name", "")) for s in dets if getattr(s, "name", "")]


def feedback_metrics(monitor: Any, decision: Any = None,
                     extra: Mapping[str, Any] | None = None,
                     scores: bool = True) -> dict[str, float]:
    """The ``stability/*`` metrics of the latest step (see the module docstring).

    Parameters
    ----------
    monitor : Monitor or None
        The monitor (``None``: only ``extra`` and neutral values).
    decision : Decision, optional
        The step's decision; its control, alarms and scores are reported.  Without it the
        monitor's current control is used and the per-step alarm count is 0.
    extra : mapping, optional
        More values, prefixed with ``stability/`` unless they already are (non-numeric and NaN
        values are left out).
    scores : bool
        Report ``stability/score/<binding>`` (one small reduction per binding).

    Returns
    -------
    dict of str to float
        No value is NaN: what is "none" (no clip, a binding without input) is left out.
    """
    out: dict[str, float] = {}
    control = getattr(decision, "control", None)
    if control is None:
        control = getattr(monitor, "control", None)
    lr_factor = getattr(control, "lr_factor", 1.0)
    clip = getattr(control, "clip_norm", None)
    out[PREFIX + "lr_factor"] = float(lr_factor) if lr_factor is not None else 1.0
    if clip is not None:
        out[PREFIX + "clip_norm"] = float(clip)
    step: Any = getattr(decision, "step", None)
    if step is None:
        step = getattr(monitor, "last_step", 0) or 0
    level = 0
    policy = getattr(monitor, "policy", None)
    if policy is not None and hasattr(policy, "level_at"):
        try:
            level = int(policy.level_at(max(int(step), 0)))
        except Exception:  # feedback must never kill the run
            level = 0
    out[PREFIX + "level"] = float(level)
    alarms = tuple(getattr(decision, "alarms", ()) or ())
    out[PREFIX + "alarms"] = float(len(alarms))
    counters = getattr(monitor, "counters", None) or {}
    out[PREFIX + "alarms_total"] = float(counters.get("alarms", 0))
    out[PREFIX + "alarm_steps_total"] = float(counters.get("alarm_steps", 0))
    out[PREFIX + "interventions_total"] = float(counters.get("interventions", 0))
    if scores and monitor is not None:
        for name in _binding_names(monitor):
            try:
                out[f"{PREFIX}score/{name}"] = _nanmax(monitor.detector(name).score)
            except Exception:
                out[f"{PREFIX}score/{name}"] = math.nan
        for a in alarms:  # alarm scores are authoritative (e.g. the nonfinite code)
            key = f"{PREFIX}score/{a.detector}"
            s = float(a.score)
            if math.isnan(out.get(key, math.nan)) or s > out[key]:
                out[key] = s
    for k, v in (extra or {}).items():
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        key = str(k) if str(k).startswith(PREFIX) else PREFIX + str(k)
        out[key] = f
    return _without_nan(out)


def _without_nan(out: dict[str, float]) -> dict[str, float]:
    """Drop the NaN values: "none" is a missing key in a trainer log, never a NaN."""
    return {k: v for k, v in out.items() if not math.isnan(v)}


class InterventionTally:
    """Counts of interventions by type over a run, with a state round trip.

    Examples
    --------
    >>> from stability.types import Decision, SkipStep, Alert
    >>> t = InterventionTally()
    >>> t.add(Decision(4, interventions=(Alert(4), SkipStep(4))))
    >>> t.metrics()["interventions/skip_step"], t.acting
    (1.0, 1)
    >>> t2 = InterventionTally(); t2.load_state_dict(t.state_dict()); t2.counts == t.counts
    True
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def add(self, decision: Any) -> None:
        """Count the interventions of a decision (or an iterable of interventions)."""
        ivs: Iterable[Any] = getattr(decision, "interventions", decision) or ()
        for iv in ivs:
            t = iv.get("type") if isinstance(iv, Mapping) else getattr(iv, "type", None)
            if t:
                self.counts[str(t)] += 1

    @property
    def acting(self) -> int:
        """How many acting interventions (see :data:`ACTING`) were counted."""
        return sum(n for t, n in self.counts.items() if t in ACTING)

    def metrics(self) -> dict[str, float]:
        """``interventions/<type>`` for every known type (0 when none), plus ``.../acting``."""
        out = {f"interventions/{t}": float(self.counts.get(t, 0)) for t in INTERVENTION_TYPES}
        for t, n in self.counts.items():
            out[f"interventions/{t}"] = float(n)
        out["interventions/acting"] = float(self.acting)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "counts": dict(self.counts)}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (checked first: ``ValueError`` naming the field)."""
        f = Fields(type(self).__name__, sd)
        f.version(1)
        counts = f.mapping("counts", {})
        self.counts = Counter({f.text("counts", value=k, max_len=200):
                               f.integer(f"counts.{k}", v, lo=0) for k, v in counts.items()})


def describe(iv: Any) -> str:
    """One human-readable line for an intervention (Keras ``verbose=1`` style).

    >>> from stability.types import ReduceLR
    >>> describe(ReduceLR(12, "L2: loss_spike(loss)", factor=0.25, duration=100))
    'step 12: reducing the LR factor to 0.25 for 100 steps (L2: loss_spike(loss))'
    >>> describe(ReduceLR(7, "LR guard", factor=0.1, duration=0))  # the LR guard's hold
    'step 7: reducing the LR factor to 0.1 while the scheduler asks for a bad LR (LR guard)'
    """
    t = getattr(iv, "type", "intervention")
    step = getattr(iv, "step", -1)
    reason = getattr(iv, "reason", "")
    if t == "reduce_lr":
        span = (f"for {iv.duration} steps" if iv.duration else
                "while the scheduler asks for a bad LR")  # the LR guard's hold
        what = f"reducing the LR factor to {iv.factor:.3g} {span}"
    elif t == "set_clip":
        span = f"for {iv.duration} steps" if iv.duration else "until changed"
        what = f"clipping gradients at {iv.max_norm:.4g} {span}"
    elif t == "skip_step":
        what = "skipping the optimizer step"
    elif t == "checkpoint":
        what = ("requesting an emergency checkpoint (written only if the weights are finite)"
                if not getattr(iv, "healthy", False) else "requesting a checkpoint")
    elif t == "rollback":
        what = f"rolling back to the checkpoint of step {iv.to_step}" + skipping(
            getattr(iv, "skip_from", None), getattr(iv, "skip_to", None))
    elif t == "stop":
        what = "stopping training"
    elif t == "alert":
        what = f"alert ({getattr(iv, 'severity', '')})"
    else:
        what = str(t)
    return f"step {step}: {what}" + (f" ({reason})" if reason else "")


def skipping(lo: Any, hi: Any) -> str:
    """What a rollback skips: ``", skipping the batches of steps a..b"``, or that it skips none.

    >>> skipping(5, 9), skipping(7, 7)
    (', skipping the batches of steps 5..9', ', skipping the batch of step 7')
    >>> skipping(200, 199), skipping(None, None)
    (', skipping no batch', ', skipping no batch')
    """
    if not isinstance(lo, int) or not isinstance(hi, int) or hi < lo:
        return ", skipping no batch"
    if hi == lo:
        return f", skipping the batch of step {lo}"
    return f", skipping the batches of steps {lo}..{hi}"


def log_interventions(decision: Any, logger: logging.Logger | None = None,
                      level: int = logging.INFO) -> int:
    """Log one line per acting intervention of ``decision``; returns how many were logged."""
    lg = logger or log
    n = 0
    for iv in getattr(decision, "interventions", ()) or ():
        if is_acting(iv):
            n += 1
            if lg.isEnabledFor(level):
                lg.log(level, "stability: %s", describe(iv))
    return n
