"""LR guard: an LR ceiling derived from the run's own healthy LR trajectory.

A learning-rate fault -- a bad config that multiplies the LR, a schedule bug, a re-warmup to a
peak k times too high -- is visible in the LR the scheduler *asks for* before the optimizer uses
it.  :class:`LRGuard` watches that requested LR on every step and keeps

* ``ref`` -- the last healthy LR during warm-up; after it, the *lowest* healthy LR since (after
  warm-up, training schedules do not rise: cosine, linear, step and inverse-sqrt decay,
  constant), so a slow ramp -- a re-warm-up to a too-high peak, each step inside the band --
  cannot climb the band step by step: it is a fault once it is ``tolerance`` above that floor
  (``allow_restarts`` keeps the last LR: rises up to the peak are healthy there);
* ``peak`` -- the highest healthy LR (the end of warm-up);

and declares an LR fault when the requested LR leaves the healthy band: above ``ref *
tolerance`` after warm-up (or above ``max(ref, peak) * tolerance`` when ``allow_restarts``,
for cyclic / warm-restart schedules), or above ``ref * warmup_jump`` during warm-up.  While the
fault lasts, the LR factor is

    ``min(1, 1 / r)``  with ``r`` the largest ``lr / ref`` seen since the onset,

so a constant-ratio fault (x30 for ever) is divided out exactly -- the effective LR follows the
healthy schedule -- a gradual ramp is capped at the last healthy LR, and once a ramp has peaked
the effective LR follows the requested LR's own decay (divided by the peak ratio).  The fault
ends (factor 1) when the requested LR is back in the healthy band *and* lifting the cut does
not raise the effective LR above the band around its last value, however long it took: a
fault that ends falls back abruptly, while a permanent multiplier on a decaying schedule only
decays into the band of the frozen reference (releasing it would multiply the effective LR).
A rewind (rollback) re-primes the reference from the next requested LR, so the scheduler's own
rewind is never mistaken for a jump.

Examples
--------
>>> g = LRGuard()
>>> for s in range(30):
...     _ = g.observe(s, 1e-3)                  # constant LR: warm-up settles
>>> g.observe(30, 3e-2)                          # x30 jump: the factor divides it out
0.0333...
>>> round(g.observe(31, 3e-2) * 3e-2, 6)         # effective LR stays at the healthy 1e-3
0.001
>>> g.observe(60, 1e-3), g.active                 # the scheduler is healthy again: released
(1.0, False)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit

from stability._state_check import Fields

STATE_VERSION = 1


@dataclass(frozen=True)
class LRGuardConfig:
    """``[policy.lr_guard]``: the healthy LR band (see the module docstring)."""

    enabled: bool = True
    tolerance: float = 1.25      #: band above the reference LR after warm-up
    warmup_jump: float = 4.0     #: allowed step-to-step rise during warm-up
    settle: int = 10             #: observed steps without a new peak that end warm-up
    min_steps: int = 5           #: observations before anything is judged
    allow_restarts: bool = False  #: cyclic / warm-restart schedules: rises up to the peak are ok

    @classmethod
    def from_dict(cls, d: Any, path: str = "policy.lr_guard") -> LRGuardConfig:
        from stability.config.sections import _bool, _int, _known, _number

        d = _known(d, tuple(sorted(f.name for f in dataclasses.fields(cls))), path)
        c = cls()
        return cls(
            enabled=_bool(d.get("enabled", c.enabled), f"{path}.enabled"),
            tolerance=_number(d.get("tolerance", c.tolerance), f"{path}.tolerance", 1.0,
                              high=1e6),
            warmup_jump=_number(d.get("warmup_jump", c.warmup_jump), f"{path}.warmup_jump",
                                1.0, high=1e6),
            settle=_int(d.get("settle", c.settle), f"{path}.settle", 1),
            min_steps=_int(d.get("min_steps", c.min_steps), f"{path}.min_steps", 1),
            allow_restarts=_bool(d.get("allow_restarts", c.allow_restarts),
                                 f"{path}.allow_restarts"),
        )


class LRGuard:
    """Healthy-band LR ceiling (see the module docstring).

    Parameters
    ----------
    config : LRGuardConfig, optional
    """

    def __init__(self, config: LRGuardConfig | None = None) -> None:
        self.config = config or LRGuardConfig()
        self.reset()

    def reset(self) -> None:
        """Forget the trajectory."""
        self.n = 0
        self.ref = math.nan
        self.peak = math.nan
        self.since_peak = 0
        self.warm = False
        self.primed = False        # False after a rewind: the next LR re-primes ``ref``
        self.active = False
        self.onset = -1
        self.inv_r0 = 1.0
        self.factor = 1.0
        self.last_lr = math.nan

    # ------------------------------------------------------------------ the band
    def upper(self) -> float:
        """Upper edge of the healthy band now (``inf`` while nothing can be judged)."""
        c = self.config
        if self.n < c.min_steps or not math.isfinite(self.ref):
            return math.inf
        if not self.warm:
            return self.ref * c.warmup_jump
        hi = self.ref
        if c.allow_restarts and math.isfinite(self.peak):
            hi = max(hi, self.peak)
        return hi * c.tolerance

    def observe(self, step: int, lr: float) -> float:
        """Feed the requested LR of ``step``; returns the LR factor the guard wants (<= 1).

        Non-finite or non-positive LRs are ignored (the non-finite detectors report them).
        """
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0.0):
            return self.factor
        lr = float(lr)
        prev, self.last_lr = self.last_lr, lr
        if not self.primed:
            # first LR after a start or a rewind: healthy if within the known range
            self.primed = True
            if self.active and lr <= self.ref * self.config.tolerance:
                self.active, self.factor = False, 1.0
            if not self.active and (not math.isfinite(self.peak)
                                    or lr <= self.peak * self.config.tolerance):
                self.ref = lr  # a rewound schedule may be back at a higher LR: the new floor
                self._healthy(lr)
                return self.factor
        up = self.upper()
        if self.active:
            if lr <= self.ref * self.config.tolerance and self._ends(lr, prev):
                self.active, self.factor = False, 1.0
                self._healthy(lr)
            else:
                # the largest fault ratio seen so far: after a ramp's peak the effective LR
                # follows the requested LR's own decay instead of staying at the reference
                self.inv_r0 = min(self.inv_r0, self.ref / lr)
                self.factor = min(1.0, self.inv_r0)
            return self.factor
        if lr > up:
            self.active = True
            self.onset = int(step)
            self.inv_r0 = self.ref / lr
            self.factor = min(1.0, self.inv_r0)
            return self.factor
        self._healthy(lr)
        return self.factor

    def _ends(self, lr: float, prev: float) -> bool:
        """Rule: an LR fault ends only when lifting the cut does not raise the effective LR
        above the band around the last effective LR (``lr <= tolerance * prev * factor``).

        After warm-up a healthy schedule does not rise, and a release that would multiply
        the effective LR is such a rise: the requested LR merely decayed back into the band
        of the frozen reference (a permanent multiplier on a decaying schedule) while the
        fault is still there.  A fault that ends falls back abruptly (by about the ratio the
        guard divides out), so the LR it asks for is the effective LR the guard let through.
        """
        if not math.isfinite(prev) or prev <= 0.0:
            return True
        return lr <= self.config.tolerance * prev * self.factor

    def observe_healthy(self, lrs: Any) -> int:
        """:meth:`observe` for each of ``lrs`` in order while the LR stays in its band.

        Stops before the first LR that would start a fault (left to :meth:`observe`) and
        returns how many LRs were taken; takes none while a fault is open or before the guard
        is primed.  The state afterwards equals that of an :meth:`observe` loop over them.

        >>> a, b = LRGuard(), LRGuard()
        >>> lrs = [1e-4 * (s + 1) for s in range(8)] + [1e-3] * 20 + [3e-2, 1e-3]
        >>> _ = a.observe(0, lrs[0]); _ = b.observe(0, lrs[0])
        >>> k = b.observe_healthy(np.asarray(lrs[1:]))
        >>> for s, lr in enumerate(lrs[1:k + 1], 1):
        ...     _ = a.observe(s, lr)
        >>> k, lrs[k + 1], a.state_dict() == b.state_dict()
        (27, 0.03, True)
        """
        lv = np.asarray(lrs, dtype=np.float64)
        if self.active or not self.primed or lv.size == 0:
            return 0
        c = self.config
        k, j, n, ref, peak, since, warm = _observe_healthy(
            lv, self.n, self.ref, self.peak, self.since_peak, self.warm, c.tolerance,
            c.warmup_jump, c.settle, c.min_steps, c.allow_restarts)
        if j >= 0:  # the last LR taken
            self.n = int(n)
            self.ref = float(ref)
            self.last_lr = float(lv[j])
            self.peak = float(peak)
            self.since_peak = int(since)
            self.warm = bool(warm)
            self.factor = 1.0
        return int(k)

    def _healthy(self, lr: float) -> None:
        self.n += 1
        self.ref = healthy_ref(self.ref, lr, self.warm, self.config.allow_restarts)
        if not math.isfinite(self.peak) or lr > self.peak:
            self.peak = lr
            self.since_peak = 0
        else:
            self.since_peak += 1
            if self.since_peak >= self.config.settle:
                self.warm = True
        self.factor = 1.0

    def prime(self, lr: float) -> None:
        """Accept ``lr`` as a healthy LR of the trajectory without judging it.

        For calibration on earlier, healthy history (:func:`stability.monitor.calibrate.calibrate`):
        the guard ends where a replay of the same LRs would have left it.  Non-finite or
        non-positive LRs are ignored.
        """
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0.0):
            return
        self.last_lr = float(lr)
        self.primed = True
        self.active, self.onset, self.inv_r0 = False, -1, 1.0
        self._healthy(float(lr))

    def rewind(self) -> None:
        """The trainer restored an earlier state: re-prime the reference from the next LR."""
        self.primed = False

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible state (non-finite floats as strings)."""
        out: dict[str, Any] = {"version": STATE_VERSION}
        for k in ("n", "since_peak", "warm", "primed", "active", "onset"):
            out[k] = getattr(self, k)
        for k in ("ref", "peak", "inv_r0", "factor", "last_lr"):
            v = getattr(self, k)
            out[k] = v if math.isfinite(v) else str(v)
        return out

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (this guard's config wins).

        Every field is checked first; a malformed one raises ``ValueError`` naming it and
        leaves the guard as it was.
        """
        f = Fields("LRGuard", sd)
        f.version(STATE_VERSION)
        vals: dict[str, Any] = {
            "n": f.integer("n", f.get("n", 0), lo=0),
            "since_peak": f.integer("since_peak", f.get("since_peak", 0), lo=0),
            "onset": f.integer("onset", f.get("onset", -1), lo=-1),
        }
        for k in ("warm", "primed", "active"):
            vals[k] = f.flag(k, False)
        for k in ("ref", "peak", "last_lr"):
            vals[k] = f.number(k, f.get(k, math.nan), nan=True)
        for k in ("inv_r0", "factor"):
            vals[k] = f.number(k, f.get(k, 1.0), lo=0.0, hi=1.0, low_open=True)
        self.reset()
        for k, v in vals.items():
            setattr(self, k, v)


def healthy_ref(ref: float, lr: float, warm: bool, restarts: bool) -> float:
    """The reference after a healthy ``lr``: the LR itself during warm-up (and with
    ``restarts``), the lowest healthy LR after it (a schedule does not rise after warm-up)."""
    if warm and not restarts and ref <= lr:  # (NaN ref: False -> lr)
        return ref
    return lr


@njit(cache=True, error_model="numpy")
def _observe_healthy(lv, n, ref, peak, since, warm, tol, jump, settle, min_steps,  # type: ignore[no-untyped-def]
                     restarts):
    """:meth:`LRGuard.observe` of a primed guard without a fault, LR after LR, up to the
    first LR above the band (its index, ``lv.size`` if none) -- the same comparisons and
    products as :meth:`LRGuard.upper` and :meth:`LRGuard._healthy`; returns that index, the
    index of the last LR taken (``-1``: none) and the state after it."""
    last = -1
    for k in range(lv.shape[0]):
        lr = lv[k]
        if not (math.isfinite(lr) and lr > 0.0):
            continue  # ignored by observe()
        if n >= min_steps and math.isfinite(ref):
            if not warm:
                up = ref * jump
            else:
                hi = ref
                if restarts and math.isfinite(peak):
                    hi = max(hi, peak)
                up = hi * tol
            if lr > up:
                return k, last, n, ref, peak, since, warm
        n += 1
        if not (warm and not restarts and ref <= lr):  # healthy_ref, inlined
            ref = lr
        if not math.isfinite(peak) or lr > peak:
            peak = lr
            since = 0
        else:
            since += 1
            if since >= settle:
                warm = True
        last = k
    return lv.shape[0], last, n, ref, peak, since, warm
