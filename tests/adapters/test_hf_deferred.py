"""``StabilityTrainerCallback(sync="deferred")`` with a real HF Trainer on CPU (a tiny GPT-2)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from stability.adapters.hf import StabilityTrainerCallback  # noqa: E402
from stability.monitor.monitor import Monitor  # noqa: E402
from stability.types import Control  # noqa: E402

from .scripted import ScriptedMonitor, watch  # noqa: E402

torch.set_num_threads(1)


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 32, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _trainer(out: Any, cb: Any, steps: int = 12, lr_at: dict[int, float] | None = None,
             **kw: Any) -> Any:
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    opts: dict[str, Any] = dict(
        max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-3, max_grad_norm=1.0,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        eval_strategy="no")
    opts.update(kw)
    args = transformers.TrainingArguments(str(out), **opts)
    optimizers: Any = (None, None)
    if lr_at is not None:  # a schedule bug: the LR jumps from the given step on
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        first = min(lr_at)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_at[first] if s >= first else 1.0)
        optimizers = (opt, sched)
    return transformers.Trainer(model=model, args=args, train_dataset=_Data(),
                                callbacks=[cb], optimizers=optimizers)


def _run(out: Any, sync: str, steps: int = 16, fp16: bool = False, **kw: Any) -> dict[str, Any]:
    mon = Monitor("small")
    seen = watch(mon)
    cb = StabilityTrainerCallback(mon, sync=sync, activations=["transformer.h.0"],
                                  activation_every=3)
    tr = _trainer(out, cb, steps=steps, fp16=fp16, **kw)
    if fp16:  # what accelerate does on a GPU: fp16 autocast and a GradScaler (overflowing)
        tr.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30)
        tr.accelerator.native_amp = True
    tr.train()
    return {"seen": seen, "cb": cb, "tr": tr, "mon": mon,
            "weights": [p.detach().clone() for p in tr.model.parameters()],
            "ledger": [(r.step, r.healthy, r.reason) for r in mon.checkpoints.records],
            "events": [(i.step, i.type, i.reason) for i in cb.guard.interventions]}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_healthy_run_is_the_step_mode_run(tmp_path: Any, precision: str) -> None:
    kw: dict[str, Any] = {"save_strategy": "steps", "save_steps": 5, "max_grad_norm": 0.57,
                          "bf16": precision == "bf16", "fp16": precision == "fp16"}
    a = _run(tmp_path / "a", "step", **kw)
    b = _run(tmp_path / "b", "deferred", **kw)
    assert b["cb"].guard.deferred is not None and a["cb"].guard.deferred is None
    assert [s for s, _, _ in a["seen"]] == list(range(16))
    assert b["seen"] == a["seen"]  # the same signal stream (families included), same order
    assert any("update_ratio" in f for _, _, f in a["seen"])
    assert any("act_mean" in f for _, _, f in a["seen"])
    for wa, wb in zip(a["weights"], b["weights"], strict=True):
        assert torch.equal(wa, wb)  # clipped on the device: the same bits
    norms = [m["grad_norm"] for _, m, _ in a["seen"] if "grad_norm" in m]
    assert min(norms) < 0.57 < max(norms)  # the clip bound on some steps, not on others
    assert b["ledger"] == a["ledger"] == [(4, True, "trainer"), (9, True, "trainer"),
                                          (14, True, "trainer"), (15, True, "trainer")]
    assert b["events"] == a["events"]
    # a save step observes its own step first: the checkpoint's state is the step mode's
    for ck in ("checkpoint-5", "checkpoint-10"):
        sa, sb = (json.loads((tmp_path / d / ck / "trainer_state.json").read_text())
                  ["stateful_callbacks"]["StabilityTrainerCallback"]["attributes"]
                  ["stability_state"]["guard"] for d in ("a", "b"))
        assert sb["deferred"]["pending"] is None
        assert sb["monitor"]["last_step"] == sa["monitor"]["last_step"] == int(ck[11:]) - 1
        ra, rb = (sorted((k, v) for r in x["monitor"]["checkpoints"]["records"]
                         for k, v in r.items() if k != "path") for x in (sa, sb))
        assert rb == ra and len(ra) >= 5
    ga, gb = a["cb"].guard, b["cb"].guard
    assert gb.step_count == ga.step_count == 16 and gb.voided_steps == 0
    assert b["tr"].args.max_grad_norm == 0.57  # the user's arguments are untouched
    if precision == "fp16":  # scaler-skipped overflow steps: information, the same in both
        assert gb.scaler is not None and gb.amp_overflows == ga.amp_overflows >= 1
        la, lb = ([(h.get("amp_overflow"), repr(h.get("grad_norm")))
                   for h in x["tr"].state.log_history if "learning_rate" in h] for x in (a, b))
        assert lb == la  # an overflow step: amp_overflow 1 and no grad_norm (missing, not nan)
        assert la.count((1.0, "None")) == ga.amp_overflows < len(la)
        assert all(o == 0.0 and g != "None" and "nan" not in g for o, g in la if o != 1.0)


def test_sync_argument_is_checked(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"'sync' parameter of StabilityTrainerCallback must be "
                                         r"one of \('auto', 'step', 'deferred'\)"):
        StabilityTrainerCallback(Monitor("small"), sync="later")
    mon = ScriptedMonitor({})
    cb = StabilityTrainerCallback(mon)
    assert cb.sync == "auto"  # the default, resolved when the guard is built
    _trainer(tmp_path, cb, steps=3, optim="adamw_torch_fused").train()
    g = cb.guard
    assert g.sync_requested == "auto" and g.sync_mode == "step" and g.deferred is None  # CPU
    assert mon.seen == [0, 1, 2]  # step mode: every step observed during itself


def test_lr_blowup_is_divided_out_from_its_first_step(tmp_path: Any) -> None:
    jump = {12: 200.0}
    runs = {}
    for name, sync, mon in (("off", "step", ScriptedMonitor({})),
                            ("step", "step", Monitor("small")),
                            ("deferred", "deferred", Monitor("small"))):
        cb = StabilityTrainerCallback(mon, sync=sync)
        tr = _trainer(tmp_path / name, cb, steps=24, lr_at=jump)
        tr.train()
        lr = {int(h["step"]): h["stability/lr_effective"] for h in tr.state.log_history
              if "stability/lr_effective" in h}
        runs[name] = (cb, tr, lr, [p.detach().clone() for p in tr.model.parameters()])
    off, step, late = runs["off"], runs["step"], runs["deferred"]
    assert off[2][13] == pytest.approx(200 * off[2][12])  # unguarded: the jump is applied
    # the LR guard judges the LR a step asks for before that step's update, in both modes
    assert late[2] == pytest.approx(step[2]) and late[2][13] < 2 * late[2][12]
    assert [(i.step, i.type) for i in late[0].guard.interventions if i.type == "lr_cut"][:1] \
        == [(i.step, i.type) for i in step[0].guard.interventions if i.type == "lr_cut"][:1]
    drift = [float((a - b).norm()) for a, b in zip(off[3], step[3], strict=True)]
    close = [float((a - b).norm()) for a, b in zip(late[3], step[3], strict=True)]
    assert max(close) < 0.1 * max(drift)  # deferred ends where step mode does


def test_nan_gradient_never_reaches_the_weights(tmp_path: Any) -> None:
    mon = Monitor("small")
    cb = StabilityTrainerCallback(mon, sync="deferred")
    tr = _trainer(tmp_path, cb, steps=30, optim="adamw_torch_fused")

    poison = {"on": False}
    tr.model.transformer.wte.weight.register_hook(  # a NaN gradient, during backward()
        lambda g: g * math.nan if poison["on"] else g)

    before: dict[int, list[torch.Tensor]] = {}

    class Rec(transformers.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                          **kw: Any) -> None:
            before[state.global_step] = [p.detach().clone() for p in model.parameters()]
            poison["on"] = state.global_step == 24

    tr.add_callback(Rec())
    tr.train()
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())
    # the fused optimizer skipped the update on the device: weights untouched
    assert all(torch.equal(a, b) for a, b in zip(before[24], before[25], strict=True))
    assert tr.state.global_step == 30 and cb.stopped is None
    assert any(i.step == 24 for i in cb.guard.interventions)  # observed one step late


def test_late_rollback_voids_the_next_step(tmp_path: Any) -> None:
    # the rollback decided at step 6 is observed during step 7, which it voids
    mon = ScriptedMonitor({6: Control(rollback_to=3, skip_batches=(5, 6))})
    cb = StabilityTrainerCallback(mon, sync="deferred")
    tr = _trainer(tmp_path, cb, steps=12, save_strategy="steps", save_steps=4)
    snap = {}

    class Rec(transformers.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                          **kw: Any) -> None:
            if state.global_step in (4, 8):
                snap[state.global_step] = model.transformer.wte.weight.detach().clone()

    tr.add_callback(Rec())
    tr.train()
    g = cb.guard
    assert mon.seen == [*range(7), *range(4, 8)]  # step 7 voided; the last step flushed
    assert g.rollbacks == 1 and g.steps_lost == 3 and g.voided_steps == 1
    assert tr.state.global_step == 12 == g.step_count + g.steps_lost + g.voided_steps
    assert torch.equal(snap[4], snap[8])  # checkpoint-4 restored; the voided step changed nothing
    assert cb.cancelled_saves == [8]  # the save due right after the rollback was not written


def test_late_emergency_checkpoint_and_stop(tmp_path: Any) -> None:
    mon = ScriptedMonitor({3: Control(save_checkpoint=True, checkpoint_reason="scripted"),
                     6: Control(stop=True, stop_reason="late")})
    cb = StabilityTrainerCallback(mon, sync="deferred")
    tr = _trainer(tmp_path, cb, steps=12)  # save_strategy="no"
    tr.train()
    # observed during step 4: written by the Trainer at its end, never an in-memory copy
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-5"]
    rec = cb.store.entries[4]
    assert not rec.healthy and rec.reason == "emergency: scripted" and not rec.in_memory
    assert cb.stopped is not None and cb.stopped.step == 6 and cb.stopped.reason == "late"
    assert mon.seen == list(range(7)) and tr.state.global_step == 8  # step 7 voided
    assert cb.guard.voided_steps == 1


def test_resume_mid_run_gives_the_uninterrupted_decisions(tmp_path: Any) -> None:
    ref = _run(tmp_path / "a", "deferred", steps=12, save_strategy="steps", save_steps=6)
    mon = Monitor("small")
    seen = watch(mon)
    cb = StabilityTrainerCallback(mon, sync="deferred", activations=["transformer.h.0"],
                                  activation_every=3)
    tr = _trainer(tmp_path / "b", cb, steps=12, save_strategy="steps", save_steps=6)
    tr.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-6"))
    assert [s for s, _, _ in seen] == list(range(6, 12))  # warm-ups did not restart
    for (_, got, _), (_, want, _) in zip(seen, ref["seen"][6:], strict=True):
        assert got == pytest.approx(want, rel=1e-5)
    assert cb.guard.step_count == tr.state.global_step == 12
    assert mon.counters["steps"] == ref["mon"].counters["steps"]
    assert [(r.step, r.healthy) for r in mon.checkpoints.records] == \
        [(r, h) for r, h, _ in ref["ledger"]]


def _count_syncs_in(cb: Any, hooks: tuple[str, ...], syncs: Any) -> dict[str, list[int]]:
    """Wrap ``hooks`` of ``cb``: host syncs counted per call (``syncs``: an installed
    ``_Syncs`` of ``test_guard_deferred``)."""
    per: dict[str, list[int]] = {h: [] for h in hooks}

    def wrap(name: str, fn: Any) -> Any:
        def counted(*a: Any, **k: Any) -> Any:
            syncs.calls, syncs.active = 0, True
            try:
                return fn(*a, **k)
            finally:
                syncs.active = False
                per[name].append(syncs.calls)
        return counted

    for h in hooks:
        setattr(cb, h, wrap(h, getattr(cb, h)))
    return per


@pytest.mark.parametrize("sync", ["step", "deferred"])
def test_no_host_sync_in_the_step_hooks(tmp_path: Any, sync: str) -> None:
    from tests.adapters.test_guard_deferred import _Syncs

    cb = StabilityTrainerCallback(Monitor("small"), sync=sync, activations=["transformer.h.0"],
                                  activation_every=2)
    tr = _trainer(tmp_path, cb, steps=12, optim="adamw_torch_fused", logging_steps=100)
    with _Syncs().installed() as syncs:
        per = _count_syncs_in(cb, ("on_pre_optimizer_step", "on_step_end"), syncs)
        tr.train()
    steady = slice(2, None)  # (the first steps allocate the reused host buffers)
    if sync == "step":
        assert min(per["on_pre_optimizer_step"][steady]) >= 1
    else:
        assert per["on_pre_optimizer_step"][steady] == [0] * 10
        assert per["on_step_end"][steady] == [0] * 10
    assert cb.guard.step_count == 12


def test_a_rollback_found_at_a_save_step_acts_as_in_step_mode(tmp_path: Any) -> None:
    # step 7 is observed before HF's save of trainer step 8: its rollback is carried out at once,
    # with the bookkeeping of sync="step" (tests/adapters/test_hf.py), no voided step
    out = {}
    for sync in ("step", "deferred"):
        mon = ScriptedMonitor({7: Control(rollback_to=3, skip_batches=(6, 7))})
        cb = StabilityTrainerCallback(mon, sync=sync)
        tr = _trainer(tmp_path / sync, cb, steps=12, save_strategy="steps", save_steps=4)
        tr.train()
        g = cb.guard
        out[sync] = (mon.seen, g.rollbacks, g.steps_lost, g.voided_steps, g.step_count,
                     cb.cancelled_saves, sorted(os.listdir(tmp_path / sync)),
                     [p.detach().clone() for p in tr.model.parameters()])
    a, b = out["step"], out["deferred"]
    assert b[:7] == a[:7]
    assert a[0] == [*range(8), *range(4, 8)] and a[1:6] == (1, 4, 0, 8, [8])
    assert all(torch.equal(x, y) for x, y in zip(a[7], b[7], strict=True))
