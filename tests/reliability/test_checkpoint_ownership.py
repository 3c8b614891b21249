"""Checkpoints and rollbacks that cannot be turned against the run (issue 27, items 1, 3, 4).

* only names the store writes, inside its own directory, are ever deleted -- whatever an index
  or a state dict says, and never through a symlink;
* one run per checkpoint directory (a lock; a second process is refused with a message);
* stale temporary files of killed writes are reaped, nobody else's;
* a restore is all or nothing (weights, optimizer, scheduler, loss scaler), restored weights are
  finite (a damaged checkpoint falls back to an older intact one);
* ``TorchGuard.load_state_dict`` refuses a bad snapshot before changing anything.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from stability.adapters.torch import TorchGuard  # noqa: E402
from stability.adapters.torch_ops.checkpoint_store import (  # noqa: E402
    CheckpointDirectoryBusy,
    CheckpointStore,
    RestoreRefused,
    load_checkpoint,
    save_checkpoint,
)
from stability.monitor.monitor import Monitor  # noqa: E402

torch.set_num_threads(1)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))


def _opt(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int = 2) -> None:
    for _ in range(n):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()


# ----------------------------------------------------------------------------- ownership
def _crafted_index(ckpt: Path, victims: list[str]) -> None:
    ckpt.mkdir(parents=True, exist_ok=True)
    rows = [{"step": i + 1, "file": v, "healthy": True, "reason": "x", "data_position": 0,
             "covers_step": i + 1, "managed": True} for i, v in enumerate(victims)]
    (ckpt / "index.json").write_text(json.dumps({"version": 2, "entries": rows}))


def test_a_crafted_index_never_deletes_outside_the_directory(tmp_path, caplog) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    rel = tmp_path / "victim_rel.txt"
    rel.write_text("precious too")
    ckpt = tmp_path / "ckpt"
    other = ckpt / "notes.txt"  # inside the directory but not a name the store writes
    ckpt.mkdir()
    other.write_text("mine")
    _crafted_index(ckpt, [str(victim), "../victim_rel.txt", "notes.txt"])
    model = _model()
    opt = _opt(model)
    with caplog.at_level(logging.WARNING, "stability.adapters"):
        store = CheckpointStore(ckpt, keep=1)
        for s in (10, 20, 30):
            store.save(model, opt, None, step=s, data_position=s, healthy=True)
    assert victim.read_text() == "precious" and rel.read_text() == "precious too"
    assert other.read_text() == "mine"
    assert "not a checkpoint file of this store" in caplog.text
    assert sorted(p.name for p in ckpt.glob("step-*.pt")) == ["step-000000030.pt"]
    store.close()


def test_a_crafted_guard_snapshot_never_deletes_outside_the_directory(tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    mon = Monitor("small")
    model = _model()
    g = TorchGuard(model, _opt(model), None, mon, checkpoint_dir=tmp_path / "ckpt",
                   checkpoint_every=0, keep_checkpoints=1)
    sd = g.state_dict()
    sd["monitor"]["checkpoints"]["records"] = [
        {"step": 1, "path": str(victim), "healthy": True, "reason": "", "covers_step": 1,
         "data_position": 0, "managed": True}]
    g2 = TorchGuard(model, _opt(model), None, Monitor("small"),
                    checkpoint_dir=tmp_path / "ckpt", checkpoint_every=0, keep_checkpoints=1)
    g2.load_state_dict(sd)
    for s in (5, 6, 7):
        g2.save_checkpoint(healthy=True, step=s)
    g2.ledger.forget(1)
    assert victim.read_text() == "precious"


def test_retention_never_follows_a_symlink(tmp_path) -> None:
    target = tmp_path / "outside.bin"
    target.write_text("precious")
    ckpt = tmp_path / "ckpt"
    store = CheckpointStore(ckpt, keep=1)
    model = _model()
    store.save(model, None, None, step=1, data_position=0, healthy=True)
    link = ckpt / "step-000000001.pt"
    link.unlink()
    link.symlink_to(target)  # planted under the store's own name
    store.save(model, None, None, step=2, data_position=0, healthy=True)
    assert target.read_text() == "precious" and link.is_symlink()
    store.close()


def test_the_index_is_never_written_through_a_planted_symlink(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    target = tmp_path / "outside.txt"
    target.write_text("precious")
    (ckpt / "index.json.tmp").symlink_to(target)
    store = CheckpointStore(ckpt, keep=2)
    store.save(_model(), None, None, step=1, data_position=0, healthy=True)
    assert target.read_text() == "precious"
    assert json.loads((ckpt / "index.json").read_text())["entries"][0]["step"] == 1
    store.close()


# ----------------------------------------------------------------------------- one run per dir
_HOLDER = textwrap.dedent("""
    import sys, time
    from stability.adapters.torch_ops.checkpoint_store import CheckpointStore
    s = CheckpointStore(sys.argv[1])
    print("ready", flush=True)
    time.sleep(60)
