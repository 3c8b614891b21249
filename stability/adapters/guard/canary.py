"""The canary set: a few early, healthy training batches the guard evaluates now and then.

Memorisation of bad data is invisible in the training loss (it *falls* while the model learns
the corrupt batches) and needs a held-out measurement.  Without a user validation set the guard
keeps its own: the first ``size`` batches of the run's healthy start (offered by the loop or the
trainer callback), and every ``every`` steps it reports their mean loss as ``canary_loss``.
The presets bind ``canary_loss`` like ``val_loss`` (a held-out loss next to the training loss:
the ``val_spike`` / ``overfit_gap`` detectors, kind ``train_val_divergence``); the policy
attributes a divergence of the canary to the data (cause ``data``) and rolls back past it.

An evaluation changes nothing in training (a clean run is bit-identical with and without the
canary): it runs under ``torch.no_grad()`` with every module in ``eval()`` mode (each module's
own mode restored afterwards) and the CPU / CUDA random-number generators forked, so dropout
masks, batch-norm statistics, gradients and the RNG streams of the run are untouched.  Only
evaluation steps pay for it (``size`` forward passes); offering a batch once the set is full is
a no-op.

Filling ends at the first alarm (the healthy start is over; a batch offered on that step is
dropped) or when ``size`` batches are kept.  A batch larger than ``max_bytes`` (all batches
together) is refused with a warning; a ``loss_fn`` that raises disables the canary with a
warning (never a crash of the run).

Examples
--------
>>> import torch
>>> net = torch.nn.Linear(3, 1)
>>> canary = CanarySet(lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), size=2, every=10)
>>> canary.offer((torch.ones(4, 3), torch.zeros(4, 1)), step=0)
True
>>> canary.due(10), canary.due(15)
(False, False)
>>> canary.offer((torch.ones(4, 3), torch.ones(4, 1)), step=1)
True
>>> canary.full, canary.due(10)
(True, True)
>>> with torch.no_grad():
...     ref = (torch.nn.functional.mse_loss(net(torch.ones(4, 3)), torch.zeros(4, 1))
...            + torch.nn.functional.mse_loss(net(torch.ones(4, 3)), torch.ones(4, 1))) / 2
>>> abs(canary.evaluate(net) - float(ref)) < 1e-6
True
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["CANARY_KEY", "CanarySet", "LossFn", "isolated_eval"]

log = logging.getLogger("stability.adapters")

#: the metric name the guard reports (bound in the presets)
CANARY_KEY = "canary_loss"

#: ``loss_fn(model, batch) -> scalar loss`` (a tensor or a float)
LossFn = Callable[[torch.nn.Module, Any], Any]

STATE_VERSION = 1


class CanarySet:
    """Keep ``size`` early healthy batches; evaluate their mean loss every ``every`` steps.

    Parameters
    ----------
    loss_fn : callable
        ``loss_fn(model, batch)`` returns the scalar loss of ``batch`` (the loop's own loss).
    size : int
        Batches kept (the first ones offered during the healthy start).
    every : int
        Evaluate on steps that are positive multiples of this.  The guard defaults it to its
        ``checkpoint_every`` so every periodic checkpoint is vouched for by the canary of its
        step (an alarm step takes no healthy checkpoint).
    max_bytes : int
        Upper bound on the memory the kept batches take (tensors only).
    """

    def __init__(self, loss_fn: LossFn, size: int = 4, every: int = 100,
                 max_bytes: int = 8 << 20) -> None:
        for name, v, lo in (("size", size, 1), ("every", every, 1), ("max_bytes", max_bytes, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"The {name!r} parameter of CanarySet must be an int in the "
                                 f"range [{lo}, inf). Got {v!r} instead.")
        if not callable(loss_fn):
            raise TypeError("The 'loss_fn' parameter of CanarySet must be a callable "
                            f"loss_fn(model, batch). Got {type(loss_fn).__name__} instead.")
        self.loss_fn = loss_fn
        self.size = size
        self.every = every
        self.max_bytes = max_bytes
        self.batches: list[Any] = []
        self.steps: list[int] = []  # the step each kept batch was offered at
        self.nbytes = 0
        self.closed = False  # filling is over (an alarm, or the set is full)
        self.disabled = False  # the loss function failed: no more evaluations
        self.last = math.nan  # the last canary loss (as reported)
        self.evaluations = 0
        self.scale = 1.0  # level offset of a set refilled after a restore (see load_state_dict)
        self._rebase = False

    @property
    def full(self) -> bool:
        """Whether ``size`` batches are kept."""
        return len(self.batches) >= self.size

    @property
    def active(self) -> bool:
        """Whether the set has batches to evaluate and has not been disabled."""
        return bool(self.batches) and not self.disabled

    def offer(self, batch: Any, step: int) -> bool:
        """Keep a detached copy of ``batch`` (offered at ``step``) while the set fills.

        Returns whether it was kept.  A no-op once the set is full or closed.
        """
        if self.closed or self.full:
            return False
        kept = _detached_copy(batch)
        n = _nbytes(kept)
        if self.nbytes + n > self.max_bytes:
            log.warning("stability: canary batch of %d bytes refused (max_bytes=%d); the "
                        "canary set keeps %d batch(es)", n, self.max_bytes, len(self.batches))
            self.closed = True
            return False
        self.batches.append(kept)
        self.steps.append(int(step))
        self.nbytes += n
        return True

    def close(self, step: int) -> None:
        """The healthy start is over at ``step`` (an alarm): drop a batch offered at or after
        it and keep no more."""
        while self.steps and self.steps[-1] >= step:
            self.steps.pop()
            self.batches.pop()
        self.nbytes = sum(_nbytes(b) for b in self.batches)
        self.closed = True

    def due(self, step: int) -> bool:
        """Whether ``step`` is an evaluation step: a positive multiple of ``every``, with the
        set full (or closed with batches)."""
        return (step > 0 and step % self.every == 0 and self.active
                and (self.full or self.closed))

    def evaluate(self, model: torch.nn.Module) -> float:
        """Mean loss of the kept batches under :func:`isolated_eval` (``nan`` when disabled
        now: the loss function raised; logged once)."""
        if not self.active:
            return math.nan
        try:
            with isolated_eval(model):
                total = sum(_as_float(self.loss_fn(model, b)) for b in self.batches)
        except Exception as exc:  # never crash the user's run
            self.disabled = True
            log.warning("stability: the canary loss function failed (%s: %s); the canary set "
                        "is disabled", type(exc).__name__, exc)
            return math.nan
        value = total / len(self.batches)
        if self._rebase and math.isfinite(value) and value > 0.0 and math.isfinite(self.last):
            self.scale = self.last / value  # continue the restored series at its level
        self._rebase = False
        self.last = value * self.scale
        self.evaluations += 1
        return self.last

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible bookkeeping.  The batches themselves are not part of it: restored
        into a set without batches, the set refills from the next healthy batches offered and
        its first evaluation is rebased onto the restored level (``scale``), so the reported
        series goes on where it was instead of jumping to the new batches' level."""
        return {"version": STATE_VERSION, "evaluations": self.evaluations,
                "last": self.last if math.isfinite(self.last) else None,
                "scale": self.scale, "disabled": self.disabled}

    def batches_state(self) -> dict[str, Any]:
        """The kept batches themselves (tensors: for a checkpoint file, not for JSON), with the
        steps they were offered at and whether filling is over."""
        return {"version": STATE_VERSION, "batches": list(self.batches),
                "steps": list(self.steps), "closed": self.closed}

    def load_batches(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`batches_state` output (call before :meth:`load_state_dict`: a set
        restored with its own batches goes on evaluating them, no rebase)."""
        batches, steps = list(sd.get("batches", [])), list(sd.get("steps", []))
        if sd.get("version", STATE_VERSION) != STATE_VERSION or len(batches) != len(steps):
            raise ValueError("CanarySet batches: unsupported version or batches/steps of "
                             f"different lengths ({len(batches)} / {len(steps)}).")
        if len(batches) > self.size:
            raise ValueError(f"CanarySet batches: {len(batches)} batches for a set of size "
                             f"{self.size}.")
        self.batches = [_detached_copy(b) for b in batches]
        self.steps = [int(s) for s in steps]
        self.nbytes = sum(_nbytes(b) for b in self.batches)
        self.closed = bool(sd.get("closed", False))

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (unknown versions refused)."""
        version = sd.get("version", STATE_VERSION)
        if version != STATE_VERSION:
            raise ValueError(f"CanarySet state version {version!r} is not supported "
                             f"(expected {STATE_VERSION}).")
        evaluations = sd.get("evaluations", 0)
        if isinstance(evaluations, bool) or not isinstance(evaluations, int) or evaluations < 0:
            raise ValueError(f"CanarySet state: 'evaluations' must be an int >= 0. Got "
                             f"{evaluations!r} instead.")
        last = sd.get("last")
        scale = float(sd.get("scale", 1.0))
        if last is not None and not math.isfinite(float(last)):
            raise ValueError(f"CanarySet state: 'last' must be finite or None. Got {last!r}.")
        if not (math.isfinite(scale) and scale > 0.0):
            raise ValueError(f"CanarySet state: 'scale' must be finite and > 0. Got {scale!r}.")
        self.evaluations = evaluations
        self.last = math.nan if last is None else float(last)
        self.disabled = bool(sd.get("disabled", False))
        self.scale = scale
        self._rebase = not self.batches and last is not None  # refilled: other batches


@contextlib.contextmanager
def isolated_eval(model: torch.nn.Module) -> Iterator[None]:
    """Evaluate ``model`` without touching training: ``no_grad``, every module in ``eval()``
    (each module's own ``training`` flag restored), the CPU and the model's CUDA RNGs forked."""
    modes = [(m, m.training) for m in model.modules()]
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model.eval()
            yield
    finally:
        for m, mode in modes:
            m.training = mode


def _detached_copy(batch: Any) -> Any:
    """``batch`` with every tensor detached and cloned (containers rebuilt)."""
    if isinstance(batch, torch.Tensor):
        return batch.detach().clone()
    if isinstance(batch, Mapping):
        return {k: _detached_copy(v) for k, v in batch.items()}
    if isinstance(batch, tuple):
        items = [_detached_copy(v) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
    if isinstance(batch, list):
        return [_detached_copy(v) for v in batch]
    return batch


def _nbytes(batch: Any) -> int:
    """Bytes of the tensors in ``batch``."""
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, Mapping):
        return sum(_nbytes(v) for v in batch.values())
    if isinstance(batch, (tuple, list)):
        return sum(_nbytes(v) for v in batch)
    return 0


def _as_float(loss: Any) -> float:
    """A loss (tensor, HF output with ``.loss``, or number) as a float."""
    v = getattr(loss, "loss", loss)
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().mean())
    return float(v)
