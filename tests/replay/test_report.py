from __future__ import annotations

import base64
import re
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
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
    from replay.cli import main

    run = Path(__file__).resolve().parents[2] / "data" / "runs" / "lr_blowup"
    labels = run.parents[1] / "labels.parquet"
    out = tmp_path / "r.html"
    assert main(["report", str(run), "--labels", str(labels), "-o", str(out)]) == 0
    page = out.read_text()
    assert "lr_loss_anomaly" in page and "detection delay" in page and "<svg" in page
    assert main(["report", str(tmp_path / "missing"), "-o", str(out)]) == 2


# ------------------------------------------------------------------ readable report (issue 16)
class _Page(HTMLParser):
    """Collects elements of interest from a report page."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, dict[str, str]]] = []
        self.svgs: list[dict[str, str]] = []
        self.cells: list[tuple[str, str, str]] = []  # (row class, td class, text) of <td>
        self.episode_rows = 0
        self.rowlabs: dict[str, list[str]] = {}
        self.imgs: dict[str, dict[str, str]] = {}
        self.row_px: dict[str, int] = {}
        self._family = ""
        self._text: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        if tag == "svg":
            self.svgs.append(a)
        if tag == "div" and "data-family" in a:
            self._family = a["data-family"]
            self.rowlabs[self._family] = []
        if tag == "img" and self._family:
            self.imgs[self._family] = a
        if tag == "tr" and a.get("class") == "episode":
            self.episode_rows += 1
        if tag in ("td", "div"):
            self._text = []
        self.stack.append((tag, a))

    def handle_data(self, data):
        if self._text is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        while self.stack:
            t, a = self.stack.pop()
            if t == tag:
                break
        text = "".join(self._text or [])
        if tag == "td":
            row = next((b.get("class", "") for t, b in reversed(self.stack) if t == "tr"), "")
            self.cells.append((row, a.get("class", ""), text))
        if tag == "div" and a.get("class") == "rowlab":
            self.rowlabs[self._family].append(text)
            self.row_px[self._family] = int(re.search(r"height:(\d+)px", a["style"]).group(1))
        if tag in ("td", "div"):
            self._text = None


def parse(page: str) -> _Page:
    p = _Page()
    p.feed(page)
    return p


def decode_png(uri: str) -> np.ndarray:
    """Decode the report's own PNGs (8-bit RGB, filter 0) back to an array."""
    data = base64.b64decode(uri.split(",", 1)[1])
    pos, idat, w, h = 8, b"", 0, 0
    while pos < len(data):
        n = struct.unpack(">I", data[pos : pos + 4])[0]
        tag, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        if tag == b"IHDR":
            w, h = struct.unpack(">II", body[:8])
        elif tag == b"IDAT":
            idat += body
        pos += 12 + n
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(h, 1 + 3 * w)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(h, w, 3)


def per_layer_alarms(steps, layers, score=12.345678901234567):
    return [{"step": s, "kind": "grad_explosion", "signal": f"grad_norm/{lay}",
             "score": score + s + k / 7, "threshold": 6.0, "severity": "warning",
             "detector": "grad_explosion"} for s in steps for k, lay in enumerate(layers)]


def test_alarms_are_grouped_into_episodes_with_rounded_numbers():
    layers = [f"blocks.{i}" for i in range(20)]
    alarms = per_layer_alarms(range(300, 310), layers)  # 200 per-layer alarms, one episode
    alarms.append({"step": 500, "kind": "nonfinite", "signal": "loss", "score": "inf",
                   "threshold": 0.0, "severity": "critical", "detector": "nonfinite"})
    ivs = [{"step": 300, "type": "set_clip", "cause": "outlier"},
           {"step": 500, "type": "skip_step"}]
    page = build_report(synthetic_run(), alarms=alarms, interventions=ivs)
    p = parse(page)
    assert p.episode_rows == 2
    first = [t for r, c, t in p.cells if r == "episode"][:7]
    assert first[0] == "300-309" and first[1] == "outlier"
    assert first[2] == "grad_explosion x200" and "+16 more" in first[3]
    assert first[6] == "set_clip"
    nums = [t for r, c, t in p.cells if c == "num"]  # episodes and the every-alarm list
    assert nums, "no numeric cells"
    for t in nums:
        head = t.split(" (")[0].strip()
        assert head == "inf" or len(re.sub(r"[^0-9]", "", head.split("e")[0]).lstrip("0")) <= 3, t
    assert "12.345678" not in page
    # one shaded band per episode on each timeline chart, not one line per alarm
    assert page.count('class="episode"') == 2 * 3


