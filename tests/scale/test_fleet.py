"""Fan-out on Ray (a local instance): replay, eval and tune give the local results, over
directories, globs and ``file://`` URIs; clear errors without Ray or without a cluster."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from replay.cli import main
from replay.fleet import BackendUnavailable, _check_reachable, fan_out
from replay.replay import alarms_for_eval, discover_many, discover_runs, replay_many

DATA = Path(__file__).resolve().parents[2] / "data"
RUNS = DATA / "runs"
#: three of the bundled runs: a clean one and two faults (enough to see alarms, fast on 1 CPU)
SOME = ["clean_mlp", "grad_explosion", "lr_blowup"]


@pytest.fixture(scope="module")
def ray_local() -> Any:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _runs() -> list[tuple[str, str]]:
    return [(rid, p) for rid, p in discover_runs(str(RUNS)) if rid in SOME]


def _summary(r: Any) -> dict[str, Any]:
    s = r.summary()
    s.pop("seconds")
    return s


def test_uri_discovery_matches_local_paths() -> None:
    local = discover_runs(str(RUNS))
    uri = discover_runs(RUNS.as_uri())
    assert [r for r, _ in uri] == [r for r, _ in local] and len(local) == 7
    assert all(p.startswith("file:///") for _, p in uri)
    globbed = discover_runs(RUNS.as_uri() + "/*_*")
    assert [r for r, _ in globbed] == [r for r, _ in local if "_" in r]
    assert discover_runs(RUNS.as_uri() + "/lr_blowup") == [
        ("lr_blowup", RUNS.as_uri() + "/lr_blowup")]
    assert discover_runs(RUNS.as_uri() + "/nothing_here") == []


def test_ray_replay_equals_local_over_uris(ray_local: Any, tmp_path: Path) -> None:
    runs = _runs()
    uris = discover_many([(RUNS / r).as_uri() for r in SOME])
    local = replay_many(runs, jobs=1, progress=False)
    remote = replay_many(uris, backend="ray", progress=False, events_dir=tmp_path)
    assert [_summary(r)["alarms"] for r in local] == [_summary(r)["alarms"] for r in remote]
    for a, b in zip(local, remote, strict=True):
        sa, sb = _summary(a), _summary(b)
        assert sb.pop("path").startswith("file://") and sa.pop("path") == a.path
        assert sa == sb
        np.testing.assert_array_equal(a.steps, b.steps)
    assert any(r.alarms for r in remote) and sorted(p.name for p in tmp_path.iterdir()) == [
        f"{r}.jsonl" for r in SOME]


def test_ray_eval_and_scoring_equal_local(ray_local: Any) -> None:
    from replay.tuning import make_candidates, score_runs
    from stability.config.config import load_config

    runs = _runs()
    st_l, al_l = alarms_for_eval(runs, baselines=True, jobs=1, progress=False)
    st_r, al_r = alarms_for_eval(runs, baselines=True, backend="ray", progress=False)
    assert st_l.keys() == st_r.keys() and al_l.keys() == al_r.keys()
    for name in al_l:
        for rid in st_l:
            np.testing.assert_array_equal(al_l[name][rid], al_r[name][rid])
    cands = make_candidates(load_config("default").to_dict()["detectors"], grids={})
    for a, b in zip(score_runs(runs, cands, jobs=1, progress=False),
                    score_runs(runs, cands, backend="ray", progress=False), strict=True):
        assert a.run_id == b.run_id
        for x, y in zip(a.scores, b.scores, strict=True):
            np.testing.assert_array_equal(x, y)


def test_cli_replay_json_same_on_ray(ray_local: Any, capsys: Any) -> None:
    args = ["replay", *[str(RUNS / r) for r in SOME], "--json"]
    assert main([*args, "--jobs", "1"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert main([*args, "--backend", "ray"]) == 0
    remote = json.loads(capsys.readouterr().out)
    for d in local + remote:
        d.pop("seconds")
    assert local == remote


def test_ray_reports_unreadable_runs_like_local(ray_local: Any, tmp_path: Path,
                                                capsys: Any) -> None:
    """A run that cannot be read fails alone on Ray too: the same failures, the same results,
    the same JSON (an ``error`` entry) and status 1 as the local processes."""
    import shutil

    from replay.fleet import RunFailure

    for rid in SOME[:2]:
        shutil.copytree(RUNS / rid, tmp_path / rid)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not a parquet file")
    runs = discover_runs(str(tmp_path))
    failed_l: list[RunFailure] = []
    failed_r: list[RunFailure] = []
    local = replay_many(runs, jobs=1, progress=False, failed=failed_l)
    remote = replay_many(runs, backend="ray", jobs=2, progress=False, failed=failed_r)
    assert failed_l == failed_r and [f.run_id for f in failed_r] == ["broken"]
    assert [_summary(r) for r in local] == [_summary(r) for r in remote]
    st, _ = alarms_for_eval(runs, backend="ray", progress=False, failed=(ev := []))
    assert sorted(st) == SOME[:2] and ev == failed_l
    assert main(["replay", str(tmp_path), "--json", "--backend", "ray"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [("error" in d, d["run_id"]) for d in data] == [
        (True, "broken"), (False, SOME[0]), (False, SOME[1])]


def test_fan_out_keeps_order_in_chunks(ray_local: Any) -> None:
    items = list(range(-7, 6))
    assert fan_out(abs, items, backend="ray", jobs=4, progress=False) == [abs(x) for x in items]


def test_without_ray_one_line_error(monkeypatch: Any, capsys: Any) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(BackendUnavailable, match="pip install"):
        fan_out(abs, [1, 2], backend="ray")
    assert main(["eval", str(RUNS / "clean"), str(RUNS / "overfit"), "--backend", "ray"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["stability eval: error: backend 'ray' needs Ray: pip install 'ray'"]


def test_unreachable_cluster_fails_fast() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there now
    for addr in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(BackendUnavailable, match="no Ray cluster reachable"):
            _check_reachable(addr)
    with pytest.raises(BackendUnavailable, match="not HOST:PORT"):
        _check_reachable("nowhere")
    with pytest.raises(ValueError, match="backend"):
        fan_out(abs, [1], backend="dask")
