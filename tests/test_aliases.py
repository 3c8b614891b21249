"""One alias table: live monitor, recorded-run reader and tuner resolve names identically."""

from __future__ import annotations

import pyarrow as pa
import pytest

from replay.reader import default_aliases
from replay.schema import apply_aliases
from stability.monitor.binding import DEFAULT_ALIASES, Aliases

LIGHTNING = {"train_loss_step": "loss", "lr-AdamW": "lr", "grad_2.0_norm_total": "grad_norm",
             "lm loss value": "val_loss", "loss scale": "loss_scale"}


def test_reader_uses_the_monitor_table() -> None:
    assert default_aliases() == DEFAULT_ALIASES


@pytest.mark.parametrize("raw, canon", sorted(LIGHTNING.items()))
def test_framework_names_bind_live_and_in_replay(raw: str, canon: str) -> None:
    assert Aliases()(raw) == canon
    t = apply_aliases(pa.table({"step": [0, 1], raw: [1.0, 2.0]}), default_aliases())
    assert t.column_names == ["step", canon]


def test_a_user_alias_overrides_and_disables_a_default() -> None:
    a = Aliases({"train_loss_step": "train_loss_step", "my/loss": "loss"})
    assert a("train_loss_step") == "train_loss_step" and a("my/loss") == "loss"
