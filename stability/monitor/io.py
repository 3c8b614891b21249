"""Monitor input/output helpers: value coercion, table columns, JSON-safe state encoding.

Examples
--------
>>> to_float(3), to_float(np.float32(0.5)), to_float(np.array([2.0]))
(3.0, 0.5, 2.0)
>>> to_float("1.5"), to_float(np.zeros(3))
('string value not accepted', 'shape (3,); expected a scalar')
>>> decode_state(encode_state({"a": np.array([1.0, np.nan]), "b": float("inf")}))
{'a': array([ 1., nan]), 'b': inf}
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["to_float", "value_kind", "value_message", "is_table", "table_columns",
           "encode_state", "decode_state"]

_ND = "__ndarray__"
# one past the monitor's largest accepted step (stability.monitor.monitor.MAX_STEP)
_STEP_LIMIT = 2**53
_FL = "__float__"


def _from_array(a: np.ndarray) -> float | str:
    if a.dtype.kind not in "fiub":
        return f"dtype {a.dtype} not accepted"
    if a.size != 1:
        return f"shape {a.shape}; expected a scalar"
    return float(a.reshape(-1)[0])


def to_float(v: Any) -> float | str:
    """Coerce one metric value to ``float``; a ``str`` return value is the rejection reason.

    Accepted: ``int``/``float`` (booleans as 0/1), NumPy scalars and size-1 arrays, objects
    with ``__float__`` (e.g. 1-element torch tensors, also on GPU) or ``__array__``.  Rejected:
    strings, bytes, complex numbers (Python, NumPy or torch), meta tensors, other shapes, other
    objects, and any object whose conversion raises.  Never raises (``Exception`` subclasses).
    """
    t = type(v)
    if t is float or t is int:
        try:
            return float(v)
        except OverflowError:
            return "integer too large for float64"
    if isinstance(v, (bool, np.bool_)):
        return float(v)
    if isinstance(v, (str, bytes)):
        return "string value not accepted"
    if isinstance(v, (complex, np.complexfloating)):
        return "complex value not accepted"
    if isinstance(v, (np.floating, np.integer)):
        return float(v)
    if isinstance(v, np.ndarray):
        return _from_array(v)
    if isinstance(v, (int, float)):  # subclasses
        return float(v)
    shape = getattr(v, "shape", None)
    dtype = getattr(v, "dtype", None)
    if getattr(dtype, "is_complex", False) or getattr(dtype, "kind", "") == "c":
        return "complex value not accepted"  # float() would drop the imaginary part
    if getattr(v, "is_meta", False) is True:
        return f"{type(v).__name__} on the meta device has no value"
    if hasattr(v, "__float__"):
        if shape is not None and math.prod(tuple(shape)) != 1:
            return f"shape {tuple(shape)}; expected a scalar"
        try:
            return float(v)
        except Exception as exc:  # foreign objects may raise anything
            return f"cannot convert {type(v).__name__} to float ({exc})"
    if hasattr(v, "__array__"):
        try:
            return _from_array(np.asarray(v))
        except Exception as exc:
            return f"cannot convert {type(v).__name__} to float ({exc})"
    return f"not a number ({type(v).__name__})"


def value_kind(value: Any, reason: str) -> str:
    """The kind of a rejected value, for one warning per kind.

    >>> value_kind("2.31", ""), value_kind("abc", ""), value_kind(None, "not a number (X)")
    ('numeric string', 'string', 'not a number')
    """
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return "string"
        return "numeric string"
    return reason.split(" (")[0]


def value_message(key: Any, value: Any, reason: str) -> str:
    """The skipped-value message of ``metrics[key]``; a numeric string says how to pass it.

    >>> value_message("loss", "2.31", "string value not accepted")
    "metrics['loss']: string value '2.31' not accepted (pass a number: float('2.31')); skipped"
    """
    if isinstance(value, str):
        text = repr(value[:40])
        try:
            float(value)
        except ValueError:
            return f"metrics[{key!r}]: string value {text} not accepted; skipped"
        return (f"metrics[{key!r}]: string value {text} not accepted (pass a number: "
                f"float({text})); skipped")
    return f"metrics[{key!r}]: {reason}; skipped"


def _numeric_column(v: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """(float64 values, present mask) of a dict column, or ``None`` for non-numeric columns."""
    if isinstance(v, np.ma.MaskedArray):
        if v.dtype.kind not in "fiub":
            return None
        mask = np.ma.getmaskarray(v)
        return np.asarray(v.filled(0), dtype=np.float64), ~mask
    a = np.asarray(v)
    if a.dtype == object:
        present = np.array([x is not None for x in a], dtype=np.bool_)
        out = np.zeros(len(a))
        for i in np.flatnonzero(present):
            x = to_float(a[i])
            if isinstance(x, str):
                return None
            out[i] = x
        return out, present
    if a.dtype.kind not in "fiub" or a.ndim != 1:
        return None
    return a.astype(np.float64), np.ones(a.shape[0], dtype=np.bool_)


#: Arrow type names of the columns replay reads (floating, integer, boolean)
ARROW_NUMERIC = frozenset({"halffloat", "float", "double", "bool", "int8", "int16", "int32",
                            "int64", "uint8", "uint16", "uint32", "uint64"})


def _frame_kind(data: Any) -> str:
    """``"pandas"`` / ``"polars"`` for their DataFrames (by module name, no import), else ``""``."""
    mod = type(data).__module__
    if mod.startswith("pandas") and hasattr(data, "iloc") and hasattr(data, "columns"):
        return "pandas"
    if mod.startswith("polars") and hasattr(data, "get_column") and hasattr(data, "columns"):
        return "polars"
    return ""


def is_table(data: Any) -> bool:
    """Whether :func:`table_columns` reads ``data`` as one table (not an iterable of batches).

    >>> is_table({"step": [0]}), is_table([{"step": [0]}])
    (True, False)
    """
    if isinstance(data, Mapping):
        return True
    mod = type(data).__module__
    return (mod.startswith("pyarrow") and hasattr(data, "column_names")) or bool(_frame_kind(data))


def _checked(name: Any, nc: tuple[np.ndarray, np.ndarray] | None, n: int,
             cols: list[tuple[str, np.ndarray, np.ndarray]]) -> None:
    if nc is None:
        return
    if nc[0].shape != (n,):
        raise ValueError(f"replay: column {name!r} has shape {nc[0].shape}; expected ({n},).")
    cols.append((str(name), nc[0], nc[1]))


def _pandas_column(s: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """(values, present) of a pandas Series; NumPy float64 NaN is a NaN value (see below)."""
    dt = s.dtype
    kind = getattr(dt, "kind", "O")
    if isinstance(dt, np.dtype):  # plain NumPy dtype: NaN cannot mean "missing" here
        return _numeric_column(s.to_numpy())
    if kind not in "fiub":
        return None
    # nullable extension dtypes (Float64, Int64, boolean, double[pyarrow]): NA = not logged
    present = ~np.asarray(s.isna().to_numpy(), dtype=np.bool_)
    vals = np.asarray(s.to_numpy(dtype="float64", na_value=np.nan), dtype=np.float64)
    return np.where(present, vals, 0.0), present


def _polars_column(s: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """(values, present) of a polars Series: null = not logged, NaN = NaN."""
    dt = s.dtype
    if not (dt.is_numeric() or str(dt) == "Boolean"):
        return None
    present = ~np.asarray(s.is_null().to_numpy(), dtype=np.bool_)
    raw = np.asarray(s.to_numpy())
    if raw.dtype == object:  # booleans / decimals with nulls
        vals = np.zeros(raw.shape[0])
        for i in np.flatnonzero(present):
            x = to_float(raw[i])
            vals[i] = np.nan if isinstance(x, str) else x
        return vals, present
    return np.where(present, raw.astype(np.float64), 0.0), present


def _frame_columns(data: Any, kind: str) -> tuple[np.ndarray,
                                                     list[tuple[str, np.ndarray, np.ndarray]]]:
    cols: list[tuple[str, np.ndarray, np.ndarray]] = []
    names = list(data.columns)
    if kind == "polars":
        if "step" not in names:
            raise ValueError("replay: the table has no 'step' column.")
        scol = data.get_column("step")
        if scol.null_count():
            raise ValueError("replay: the 'step' column contains nulls.")
        steps = np.asarray(scol.to_numpy())
        for name in names:
            if name != "step":
                _checked(name, _polars_column(data.get_column(name)), steps.shape[0], cols)
        return steps, cols
    if "step" in names:
        scol = data.iloc[:, names.index("step")]
    elif getattr(data.index, "name", None) == "step":
        scol = data.index.to_series()
    else:
        raise ValueError("replay: the table has no 'step' column (nor a 'step' index).")
    if bool(scol.isna().any()):
        raise ValueError("replay: the 'step' column contains nulls.")
    steps = np.asarray(scol.to_numpy())
    for k, name in enumerate(names):
        if name != "step":
            _checked(name, _pandas_column(data.iloc[:, k]), steps.shape[0], cols)
    return steps, cols


def table_columns(data: Any) -> tuple[np.ndarray, list[tuple[str, np.ndarray, np.ndarray]]]:
    """``(steps, [(name, values, present), ...])`` of a wide table.

    Accepted tables: a pyarrow ``Table`` / ``RecordBatch``, a dict of arrays, a pandas or a
    polars ``DataFrame`` (all duck-typed: the runtime imports neither pyarrow nor pandas).
    Numeric columns only (integer / floating / boolean); the rest are ignored.  ``step`` is
    required (for pandas it may be the index) and may not contain nulls.

    What counts as *not logged* (the monitor skips the metric at that step) and what as a
    NaN value (a ``nonfinite`` alarm):

    * Arrow, polars and nullable pandas dtypes (``Float64``, ``Int64``, ``boolean``,
      ``double[pyarrow]``): null / ``pd.NA`` = not logged, NaN = NaN.
    * dicts: masked entries and ``None`` = not logged, NaN = NaN.
    * plain NumPy ``float64`` pandas columns cannot tell the two apart; NaN there is a NaN
      value.  Sparse metrics (an eval every 100 steps) in a pandas frame therefore need a
      nullable dtype -- ``df.convert_dtypes()`` or ``df.astype({"val_loss": "Float64"})`` --
      or a dict / Arrow table (in pandas 3 a NaN written into a ``Float64`` column is NA).

    >>> steps, cols = table_columns({"step": [0, 1], "loss": [1.0, None], "tag": ["a", "b"]})
    >>> steps.tolist(), [(n, v.tolist(), p.tolist()) for n, v, p in cols]
    ([0, 1], [('loss', [1.0, 0.0], [True, False])])
    """
    cols: list[tuple[str, np.ndarray, np.ndarray]] = []
    kind = _frame_kind(data)
    if kind:
        steps, cols = _frame_columns(data, kind)
    elif isinstance(data, Mapping):
        if "step" not in data:
            raise ValueError("replay: the table has no 'step' column.")
        steps = np.asarray(data["step"])
        for name, v in data.items():
            if name == "step":
                continue
            nc = _numeric_column(v)
            if nc is not None:
                if nc[0].shape != steps.shape:
                    raise ValueError(f"replay: column {name!r} has shape {nc[0].shape}; "
                                     f"expected {steps.shape}.")
                cols.append((str(name), nc[0], nc[1]))
    else:  # an Arrow table, duck-typed: the runtime never imports pyarrow
        names = list(data.column_names)
        if "step" not in names:
            raise ValueError("replay: the table has no 'step' column.")
        scol = data.column(names.index("step"))
        if scol.null_count:
            raise ValueError("replay: the 'step' column contains nulls.")
        steps = np.asarray(scol.to_numpy(zero_copy_only=False))
        for k, name in enumerate(names):
            if name == "step":
                continue
            col = data.column(k)
            if str(col.type) not in ARROW_NUMERIC:
                continue
            present = ~np.asarray(col.is_null().to_numpy(zero_copy_only=False), dtype=np.bool_)
            vals = np.asarray(col.cast("float64").to_numpy(zero_copy_only=False),
                              dtype=np.float64)
            cols.append((str(name), np.where(present, vals, 0.0), present))
    if steps.dtype.kind not in "iu" and steps.size:
        if steps.dtype.kind != "f" or not np.all(np.isfinite(steps)) or np.any(steps % 1):
            raise ValueError("replay: the 'step' column must hold integers.")
    if steps.dtype.kind in "uf" and steps.size:
        # out-of-range steps (1e300, uint64 near 2**64) must not wrap around to valid-looking
        # int64 steps: clip them just past the largest accepted step, where observe() skips them
        steps = (np.minimum(steps, np.uint64(_STEP_LIMIT)) if steps.dtype.kind == "u"
                 else np.clip(steps, -_STEP_LIMIT, _STEP_LIMIT))
    return steps.astype(np.int64), cols


def encode_state(x: Any) -> Any:
    """Make nested state JSON-safe: arrays and non-finite floats become tagged dicts."""
    if isinstance(x, np.ndarray):
        flat = x.reshape(-1).tolist()
        if x.dtype.kind == "f":
            flat = [v if math.isfinite(v) else repr(v) for v in flat]
        return {_ND: x.dtype.str, "shape": list(x.shape), "data": flat}
    if isinstance(x, Mapping):
        return {str(k): encode_state(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [encode_state(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return {_FL: repr(x)}
    return x


def decode_state(x: Any) -> Any:
    """Inverse of :func:`encode_state` (bit-exact for floats)."""
    if isinstance(x, Mapping):
        if _ND in x:
            dt = np.dtype(x[_ND])
            data = [float(v) for v in x["data"]] if dt.kind == "f" else x["data"]
            return np.array(data, dtype=dt).reshape(tuple(x["shape"]))
        if _FL in x and len(x) == 1:
            return float(x[_FL])
        return {k: decode_state(v) for k, v in x.items()}
    if isinstance(x, list):
        return [decode_state(v) for v in x]
    return x
