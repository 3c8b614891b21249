"""Rollback checkpoints are loaded with ``weights_only=True``: a pickled payload never runs."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from stability.adapters.interventions import (  # noqa: E402
    load_checkpoint,
    safe_torch_load,
    save_checkpoint,
)


class _Payload:
    """Unpickling this object would create a file (stands in for arbitrary code)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.makedirs, (self.target,))


def test_malicious_checkpoint_is_refused_and_never_runs(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    target = tmp_path / "pwned"
    path = tmp_path / "step-10.pt"
    torch.save({"model": model.state_dict(), "extra": _Payload(str(target))}, path)
    with pytest.raises(ValueError, match=r"step-10\.pt.*weights_only"):
        load_checkpoint(path, model)
    assert not target.exists()


def test_own_checkpoints_round_trip_with_weights_only(tmp_path: Path) -> None:
    from stability import Monitor

    mon = Monitor()
    for s in range(30):
        mon.observe(s, {"loss": 1.0 + 0.01 * s, "grad_norm": 1.0})
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=100)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched.step()
    path = tmp_path / "step-1.pt"
    save_checkpoint(path, model, opt, sched, step=1, monitor_state=mon.state_dict(),
                    extra={"note": "x"})
    fresh = torch.nn.Linear(3, 2)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.OneCycleLR(opt2, max_lr=0.1, total_steps=100)
    snap = load_checkpoint(path, fresh, opt2, sched2)
    assert torch.equal(fresh.weight, model.weight)
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert sched2.state_dict()["last_epoch"] == sched.state_dict()["last_epoch"]
    mon2 = Monitor()
    mon2.load_state_dict(snap["monitor"])
    assert mon2.observe(30, {"loss": 50.0, "grad_norm": 1.0}) == \
        mon.observe(30, {"loss": 50.0, "grad_norm": 1.0})


def test_safe_load_allows_registered_types(tmp_path: Path) -> None:
    path = tmp_path / "t.pt"
    torch.save({"w": torch.zeros(3)}, path)
    assert safe_torch_load(path)["w"].shape == (3,)
