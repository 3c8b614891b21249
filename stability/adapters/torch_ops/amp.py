"""Mixed precision: a ``torch.amp.GradScaler`` overflow step is information, not a fault.

With fp16 autocast a :class:`torch.amp.GradScaler` multiplies the loss by a *scale* before
``backward()``.  When a scaled gradient overflows (``inf``/``nan`` somewhere), ``scaler.step``
skips the optimizer step and ``scaler.update`` halves the scale; after ``growth_interval``
(default 2000) clean steps the scale doubles again, which usually overflows once more.  Start-up
(the default initial scale is ``2**16``) typically costs a handful of such skipped steps.  All
of this is routine: the non-finite gradients of an overflow step are an artefact of the scale,
not of the model.

So on an overflow step the adapters report ``amp_overflow = 1.0`` and ``loss_scale`` and leave the
(non-finite) gradient norms out -- *missing*, not NaN -- so the ``nonfinite`` binding does not
fire; on a normal step they report ``amp_overflow = 0.0``, ``loss_scale`` and the true *unscaled*
gradient norms (``scaler.unscale_(optimizer)`` first, the documented pattern for clipping).  The
presets alarm only on an abnormal overflow *frequency* (``amp_overflow`` binding) or a collapsing
scale (``loss_scale`` binding); a non-finite *loss* is still a critical fault.

bf16 autocast needs no scaler (bf16 has fp32's exponent range): no ``amp_overflow`` /
``loss_scale`` metrics, and a non-finite gradient is a real fault as in fp32.

The helpers here are shared by the plain-torch guard and the HF / Lightning adapters:

* :func:`scaler_enabled`, :func:`loss_scale`, :func:`amp_state` -- read a scaler;
* :func:`ensure_unscaled` -- ``scaler.unscale_(optimizer)`` unless already done this step;
* :func:`amp_metrics` -- the two metrics of a step;
* :func:`drop_grad_norms` -- remove the gradient-norm keys of an overflow step from a metric dict.

Everything is duck-typed on the scaler (``get_scale``, ``is_enabled``, ``unscale_``), so a
scaler-like object of another framework works too.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "AMP_OVERFLOW",
    "GRAD_NORM_PREFIXES",
    "LOSS_SCALE",
    "amp_metrics",
    "amp_state",
    "autocast_dtype",
    "drop_grad_norms",
    "ensure_unscaled",
    "found_inf",
    "loss_scale",
    "scaler_enabled",
]

log = logging.getLogger("stability.adapters")

#: Metric name of the overflow flag (1.0 on a step the scaler skips, else 0.0).
AMP_OVERFLOW = "amp_overflow"
#: Metric name of the loss scale used for the step's backward pass.
LOSS_SCALE = "loss_scale"
#: Metric names (exact, or prefixes ending in ``/``) dropped on an overflow step.
GRAD_NORM_PREFIXES = ("grad_norm", "grad_norm/")


def scaler_enabled(scaler: Any) -> bool:
    """Whether ``scaler`` is an enabled loss scaler (``None`` / disabled: ``False``).

    >>> scaler_enabled(None)
    False
    """
    if scaler is None:
        return False
    fn = getattr(scaler, "is_enabled", None)
    try:
        return bool(fn()) if callable(fn) else hasattr(scaler, "get_scale")
    except Exception:  # reading a scaler must never kill the run
        return False


def loss_scale(scaler: Any) -> float:
    """The scaler's current scale (``nan`` when unknown or disabled).

    One host sync on an accelerator (``get_scale`` reads the device tensor).
    """
    if not scaler_enabled(scaler):
        return math.nan
    try:
        return float(scaler.get_scale())
    except Exception:
        return math.nan


def found_inf(scaler: Any, optimizer: Any) -> bool | None:
    """Whether ``scaler.unscale_(optimizer)`` found non-finite gradients this step.

    ``None`` when not known: no unscale recorded yet for this optimizer (before ``unscale_`` /
    ``step``, or after ``update()`` reset the scaler's per-optimizer state).
    """
    if not scaler_enabled(scaler) or optimizer is None:
        return None
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, Mapping) or id(optimizer) not in states:
        return None  # (reading a defaultdict by key would insert an entry)
    per_device = states[id(optimizer)].get("found_inf_per_device") or {}
    if not per_device:
        return None
    try:
        return bool(sum(float(v) for v in per_device.values()))
    except Exception:
        return None


def amp_state(scaler: Any, optimizer: Any = None,
              prev_scale: float | None = None) -> tuple[bool, float]:
    """``(overflow, scale)`` of the current step for a loss scaler.

    ``overflow`` comes from the scaler's own found-inf record for ``optimizer`` when it is known
    (between ``unscale_``/``step`` and ``update``); after ``update()`` pass ``prev_scale`` (the
    scale before the step): a smaller scale now means the step overflowed and was skipped.
    ``scale`` is the current scale (``nan`` without an enabled scaler, where ``overflow`` is
    ``False``).

    Examples
    --------
    >>> amp_state(None)
    (False, nan)
    """
    scale = loss_scale(scaler)
    if math.isnan(scale):
        return False, scale
    inf = found_inf(scaler, optimizer)
    if inf is not None:
        return inf, scale
    if prev_scale is not None and math.isfinite(prev_scale):
        return scale < prev_scale, scale
    return False, scale


def ensure_unscaled(scaler: Any, optimizer: Any) -> bool:
    """``scaler.unscale_(optimizer)`` unless it was already called since the last ``update``.

    Returns ``True`` when the gradients are unscaled now (by this call or an earlier one),
    ``False`` without an enabled scaler.  Never raises.
    """
    if not scaler_enabled(scaler):
        return False
    states = getattr(scaler, "_per_optimizer_states", None)
    if isinstance(states, Mapping) and id(optimizer) in states and \
            states[id(optimizer)].get("found_inf_per_device"):
        return True  # unscale_ already ran this step (checked without reading the device)
    try:
        scaler.unscale_(optimizer)
    except RuntimeError as exc:  # "unscale_() has already been called ..." and the like
        log.debug("scaler.unscale_ skipped: %s", exc)
    except Exception:
        log.debug("scaler.unscale_ failed", exc_info=True)
        return False
    return True


def amp_metrics(overflow: bool, scale: float) -> dict[str, float]:
    """The two metrics of a scaled step (empty when there is no scale).

    >>> amp_metrics(True, 32768.0)
    {'amp_overflow': 1.0, 'loss_scale': 32768.0}
    >>> amp_metrics(False, float("nan"))
    {}
    """
    if not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        return {}
    return {AMP_OVERFLOW: 1.0 if overflow else 0.0, LOSS_SCALE: float(scale)}


def is_grad_norm_key(name: str) -> bool:
    """``grad_norm`` or ``grad_norm/<layer>`` (HF's ``grad_norm`` included).

    >>> is_grad_norm_key("grad_norm/blocks.0"), is_grad_norm_key("loss")
    (True, False)
    """
    return name == "grad_norm" or name.startswith("grad_norm/")


def drop_grad_norms(metrics: Mapping[str, Any], overflow: bool) -> dict[str, Any]:
    """A copy of ``metrics`` without the gradient-norm keys when ``overflow`` (else unchanged).

    On an overflow step the gradient norms are non-finite by construction: they are *missing*
    for the monitor, never NaN.

    >>> drop_grad_norms({"loss": 2.0, "grad_norm": float("inf"), "grad_norm/fc": 1e9}, True)
    {'loss': 2.0}
    >>> drop_grad_norms({"loss": 2.0, "grad_norm": 1.5}, False)
    {'loss': 2.0, 'grad_norm': 1.5}
    """
    if not overflow:
        return dict(metrics)
    return {k: v for k, v in metrics.items() if not is_grad_norm_key(str(k))}


def autocast_dtype(precision: str) -> Any:
    """The autocast dtype of a precision name (``None`` for full precision).

    ``"fp32"``/``"32"`` -> ``None``; ``"fp16"``/``"16-mixed"`` -> ``torch.float16``;
    ``"bf16"``/``"bf16-mixed"`` -> ``torch.bfloat16``.
    """
    import torch

    p = str(precision).lower()
    if p in ("fp32", "32", "32-true", "float32", "full"):
        return None
    if p in ("fp16", "16", "16-mixed", "float16", "half"):
        return torch.float16
    if p in ("bf16", "bf16-mixed", "bfloat16"):
        return torch.bfloat16
    raise ValueError(f"The 'precision' parameter must be one of fp32, fp16, bf16. "
                     f"Got {precision!r} instead.")