def test_loss_axis_is_log_so_a_spike_does_not_flatten_the_run():
    n = 600
    steps = np.arange(n)
    loss = 2.0 + 8.0 * np.exp(-steps / 60.0)  # 10 -> 2
    loss[400] = 38 * 2.0
    page = build_report(pa.table({"step": steps, "loss": loss}))
    p = parse(page)
    scales = {s.get("aria-label"): s.get("data-yscale") for s in p.svgs}
    assert scales["loss and validation loss"] == "log"
    svg = page[page.index('aria-label="loss and validation loss"'):]
    svg = svg[: svg.index("</svg>")]
    rect = re.search(r'<rect x="[\d.]+" y="([\d.]+)" width="[\d.]+" height="([\d.]+)" '
                     r'class="plot"', svg)
    top, height = float(rect.group(1)), float(rect.group(2))
    pts = [tuple(map(float, q.split(","))) for q in
           re.search(r'<polyline points="([^"]+)"', svg).group(1).split()]
    ys = np.array([y for x, y in pts])
    # the 10 -> 2 decay (everything but the spike) spans a third of the plot or more;
    # on a linear axis it would be squeezed into 8/74 of it
    normal = ys[ys > ys.min() + 1]
    assert (normal.max() - normal.min()) / height > 0.3
    assert top <= ys.min()
    # losses that go negative fall back to a linear axis
    page2 = build_report(pa.table({"step": steps, "loss": loss - 5.0}))
    assert {s.get("aria-label"): s.get("data-yscale") for s in parse(page2).svgs}[
        "loss and validation loss"] == "linear"


def test_heatmap_rows_are_labelled_and_sparse_rows_filled():
    t = synthetic_run()
    n = t.num_rows
    sparse = np.full(n, np.nan)
    sparse[::10] = 1.0 + 0.1 * np.arange(n // 10)  # activations logged every 10 steps
    t = t.append_column("act_absmax/blocks.0", pa.array(
        [v if i % 10 == 0 else None for i, v in enumerate(sparse)]))
    p = parse(build_report(t))
    assert p.rowlabs["grad_norm"] == ["l0", "l1", "l2"]
    assert p.rowlabs["act_absmax"] == ["blocks.0"]
    img = decode_png(p.imgs["act_absmax"]["src"])
    grey = np.all(img == 200, axis=2)
    assert grey.mean() < 0.02  # filled; unfilled it would be 90 % grey stripes
    # the labels line up with the image rows
    h = re.search(r"height:(\d+)px", p.imgs["grad_norm"]["style"])
    assert h and int(h.group(1)) == 3 * p.row_px["grad_norm"]


def test_sparse_line_series_are_drawn_as_points():
    t = synthetic_run()  # val_loss logged every 50 steps
    page = build_report(t)
    svg = page[page.index('aria-label="loss and validation loss"'):]
    svg = svg[: svg.index("</svg>")]
    vals = [v for v in t.column("val_loss").to_pylist() if v is not None]
    n_val = sum(np.isfinite(vals))
    assert n_val >= 10 and svg.count("<circle") >= n_val


def test_goodput_panel_from_the_event_log():
    from stability.run.goodput import GoodputTracker

    now = [0.0]
    g = GoodputTracker(clock=lambda: now[0])
    g.start()
    for s in range(1, 11):
        now[0] += 2.0
        g.update(s, skipped=s == 5)
    g.note_checkpoint(4.0)
    rec = g.record()
    page = build_report(synthetic_run(), events=[rec])
    assert "wall time by bucket" in page and page.count("<svg") == 3 + 2
    panel = page[page.index("<h2>Goodput</h2>") : page.index("<h2>Timeline</h2>")]
    assert "checkpoint: 4s" in panel and "skipped: 1 (10.0%)" in panel
    # a replay's counterfactual figures instead
    page = build_report(synthetic_run(), goodput={"executed_steps": 100, "skipped_steps": 2,
                                                  "rollback_steps": 8, "steps_after_stop": 50,
                                                  "goodput": 0.9, "stop_step": 99})
    assert "counterfactual" in page and "saved by the stop: 50" in page
    assert build_report(synthetic_run()).count("<h2>Goodput</h2>") == 0
