"""Step 1 of :mod:`replay.tuning`: candidates and scoring jobs.

Every (binding, grid point) of a config is a :class:`Candidate` (:func:`make_candidates`, grids
from :func:`stability.config.registry.tune_grids`); :func:`score_table` computes each candidate's
per-step score on one run (``threshold = +inf``, through the monitor's own binder, reduced to
one score per step), and :func:`score_runs` runs one such job per run in local processes or on
Ray. :mod:`replay.tuning` re-exports all of it.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from stability.config.registry import tune_grids

from .fleet import RunFailure, fan_out_runs
from .replay import read_table
from .scoring import reduce_series

__all__ = ["Candidate", "RunScores", "base_candidate", "detector_defaults", "make_candidates",
           "score_runs", "score_table"]

FloatArray = NDArray[np.float64]


# ---------------------------------------------------------------------------- candidates
@dataclass(frozen=True)
class Candidate:
    """One parameter setting of one binding."""

    binding: int
    name: str
    detector: str
    inputs: tuple[str, ...]
    params: tuple[tuple[str, Any], ...]
    tunable: bool
    #: the threshold its scores are computed with: ``inf`` (threshold-free scores, swept by the
    #: tuner), or the base threshold of a binding scored as it is -- one that freezes on alarms,
    #: or whose base setting is not a grid point (exact at that threshold only: never swept; the
    #: warm start, and what a binding the search leaves alone is counted with)
    scored_at: float = math.inf

    def params_dict(self) -> dict[str, Any]:
        """The parameters as a dict."""
        return dict(self.params)

    @property
    def sweepable(self) -> bool:
        """Whether the tuner may sweep thresholds over its scores."""
        return self.tunable and self.scored_at == math.inf


def detector_defaults(cls: type) -> dict[str, Any]:
    """The constructor's keyword defaults of a detector class."""
    init = cls.__init__  # type: ignore[misc]
    return {k: p.default for k, p in inspect.signature(init).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _init_args(cls: type) -> list[str]:
    init = cls.__init__  # type: ignore[misc]
    return [p for p in inspect.signature(init).parameters if p != "self"]


def make_candidates(detectors: Sequence[Mapping[str, Any]],
                    grids: Mapping[str, Mapping[str, list[Any]]] | None = None
                    ) -> list[Candidate]:
    """Every (binding, grid point) of a resolved config's ``detectors`` list, and the base
    setting of a binding scored as it is where the grid points do not cover it
    (:attr:`Candidate.scored_at`)."""
    from stability.config.registry import detector_class, is_available

    grids = tune_grids() if grids is None else grids
    out = []
    for b, d in enumerate(detectors):
        det = d["detector"]
        if not is_available(det):
            continue
        cls = detector_class(det)
        args = _init_args(cls)
        base = {k: v for k, v in dict(d.get("params", {})).items() if k != "threshold"}
        tunable = "threshold" in args and not getattr(cls, "fixed_threshold", False)
        grid = dict(grids.get(det, {})) if tunable else {}
        grid = {k: v for k, v in grid.items() if k in args}
        keys = sorted(grid)
        for combo in itertools.product(*(grid[k] for k in keys)) if keys else [()]:
            p = dict(base)
            p.update(zip(keys, combo, strict=True))
            if tunable and "freeze_on_alarm" in args:
                p["freeze_on_alarm"] = False
            out.append(Candidate(b, d["name"], det, tuple(d["inputs"]),
                                 tuple(sorted(p.items())), tunable))
        dflt = detector_defaults(cls)
        if tunable and _needs_as_is(base, grid, dflt):
            th = float(dict(d.get("params", {})).get("threshold", dflt["threshold"]))
            out.append(Candidate(b, d["name"], det, tuple(d["inputs"]),
                                 tuple(sorted(base.items())), True, th))
    return out


def _needs_as_is(base: Mapping[str, Any], grid: Mapping[str, Sequence[Any]],
                 dflt: Mapping[str, Any]) -> bool:
    """Whether a binding needs a candidate scored as it is (:attr:`Candidate.scored_at`): its
    base setting is not a grid point, or it freezes on alarms (threshold-free scores would
    differ from the monitor's after its first alarm)."""
    off_grid = not all(base.get(k, dflt.get(k)) in grid[k] for k in grid)
    return off_grid or base.get("freeze_on_alarm", dflt.get("freeze_on_alarm")) is True


def base_candidate(candidates: Sequence[Candidate], base: Mapping[str, Any], b: int
                   ) -> int | None:
    """The index of binding ``b``'s candidate with the base config's parameters (threshold
    aside; the one scored as it is when there is one, else the grid point),
    ``None`` when ``b`` has no tunable candidate.

    >>> det = {"name": "s", "detector": "ewma_z", "inputs": ["loss"], "params": {"alpha": 0.3}}
    >>> cands = make_candidates([det])
    >>> cands[base_candidate(cands, {"detectors": [det]}, 0)].params_dict()["alpha"]
    0.3
    """
    from stability.config.registry import detector_class

    want = {k: v for k, v in dict(base["detectors"][b].get("params", {})).items()
            if k not in ("threshold", "freeze_on_alarm")}
    found = None
    for i, c in enumerate(candidates):
        if c.binding != b or not c.tunable:
            continue
        have = {k: v for k, v in c.params if k != "freeze_on_alarm"}
        dflt = detector_defaults(detector_class(c.detector))
        if set(want) <= set(have) and all(v == want.get(k, dflt.get(k, v))
                                          for k, v in have.items()):
            if not c.sweepable:
                return i  # the binding as it is (freezing on alarms)
            found = i if found is None else found
    return found


# ---------------------------------------------------------------------------- scoring jobs
@dataclass
class RunScores:
    """Per-step scores of every candidate on one run."""

    run_id: str
    steps: NDArray[np.int64]
    scores: list[FloatArray]


def _binder(candidates: Sequence[Candidate], aliases: Mapping[str, str]) -> Any:
    """A log-only monitor holding one binding per candidate binding: the monitor's own binder
    (:meth:`stability.monitor.monitor.Monitor.bind_table`) is what tuning scores are computed on."""
    from stability.monitor.monitor import Monitor

    dets: dict[str, dict[str, Any]] = {}
    for c in candidates:
        dets.setdefault(c.name, {"name": c.name, "detector": c.detector,
                                 "inputs": list(c.inputs), "params": c.params_dict()})
    return Monitor({"monitor": {"aliases": dict(aliases), "log_only": True},
                    "detectors": list(dets.values())}, alert_sinks=[])


def score_table(table: Any, candidates: Sequence[Candidate], aliases: Mapping[str, str],
                run_id: str = "") -> RunScores:
    """Compute every candidate's per-step score on one run table.

    The table is bound by the monitor's own binder, so a tuned threshold applies online to
    exactly the scores it was tuned on.
    """
    from stability.config.registry import make_detector

    steps, bound = _binder(candidates, aliases).bind_table(table)
    t = steps.size
    out: list[FloatArray] = []
    for c in candidates:
        x, m = bound[c.name]
        if t == 0 or x.shape[2] == 0:
            out.append(np.full(t, -np.inf))
            continue
        params = c.params_dict()
        if c.tunable:
            params["threshold"] = c.scored_at
        det = make_detector(c.detector, params, n_series=x.shape[2], n_inputs=x.shape[1],
                            where=c.name)
        scores, alarms = det.update_many(*[x[:, i, :] for i in range(x.shape[1])], missing=m)
        if c.tunable:
            out.append(reduce_series(scores))
        else:
            out.append(np.where(alarms.any(axis=1), np.inf, -np.inf))
    return RunScores(run_id, steps, out)


def _score_job(args: tuple[str, str, Sequence[Candidate], Mapping[str, str]]) -> RunScores:
    rid, path, cands, aliases = args
    return score_table(read_table(path, aliases), cands, aliases, rid)


def score_runs(runs: Sequence[tuple[str, str]], candidates: Sequence[Candidate],
               aliases: Mapping[str, str] | None = None, *, backend: str = "local",
               jobs: int | None = None, progress: bool | None = None,
               address: str | None = None,
               failed: list[RunFailure] | None = None) -> list[RunScores]:
    """Run the scoring jobs (one per run) locally in processes or on Ray
    (:func:`replay.fleet.fan_out`, the fan-out of replay and eval too).  ``failed``: as
    :func:`replay.replay.replay_many` (a run that cannot be read is reported there)."""
    al = dict(aliases or {})
    job_args = [(rid, path, list(candidates), al) for rid, path in runs]
    return fan_out_runs(_score_job, job_args, failed=failed, backend=backend, jobs=jobs,
                        label="scoring", progress=progress, address=address)
