"""The policy's state: named records, and its snapshot format with the checks on loading.

The timers the policy keeps are small named tuples (:class:`LRCut`, :class:`ClipHold`,
:class:`JumpHold`, :class:`Probation`) and the open episode an :class:`Episode`.  On disk they
stay the lists of version 2 (``"lr": [start, factor, duration, restore]``, ...), so snapshots
written before the records had names load unchanged.

:func:`read_state` checks a whole snapshot (every leaf through :class:`~stability._state_check.
Fields`) into a :class:`PolicySnapshot` before the policy installs anything, so a rejected one
leaves the policy as it was; :func:`write_state` is its inverse.

Examples
--------
>>> from stability.policy.config import PolicyConfig
>>> snap = read_state({"version": 2, "level": 1, "lr": [10, 0.5, 100, 50]},
...                   PolicyConfig.from_dict(None))
>>> snap.lr
LRCut(start=10, factor=0.5, duration=100, restore=50)
>>> write_state(snap)["lr"]
[10, 0.5, 100, 50]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from stability._state_check import Fields
from stability.policy.config import PolicyConfig
from stability.policy.loss_tracker import LossTracker, ValTracker
from stability.policy.lr_guard import LRGuard

__all__ = ["Aftermath", "ClipHold", "Episode", "JumpHold", "LRCut", "PolicySnapshot",
           "Probation", "STATE_VERSION", "read_state", "write_state"]

STATE_VERSION = 2
#: "never" / "always" for step arithmetic (well inside int64)
INF_STEP = 2**62


class LRCut(NamedTuple):
    """The ladder's LR cut: ``factor`` from ``start`` for ``duration`` steps, then a ramp back
    over ``restore`` steps."""

    start: int
    factor: float
    duration: int
    restore: int


class ClipHold(NamedTuple):
    """A tighter gradient clip ``norm`` from ``start`` for ``duration`` steps (0: for good)."""

    norm: float
    start: int
    duration: int


class JumpHold(NamedTuple):
    """An LR jump held: the jump ``ratio`` in force, its ``last`` alarm step, the cut's
    ``factor``."""

    ratio: float
    last: int
    factor: float


class Probation(NamedTuple):
    """After a rollback that skipped bad data: resumed at ``resume`` from the checkpoint of
    ``target``; ``n_worse`` steps measurably worse (and not closing the gap) so far; the
    episode's ``cause``; ``ref`` the loss level (log) the gap is measured from."""

    resume: int
    target: int
    n_worse: int
    cause: str
    ref: float = math.nan


class Aftermath(NamedTuple):
    """An episode is over (its cause gone): does the damage outlive it?  The episode began at
    ``onset`` (its last acting alarm at ``last``, its ``cause``); watched since ``start``;
    ``n_worse`` steps measurably worse without closing the gap; ``ref`` the loss level (log)
    the gap is measured from."""

    onset: int
    last: int
    cause: str
    start: int
    n_worse: int
    ref: float


@dataclass
class Episode:
    """The open episode (reset by a rollback, or when it is over)."""

    consec: int = 0                 #: consecutive alarm steps of the episode
    last_seen: int = -INF_STEP      #: last step with acting alarms
    skip_run: int = 0               #: consecutive skipped alarm steps (a skip storm)
    last_skip: int = -INF_STEP      #: last step the policy skipped
    adapt_start: int | None = None  #: step the policy started adapting (clip + LR cut)
    adapt_fast: float = math.nan    #: the fast loss average then
    cause: str = ""                 #: the episode's attributed cause


@dataclass
class PolicySnapshot:
    """Everything :meth:`~stability.policy.policy.Policy.state_dict` saves, checked and typed."""

    level: int
    last_alarm: int | None
    last_response: int | None
    kind_last: dict[str, int]
    onset: int | None
    hist: dict[str, list[int]]
    lr: LRCut | None
    clip: ClipHold | None
    jump: JumpHold | None
    damage_last: int | None
    n_rollbacks: int
    n_responses: int
    n_merged: int
    guard: LRGuard
    episode: Episode
    probation: Probation | None
    loss: LossTracker
    val: ValTracker
    aftermath: Aftermath | None = None
    judged_onset: int | None = None
    n_undo: int = 0
    rb_onsets: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    kept_onsets: list[int] = dataclasses.field(default_factory=list)


