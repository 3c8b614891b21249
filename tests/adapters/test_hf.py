"""StabilityTrainerCallback with a real HF Trainer on CPU, a tiny GPT-2 built from a config."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from stability.adapters.hf import StabilityTrainerCallback  # noqa: E402
from stability.monitor.monitor import Monitor  # noqa: E402
from stability.types import Control, Decision  # noqa: E402

torch.set_num_threads(1)


class _Scripted:
    def __init__(self, script):
        self.script = script
        self.seen = []
        self.metrics = []
        self.control = Control()

    def observe(self, step, metrics=None, families=None):
        self.seen.append(step)
        self.metrics.append(dict(metrics or {}))
        return Decision(step, control=self.script.pop(step, Control()))  # each fires once

    def state_dict(self):
        return {"version": 1}

    def load_state_dict(self, sd):
        pass


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 32, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _trainer(tmp_path, cb, steps: int = 12, **kw):
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    opts = dict(max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-3,
                max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
                use_cpu=True, disable_tqdm=True, eval_strategy="steps", eval_steps=5)
    opts.update(kw)
    args = transformers.TrainingArguments(str(tmp_path), **opts)
    return transformers.Trainer(model=model, args=args, train_dataset=_Data(),
                                eval_dataset=_Data(16), callbacks=[cb])


def test_hf_callback_acts(tmp_path) -> None:
    mon = _Scripted({3: Control(skip_step=True), 5: Control(lr_factor=0.5),
                     8: Control(stop=True, stop_reason="scripted")})
    cb = StabilityTrainerCallback(mon)
    tr = _trainer(tmp_path, cb)
    weights = []

    class Rec(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            weights.append(model.transformer.wte.weight.detach().clone())

    tr.add_callback(Rec())
    tr.train()
    assert mon.seen == list(range(9))
    assert cb.stopped is not None and tr.state.global_step == 9
    assert torch.equal(weights[3], weights[4]) and not torch.equal(weights[2], weights[3])
    m0 = mon.metrics[0]
    assert m0["loss"] > 0 and m0["grad_norm"] > 0 and "lr" in m0
    assert any("val_loss" in m for m in mon.metrics)  # eval at step 5 fed to the next step
    # the pre-clip norm the callback measured equals the Trainer's own (logged) one
    logged = [h["grad_norm"] for h in tr.state.log_history if "grad_norm" in h]
    assert logged[0] == pytest.approx(mon.metrics[0]["grad_norm"], rel=1e-4)
    # clipping taken over, but the user's arguments are untouched
    assert tr.args.max_grad_norm == 1.0 and cb.guard.clip_norm == 1.0


def test_logs_carry_stability_keys_and_effective_lr(tmp_path) -> None:
    mon = _Scripted({s: Control(lr_factor=0.25) for s in range(4, 8)})
    cb = StabilityTrainerCallback(mon)
    tr = _trainer(tmp_path, cb, steps=8, eval_strategy="no")
    base = []

    class Rec(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):  # runs after the callback
            base.append(dict(logs))

    tr.add_callback(Rec())
    tr.train()
    train_logs = [h for h in tr.state.log_history if "loss" in h and "learning_rate" in h]
    assert len(train_logs) == 8
    for h in train_logs:
        assert {"stability/lr_factor", "stability/lr_effective", "stability/steps_skipped",
                "stability/level"} <= set(h)
        assert h["learning_rate"] == pytest.approx(h["stability/lr_effective"])
    cut = [h for h in train_logs if h["step"] >= 5]
    assert all(h["stability/lr_factor"] == 0.25 for h in cut)
    assert all(h["learning_rate"] == pytest.approx(0.25 * h["stability/lr_base"]) for h in cut)
    # the callback moved itself before later callbacks (reporting integrations): they see it
    assert all("stability/lr_factor" in b for b in base if "learning_rate" in b)
    # the callback runs right after HF's flow callback
    names = [type(c).__name__ for c in tr.callback_handler.callbacks]
    assert names.index("StabilityTrainerCallback") == names.index("DefaultFlowCallback") + 1


def test_saved_arguments_equal_the_users(tmp_path) -> None:
    cb = StabilityTrainerCallback(Monitor("small"))
    tr = _trainer(tmp_path, cb, steps=10, save_strategy="steps", save_steps=5,
                  eval_strategy="no")
    before = tr.args.to_dict()
    tr.train()
    assert tr.args.to_dict() == before
    saved = [torch.load(tmp_path / d / "training_args.bin", weights_only=False)
             for d in ("checkpoint-5", "checkpoint-10")]
    assert all(a.to_dict() == before and a.max_grad_norm == 1.0 for a in saved)


def test_state_in_trainer_state_json_and_restored_on_resume(tmp_path) -> None:
    cb = StabilityTrainerCallback(Monitor("small"))
    tr = _trainer(tmp_path, cb, steps=10, save_strategy="steps", save_steps=5,
                  eval_strategy="no")
    tr.train()
    js = json.loads((tmp_path / "checkpoint-5" / "trainer_state.json").read_text())
    saved = js["stateful_callbacks"]["StabilityTrainerCallback"]["attributes"]["stability_state"]
    assert saved["guard"]["step"] == 5 and saved["global_step"] == 5
    assert saved["guard"]["monitor"]["last_step"] == 4
    # the checkpoint being written is already a registered (healthy) rollback target, in the
    # one registry: the monitor's ledger (the store saves no copy of its own)
    recs = saved["guard"]["monitor"]["checkpoints"]["records"]
    assert [(r["step"], r["healthy"]) for r in recs] == [(4, True)]
    assert saved["store"]["ledger"] is None
    cb2 = StabilityTrainerCallback(Monitor("small"))
    tr2 = _trainer(tmp_path, cb2, steps=10, save_strategy="steps", save_steps=5,
                   eval_strategy="no")
    seen = []
    mon2 = cb2.monitor
    orig = mon2.observe

    def spy(step, *a, **k):
        seen.append(step)
        return orig(step, *a, **k)

    mon2.observe = spy
    tr2.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))
    assert seen == list(range(5, 10))  # warm-ups did not restart at step 0
    assert cb2.guard.step_count == tr2.state.global_step == 10
    assert cb2.monitor.counters["steps"] == cb.monitor.counters["steps"]


@pytest.mark.parametrize("restore_flag", [False, True])
def test_resume_keeps_the_users_callback(tmp_path, restore_flag) -> None:
    cb = StabilityTrainerCallback(Monitor("small"))
    _trainer(tmp_path, cb, steps=6, save_strategy="steps", save_steps=3, eval_strategy="no",
             restore_callback_states_from_checkpoint=restore_flag).train()
    cb2 = StabilityTrainerCallback(Monitor("small"))
    tr2 = _trainer(tmp_path, cb2, steps=6, save_strategy="steps", save_steps=3,
                   eval_strategy="no", restore_callback_states_from_checkpoint=restore_flag)
    tr2.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    ours = [c for c in tr2.callback_handler.callbacks if isinstance(c, StabilityTrainerCallback)]
    assert ours == [cb2] and cb2.guard.step_count == 6


def test_emergency_checkpoint_is_an_hf_checkpoint(tmp_path) -> None:
    mon = _Scripted({3: Control(save_checkpoint=True, checkpoint_reason="scripted")})
    cb = StabilityTrainerCallback(mon)
    tr = _trainer(tmp_path, cb, steps=6, eval_strategy="no")  # save_strategy="no"
    tr.train()
    ck = tmp_path / "checkpoint-4"
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4"]
    assert (ck / "optimizer.pt").exists() and (ck / "trainer_state.json").exists()
    assert cb.store.entries[3].reason.startswith("emergency") and not cb.store.entries[3].healthy


def test_no_checkpoint_of_nonfinite_weights(tmp_path) -> None:
    mon = _Scripted({3: Control(save_checkpoint=True, checkpoint_reason="nan")})
    cb = StabilityTrainerCallback(mon)
    tr = _trainer(tmp_path, cb, steps=6, eval_strategy="no", save_strategy="steps",
                  save_steps=2)

    class Poison(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            if state.global_step == 3:
                with torch.no_grad():
                    model.transformer.wte.weight[0, 0] = float("nan")

    tr.add_callback(Poison())
    tr.train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2"]  # 4 and 6 held NaN weights
    assert cb.cancelled_saves == [4, 6]


def test_step_counters_after_rollback(tmp_path) -> None:
    # a scripted rollback at step 7 to the HF checkpoint of guard step 3 (trainer step 4)
    mon = _Scripted({7: Control(rollback_to=3, skip_batches=(6, 7))})
    cb = StabilityTrainerCallback(mon)
    tr = _trainer(tmp_path, cb, steps=12, eval_strategy="no", save_strategy="steps",
                  save_steps=4)
    snap = {}

    class Rec(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            if state.global_step == 4:
                snap["w"] = model.transformer.wte.weight.detach().clone()
            if state.global_step == 8:
                snap["after"] = model.transformer.wte.weight.detach().clone()

    tr.add_callback(Rec())
    tr.train()
    g = cb.guard
    assert g.rollbacks == 1 and g.steps_lost == 4
    assert torch.equal(snap["w"], snap["after"])  # weights of checkpoint-4 restored
    assert tr.state.global_step == 12 == g.step_count + g.steps_lost
    assert mon.seen == list(range(8)) + list(range(4, 8))  # the guard's step went back
    assert 8 in cb.cancelled_saves  # the save due right after the rollback was not written
    assert not (tmp_path / "checkpoint-8").exists()


def test_memory_checkpoints_bounded(tmp_path) -> None:
    cb = StabilityTrainerCallback(Monitor("small"), memory_checkpoint_every=2,
                                  memory_limit_mb=0.001)
    _trainer(tmp_path, cb, steps=4, eval_strategy="no").train()
    assert cb.store.memory_bytes() == 0 and cb.guard.checkpoint_failures >= 1
    cb2 = StabilityTrainerCallback(Monitor("small"), memory_checkpoint_every=2,
                                   memory_limit_mb=1.0)
    _trainer(tmp_path, cb2, steps=8, eval_strategy="no").train()
    assert 0 < cb2.store.memory_bytes() <= 2**20 and cb2.guard.checkpoint_failures == 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="checkpoint_every"):
        StabilityTrainerCallback(Monitor("small"), checkpoint_every=-1)


def test_checkpoint_every_requests_hf_saves(tmp_path) -> None:
    cb = StabilityTrainerCallback(Monitor("small"), checkpoint_every=3)
    _trainer(tmp_path, cb, steps=7, eval_strategy="no").train()  # save_strategy="no"
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3", "checkpoint-6"]
    assert sorted(cb.store.entries) == [2, 5] and all(e.healthy for e in cb.store.entries.values())
    led = cb.monitor.checkpoints
    assert [r.step for r in led.records] == [2, 5]


def test_rotated_checkpoints_are_no_rollback_target(tmp_path) -> None:
    cb = StabilityTrainerCallback(Monitor("small"))
    _trainer(tmp_path, cb, steps=8, eval_strategy="no", save_strategy="steps", save_steps=2,
             save_total_limit=2).train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-6", "checkpoint-8"]
    assert sorted(cb.store.entries) == [5, 7]  # HF's rotation deleted the others
    assert cb.store.latest_healthy(4) is None
    # the ledger forgot them too (one registry): the policy never plans a rollback onto them
    assert [r.step for r in cb.monitor.checkpoints.records] == [5, 7]
    assert cb.monitor.checkpoints.latest_healthy_before(5) is None
