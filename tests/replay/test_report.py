from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.plotting import bin_columns, colormap, encode_png
from replay.report import build_report, split_events, write_report
from tests.shared_data import PUBLIC_RUNS

PUBLIC = PUBLIC_RUNS


def synthetic_run(n: int = 600) -> pa.Table:
    rng = np.random.default_rng(0)
    steps = np.arange(n)
    loss = 3.0 * np.exp(-steps / 200) + 0.1 * rng.random(n)
    loss[400] = np.nan
    val = np.full(n, np.nan)
    cols = {
        "step": pa.array(steps, pa.int64()),
        "loss": pa.array(loss),
        "val_loss": pa.array([v if i % 50 == 0 else None for i, v in enumerate(loss + 0.1)]),
        "lr": pa.array(np.linspace(1e-3, 1e-4, n)),
        "grad_norm": pa.array(np.exp(rng.normal(0, 0.3, n))),
    }
    for layer in ("l0", "l1", "l2"):
        cols[f"grad_norm/{layer}"] = pa.array(np.exp(rng.normal(0, 0.3, n)))
        cols[f"act_std/{layer}"] = pa.array(1 + 0.1 * rng.random(n))
    del val
    return pa.table(cols)


def test_png_encoder_roundtrip_header_and_size():
    img = np.zeros((5, 7, 3), dtype=np.uint8)
    img[2, 3] = [255, 0, 0]
    png = encode_png(img)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(png[16:20], "big") == 7 and int.from_bytes(png[20:24], "big") == 5
    with pytest.raises(ValueError, match="uint8"):
        encode_png(np.zeros((2, 2, 3)))


def test_colormap_and_binning():
    c = colormap(np.array([[0.0, 0.5, 1.0, np.nan]]))
    assert c.shape == (1, 4, 3) and c.dtype == np.uint8
    s, v = bin_columns(np.arange(10), np.arange(10.0)[:, None], 5)
    assert s.tolist() == [0.5, 2.5, 4.5, 6.5, 8.5] and v[:, 0].tolist() == s.tolist()


def test_report_contents():
    t = synthetic_run()
    alarms = [
        {
            "step": 400,
            "kind": "nonfinite",
            "signal": "loss",
            "score": "inf",
            "severity": "critical",
            "detector": "nonfinite",
        }
    ]
    page = build_report(
        t,
        alarms=alarms,
        interventions=[{"step": 400, "type": "skip_step"}],
        config={"preset": "default"},
        title="synthetic",
    )
    assert page.count("<svg") == 3
    assert page.count("<img") == 2  # grad_norm and act_std heat maps
    assert "nonfinite" in page and "skip_step x1" in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in page


def test_split_events_accepts_nested_and_flat_records():
    recs = [
        {"event": "alarm", "alarm": {"step": 5, "kind": "loss_spike", "signal": "loss"}},
        {"event": "intervention", "intervention": {"step": 5, "type": "set_clip"}},
        {"type": "goodput", "productive_steps": 10},
        {"type": "info", "msg": "hello"},
    ]
    a, i, g = split_events(recs)
    assert [x["step"] for x in a] == [5] and i[0]["type"] == "set_clip"
    assert g == {"productive_steps": 10}


def test_report_rejects_table_without_steps():
    with pytest.raises(ValueError, match="step"):
        build_report(pa.table({"loss": [1.0]}))


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed")
def test_report_renders_in_headless_chromium(tmp_path):
    run = PUBLIC / "public_0023.parquet"
    table = pq.read_table(run) if run.exists() else synthetic_run()
    html_path = write_report(
        tmp_path / "report.html",
        table,
        alarms=[
            {
                "step": 1030,
                "kind": "loss_spike",
                "signal": "loss",
                "score": 9.0,
                "severity": "warning",
                "detector": "ewma_z",
            }
        ],
        title="browser test",
    )
    flags = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
    ]
    dom = subprocess.run(
        [*flags, "--dump-dom", html_path.as_uri()], capture_output=True, text=True, timeout=120
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert dom.stdout.count("<svg") == 3
    assert len(re.findall(r"<polyline", dom.stdout)) >= 3
    assert "data:image/png;base64," in dom.stdout
    console = [ln for ln in dom.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    assert console == [], console
    shot = tmp_path / "shot.png"
    res = subprocess.run(
        [*flags, "--window-size=1000,2000", f"--screenshot={shot}", html_path.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0 and shot.stat().st_size > 20_000


def test_png_summary(tmp_path):
    pytest.importorskip("matplotlib")
    from replay.report import write_png

    out = tmp_path / "run.png"
    write_png(out, synthetic_run(), alarms=[{"step": 400, "kind": "nonfinite"}], title="png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_report_cli_replays_a_bundled_sample(tmp_path):
    from stability.cli import main

    run = Path(__file__).resolve().parents[2] / "data" / "runs" / "lr_blowup"
    labels = run.parents[1] / "labels.parquet"
    out = tmp_path / "r.html"
    assert main(["report", str(run), "--labels", str(labels), "-o", str(out)]) == 0
    page = out.read_text()
    assert "lr_loss_anomaly" in page and "detection delay" in page and "<svg" in page
    assert main(["report", str(tmp_path / "missing"), "-o", str(out)]) == 2
