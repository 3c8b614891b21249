"""Megatron / DeepSpeed log importer, on verbatim and reconstructed BigScience lines."""

from __future__ import annotations

import math

import numpy as np
import pyarrow.parquet as pq
import pytest

from replay.importers.megatron import parse_megatron_lines, read_megatron_log
from replay.schema import RunFormatError, read_metadata

from .fixtures import CHRONICLES, FIXTURES, need

#: chronicle columns and the Megatron-DeepSpeed format of each field (training.py, training_log)
_FIELDS = [
    ("consumed_samples", "consumed samples", "{:12d}"),
    ("consumed_tokens", "consumed tokens", "{:12d}"),
    ("iter_time_ms", "elapsed time per iteration (ms)", "{:.1f}"),
    ("iter_time_s", "elapsed time per iteration (s)", "{:.2f}"),
    ("lr", "learning rate", "{:.3E}"),
    ("global_batch_size", "global batch size", "{:5d}"),
    ("loss", "lm loss", "{:.6E}"),
    ("loss_scale", "loss scale", "{:.1f}"),
    ("grad_norm", "grad norm", "{:.3f}"),
    (None, "num zeros", "0.0"),
    ("skipped_iterations", "number of skipped iterations", "{:3d}"),
    ("nan_iterations", "number of nan iterations", "{:3d}"),
    ("samples_per_second", "samples per second", "{:.3f}"),
    ("tflops", "TFLOPs", "{:.2f}"),
]
COMPARED = [c for c, _, _ in _FIELDS if c is not None] + ["train_iters_total", "val_loss"]


def _present(v: object) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def format_megatron_line(row: dict) -> list[str]:
    """Megatron-DeepSpeed stdout line(s) for one chronicle row (fields absent where NaN)."""
    lines = []
    if _present(row.get("loss")) or _present(row.get("grad_norm")):
        s = " iteration {:8d}/{:8d} |".format(row["step"], int(row["train_iters_total"]))
        for col, label, fmt in _FIELDS:
            if col is None:
                s += f" {label}: {fmt} |"
            elif _present(row.get(col)):
                v = row[col]
                s += f" {label}: " + fmt.format(int(v) if "d}" in fmt else v) + " |"
        lines.append(s)
    if _present(row.get("val_loss")):
        v = row["val_loss"]
        lines.append("-" * 96)
        lines.append(
            f" validation loss at iteration {row['step']} | lm loss value: {v:.6E} | "
            f"lm loss PPL: {math.exp(v):.6E} | "
        )
        lines.append("-" * 96)
    return lines


@pytest.fixture(scope="module")
def quoted():
    return pq.read_table(need(CHRONICLES / "all_quoted_lines.parquet")).to_pylist()


def test_verbatim_lines():
    t = read_megatron_log(FIXTURES / "megatron_verbatim.log")
    d = {s: r for s, r in zip(t.column("step").to_pylist(), t.to_pylist(), strict=True)}
    assert sorted(d) == [7000, 7010, 17063, 29030, 29040, 29050, 29060, 31217, 31218, 31219, 31220]
    assert d[31219]["grad_norm"] == 960.351 and d[31219]["loss"] == 5.098124
    assert d[31219]["iter_time_s"] == 106.36 and d[31219]["tflops"] == 147.43
    assert d[31219]["train_iters_total"] == 115311 and d[31219]["lr"] == 5.279e-05
    assert d[7000]["val_loss"] == 7.1742 and d[7000]["val_ppl"] == 1305.315
    assert d[7000]["loss_scale"] == 2048.0 and d[7000]["iter_time_ms"] == 18706.1
    assert d[7010]["val_loss"] is None
    assert d[29050]["loss_scale"] == 8192.0 and d[29050]["grad_norm"] == 0.0
    # the DeepSpeed OVERFLOW line belongs to the iteration printed after it
    assert d[17063]["overflow_skips"] == 1.0 and d[17063]["loss_scale"] == 524288.0
    assert d[31219]["overflow_skips"] is None
    assert d[31219]["skipped_iterations"] == 0.0 and d[31219]["nan_iterations"] == 0.0
    md = read_metadata(t.schema)
    assert md["run"]["format"] == "megatron"


def test_every_quoted_line_round_trips(quoted):
    """Each of the 93 quoted chronicle rows, printed the Megatron way, parses to its numbers."""
    n = 0
    for row in quoted:
        lines = format_megatron_line(row)
        if not lines:
            continue
        got = parse_megatron_lines(lines, source=row["file"]).to_pylist()
        assert len(got) == 1, lines
        g = got[0]
        assert g["step"] == row["step"]
        for col in COMPARED:
            want = row.get(col)
            if _present(want):
                assert g.get(col) == pytest.approx(want, rel=1e-12, abs=0), (col, lines)
            else:
                assert g.get(col) is None, (col, lines)
        n += 1
    assert n == len(quoted)