def write_state(s: PolicySnapshot) -> dict[str, Any]:
    """JSON-compatible snapshot (format version :data:`STATE_VERSION`)."""
    ep = s.episode
    return {
        "version": STATE_VERSION,
        "level": s.level,
        "last_alarm": s.last_alarm,
        "last_response": s.last_response,
        "kind_last": dict(s.kind_last),
        "onset": s.onset,
        "hist": {k: list(v) for k, v in s.hist.items()},
        "lr": None if s.lr is None else list(s.lr),
        "clip": None if s.clip is None else list(s.clip),
        "jump": None if s.jump is None else list(s.jump),
        "damage_last": s.damage_last,
        "n_rollbacks": s.n_rollbacks,
        "n_responses": s.n_responses,
        "n_merged": s.n_merged,
        "guard": s.guard.state_dict(),
        "episode": {"consec": ep.consec, "last_seen": ep.last_seen,
                    "skip_run": ep.skip_run, "last_skip": ep.last_skip,
                    "adapt_start": ep.adapt_start,
                    "adapt_fast": _enc(ep.adapt_fast), "cause": ep.cause},
        "probation": _probation(s.probation),
        "aftermath": None if s.aftermath is None else [*s.aftermath[:5],
                                                       _enc(s.aftermath.ref)],
        "judged_onset": s.judged_onset,
        "n_undo": s.n_undo,
        "rb_onsets": [list(x) for x in s.rb_onsets],
        "kept_onsets": list(s.kept_onsets),
        "loss": s.loss.state_dict(),
        "val": s.val.state_dict(),
    }


