"""Signal binding: metric-name aliases, glob patterns, slots, and the per-step gather.

Names
    Every incoming metric name is first normalised through an alias table
    (:data:`DEFAULT_ALIASES` plus the config's ``[monitor].aliases``).  An alias key ending in
    ``/*`` rewrites a prefix: ``"grad-norm/*" = "grad_norm/*"`` maps ``grad-norm/blk0`` to
    ``grad_norm/blk0``.  Two raw names that alias to the same canonical name share one slot (the
    one given last on a step wins).

Patterns
    Each detector input is an fnmatch-style pattern (``*``, ``?``, ``[seq]``).  The text matched
    by the wildcards is the *series key* (wildcard captures joined with ``/``): ``grad_norm/*``
    on ``grad_norm/blk0`` gives key ``blk0``; a pattern without wildcards gives key ``''``.
    For multi-input detectors the series keys of all inputs are matched, so
    ``["act_mean/*", "act_std/*"]`` makes one series per layer with two inputs.

Slots and growth
    Each canonical name bound by at least one pattern gets a *slot* (an index into the step's
    value vector).  A name seen for the first time -- e.g. a layer that appears after the
    first step -- is resolved once (then cached) and ``grow()``s every bank it belongs to by
    one fresh series; the new series warms up on its own, existing series are untouched.
    A bank holds at most ``[monitor] max_series`` series (default 4096): a new name is not
    added to a full bank (one warning per bank), and a name no bank takes is skipped and
    recorded on every step it appears, without being cached (bounded memory under a new name
    every step).  Names that match no pattern are ignored (listed in ``Monitor.unbound``, up to
    ``max_series`` of them).

Own outputs
    Names under the project's own prefix (:data:`OWN_PREFIX`, ``stability/``; plus any
    ``[monitor] own_prefixes``) are never bound, by any pattern -- not even a catch-all such
    as the non-finite binding's ``*``.  They are what the guard logs about itself
    (``stability/lr_factor``, ``stability/score/...``): replaying or watching a guarded run's
    own trainer logs must not read them as training signals.  A prefix also matches after a
    logger's path prefix (HF's TensorBoard writes ``train/stability/lr_factor``).

Per step the monitor writes values into the slot vector and :func:`gather_step` copies them
into every binding's ``(1, n_inputs, n_series)`` input array and missing mask in one Numba call.

Examples
--------
>>> a = Aliases({"my loss": "loss"})
>>> a("my loss"), a("train/loss"), a("grad-norm/blk0"), a("learning_rate")
('loss', 'loss', 'grad_norm/blk0', 'lr')
>>> p = Pattern("grad_norm/*")
>>> p.match("grad_norm/blk0"), p.match("grad_norm"), Pattern("loss").match("loss")
('blk0', None, '')
>>> own = OwnNames(["guard/"])
>>> own("stability/clip_norm"), own("train/stability/score/nan"), own("guard/x"), own("loss")
(True, True, True, False)
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
from numba import njit

from detectors import BoolArray, FloatArray

__all__ = ["DEFAULT_ALIASES", "OWN_PREFIX", "Aliases", "OwnNames", "Pattern", "gather_step"]

#: Prefix of every metric the project logs about itself (never an input of a detector).
OWN_PREFIX = "stability/"

#: Aliases applied to every metric name before matching (config aliases are merged on top).
DEFAULT_ALIASES: dict[str, str] = {
    # training loss
    "train/loss": "loss",
    "train_loss": "loss",
    "training_loss": "loss",
    "loss/train": "loss",
    "lm loss": "loss",
    "lm_loss": "loss",
    "train_loss_step": "loss",  # Lightning self.log("train_loss", on_step=True, on_epoch=True)
    "lm-loss": "loss",
    "train/lm_loss": "loss",
    # validation loss
    "val/loss": "val_loss",
    "valid/loss": "val_loss",
    "eval/loss": "val_loss",
    "eval_loss": "val_loss",
    "validation_loss": "val_loss",
    "loss/val": "val_loss",
    "lm loss validation": "val_loss",
    "lm loss value": "val_loss",
    "valid_loss": "val_loss",
    # learning rate
    "learning_rate": "lr",
    "learning-rate": "lr",
    "learning rate": "lr",
    "train/lr": "lr",
    "train/learning_rate": "lr",
    # Lightning's LearningRateMonitor ("lr-<Optimizer>")
    "lr-Adam": "lr",
    "lr-AdamW": "lr",
    "lr-SGD": "lr",
    "lr-RMSprop": "lr",
    "lr-Adagrad": "lr",
    # global gradient norm
    "grad-norm": "grad_norm",
    "grad norm": "grad_norm",
    "gradnorm": "grad_norm",
    "global_grad_norm": "grad_norm",
    "train/grad_norm": "grad_norm",
    "grad_norm/global": "grad_norm",
    "gradient_norm": "grad_norm",
    "grad_2.0_norm_total": "grad_norm",  # Lightning's grad_norm(module, 2)
    # AMP loss scale, epochs
    "loss scale": "loss_scale",
    "train/loss_scale": "loss_scale",
    "train/epoch": "epoch",
    # per-layer families (prefix rewrites)
    "grad-norm/*": "grad_norm/*",
    "train/grad_norm/*": "grad_norm/*",
    "update-ratio/*": "update_ratio/*",
}


class Aliases:
    """Callable name normaliser: exact aliases first, then ``prefix/*`` rewrites.

    Parameters
    ----------
    extra
        Aliases merged over :data:`DEFAULT_ALIASES` (mapping a name to itself disables a default).
    defaults
        Start from :data:`DEFAULT_ALIASES` (``False``: ``extra`` alone).
    """

    def __init__(self, extra: Mapping[str, str] | None = None, *, defaults: bool = True):
        table = dict(DEFAULT_ALIASES) if defaults else {}
        table.update(extra or {})
        self.exact: dict[str, str] = {}
        self.prefix: list[tuple[str, str]] = []
        for src, dst in table.items():
            if src.endswith("/*"):
                self.prefix.append((src[:-1], dst[:-1] if dst.endswith("/*") else dst + "/"))
            else:
                self.exact[src] = dst
        self.prefix.sort(key=lambda p: -len(p[0]))

    def __call__(self, name: str) -> str:
        out = self.exact.get(name)
        if out is not None:
            return out
        for src, dst in self.prefix:
            if name.startswith(src):
                return dst + name[len(src):]
        return name


class OwnNames:
    """Predicate: is a metric name one of the project's own outputs (never bound)?

    A name is the project's own when it starts with :data:`OWN_PREFIX` or one of ``extra``, or
    contains one of them right after a ``/`` (a logger's prefix such as HF's ``train/``).

    Parameters
    ----------
    extra
        More prefixes (``[monitor] own_prefixes``), e.g. ``["guard/"]``.
    """

    def __init__(self, extra: tuple[str, ...] | list[str] = ()):
        prefixes = [OWN_PREFIX, *(p for p in extra if p and p != OWN_PREFIX)]
        self.prefixes = tuple(prefixes)
        self._inner = tuple("/" + p for p in prefixes)

    def __call__(self, name: str) -> bool:
        return name.startswith(self.prefixes) or any(q in name for q in self._inner)


class Pattern:
    """fnmatch-style pattern whose wildcards capture the series key.

    >>> Pattern("act_*/*").match("act_mean/blk3")
    'mean/blk3'
    >>> Pattern("*").match("loss")
    'loss'
    """

    def __init__(self, pattern: str):
        self.pattern = pattern
        out, i, n = [], 0, len(pattern)
        while i < n:
            c = pattern[i]
            if c == "*":
                out.append("(.*)")
            elif c == "?":
                out.append("(.)")
            elif c == "[":
                j = pattern.find("]", i + 2)
                if j < 0:
                    out.append(re.escape(c))
                else:
                    body = pattern[i + 1 : j]
                    if body.startswith("!"):
                        body = "^" + body[1:]
                    out.append("([" + body.replace("\\", "\\\\") + "])")
                    i = j
            else:
                out.append(re.escape(c))
            i += 1
        self.wildcard = any(ch in pattern for ch in "*?[")
        self._re = re.compile("".join(out) + r"\Z", re.DOTALL)

    def match(self, name: str) -> str | None:
        """The series key if ``name`` matches, else ``None``."""
        m = self._re.match(name)
        if m is None:
            return None
        return "/".join(m.groups())

    def __repr__(self) -> str:
        return f"Pattern({self.pattern!r})"


@njit(cache=True, error_model="numpy")
def gather_step(  # type: ignore[no-untyped-def]
    vals, present, gidx, boff, soff, X, M, S, A, active
):
    """Copy slot values into all bindings' inputs; clear outputs of idle bindings.

    ``gidx[k]`` is the slot feeding element ``k`` of the concatenated input buffer ``X``
    (missing mask ``M``); binding ``b`` owns ``X[boff[b]:boff[b+1]]`` and outputs
    ``S/A[soff[b]:soff[b+1]]``.  ``active[b]`` is set when any of its inputs is present;
    idle bindings get score ``nan`` / no alarm (exactly what their kernel would output for
    an all-missing step).  ``present`` is cleared for the next step.
    """
    n_b = boff.shape[0] - 1
    for b in range(n_b):
        any_p = False
        for k in range(boff[b], boff[b + 1]):
            s = gidx[k]
            p = present[s]
            X[k] = vals[s]
            M[k] = not p
            if p:
                any_p = True
        active[b] = any_p
        if not any_p:
            for i in range(soff[b], soff[b + 1]):
                S[i] = np.nan
                A[i] = False
    for s in range(present.shape[0]):
        present[s] = False


def empty_buffers(n: int) -> tuple[FloatArray, BoolArray]:
    """Value and presence vectors for ``n`` slots (slot 0 = always absent, 1 = scratch)."""
    return np.zeros(n), np.zeros(n, dtype=np.bool_)
