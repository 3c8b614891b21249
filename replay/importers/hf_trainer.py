"""Hugging Face Transformers ``trainer_state.json`` -> recorded-run table.

The ``Trainer`` appends one dict per logging event to ``state.log_history``: training logs
(``loss``, ``grad_norm``, ``learning_rate``, ``epoch``, ``step``), evaluation logs (``eval_loss``,
``eval_runtime``, ... with the same ``step``) and one final summary (``train_runtime``,
``train_loss``, ``total_flos``, ...). This importer

* uses ``step`` as the step (entries without one are an error naming the entry);
* renames ``learning_rate`` -> ``lr`` and ``eval_loss`` -> ``val_loss``; keeps other numeric keys
  (``grad_norm``, ``epoch``, ``eval_accuracy``, ...) under their own names;
* merges entries with the same step (train + eval);
* moves the final summary's keys (:data:`SUMMARY_KEYS`) and the top-level scalars of the state
  (``global_step``, ``max_steps``, ``train_batch_size``, ...) to the ``"run"`` metadata;
* keeps ``NaN`` / ``Infinity`` (Python's JSON writes them) and treats ``null`` as not logged;
  strings or nested objects in an entry are skipped with one warning.

``path`` may also be a checkpoint directory holding ``trainer_state.json``.

Examples
--------
>>> import json, tempfile, os
>>> p = os.path.join(tempfile.mkdtemp(), "trainer_state.json")
>>> _ = open(p, "w").write(json.dumps({"global_step": 2, "log_history": [
...     {"loss": 2.0, "grad_norm": 1.0, "learning_rate": 1e-4, "epoch": 0.5, "step": 1},
...     {"eval_loss": 2.1, "epoch": 0.5, "step": 1},
...     {"loss": float("nan"), "learning_rate": 5e-5, "epoch": 1.0, "step": 2},
...     {"train_runtime": 3.0, "train_loss": 1.9, "epoch": 1.0, "step": 2}]}))
>>> t = read_trainer_state(p)
>>> t.column_names
['step', 'loss', 'grad_norm', 'lr', 'epoch', 'val_loss']
>>> t.column("loss").to_pylist(), t.column("val_loss").to_pylist()
([2.0, nan], [2.1, None])
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from replay.importers._files import read_text
from replay.schema import RunFormatError, make_metadata, table_from_records

__all__ = ["RENAMES", "SUMMARY_KEYS", "read_trainer_state"]

#: HF key -> canonical column name
RENAMES = {"learning_rate": "lr", "eval_loss": "val_loss"}
#: keys of the final ``train()`` summary entry, stored as run metadata instead of columns
SUMMARY_KEYS = frozenset(
    {
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
        "total_flos",
        "train_loss",
    }
)


_INT64_MAX = 2**63 - 1


def read_trainer_state(path: str | os.PathLike[str]) -> pa.Table:
    """Read ``trainer_state.json`` (or a checkpoint directory holding one).

    Raises
    ------
    RunFormatError
        Invalid (or too deeply nested) JSON, no ``log_history`` list, an entry without an integer
        ``step`` in the int64 range, or no metrics.
    """
    text_path = os.fspath(path)
    if os.path.isdir(text_path):
        text_path = os.path.join(text_path, "trainer_state.json")
    raw = read_text(text_path)
    try:
        state = json.loads(raw)
    except ValueError as exc:
        raise RunFormatError(text_path, f"invalid JSON ({exc})") from None
    except RecursionError:
        raise RunFormatError(text_path, "invalid JSON (nested too deeply)") from None
    if not isinstance(state, dict) or not isinstance(state.get("log_history"), list):
        raise RunFormatError(text_path, "not a trainer_state.json: no 'log_history' list")
    run: dict[str, Any] = {"source": text_path, "format": "hf_trainer"}
    for key, value in state.items():
        if key != "log_history" and isinstance(value, (int, float, str, bool)):
            run[key] = value
    skipped: set[str] = set()

    def records() -> Iterator[tuple[int, dict[str, float | None]]]:
        for i, entry in enumerate(state["log_history"]):
            if not isinstance(entry, dict):
                raise RunFormatError(text_path, f"log_history[{i}] is not an object")
            step = entry.get("step")
            if isinstance(step, float) and step.is_integer():
                step = int(step)
            if not isinstance(step, int) or isinstance(step, bool):
                raise RunFormatError(text_path, f"log_history[{i}] has no integer 'step': {step!r}")
            if not -_INT64_MAX - 1 <= step <= _INT64_MAX:
                raise RunFormatError(
                    text_path, f"log_history[{i}]: 'step' {str(step)[:30]} is beyond int64"
                )
            row: dict[str, float | None] = {}
            is_summary = any(k in SUMMARY_KEYS for k in entry)
            for key, value in entry.items():
                if key == "step":
                    continue
                if is_summary:
                    if key != "epoch":
                        run[key] = value
                    continue
                name = RENAMES.get(str(key), str(key))
                if value is None:
                    row[name] = None
                elif isinstance(value, float):
                    row[name] = value
                elif isinstance(value, int) and not isinstance(value, bool):
                    try:
                        row[name] = float(value)
                    except OverflowError:  # an integer beyond the float range
                        skipped.add(key)
                else:
                    skipped.add(key)
            if row:
                yield step, row

    rows = list(records())  # fills ``run`` with the summary entry
    table = table_from_records(rows, make_metadata(run=run))
    if skipped:
        warnings.warn(
            f"{text_path}: skipped non-numeric log_history key(s) {sorted(skipped)}",
            UserWarning,
            stacklevel=2,
        )
    if table.num_rows == 0:
        raise RunFormatError(text_path, "log_history holds no metrics")
    return table
