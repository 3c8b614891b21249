"""Child process of ``test_hostile_state.py``: load tampered monitor snapshots, then observe.

Reads a JSON list of mutation plans on stdin; each plan is ``[leaf_selector, op, value]``.
For each plan a fresh monitor loads the real snapshot with one leaf (or container) changed by
``op``; the outcome must be a ``ValueError`` at load time or a monitor whose next ``observe()``
calls work -- and after a rejected load the monitor must still work.  Anything else is printed
as ``FAIL <plan> <exception>`` and the process exits 1; a segmentation fault kills the process
(negative return code), which the parent reports.  On success prints ``OK <loaded> <rejected>``.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import traceback
from typing import Any

import numpy as np

from stability import Monitor

#: every detector class: the llm_pretrain preset plus the ones it does not bind
CONFIG: dict[str, Any] = {
    "preset": "llm_pretrain",
    "detectors": [
        {"name": "x_cusum", "detector": "cusum", "inputs": ["loss"]},
        {"name": "x_adwin", "detector": "adwin", "inputs": ["grad_norm"]},
        {"name": "x_ratio_median", "detector": "ratio", "inputs": ["loss"],
         "params": {"reference": "median", "window": 16}},
        {"name": "x_ratio_ewm", "detector": "ratio", "inputs": ["grad_norm"],
         "params": {"reference": "ewm"}},
        {"name": "x_hist", "detector": "histogram_drift", "inputs": ["grad_norm/*"],
         "params": {"window": 20, "n_bins": 4}},
        {"name": "x_robust_mean", "detector": "robust_z", "inputs": ["grad_norm"],
         "params": {"robust": False, "window": 32}},
    ],
}
LAYERS = [f"h{i}" for i in range(4)]
HISTORY = 300

REPLACEMENTS: list[Any] = [
    -1, 0, 1, 7, -7, 2**31, 2**63, -(2**63), 10**30, 1e308, -1e308, 0.5, -0.5,
    math.nan, math.inf, -math.inf, "nan", "inf", "abc", "", None, True, False, [], {},
    [1, 2], {"a": 1}, {"__float__": "nan"}, {"__ndarray__": "<f8", "shape": [2], "data": [1, 2]},
]


def metrics(step: int, rng: np.random.Generator) -> tuple[dict[str, Any], dict[str, Any]]:
    loss = 3.0 * math.exp(-step / 400.0) + 0.02 * rng.standard_normal()
    m: dict[str, Any] = {"loss": loss, "grad_norm": 1.0 + 0.1 * rng.random(),
                         "lr": 1e-3 * min(1.0, (step + 1) / 50.0),
                         "param_norm": 100.0 + 0.01 * step}
    if step % 25 == 0:
        m["val_loss"] = loss * 1.05
    fam = {"grad_norm": 0.5 + 0.1 * rng.random(4),
           "act_mean": rng.standard_normal(4) * 0.01, "act_std": 1.0 + 0.01 * rng.random(4),
           "act_absmax": 5.0 + rng.random(4), "act_kurtosis": 3.0 + 0.1 * rng.random(4)}
    return m, fam


def fresh_monitor() -> Monitor:
    mon = Monitor(CONFIG, alert_sinks=[])
    for fam in ("grad_norm", "act_mean", "act_std", "act_absmax", "act_kurtosis"):
        mon.declare_family(fam, LAYERS)
    return mon


def snapshot() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    mon = fresh_monitor()
    for s in range(HISTORY):
        m, fam = metrics(s, rng)
        if s == 200:
            m["loss"] *= 30.0  # one incident: policy, control and ledger state are non-trivial
        mon.observe(s, m, families=fam)
    return json.loads(json.dumps(mon.state_dict()))


def leaves(x: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths of every node (containers too), depth first."""
    out = [path]
    if isinstance(x, dict):
        for k, v in x.items():
            out += leaves(v, (*path, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out += leaves(v, (*path, i))
    return out


def pools(sd: dict[str, Any]) -> list[list[tuple[Any, ...]]]:
    """Where to tamper: the structure (every node outside array data), the elements of the
    detectors' state arrays (ring positions, counts, statistics), anything."""
    paths = leaves(sd)[1:]
    structure = [p for p in paths if "data" not in p]
    state = [p for p in paths if len(p) > 3 and p[-3:-1] == ("state", "data")]
    return [structure, state, paths]


def mutate(sd: dict[str, Any], selector: int, op: int, value: Any) -> None:
    pool = pools(sd)[selector % 3]
    path = pool[(selector // 3) % len(pool)]
    parent: Any = sd
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    kind = op % 6
    if kind == 0:  # replace by a hostile constant
        idx = int(value) if isinstance(value, int) else len(str(value))
        parent[key] = copy.deepcopy(REPLACEMENTS[idx % len(REPLACEMENTS)])
    elif kind == 1:  # replace by a number from the strategy
        parent[key] = value
    elif kind == 2:  # delete the key / item
        del parent[key]
    elif kind == 3:  # extra key next to it, or an extra item
        if isinstance(parent, dict):
            parent[f"extra_{value}"] = value
        else:
            parent.append(value)
    elif kind == 4:  # wrong shape: truncate or grow a list
        node = parent[key]
        if isinstance(node, list):
            parent[key] = node[: len(node) // 2] if node else [value]
        elif isinstance(node, dict) and "shape" in node:
            node["shape"] = [*node["shape"], 2]
        else:
            parent[key] = [node, node]
    else:  # wrong type: scalar <-> string / list
        node = parent[key]
        parent[key] = str(node) if not isinstance(node, str) else [node]


def check(mon: Monitor, rng: np.random.Generator, start: int) -> None:
    for s in range(start, start + 3):
        m, fam = metrics(s, rng)
        mon.observe(s, m, families=fam)


def main() -> int:
    plans = json.load(sys.stdin)
    base = snapshot()
    loaded = rejected = 0
    rng = np.random.default_rng(1)
    for plan in plans:
        sd = copy.deepcopy(base)
        try:
            mutate(sd, *plan)
        except (KeyError, IndexError, TypeError):
            continue
        mon = fresh_monitor()
        try:
            try:
                mon.load_state_dict(sd)
                loaded += 1
                start = max(mon.last_step + 1, HISTORY)
            except ValueError:
                rejected += 1
                start = HISTORY
            check(mon, rng, start)
        except Exception as exc:  # every other outcome is a failure
            print("FAIL", json.dumps(plan), type(exc).__name__, exc, flush=True)
            traceback.print_exc()
            return 1
    print("OK", loaded, rejected, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
