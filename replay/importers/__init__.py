"""Importers: turn the files where runs really live into the recorded-run schema.

Every importer returns the same wide table as :func:`replay.reader.read_run` (``step`` int64,
float64 metrics, null = not logged, NaN = NaN, ``b"stability"`` metadata naming the source) and
raises :class:`replay.schema.RunFormatError` naming the file for anything it cannot read.

========================  ==============================================  ====================
format                    function                                        module
========================  ==============================================  ====================
TensorBoard event files   :func:`read_tensorboard`                        ``tensorboard``
HF ``trainer_state.json`` :func:`read_trainer_state`                      ``hf_trainer``
Megatron / DeepSpeed log  :func:`read_megatron_log`, ``parse_megatron_lines``  ``megatron``
CSV / TSV / JSONL / JSON  :func:`read_csv`, :func:`read_jsonl`            ``tabular``
========================  ==============================================  ====================

:func:`replay.io.load_run` picks the right one from the path.

Paths may be local or URIs that :func:`pyarrow.fs.FileSystem.from_uri` understands.
"""

from __future__ import annotations

from replay.importers._files import read_bytes, read_text
from replay.importers.hf_trainer import read_trainer_state
from replay.importers.megatron import read_megatron_log
from replay.importers.tabular import read_csv, read_json, read_jsonl
from replay.importers.tensorboard import read_tensorboard

__all__ = [
    "read_bytes",
    "read_csv",
    "read_json",
    "read_jsonl",
    "read_megatron_log",
    "read_tensorboard",
    "read_text",
    "read_trainer_state",
]
