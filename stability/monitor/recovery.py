"""Recovering alarms: an excursion already returning to trend is reported, but as recovering.

A loss excursion that is already on its way back (the MLPerf Llama-3.1-8B runs: loss 1.2-8x its
previous level, back within 40-150 steps without help) is correct to report and wrong to escalate.
:class:`RecoveryTracker` follows each alarming ``(binding, signal)`` through its *episode*
(alarms no more than :data:`EPISODE_GAP` steps apart) and keeps the episode's peak score.  An
alarm whose score has fallen back by at least :data:`RECOVERED_FRACTION` of the peak's excess
over the threshold -- ``score <= threshold + f * (peak - threshold)`` -- is *recovering*: the
monitor reports it with ``Alarm.recovering = True`` and never as critical.  The first alarm of an
episode is never recovering (there is no peak to come back from yet).

It sees only the scores of alarming steps, in step order, so a replay and a live run (the same
:meth:`~stability.monitor.monitor.Monitor._finish_step`) rate every alarm alike; its state is
part of the monitor's snapshot.

Examples
--------
>>> r = RecoveryTracker()
>>> [r.update("loss_level", "loss", s, score, 1.1) for s, score in
...  [(10, 2.0), (11, 3.0), (12, 2.5), (13, 1.9), (100, 1.5)]]
[False, False, False, True, False]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["EPISODE_GAP", "RECOVERED_FRACTION", "RecoveryTracker"]

#: alarms of one (binding, signal) at most this many steps apart belong to one episode
EPISODE_GAP = 50
#: recovering once the score has given back this fraction of the peak's excess over the threshold
RECOVERED_FRACTION = 0.5
#: episodes kept at most (the oldest are dropped first)
MAX_EPISODES = 4096


class RecoveryTracker:
    """Per ``(binding, signal)``: the step of its last alarm and the peak score of its episode."""

    def __init__(self) -> None:
        self.episodes: dict[str, tuple[int, float]] = {}

    def update(self, binding: str, signal: str, step: int, score: float,
               threshold: float) -> bool:
        """Record an alarm; ``True`` when it is recovering (see the module docstring)."""
        key = f"{binding}\x1f{signal}"
        last = self.episodes.pop(key, None)
        if not math.isfinite(score):
            return False  # a non-finite value is never "coming back"
        same = last is not None and 0 <= step - last[0] <= EPISODE_GAP
        peak = max(last[1], score) if same and last is not None else score
        self.episodes[key] = (step, peak)
        if len(self.episodes) > MAX_EPISODES:
            del self.episodes[next(iter(self.episodes))]
        return same and score < peak and \
            score - threshold <= RECOVERED_FRACTION * (peak - threshold)

    def state_dict(self) -> list[list[Any]]:
        """``[[key, step, peak], ...]`` (JSON-compatible)."""
        return [[k, s, p] for k, (s, p) in self.episodes.items()]

    def load_state_dict(self, state: Any) -> None:
        """Restore :meth:`state_dict`; raises ``ValueError`` naming what is wrong."""
        if isinstance(state, Mapping) or not isinstance(state, (list, tuple)):
            raise ValueError(f"recovery: expected a list of [key, step, peak]; got "
                             f"{type(state).__name__}.")
        out: dict[str, tuple[int, float]] = {}
        for i, e in enumerate(state[-MAX_EPISODES:]):
            ok = (isinstance(e, (list, tuple)) and len(e) == 3 and isinstance(e[0], str)
                  and isinstance(e[1], int) and not isinstance(e[1], bool)
                  and isinstance(e[2], (int, float)) and not isinstance(e[2], bool)
                  and math.isfinite(float(e[2])))
            if not ok:
                raise ValueError(f"recovery[{i}]: expected [key, step, finite peak]; got {e!r}.")
            out[e[0]] = (int(e[1]), float(e[2]))
        self.episodes = out
