"""Megatron-LM / Megatron-DeepSpeed / DeepSpeed stdout logs -> recorded-run table.

Recognised lines (anywhere in a line, so ``[default7]:``, ``0:`` or timestamp prefixes are fine):

* Megatron training lines, every ``log_interval`` iterations::

    iteration    31219/  115311 | consumed samples:     47778736 | ... | learning rate: 5.279E-05 |
    global batch size:  2048 | lm loss: 5.098124E+00 | grad norm: 960.351 | num zeros: 0.0 |
    number of skipped iterations:   0 | number of nan iterations:   0 | ...

  ``N/M`` gives ``step`` and ``train_iters_total``; every ``key: value`` field becomes a column
  through :data:`FIELD_NAMES` (``lm loss`` -> ``loss``, ``learning rate`` -> ``lr``, ``grad norm``
  -> ``grad_norm``, ``loss scale`` -> ``loss_scale``, ``number of skipped iterations`` ->
  ``skipped_iterations``, ``number of nan iterations`` -> ``nan_iterations``, ...); unknown keys are
  snake-cased (``mlm loss`` -> ``mlm_loss``). A field absent from a line is null (Megatron drops
  ``lm loss`` on skipped iterations); a printed ``nan`` is NaN.
* Validation lines ``validation loss at iteration N [on <split> set] | lm loss value: X |
  lm loss PPL: Y |`` -> ``val_loss``, ``val_ppl`` (``test_loss`` / ``test_ppl`` for the test set).
* DeepSpeed engine lines ``step=N, skipped=K, lr=[...]`` -> ``lr``, ``skipped_total`` and
  ``steps: N loss: X iter time (s): T samples/sec: S`` -> ``loss``, ``iter_time_s``,
  ``samples_per_second``.
* DeepSpeed fp16 ``OVERFLOW! ... Attempted loss scale: A, reducing to B`` lines: counted into
  ``overflow_skips`` of the *next* iteration line (DeepSpeed prints them before the line of the
  skipped iteration), which also gets ``loss_scale = B`` if it prints none itself.

Everything else is ignored. A file with no recognised line is a
:class:`replay.schema.RunFormatError`; an unparsable value in a recognised line is skipped with
one warning (or raises with the line number when ``strict=True``).

Examples
--------
>>> lines = [
...     " iteration   10/  100 | learning rate: 1.000E-04 | lm loss: 7.5E+00 | grad norm: 1.5 |",
...     " validation loss at iteration 10 | lm loss value: 7.600000E+00 | lm loss PPL: 2.0E+03 |",
...     " iteration   20/  100 | learning rate: 1.000E-04 | lm loss: nan | grad norm: inf |",
... ]
>>> parse_megatron_lines(lines).select(["step", "loss", "grad_norm", "val_loss"]).to_pydict()
{'step': [10, 20], 'loss': [7.5, nan], 'grad_norm': [1.5, inf], 'val_loss': [7.6, None]}
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterable, Iterator, Sequence

import pyarrow as pa

from replay.importers._stream import RowChunks, iter_lines, open_binary
from replay.schema import STEP, RunFormatError, make_metadata, normalize_table

__all__ = ["FIELD_NAMES", "parse_megatron_lines", "read_megatron_log"]

#: Megatron field label -> column name
FIELD_NAMES: dict[str, str] = {
    "consumed samples": "consumed_samples",
    "consumed tokens": "consumed_tokens",
    "elapsed time per iteration (ms)": "iter_time_ms",
    "elapsed time per iteration (s)": "iter_time_s",
    "throughput per gpu (tflop/s/gpu)": "tflops_per_gpu",
    "tflops": "tflops",
    "learning rate": "lr",
    "global batch size": "global_batch_size",
    "lm loss": "loss",
    "loss scale": "loss_scale",
    "grad norm": "grad_norm",
    "num zeros": "num_zeros",
    "params norm": "params_norm",
    "number of skipped iterations": "skipped_iterations",
    "number of nan iterations": "nan_iterations",
    "samples per second": "samples_per_second",
    "curriculum seqlen": "curriculum_seqlen",
}

_ITER = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)$")
_VALID = re.compile(
    r"\bvalidation loss at iteration\s+(\d+)(?:\s+on\s+(\w+)\s+set)?\s*\|(.*)$", re.IGNORECASE
)
_DS_STEP = re.compile(r"\bstep=(\d+),\s*skipped=(\d+),\s*lr=\[([^\]]*)\]")
_DS_STEPS = re.compile(
    r"\bsteps:\s*(\d+)\s+loss:\s*(\S+)\s+iter time \(s\):\s*(\S+)\s+samples/sec:\s*(\S+)"
)
_OVERFLOW = re.compile(r"OVERFLOW!.*?reducing to\s*([-+0-9.eE]+|inf|nan)", re.IGNORECASE)
_NON_WORD = re.compile(r"[^0-9a-z]+")


def _column(label: str) -> str:
    key = " ".join(label.strip().lower().split())
    name = FIELD_NAMES.get(key)
    if name is not None:
        return name
    return _NON_WORD.sub("_", key).strip("_")


def _number(text: str) -> float:
    tok = text.strip().split()
    if not tok:
        raise ValueError("empty value")
    return float(tok[0].rstrip(","))


_INT64_MAX = 2**63 - 1


class _Parser:
    def __init__(self, source: str, strict: bool) -> None:
        self.source = source
        self.strict = strict
        self.bad: tuple[int, str] | None = None
        self.overflows = 0
        self.overflow_scale: float | None = None
        self.matched = 0

    def _fields(self, body: str, lineno: int) -> Iterator[tuple[str, float]]:
        for piece in body.split("|"):
            label, sep, value = piece.rpartition(":")
            if not sep or not label.strip():
                continue
            try:
                yield label, _number(value)
            except ValueError:
                self._bad(lineno, piece.strip())

    def _step(self, text: str, lineno: int) -> int:
        """An iteration number; beyond int64 (a corrupted line) is an error naming the line."""
        step = int(text)
        if step > _INT64_MAX:
            raise RunFormatError(
                self.source, f"line {lineno}: iteration {text[:30]} is beyond the int64 range"
            )
        return step

    def _bad(self, lineno: int, piece: str) -> None:
        if self.strict:
            raise RunFormatError(self.source, f"line {lineno}: cannot parse field {piece!r}")
        if self.bad is None:
            self.bad = (lineno, piece)

    def _take_overflow(self, row: dict[str, float | None]) -> None:
        if self.overflows:
            row["overflow_skips"] = float(self.overflows)
            if row.get("loss_scale") is None and self.overflow_scale is not None:
                row["loss_scale"] = self.overflow_scale
            self.overflows = 0
            self.overflow_scale = None

    def parse(self, lines: Iterable[str]) -> Iterator[tuple[int, dict[str, float | None]]]:
        for lineno, line in enumerate(lines, 1):
            if "|" in line:
                m = _ITER.search(line)
                if m is not None:
                    self.matched += 1
                    row: dict[str, float | None] = {"train_iters_total": float(m.group(2))}
                    for label, value in self._fields(m.group(3), lineno):
                        row[_column(label)] = value
                    self._take_overflow(row)
                    yield self._step(m.group(1), lineno), row
                    continue
                m = _VALID.search(line)
                if m is not None:
                    self.matched += 1
                    split = (m.group(2) or "validation").lower()
                    prefix = "test" if split == "test" else "val"
                    row = {}
                    for label, value in self._fields(m.group(3), lineno):
                        lab = " ".join(label.lower().split())
                        if lab.endswith(" value"):
                            base = lab[: -len(" value")]
                            kind = "loss" if base == "lm loss" else _column(base)
                        elif lab.endswith(" ppl"):
                            base = lab[: -len(" ppl")]
                            kind = "ppl" if base == "lm loss" else _column(base) + "_ppl"
                        else:
                            kind = _column(lab)
                        row[f"{prefix}_{kind}"] = value
                    yield self._step(m.group(1), lineno), row
                    continue
            if "OVERFLOW" in line:
                m = _OVERFLOW.search(line)
                if m is not None:
                    self.matched += 1
                    self.overflows += 1
                    try:
                        self.overflow_scale = float(m.group(1))
                    except ValueError:
                        self._bad(lineno, m.group(0))
                    continue
            m = _DS_STEP.search(line)
            if m is not None:
                self.matched += 1
                row = {"skipped_total": float(m.group(2))}
                lrs = [x for x in m.group(3).split(",") if x.strip()]
                if lrs:
                    try:
                        row["lr"] = _number(lrs[0])
                    except ValueError:
                        self._bad(lineno, m.group(0))
                self._take_overflow(row)
                yield self._step(m.group(1), lineno), row
                continue
            m = _DS_STEPS.search(line)
            if m is not None:
                self.matched += 1
                row = {}
                for name, text in (
                    ("loss", m.group(2)),
                    ("iter_time_s", m.group(3)),
                    ("samples_per_second", m.group(4)),
                ):
                    try:
                        row[name] = _number(text)
                    except ValueError:
                        self._bad(lineno, f"{name}: {text}")
                self._take_overflow(row)
                yield self._step(m.group(1), lineno), row


def parse_megatron_lines(
    lines: Iterable[str], source: str = "<lines>", strict: bool = False
) -> pa.Table:
    """Parse Megatron / DeepSpeed log lines (see the module docstring) into a run table.

    Parameters
    ----------
    lines : iterable of str
        Log lines (newlines allowed at the ends).
    source : str
        Name used in messages and in the ``run`` metadata.
    strict : bool
        Raise on an unparsable value instead of skipping it.
    """
    parser = _Parser(source, strict)
    chunks = RowChunks()
    for step, row in parser.parse(lines):
        chunks.add({STEP: step, **row})
    if parser.matched == 0 or chunks.n_rows == 0:
        raise RunFormatError(source, "no Megatron/DeepSpeed iteration lines found")
    md = make_metadata(run={"source": source, "format": "megatron"})
    table = normalize_table(chunks.table().replace_schema_metadata(md), source)
    if parser.bad is not None:
        warnings.warn(
            f"{source}: line {parser.bad[0]}: skipped unparsable field {parser.bad[1]!r} "
            "(first of possibly several)",
            UserWarning,
            stacklevel=2,
        )
    return table


def read_megatron_log(
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], strict: bool = False
) -> pa.Table:
    """Read one log file, or several (e.g. successive restarts) in the given order.

    Later files win for steps that appear twice (a restart re-running iterations after a rollback).
    Files are streamed line by line (memory grows with the rows found, not with the file size);
    lines longer than 16 MiB (binary junk, a zero-filled tail) are skipped.

    Raises
    ------
    RunFormatError
        Missing file, or no recognised line in any of the files.
    """
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    if not paths:
        raise ValueError("read_megatron_log needs at least one path")
    names = [os.fspath(p) for p in paths]

    def lines() -> Iterator[str]:
        for name in names:
            with open_binary(name) as fh:
                try:
                    for _, raw in iter_lines(fh):
                        yield "" if raw is None else raw.decode("utf-8", errors="replace")
                except OSError as exc:
                    raise RunFormatError(name, f"cannot read ({exc})") from None

    return parse_megatron_lines(lines(), source=", ".join(names), strict=strict)