def read_state(sd: Mapping[str, Any], config: PolicyConfig) -> PolicySnapshot:
    """Check a :func:`write_state` snapshot; raise ``ValueError`` naming the first bad field.

    ``config`` bounds the level (its ladder) and configures the trackers.  Absent keys take
    their defaults; unknown keys are ignored.
    """
    f = Fields("Policy", sd)
    f.version(STATE_VERSION, default=0)
    n_levels = len(config.ladder)
    level = min(f.integer("level", f.get("level", 0), lo=0, hi=10_000), n_levels)
    last_alarm = f.opt_integer("last_alarm")
    last_response = f.opt_integer("last_response")
    kind_last = {f.text("kind_last", value=k, max_len=200): f.integer(f"kind_last.{k}", v)
                 for k, v in f.mapping("kind_last", {}).items()}
    onset = f.opt_integer("onset")
    hist = {f.text("hist", value=k, max_len=200): [f.integer(f"hist.{k}", x)
                                                  for x in f.seq(f"hist.{k}", None, v)]
            for k, v in f.mapping("hist", {}).items()}
    lr_ = f.opt_seq("lr", 4)
    lr = None if lr_ is None else LRCut(
        f.integer("lr[0]", lr_[0]), f.number("lr[1]", lr_[1], lo=0.0, hi=1.0, low_open=True),
        f.integer("lr[2]", lr_[2], lo=0), f.integer("lr[3]", lr_[3], lo=0))
    clip_ = f.opt_seq("clip", 3)
    clip = None if clip_ is None else ClipHold(
        f.number("clip[0]", clip_[0], lo=0.0, low_open=True), f.integer("clip[1]", clip_[1]),
        f.integer("clip[2]", clip_[2], lo=0))
    jump_ = f.opt_seq("jump", 3)
    jump = None if jump_ is None else JumpHold(
        f.number("jump[0]", jump_[0], lo=0.0, low_open=True), f.integer("jump[1]", jump_[1]),
        f.number("jump[2]", jump_[2], lo=0.0, hi=1.0, low_open=True))
    damage_last = f.opt_integer("damage_last")
    counts = {k: f.integer(k, f.get(k, 0), lo=0) for k in ("n_rollbacks", "n_responses",
                                                       "n_merged")}
    ep = f.sub("episode", {})
    episode = Episode(
        consec=ep.integer("consec", ep.get("consec", 0), lo=0),
        last_seen=ep.integer("last_seen", ep.get("last_seen", -INF_STEP)),
        skip_run=ep.integer("skip_run", ep.get("skip_run", 0), lo=0),
        last_skip=ep.integer("last_skip", ep.get("last_skip", -INF_STEP)),
        adapt_start=ep.opt_integer("adapt_start"),
        adapt_fast=ep.number("adapt_fast", ep.get("adapt_fast", math.nan), nan=True),
        cause=ep.text("cause", "", max_len=200))
    pb = f.opt_seq("probation")
    if pb is not None and len(pb) not in (4, 5):
        f.fail("probation", "a list of 4 or 5 items", pb)
    probation = None if pb is None else Probation(
        f.integer("probation[0]", pb[0]), f.integer("probation[1]", pb[1]),
        f.integer("probation[2]", pb[2], lo=0),
        f.text("probation[3]", value=pb[3], max_len=200),
        f.number("probation[4]", pb[4] if len(pb) > 4 else math.nan, nan=True))
    af = f.opt_seq("aftermath", 6)
    aftermath = None if af is None else Aftermath(
        f.integer("aftermath[0]", af[0]), f.integer("aftermath[1]", af[1]),
        f.text("aftermath[2]", value=af[2], max_len=200), f.integer("aftermath[3]", af[3]),
        f.integer("aftermath[4]", af[4], lo=0), f.number("aftermath[5]", af[5], nan=True))
    judged_onset = f.opt_integer("judged_onset")
    n_undo = f.integer("n_undo", f.get("n_undo", 0), lo=0)
    rb_onsets = [(f.integer(f"rb_onsets[{i}][0]", f.seq(f"rb_onsets[{i}]", 2, x)[0]),
                  f.text(f"rb_onsets[{i}][1]", value=x[1], max_len=200))
                 for i, x in enumerate(f.seq("rb_onsets", None, f.get("rb_onsets", []),
                                             max_len=64))]
    kept_onsets = [f.integer(f"kept_onsets[{i}]", x)
                   for i, x in enumerate(f.seq("kept_onsets", None, f.get("kept_onsets", []),
                                               max_len=64))]
    guard = LRGuard(config.lr_guard)
    if f.get("guard", None) is not None:
        guard.load_state_dict(f.get("guard"))
    rc = config.recovery
    loss = LossTracker(rc.fast_alpha, rc.base_alpha)
    loss.load_state_dict(f.mapping("loss", {}))
    val = ValTracker(rc.val_margin)
    val.load_state_dict(f.mapping("val", {}))
    return PolicySnapshot(
        level=level, last_alarm=last_alarm, last_response=last_response, kind_last=kind_last,
        onset=onset, hist=hist, lr=lr, clip=clip, jump=jump, damage_last=damage_last,
        n_rollbacks=counts["n_rollbacks"], n_responses=counts["n_responses"],
        n_merged=counts["n_merged"], guard=guard, episode=episode, probation=probation,
        loss=loss, val=val, aftermath=aftermath, judged_onset=judged_onset, n_undo=n_undo,
        rb_onsets=rb_onsets, kept_onsets=kept_onsets)


def _probation(p: Probation | None) -> list[Any] | None:
    """A probation as written: 4 items (version 2) or 5 once its gap reference is known."""
    if p is None:
        return None
    return list(p[:4]) if math.isnan(p.ref) else [*p[:4], p.ref]


def _enc(v: float) -> float | str:
    """JSON-safe float (non-finite as a string, read back by ``float``)."""
    return v if math.isfinite(v) else str(v)