@pytest.mark.parametrize(
    ("section", "run"),
    [
        ("### 2022-04-12 First lm loss spike", "tr11-176B_BLOOM_first_loss_spike_31216"),
        ("## Experiment 12", "tr8-104B_exp12_spike_8740_diverge_9027"),
        ("## Embed-Norm Experiment 7", "tr8b-104B_embnorm_exp7_optim_reset_spike_17062"),
        ("### Analyzing Spike", "tr8-104B_exp11_spike_11447"),
    ],
)
def test_reconstructed_log_equals_chronicle_parquet(quoted, section, run, tmp_path):
    lines = [ln for r in quoted if r["section"] == section for ln in format_megatron_line(r)]
    log = tmp_path / "stdout.log"
    log.write_text("\n".join(f"[default7]:{ln}" for ln in lines) + "\n")
    got = read_megatron_log(log)
    want = pq.read_table(need(CHRONICLES / f"{run}.parquet"))
    assert got.column("step").to_pylist() == want.column("step").to_pylist()
    for col in want.column_names[1:]:
        a = np.array(got.column(col).to_pylist(), dtype=float)
        b = want.column(col).to_numpy(zero_copy_only=False)
        if run.startswith("tr8-104B_exp12") and col == "loss":
            # 9027 prints no lm loss: the importer says "not logged" (null); the chronicle
            # parquet stores NaN for it
            assert got.column("loss")[-1].as_py() is None
        np.testing.assert_array_equal(a, b, err_msg=col)
    if run.startswith("tr11"):
        gn = dict(
            zip(got.column("step").to_pylist(), got.column("grad_norm").to_pylist(), strict=True)
        )
        assert [gn[s] for s in range(31214, 31220)] == [
            0.242,
            0.947,
            2.39,
            15.886,
            145.119,
            960.351,
        ]


def test_megatron_lm_new_style_and_deepspeed_lines():
    lines = [
        "[2024-05-01 10:00:00] iteration      100/   50000 | consumed samples:        51200 | "
        "elapsed time per iteration (ms): 1234.5 | throughput per GPU (TFLOP/s/GPU): 401.2 | "
        "learning rate: 3.000000E-04 | global batch size:   512 | lm loss: 7.123456E+00 | "
        "load_balancing_loss: 1.010000E+00 | loss scale: 1.0 | grad norm: 2.345 | "
        "num zeros: 12.0 | params norm: 345.678 | number of skipped iterations:   0 | "
        "number of nan iterations:   1 |",
        " validation loss at iteration 100 on validation set | lm loss value: 7.2E+00 | "
        "lm loss PPL: 1.3E+03 | ",
        " validation loss at iteration 100 on test set | lm loss value: 7.3E+00 | ",
        "0: [Rank 0] step=110, skipped=3, lr=[0.00029, 0.00029], mom=[(0.9, 0.95), (0.9, 0.95)]",
        "0: steps: 110 loss: 6.9876 iter time (s): 0.512 samples/sec: 125.000",
        "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, "
        "reducing to 32768",
        "0: steps: 120 loss: nan iter time (s): 0.5 samples/sec: 120.0",
        "random noise | with pipes: but no iteration",
    ]
    d = {r["step"]: r for r in parse_megatron_lines(lines).to_pylist()}
    r = d[100]
    assert r["tflops_per_gpu"] == 401.2 and r["load_balancing_loss"] == 1.01
    assert r["params_norm"] == 345.678 and r["nan_iterations"] == 1.0
    assert r["val_loss"] == 7.2 and r["val_ppl"] == 1300.0 and r["test_loss"] == 7.3
    assert d[110]["lr"] == 0.00029 and d[110]["skipped_total"] == 3.0
    assert d[110]["loss"] == 6.9876 and d[110]["iter_time_s"] == 0.512
    assert math.isnan(d[120]["loss"]) and d[120]["overflow_skips"] == 1.0
    assert d[120]["loss_scale"] == 32768.0


def test_nan_and_inf_values_and_missing_fields():
    lines = [
        " iteration 1/ 10 | learning rate: 1.0E-04 | lm loss: nan | grad norm: inf |",
        " iteration 2/ 10 | learning rate: 1.0E-04 | grad norm: -inf |",
    ]
    t = parse_megatron_lines(lines).to_pydict()
    assert math.isnan(t["loss"][0]) and t["loss"][1] is None
    assert t["grad_norm"] == [math.inf, -math.inf]


def test_garbage_logs(tmp_path):
    p = tmp_path / "garbage.log"
    p.write_bytes(b"\x00\xff\xfe random bytes \n no iteration here | at all\n")
    with pytest.raises(RunFormatError, match="garbage.log: no Megatron/DeepSpeed iteration lines"):
        read_megatron_log(p)
    with pytest.raises(RunFormatError, match="missing.log: cannot read"):
        read_megatron_log(tmp_path / "missing.log")
    bad = [
        " iteration 1/ 10 | lm loss: 2.0 | grad norm: abc |",
        " iteration 2/ 10 | lm loss: 2.0 | grad norm: 1.0 |",
    ]
    with pytest.warns(UserWarning, match="line 1: skipped unparsable field 'grad norm: abc'"):
        t = parse_megatron_lines(bad, source="x.log")
    assert t.column("grad_norm").to_pylist() == [None, 1.0]
    with pytest.raises(RunFormatError, match="x.log: line 1: cannot parse field 'grad norm: abc'"):
        parse_megatron_lines(bad, source="x.log", strict=True)


def test_several_files_later_wins(tmp_path):
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text(" iteration 1/ 9 | lm loss: 2.0 |\n iteration 2/ 9 | lm loss: 9.0 |\n")
    b.write_text(" iteration 2/ 9 | lm loss: 1.5 |\n iteration 3/ 9 | lm loss: 1.4 |\n")
    t = read_megatron_log([a, b])
    assert t.column("loss").to_pylist() == [2.0, 1.5, 1.4]
    with pytest.raises(ValueError):
        read_megatron_log([])
