"""The messages listed in issue 26 say what happened."""

from __future__ import annotations

from stability.outputs.feedback import describe
from stability.types import Checkpoint, ReduceLR, Rollback


def test_rollback_without_batches_to_skip() -> None:
    text = describe(Rollback(200, "L3", to_step=150, skip_from=200, skip_to=199))
    assert "200..199" not in text and "skipping no batch" in text
    assert "skipping None" not in describe(Rollback(9, "L3", to_step=4, skip_from=None,  # type: ignore[arg-type]
                                                    skip_to=None))


def test_lr_guard_hold_is_not_zero_steps() -> None:
    text = describe(ReduceLR(30, "LR left its band", factor=0.0202, duration=0))
    assert "for 0 steps" not in text and "while the scheduler asks for a bad LR" in text


def test_emergency_checkpoint_is_a_request() -> None:
    text = describe(Checkpoint(5, "L2", healthy=False))
    assert "requesting an emergency checkpoint" in text and "only if the weights are finite" in text
