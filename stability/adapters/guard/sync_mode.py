"""``sync="auto"``: the guard picks its step path once, from where the weights live.

:class:`~stability.adapters.torch.TorchGuard` has two step paths
(:mod:`stability.adapters.guard.deferred`): ``sync="step"`` -- one host sync per step, a decision
acts
on its own step -- and ``sync="deferred"`` -- no host sync, decisions act one step late, with
device-side clip, spike clip, non-finite skip and skip gate.  ``sync="auto"``, the default of
``TorchGuard``, ``attach()`` and both trainer callbacks, resolves to

* ``"deferred"`` when every parameter (the model's trainable ones and the optimizer's) is on a
  CUDA device (ROCm builds report ``"cuda"`` too) **and** the optimizer skips a step on the
  device (:func:`device_skips`: fused Adam / AdamW / SGD / Adagrad take ``optimizer.found_inf``);
* ``"step"`` otherwise.  On a CPU there is no pipeline to stall: deferred gains nothing.  A
  non-fused optimizer on a GPU would need a ``torch.where`` per gradient and, when the skip gate
  arms, a copy of the weights and optimizer state.  Other accelerators (``mps``, ``xpu``, ...)
  take ``"step"`` too: the deferred mode's non-blocking signal copy is CUDA's (elsewhere the copy
  itself waits for the device).  Parameters on ``meta`` (not materialised) give ``"step"``.

**When.** Once.  ``TorchGuard`` resolves at its first ``step()`` / ``check()`` (the model may be
moved to its device after the guard is built); the trainer callbacks' guard at construction (they
build it when the trainer's optimizer exists and the model is placed).  Until then
``guard.sync_mode`` reads ``"auto"``; afterwards the mode taken (``guard.sync_requested`` keeps
what was asked).  The choice is logged once (INFO, logger ``stability.adapters``).

**Distributed.** With a :class:`~stability.adapters.distributed.ControlSync` (torch.distributed
initialised) the ranks agree on the mode with one ``all_reduce`` (MIN) at resolution: deferred
only when every rank resolved deferred, else step on every rank.

**Resume.** ``state_dict()["sync"]`` records the mode taken.  An ``"auto"`` guard resolves again
where it resumes (the same hardware gives the same mode); explicit modes are kept.  Either way a
snapshot's pending step is neither lost nor observed twice:

* a ``sync="deferred"`` snapshot with a pending step, restored into a step-mode guard: the first
  step after the restore runs the deferred way (it observes the pending step, then its own
  signals at its end, after its update), then the guard goes on in step mode;
* a step-mode snapshot restored into a deferred guard: nothing is pending; the control in force
  (``state_dict()["control"]``) governs the first update, as it would have.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from stability.adapters.guard.deferred import (
    SYNC_MODES,
    DeferredSteps,
    device_skips,
    parse_deferred,
)
from stability.types import Control

__all__ = ["SYNC_CHOICES", "SyncPath", "auto_sync", "check_sync", "device_skips"]

log = logging.getLogger("stability.adapters")

#: What ``sync=`` accepts: ``"auto"`` and the two modes it resolves to.
SYNC_CHOICES = ("auto", *SYNC_MODES)


def check_sync(owner: str, sync: str) -> str:
    """``sync`` if it is one of :data:`SYNC_CHOICES`, else a ``ValueError`` naming ``owner``."""
    if sync not in SYNC_CHOICES:
        raise ValueError(f"The 'sync' parameter of {owner} must be one of {SYNC_CHOICES}. "
                         f"Got {sync!r} instead.")
    return sync


def auto_sync(params: Iterable[Any], optimizer: Any) -> tuple[str, str]:
    """What ``sync="auto"`` resolves to for these parameters and optimizer, and why.

    Parameters
    ----------
    params : iterable of tensors
        The model's trainable parameters (the optimizer's are added).
    optimizer : torch.optim.Optimizer

    Returns
    -------
    (mode, reason) : ``("deferred" | "step", str)``

    Examples
    --------
    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> auto_sync([w], torch.optim.AdamW([w], fused=True))
    ('step', 'parameters on cpu')
    """
    groups = getattr(optimizer, "param_groups", None) or []
    every = [*params, *(p for g in groups for p in g.get("params", []))]
    types = sorted({p.device.type for p in every})
    name = type(optimizer).__name__
    if not types:
        return "step", "no parameters"
    if types != ["cuda"]:
        return "step", f"parameters on {', '.join(types)}"
    if not device_skips(optimizer):
        return "step", f"{name} cannot skip a step on the device (not fused)"
    return "deferred", f"parameters on cuda, fused {name}"


def agree(mode: str, control_sync: Any) -> str:
    """The mode every rank takes: deferred only if all ranks resolved deferred (one
    ``all_reduce`` over the :class:`ControlSync`'s group; none without an active one in an
    initialised process group)."""
    if control_sync is None or not getattr(control_sync, "active", False) or not (
            dist.is_available() and dist.is_initialized()):
        return mode
    flag = torch.tensor([1.0 if mode == "deferred" else 0.0], dtype=torch.float64,
                        device=getattr(control_sync, "device", None) or torch.device("cpu"))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=getattr(control_sync, "group", None))
    return "deferred" if float(flag.item()) > 0 else "step"


class _Handover(DeferredSteps):
    """One step of the deferred machinery in a step-mode guard: it observes a restored pending
    step, then (at its end, after the update) its own signals, and hands back to step mode."""

    def check(self, loss: Any, metrics: Mapping[str, Any] | None, signals: Any) -> Any:
        # a step-mode caller's own signals (collect() + check(signals=...)) are measured again
        return super().check(loss, metrics, None)

    def finish(self) -> None:
        try:
            super().finish()
            if self.pending is not None:
                self.flush(self.g.raise_on_stop)
        finally:
            path = self.g.sync_path
            if path.deferred is self:
                path.deferred = None


class SyncPath:
    """The ``sync=`` mode of one :class:`~stability.adapters.torch.TorchGuard`
    (``guard.sync_path``): resolution of ``"auto"`` and the state of either mode (see the module
    docstring).

    Parameters
    ----------
    guard : TorchGuard
    sync : {"auto", "step", "deferred"}

    Attributes
    ----------
    requested : {"auto", "step", "deferred"}
        What the guard was built with (``guard.sync_requested``).
    mode : {"auto", "step", "deferred"}
        The step path taken (``"auto"`` until :meth:`resolve` ran; ``guard.sync_mode``).
    deferred : DeferredSteps or None
        The deferred machinery while it runs (``guard.deferred``).
    """

    def __init__(self, guard: Any, sync: str) -> None:
        self.g = guard
        self.requested = self.mode = check_sync("TorchGuard", sync)
        self._carried: Mapping[str, Any] | None = None  # deferred state waiting for "auto"
        self.deferred: DeferredSteps | None = DeferredSteps(guard) if sync == "deferred" else None

    def resolve(self) -> str:
        """The step path, ``"step"`` or ``"deferred"``; resolves ``sync="auto"`` the first time
        (:func:`auto_sync`, agreed across ranks).  Called by the first ``step()`` / ``check()``."""
        if self.mode != "auto":
            return self.mode
        g = self.g
        try:
            mode, why = auto_sync(getattr(g.collector, "params", []), g.optimizer)
        except Exception as exc:  # an exotic optimizer: the safe path, never a crash
            mode, why = "step", f"undecidable: {type(exc).__name__}: {exc}"
        agreed = agree(mode, g.sync)
        if agreed != mode:
            why += f"; another rank resolved {agreed!r}"
        self.mode = agreed
        log.info("stability: sync='auto' resolved to %r (%s)", agreed, why)
        if agreed == "deferred":
            self.deferred = DeferredSteps(g)
        carried, self._carried = self._carried, None
        self._take(carried)
        return agreed

    def _take(self, section: Mapping[str, Any] | None) -> None:
        """Restore a checked deferred section into the resolved mode (see the module docstring)."""
        if self.mode == "deferred":
            assert self.deferred is not None
            self.deferred.load_state_dict(section)
        elif section is not None and section.get("pending") is not None:
            self.deferred = _Handover(self.g)
            self.deferred.load_state_dict(section)
        else:
            self.deferred = None  # (a handover not yet run is replaced by the restored state)

    def state_dict(self, control: Control) -> dict[str, Any]:
        """The guard state's sync part: the mode taken (``"sync"``); with a pending step
        (``sync="deferred"``) its signals, observed after a restore; in step mode the control
        in force."""
        sd: dict[str, Any] = {"sync": self.mode}
        if self.deferred is not None:
            sd["deferred"] = self.deferred.state_dict()
        elif self._carried is not None:
            sd["deferred"] = dict(self._carried)
        else:
            sd["control"] = control.to_dict()
        return sd

    @staticmethod
    def parse(sd: dict[str, Any]) -> tuple[Mapping[str, Any] | None, str | None]:
        """Pop and check the sync part of a guard state (``ValueError`` names a bad field);
        returns ``(section, recorded mode)`` for :meth:`load` -- nothing changes yet."""
        section = sd.pop("deferred", None)
        control = sd.pop("control", None)
        recorded = sd.pop("sync", None)
        if recorded is not None and recorded not in SYNC_CHOICES:
            raise ValueError(f"TorchGuard state field 'sync' must be one of {SYNC_CHOICES}. "
                             f"Got {recorded!r} instead.")
        if section is None and control is not None:
            section = {"pending": None, "control": control}
        parse_deferred(section)  # checked before anything changes
        return section, recorded

    def load(self, section: Mapping[str, Any] | None, recorded: str | None) -> None:
        """Restore :meth:`parse` output, from a guard of either mode."""
        if self.mode == "auto":
            self._carried = section
            return
        self._take(section)
        if recorded not in (None, "auto", self.mode):
            log.info("stability: a sync=%r snapshot resumed with sync=%r", recorded, self.mode)
