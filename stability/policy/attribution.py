"""Cause attribution: what is behind an alarm episode, so the response can fit the cause.

The policy attributes every step it responds to one of :data:`CAUSES`:

==============  =============================================================================
``lr``          the LR itself left its healthy band (:class:`~stability.policy.lr_guard.LRGuard`),
or
                an LR/loss anomaly detector fired -- the fix is the LR, not the data
``corruption``  the model state is bad: a weight-norm jump (``weight_corruption`` alarm),
                non-finite weights (``param_norm``, ``update_ratio/*``) or a non-finite loss
                that persists on fresh batches after the previous step was skipped -- the fix
                is a rollback (the batches were not the problem)
``overflow``    non-finite gradients (or other signals) while the loss is finite: a numerical
                overflow -- skip the step, never roll back for it alone
``outlier``     a transient bad batch: spike alarms on the first few consecutive steps -- skip
                or clip that step only
``shift``       the same spikes persisting beyond ``recovery.max_consecutive_skips`` steps: a
                persistent data / input shift -- adapt (tighter clip, lower LR), no skip storm
``divergence``  slow trends without spikes (level shift, train/val divergence)
``overfit``     (set by the policy) a train/validation divergence while validation stays
                measurably above its best: early stop with the best checkpoint restored
``data``        a divergence of the guard's canary loss (``canary_loss``: a few early healthy
                batches it evaluates itself): the model is learning bad data -- roll back past
                it, skipping every batch since the restored checkpoint
==============  =============================================================================

Examples
--------
>>> from stability.types import Alarm
>>> a = Alarm(5, "loss_spike", "loss", 9.0, 6.0, "critical", "loss_spike")
>>> attribute([a], lr_fault=False, nonfinite_loss_run=0, consecutive=1, persistent_after=8)
'outlier'
>>> attribute([a], lr_fault=False, nonfinite_loss_run=0, consecutive=9, persistent_after=8)
'shift'
>>> nf = Alarm(5, "nonfinite", "grad_norm", float("inf"), 0.0, "critical", "nonfinite")
>>> attribute([nf], lr_fault=False, nonfinite_loss_run=0, consecutive=1, persistent_after=8)
'overflow'
"""

from __future__ import annotations

from collections.abc import Iterable

from stability.types import Alarm

CAUSES = ("lr", "corruption", "overflow", "outlier", "shift", "divergence", "overfit", "data")

#: kinds that are spikes in the data path (loss, gradients, activations)
SPIKE_KINDS = frozenset({"loss_spike", "grad_explosion", "activation_shift"})
#: causes whose episode may skip the offending batches on a rollback
DATA_CAUSES = frozenset({"outlier", "shift", "data"})


def is_loss_signal(signal: str) -> bool:
    """Whether ``signal`` names a training-loss series (``loss``, ``loss/...``, ``train_loss``).

    >>> is_loss_signal("loss"), is_loss_signal("train/loss"), is_loss_signal("val_loss")
    (True, True, False)
    """
    s = signal.lower()
    return s == "loss" or s.startswith("loss/") or s.endswith("/loss") or s in (
        "train_loss", "lm_loss", "lm loss")


def is_canary_signal(signal: str) -> bool:
    """Whether ``signal`` is the guard's canary loss (``canary_loss``, ``canary_loss/...``).

    >>> is_canary_signal("canary_loss"), is_canary_signal("loss,canary_loss")
    (True, True)
    >>> is_canary_signal("val_loss")
    False
    """
    return any(s.startswith("canary_loss") for s in signal.lower().split(","))


def is_weight_signal(signal: str) -> bool:
    """Whether ``signal`` measures the weights themselves (``param_norm``, ``update_ratio/*``).

    >>> [is_weight_signal(s) for s in ("param_norm", "update_ratio/fc1", "loss")]
    [True, True, False]
    """
    s = signal.lower()
    return s.startswith(("param_norm", "weight_norm", "update_ratio"))


def attribute(alarms: Iterable[Alarm], *, lr_fault: bool, nonfinite_loss_run: int,
              consecutive: int, persistent_after: int) -> str:
    """Cause of the alarms of one step.

    Parameters
    ----------
    alarms : iterable of Alarm
        The acting alarms of the step.
    lr_fault : bool
        The LR guard holds an LR fault now.
    nonfinite_loss_run : int
        Consecutive observed steps (this one included) whose training loss was non-finite.
    consecutive : int
        Consecutive alarm steps of this episode (this one included).
    persistent_after : int
        Alarm steps after which a spike episode counts as a persistent shift.
    """
    kinds = set()
    nonfinite_signals = []
    canary = False
    for a in alarms:
        kinds.add(a.kind)
        if a.kind == "nonfinite":
            nonfinite_signals.append(a.signal)
        elif a.kind == "train_val_divergence" and is_canary_signal(a.signal):
            canary = True
    if lr_fault or "lr_loss_anomaly" in kinds:
        return "lr"
    if ("weight_corruption" in kinds or nonfinite_loss_run >= 2
            or any(is_weight_signal(s) for s in nonfinite_signals)):
        return "corruption"
    if canary:
        return "data"
    loss_bad = nonfinite_loss_run >= 1 or any(is_loss_signal(s) for s in nonfinite_signals)
    if nonfinite_signals and not loss_bad:
        return "overflow"
    if kinds & SPIKE_KINDS or loss_bad:
        return "shift" if consecutive > persistent_after else "outlier"
    return "divergence"