""")


def test_a_second_run_on_the_same_directory_is_refused(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(ckpt)], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        with pytest.raises(CheckpointDirectoryBusy, match=rf"pid {holder.pid}.*own checkpoint_dir"):
            CheckpointStore(ckpt)
        CheckpointStore(ckpt, rank=1).close()  # another rank of the same job: its own lock
    finally:
        holder.kill()
        holder.wait()
    CheckpointStore(ckpt).close()  # the holder died: the lock went with it


def test_stores_of_one_process_share_the_lock(tmp_path) -> None:
    a = CheckpointStore(tmp_path)
    b = CheckpointStore(tmp_path)  # a resume in the same process
    a.close()
    b.close()


def test_stale_temporary_files_of_the_store_are_reaped(tmp_path) -> None:
    mine = ["step-000000005.pt.k2j_x9a.tmp", "index.json.abc123.tmp"]
    theirs = ["step-000000005-rank1.pt.k2j_x9a.tmp", "data.csv.tmp", "notes.abc.tmp"]
    for n in mine + theirs:
        (tmp_path / n).write_bytes(b"x" * 100)
    CheckpointStore(tmp_path).close()
    assert sorted(p.name for p in tmp_path.glob("*.tmp")) == sorted(theirs)


# ----------------------------------------------------------------------------- restores
def test_a_refused_restore_changes_nothing(tmp_path) -> None:
    model = _model(0)
    opt = _opt(model)
    _train(model, opt)
    path = tmp_path / "c.pt"
    save_checkpoint(path, model, opt)
    model2 = _model(1)
    opt2 = torch.optim.AdamW([{"params": [model2[0].weight]},
                              {"params": [p for n, p in model2.named_parameters()
                                          if n != "0.weight"]}], lr=1e-2)
    _train(model2, opt2)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    opt_before = repr(opt2.state_dict())
    with pytest.raises(RestoreRefused, match="parameter groups"):
        load_checkpoint(path, model2, opt2)
    assert all(torch.equal(before[k], v) for k, v in model2.state_dict().items())
    assert repr(opt2.state_dict()) == opt_before


def test_hf_restore_is_all_or_nothing(tmp_path) -> None:
    pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from stability.adapters.hf import load_hf_checkpoint

    model = _model(0)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    bad = torch.optim.SGD([model[0].weight], lr=0.1)  # one group of one param
    torch.save(bad.state_dict(), tmp_path / "optimizer.pt")
    model2 = _model(1)
    opt2 = _opt(model2)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(RestoreRefused):
        load_hf_checkpoint(str(tmp_path), model2, opt2)
    assert all(torch.equal(before[k], v) for k, v in model2.state_dict().items())


def test_rollback_restores_the_loss_scale(tmp_path) -> None:
    model = _model()
    opt = _opt(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    g = TorchGuard(model, opt, None, None, checkpoint_dir=tmp_path, checkpoint_every=0,
                   scaler=scaler)
    scaler.scale(torch.ones(()))  # (the scale tensor is created lazily)
    g.save_checkpoint(healthy=True, step=0)
    scaler.update(2.0)  # the scale collapsed after the checkpoint
    assert scaler.get_scale() == 2.0
    assert g.rollback(0)
    assert scaler.get_scale() == 65536.0


def test_damaged_weights_fall_back_to_an_older_intact_checkpoint(tmp_path, caplog) -> None:
    model = _model()
    opt = _opt(model)
    g = TorchGuard(model, opt, None, None, checkpoint_dir=tmp_path, checkpoint_every=0,
                   keep_checkpoints=4)
    good = {}
    for s in (1, 2, 3):
        _train(model, opt, 1)
        good[s] = {k: v.clone() for k, v in model.state_dict().items()}
        g.save_checkpoint(healthy=True, step=s)
    for s in (2, 3):  # NaN bytes in the two newest files
        p = tmp_path / f"step-{s:09d}.pt"
        snap = torch.load(p, weights_only=True)
        snap["model"]["0.weight"][0, 0] = float("nan")
        torch.save(snap, p)
    with torch.no_grad():
        model[0].weight.fill_(float("nan"))
    with caplog.at_level(logging.WARNING, "stability.adapters"):
        assert g.rollback(3)
    assert all(torch.equal(good[1][k], v) for k, v in model.state_dict().items())
    assert caplog.text.count("non-finite values") == 2


def test_guard_load_state_dict_refuses_before_changing_anything() -> None:
    mon = Monitor("small")
    model = _model()
    opt = _opt(model)
    g = TorchGuard(model, opt, None, mon, checkpoint_every=0)
    for _ in range(5):
        _train(model, opt, 0)
        opt.zero_grad()
        loss = model(torch.ones(2, 4)).pow(2).mean()
        loss.backward()
        g.step(loss)
    sd = g.state_dict()
    sd["step"] = 500
    sd["monitor"] = Monitor("small").state_dict()
    sd["monitor"]["last_step"] = 400
    sd["interventions"] = {"version": 1, "counts": {"clip": -3}}
    before = mon.state_dict()
    with pytest.raises(ValueError):
        g.load_state_dict(sd)
    assert mon.state_dict() == before and g.step_count == 5
