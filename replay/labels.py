"""Run labels: what was injected into each run, when, and how the run ended.

Format
------
One row (or JSON object) per run.  Parquet, JSON (a list of objects, or ``{"runs": [...]}``)
and CSV are accepted; the format is chosen by the file suffix.

============================  ===========  ==================================================
column                        type         meaning
============================  ===========  ==================================================
``run_id``                    string       file stem of the run (``public_0007``), required
``scenario``                  string       fault kind; ``clean`` for a run without a fault
``onset_step``                int or null  first step affected; null (only) for clean runs
``end_step``                  int or null  last step of the acute injection (null = to the end)
``outcome``                   string       ``clean``, ``recovered``, ``degraded``, ``diverged``
``divergence_step``           int or null  first step >= onset with non-finite or runaway loss
``failure_step``              int or null  start of the final stretch of a diverged run
``nan_step``                  int or null  first step with a non-finite loss
``effect_step``               int or null  optional: first step with a visible loss effect
============================  ===========  ==================================================

Any other column is kept in :attr:`RunLabel.extra` and ignored by the evaluation.  A missing
``outcome`` defaults to ``clean`` for clean runs and ``degraded`` otherwise; missing step
columns are null.  A clean run must not have an onset; a faulty run must have one.

Examples
--------
>>> labels = labels_from_records([
...     {"run_id": "a", "scenario": "clean"},
...     {"run_id": "b", "scenario": "grad_explosion", "onset_step": 100, "outcome": "diverged",
...      "nan_step": 130},
... ])
>>> labels["b"].onset_step, labels["b"].divergence_ref
(100, 130)
>>> labels["a"].is_clean
True
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUTCOMES = ("clean", "recovered", "degraded", "diverged")
STEP_COLUMNS = (
    "onset_step",
    "end_step",
    "divergence_step",
    "failure_step",
    "nan_step",
    "effect_step",
)
KNOWN_COLUMNS = ("run_id", "scenario", "outcome", *STEP_COLUMNS)


class LabelError(ValueError):
    """A labels file or record is malformed."""


@dataclass(frozen=True)
class RunLabel:
    """Ground truth for one run (see the module docstring for the columns)."""

    run_id: str
    scenario: str = "clean"
    onset_step: int | None = None
    end_step: int | None = None
    outcome: str = "clean"
    divergence_step: int | None = None
    failure_step: int | None = None
    nan_step: int | None = None
    effect_step: int | None = None
    has_effect_column: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_clean(self) -> bool:
        """``True`` for a run without an injected fault."""
        return self.onset_step is None

    @property
    def divergence_ref(self) -> int | None:
        """Earliest of ``nan_step``, ``failure_step`` and ``divergence_step`` (``None`` if none).

        Only defined for faulty runs; this is the step an alarm must precede to count as a
        warning *before* divergence.
        """
        steps = [
            s for s in (self.nan_step, self.failure_step, self.divergence_step) if s is not None
        ]
        if self.is_clean or not steps:
            return None
        return min(steps)

    @property
    def visible(self) -> bool:
        """Whether the fault had a visible effect on the run.

        ``degraded`` and ``diverged`` runs are visible; a ``recovered`` run is visible only when
        the labels carry an ``effect_step`` column and it is set for this run (a transient loss
        effect).  Recovered runs without an effect column are treated as invisible.
        """
        if self.is_clean:
            return False
        if self.outcome in ("degraded", "diverged"):
            return True
        return self.has_effect_column and self.effect_step is not None


def _opt_int(run_id: str, name: str, value: Any) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if not value.is_integer():
            raise LabelError(f"run {run_id!r}: '{name}' must be an integer step; got {value!r}.")
        return int(value)
    if isinstance(value, bool):
        raise LabelError(f"run {run_id!r}: '{name}' must be an integer step; got {value!r}.")
    try:
        return int(value)
    except (TypeError, ValueError):
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise LabelError(
                f"run {run_id!r}: '{name}' must be an integer step or null; got {value!r}."
            ) from None
        return _opt_int(run_id, name, f)


def _keys(rec: Mapping[str, Any], limit: int = 12) -> str:
    """The record's keys, at most ``limit`` of them (a record may be a whole foreign document).

    >>> _keys({"run": "a", "events": []})
    "'run', 'events'"
    """
    keys = [repr(str(k)) for k in list(rec)[:limit]]
    more = len(rec) - limit
    return ", ".join(keys) + (f", ... ({more} more)" if more > 0 else "")


def label_from_record(rec: Mapping[str, Any], has_effect_column: bool | None = None) -> RunLabel:
    """Validate one record and build a :class:`RunLabel`.

    >>> label_from_record({"run_id": "x", "scenario": "clean", "onset_step": 5})
    Traceback (most recent call last):
    ...
    replay.labels.LabelError: run 'x': a clean run must not have an onset_step (got 5).
    """
    if "run_id" not in rec or rec["run_id"] in (None, ""):
        raise LabelError(f"label record without a 'run_id' (keys: {_keys(rec)}); a label "
                         f"record names its run by 'run_id' (docs/guides/tuning.md: labels)")
    run_id = str(rec["run_id"])
    scenario = rec.get("scenario")
    scenario = "clean" if scenario in (None, "") else str(scenario)
    steps = {k: _opt_int(run_id, k, rec.get(k)) for k in STEP_COLUMNS}
    for k, v in steps.items():
        if v is not None and v < 0:
            raise LabelError(f"run {run_id!r}: '{k}' must be >= 0; got {v}.")
    onset = steps["onset_step"]
    if scenario == "clean" and onset is not None:
        raise LabelError(f"run {run_id!r}: a clean run must not have an onset_step (got {onset}).")
    if scenario != "clean" and onset is None:
        raise LabelError(f"run {run_id!r}: scenario {scenario!r} needs an onset_step.")
    outcome = rec.get("outcome")
    if outcome in (None, ""):
        outcome = "clean" if onset is None else "degraded"
    outcome = str(outcome)
    if outcome not in OUTCOMES:
        raise LabelError(f"run {run_id!r}: outcome must be one of {OUTCOMES}; got {outcome!r}.")
    if (outcome == "clean") != (onset is None):
        raise LabelError(
            f"run {run_id!r}: outcome {outcome!r} does not match scenario {scenario!r}."
        )
    end = steps["end_step"]
    if onset is not None and end is not None and end < onset:
        raise LabelError(f"run {run_id!r}: end_step {end} is before onset_step {onset}.")
    extra = {k: v for k, v in rec.items() if k not in KNOWN_COLUMNS}
    if has_effect_column is None:
        has_effect_column = "effect_step" in rec
    return RunLabel(
        run_id=run_id,
        scenario=scenario,
        outcome=outcome,
        has_effect_column=has_effect_column,
        extra=extra,
        **steps,
    )


def labels_from_records(records: Iterable[Mapping[str, Any]]) -> dict[str, RunLabel]:
    """Validate records (dicts) and index them by ``run_id``; duplicate ids are an error."""
    recs = list(records)
    has_effect = any("effect_step" in r for r in recs)
    out: dict[str, RunLabel] = {}
    for rec in recs:
        lab = label_from_record(rec, has_effect_column=has_effect)
        if lab.run_id in out:
            raise LabelError(f"duplicate run_id {lab.run_id!r} in labels.")
        out[lab.run_id] = lab
    return out


def load_labels(path: str | Path) -> dict[str, RunLabel]:
    """Load and validate a labels file (``.parquet``, ``.json`` or ``.csv``).

    Returns
    -------
    dict
        ``run_id -> RunLabel``.

    Raises
    ------
    LabelError
        For an unknown suffix, unreadable content or an invalid record (the message names the
        run and the column).
    """
    p = Path(path)
    if not p.exists():
        raise LabelError(f"labels file not found: {p}")
    suffix = p.suffix.lower()
    if suffix in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        table = pq.read_table(p)
        if "run_id" not in table.column_names:
            raise LabelError(f"{p}: no 'run_id' column (columns: {table.column_names}).")
        records: list[dict[str, Any]] = table.to_pylist()
    elif suffix == ".json":
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise LabelError(f"{p}: not valid JSON ({exc}).") from exc
        if isinstance(data, Mapping) and "runs" in data:
            data = data["runs"]
        if not isinstance(data, list) or not all(isinstance(r, Mapping) for r in data):
            raise LabelError(f"{p}: expected a JSON list of objects (one per run).")
        records = [dict(r) for r in data]
    elif suffix == ".csv":
        with p.open(newline="") as fh:
            records = [dict(r) for r in csv.DictReader(fh)]
    else:
        raise LabelError(f"{p}: unknown labels format {suffix!r}; use .parquet, .json or .csv.")
    try:
        return labels_from_records(records)
    except LabelError as exc:
        raise LabelError(f"{p}: {exc}") from None
