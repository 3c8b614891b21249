"""Collect training signals from a PyTorch model with one host sync per step.

:class:`SignalCollector` measures, after ``backward()`` and before the optimizer step:

* the global gradient norm before clipping and per-layer gradient norms, fused:
  ``torch._foreach_norm`` over all gradients, then one ``index_add_`` to sum squares per layer;
* the global weight norm ``param_norm`` on the steps ``s % param_norm_every == 0``
  (:data:`PARAM_NORM_EVERY` = 2; missing -- "not logged on this step" -- on the others).  The
  ``weight_jump`` detector counts its warm-up (20) in values: at k = 4 it spanned 80 steps and
  lost two short GPT ``weight_scale`` rescues in ``bench_rescue.py --quick``;
* the update-to-weight ratio ``||w_t+1 - w_t|| / ||w_t||`` per layer every
  ``update_ratio_every`` steps (:data:`UPDATE_RATIO_EVERY` = 4 by default: the steps
  ``s % 4 == 0``; ``1`` = every step).  On the other steps it is missing ("not logged on this
  step", which the monitor and a replay handle as such).  It is only known after the optimizer
  step, so it is kept on the device and reported with the *next* step's signals (steps 1, 5,
  9, ...) -- that keeps it inside the single host transfer.  Two ways (``update_ratio=``):

  - ``"sampled"`` (default): no parameter copy.  Before the step a fixed subset of each
    tensor's elements is gathered (``torch.take``): about ``update_ratio_samples`` (4096)
    elements in blocks of 16 contiguous ones spread over the rows (:func:`_sample_index`;
    smaller tensors are copied whole).  After the step ``||dw||^2`` of a tensor is estimated
    as ``n / m * sum(dw_i^2)`` over its ``m`` sampled elements, summed per layer, against
    the exact per-tensor weight norms.  It measures the optimizer's real update (momentum,
    Adam, weight decay, clipping, LR factor) on the same coordinates every step.  Against
    ``"exact"`` (``tests/adapters/test_update_ratio_sampled.py``, tolerance 7%): AdamW within
    about 1% (MLP, char-GPT, 12.9M transformer), SGD with momentum within 2-6%.  A spike
    confined to unsampled coordinates is underestimated; ``param_norm`` sees it.
  - ``"exact"``: a full copy of every parameter when due.

  Every-step, exact measurement (the most expensive): ``update_ratio_every=1,
  param_norm_every=1, update_ratio="exact"``; ``update_ratio_every=0`` turns the ratios off.

  (Reading the update back from an optimizer's state would re-implement, and drift from,
  every optimizer's arithmetic);
* per-layer activation statistics of chosen modules via forward hooks (mean, std, abs-max,
  excess kurtosis), every ``activation_every`` steps, on training forwards only, computed on
  the device with one temporary per hooked module (``var_mean`` + ``aminmax`` + one centred
  fourth moment) and no host copy;
* the loss.

Everything is computed on the device and concatenated into one vector that is copied to the host
once (``.tolist()``). Layer families are returned as NumPy arrays for the monitor's fast path
(``monitor.declare_family(name, layers)`` then ``observe(..., families=...)``), under the metric
names of the convention: ``grad_norm/<layer>``, ``update_ratio/<layer>``,
``act_mean|act_std|act_absmax|act_kurtosis/<layer>``.

Overhead (``benchmarks/bench_overhead.py``): per step the guard reads every gradient once (the
norms, reused for clipping: a loop that clips pays no second norm); every ``param_norm_every``
steps every weight once; every ``update_ratio_every`` steps the update-ratio sample twice.
No full parameter is copied.  The torch ops dispatched per step (the host's cost when the
accelerator waits for it) do not grow with the number of parameter tensors: foreach calls over
cached tensor lists, one ``index_add_`` per per-layer reduction
(:mod:`stability.adapters.torch_ops.param_lists`); only the update-ratio sample of each tensor above
``update_ratio_samples`` elements is one ``torch.take`` before and one after the step, on the
ratio steps (``bench_overhead.py --ops``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from stability.adapters.torch_ops.param_lists import SAMPLE_BLOCK, ParamLists

__all__ = ["ACT_STATS", "PARAM_NORM_EVERY", "SAMPLE_BLOCK", "UPDATE_RATIO_EVERY",
           "UPDATE_RATIO_MODES", "SignalCollector", "Signals", "layer_of"]

#: Activation statistics, in the order they are reported.
ACT_STATS = ("act_mean", "act_std", "act_absmax", "act_kurtosis")
#: Ways to measure update ratios (see the module docstring).
UPDATE_RATIO_MODES = ("sampled", "exact")
#: Default cadences of the update ratios and of the per-tensor weight norms (see the module
#: docstring and ``docs/performance.md``, "Overhead per step").
UPDATE_RATIO_EVERY = 4
PARAM_NORM_EVERY = 2


def layer_of(param_name: str, depth: int | None = None) -> str:
    """Layer key of a parameter: its owning module, optionally truncated to ``depth`` parts.

    Examples
    --------
    >>> layer_of("blocks.0.attn.c_attn.weight")
    'blocks.0.attn.c_attn'
    >>> layer_of("blocks.0.attn.c_attn.weight", depth=2)
    'blocks.0'
    >>> layer_of("bias")
    'root'
    """
    parts = param_name.split(".")[:-1]
    if depth is not None:
        parts = parts[:depth]
    return ".".join(parts) or "root"


@dataclass
class Signals:
    """One step's signals, on the host."""

    scalars: dict[str, float] = field(default_factory=dict)
    families: dict[str, np.ndarray] = field(default_factory=dict)

    def flat(self, layers: Mapping[str, list[str]]) -> dict[str, float]:
        """All signals as one ``{name: float}`` mapping (``grad_norm/<layer>`` keys)."""
        out = dict(self.scalars)
        for fam, arr in self.families.items():
            for name, v in zip(layers[fam], arr.tolist(), strict=False):
                out[f"{fam}/{name}"] = v
        return out


@dataclass
class SignalLayout:
    """Where the signals sit in :meth:`SignalCollector.measure`'s vector: the scalars ``names``
    (``grad_norm`` first), then each family's values; ``host`` scalars were host numbers."""

    names: list[str]
    families: list[tuple[str, int]]
    host: dict[str, float]

    def unpack(self, flat: Any) -> Signals:
        """The :class:`Signals` of the vector's host values (a sequence of floats)."""
        n = len(self.names)
        out = Signals(dict(zip(self.names, flat[:n], strict=False)) | self.host)
        for fam, k in self.families:
            out.families[fam] = np.asarray(flat[n:n + k], dtype=np.float64)
            n += k
        return out


class SignalCollector:
    """Fused per-step signal collection for one model.

    Parameters
    ----------
    model : torch.nn.Module
        The model; its trainable parameters are grouped into layers.
    layer_depth : int, optional
        Group parameters by the first ``layer_depth`` parts of their owning module's name
        (``None`` = one layer per module that owns parameters).
    layer_fn : callable, optional
        ``param_name -> layer key``; overrides ``layer_depth``.
    per_layer : bool
        Report per-layer gradient norms (the global norm is always reported).
    update_ratio_every : int
        Measure update/weight ratios on the steps ``s % k == 0`` (reported with step ``s + 1``,
        missing on the others; 0 = never).  Default :data:`UPDATE_RATIO_EVERY`.  The step is
        the one given to :meth:`before_step`.
    param_norm_every : int
        Measure ``param_norm`` on the steps ``s % k == 0`` (missing on the others; 0 = never).
        Default :data:`PARAM_NORM_EVERY`.  The step is the one given to :meth:`begin_step`
        (else counted by :meth:`after_step`).  Also an attribute.
    update_ratio : {"sampled", "exact"}
        ``"sampled"`` (default) copies at most ``update_ratio_samples`` strided elements per
        tensor; ``"exact"`` copies every parameter when a ratio is due.
    update_ratio_samples : int
        Elements sampled per tensor in ``"sampled"`` mode (smaller tensors are copied whole).
    activations : iterable of str or mapping of str to Module, optional
        Modules whose outputs are summarised (names from ``model.named_modules()``).
    activation_every : int
        Summarise activations every this many steps.

    Examples
    --------
    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    >>> col = SignalCollector(m, activations=["1"])
    >>> col.begin_step(0)
    >>> loss = m(torch.randn(8, 3)).pow(2).mean(); loss.backward()
    >>> s = col.collect(loss)
    >>> sorted(s.scalars), col.layers["grad_norm"], s.families["act_mean"].shape
    (['grad_norm', 'loss', 'param_norm'], ['0', '2'], (1,))
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        layer_depth: int | None = None,
        layer_fn: Callable[[str], str] | None = None,
        per_layer: bool = True,
        update_ratio_every: int = UPDATE_RATIO_EVERY,
        activations: Iterable[str] | Mapping[str, torch.nn.Module] | None = None,
        activation_every: int = 10,
        update_ratio: str = "sampled",
        update_ratio_samples: int = 4096,
        param_norm_every: int = PARAM_NORM_EVERY,
    ) -> None:
        if update_ratio not in UPDATE_RATIO_MODES:
            raise ValueError("The 'update_ratio' parameter of SignalCollector must be one of "
                             f"{UPDATE_RATIO_MODES}. Got {update_ratio!r} instead.")
        if isinstance(update_ratio_samples, bool) or not isinstance(update_ratio_samples, int) \
                or update_ratio_samples < 1:
            raise ValueError("The 'update_ratio_samples' parameter of SignalCollector must be an "
                             f"int in the range [1, inf). Got {update_ratio_samples!r} instead.")
        for nm, v in (("update_ratio_every", update_ratio_every),
                      ("param_norm_every", param_norm_every)):
            if v < 0:
                raise ValueError(f"The '{nm}' parameter of SignalCollector must be an int in "
                                 f"the range [0, inf). Got {v} instead.")
        if activation_every < 1:
            raise ValueError("The 'activation_every' parameter of SignalCollector must be an "
                             f"int in the range [1, inf). Got {activation_every} instead.")
        self.model = model
        fn = layer_fn or (lambda n: layer_of(n, layer_depth))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        keys = [fn(n) for n, _ in named]
        self.layer_names: list[str] = list(dict.fromkeys(keys))
        index = {k: i for i, k in enumerate(self.layer_names)}
        self._group = [index[k] for k in keys]
        self.per_layer = per_layer
        self.update_ratio_every = int(update_ratio_every)
        self.param_norm_every = int(param_norm_every)
        self.activation_every = int(activation_every)
        self.update_ratio = update_ratio
        self.update_ratio_samples = int(update_ratio_samples)
        # cached lists and index tensors: the ops per step do not grow with the tensor count
        self._lists = ParamLists(self.params, self._group, len(self.layer_names),
                                 self.update_ratio_samples)
        self._step = 0  # the step being collected (begin_step, else counted by after_step)
        self._pending_ratio: torch.Tensor | None = None
        self._snapshot: Any = None  # what the update ratio compares against
        self._pn: torch.Tensor | None = None  # per-tensor weight norms of this step
        self._act_on = False
        self._act: dict[str, torch.Tensor] = {}
        self._hooks: list[Any] = []
        if activations is not None:
            mods = dict(model.named_modules())
            items = (activations.items() if isinstance(activations, Mapping)
                     else [(n, mods[n]) for n in activations])
            self.act_names = [n for n, _ in items]
            for name, mod in items:
                self._hooks.append(mod.register_forward_hook(self._make_hook(name)))
        else:
            self.act_names = []
        self.layers: dict[str, list[str]] = {}
        if per_layer:
            self.layers["grad_norm"] = self.layer_names
        if self.update_ratio_every:
            self.layers["update_ratio"] = self.layer_names
        for st in ACT_STATS if self.act_names else ():
            self.layers[st] = self.act_names

    # ------------------------------------------------------------------ activations
    def _make_hook(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            if not (self._act_on and module.training):
                return
            out = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(out, torch.Tensor) and out.numel() > 1:
                with torch.no_grad():
                    self._act[name] = _moments(out)
        return hook

    def begin_step(self, step: int) -> None:
        """Call before the forward pass of ``step``: turns activation hooks on when due."""
        self._step = int(step)
        self._act_on = bool(self.act_names) and step % self.activation_every == 0
        if not self._act_on:
            self._act.clear()

    # ------------------------------------------------------------------ gradients
    def _norms(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """This step's per-layer gradient norms, the weight norm when due (else ``None``) and
        the pending update ratios (else ``None``).

        Sharded parameters: every per-layer sum of squares of the step (gradients, weights,
        the pending ratio's two) is summed over the ranks in one ``all_reduce``.
        """
        lists = self._lists
        grads, mask = lists.grads()
        gsq = (lists.layer_sq(lists.norms(grads), mask, lists.grad_copies) if grads
               else torch.zeros(len(self.layer_names), device=lists.device))
        every, self._pn = self.param_norm_every, None
        due = bool(self.params) and every > 0 and self._step % every == 0
        if due:
            # global weight norm (weight-corruption evidence: an abrupt jump between two
            # steps); the per-tensor norms are kept for the update ratio's denominator
            self._pn = lists.norms(lists.local)
        ratio, self._pending_ratio = self._pending_ratio, None
        if lists.shards is None:
            return gsq.sqrt(), None if self._pn is None else self._pn.square().sum().sqrt(), ratio
        psq = None if self._pn is None else lists.layer_sq(self._pn, None, lists.param_copies)
        out = lists.reduce([v for v in (gsq, psq, ratio) if v is not None])
        gsq, rest = out[0], out[1:]
        if psq is not None:
            psq, rest = rest[0], rest[1:]
        if ratio is not None:  # (the pending squares: ||dw||^2 then ||w||^2 per layer)
            dsq, wsq = rest[0].chunk(2)
            ratio = dsq.sqrt() / wsq.sqrt().clamp_min(1e-12)
        return gsq.sqrt(), None if psq is None else psq.sum().sqrt(), ratio

    def local_grads(self) -> list[torch.Tensor]:
        """The present gradients, as their local shards when the parameters are sharded (what
        a clip scales in place)."""
        return self._lists.local_grads()

    def measure(self, loss: Any = None, extra: Mapping[str, Any] | None = None
                ) -> tuple[torch.Tensor, SignalLayout]:
        """This step's signals as one device vector and its :class:`SignalLayout` (:meth:`collect`
        without the host copy; ``vec[0]`` is the global gradient norm)."""
        device = self._lists.device
        layer, pnorm, ratio = self._norms()
        parts: list[torch.Tensor] = [layer.square().sum().sqrt().reshape(1)]
        names: list[str] = ["grad_norm"]
        if pnorm is not None:
            parts.append(pnorm.reshape(1))
            names.append("param_norm")
        scalars_in = dict(extra or {})
        if loss is not None:
            scalars_in = {"loss": loss, **scalars_in}
        host_scalars: dict[str, float] = {}
        for k, v in scalars_in.items():
            if isinstance(v, torch.Tensor):
                parts.append(v.detach().reshape(-1)[:1].to(device, torch.float32))
                names.append(k)
            elif v is not None:
                host_scalars[k] = float(v)
        fams: list[tuple[str, int]] = []
        if self.per_layer:
            parts.append(layer)
            fams.append(("grad_norm", layer.numel()))
        if ratio is not None:
            parts.append(ratio.to(device))
            fams.append(("update_ratio", ratio.numel()))
        if self._act_on and len(self._act) == len(self.act_names):
            # (a step where a hooked module did not run reports no activation family at all)
            stats = _finish_stats(  # (layers, 4), finished for all layers at once
                torch.stack([self._act[n].to(device) for n in self.act_names]))
            for j, st in enumerate(ACT_STATS):
                parts.append(stats[:, j])
                fams.append((st, len(self.act_names)))
            self._act.clear()
        vec = torch.cat([(t if t.dim() == 1 else t.reshape(-1)).float() for t in parts])
        return vec, SignalLayout(names, fams, host_scalars)

    def collect(self, loss: Any = None, extra: Mapping[str, Any] | None = None) -> Signals:
        """Measure this step's signals (call after ``backward()``, before clipping/stepping).

        Parameters
        ----------
        loss : tensor or float, optional
            The training loss of the step.
        extra : mapping, optional
            More scalar signals (floats or 0-d tensors); they join the single host transfer.

        Returns
        -------
        Signals
        """
        vec, layout = self.measure(loss, extra)
        return layout.unpack(vec.tolist())  # the one host sync

    # ------------------------------------------------------------------ update ratios
    def before_step(self, step: int) -> None:
        """Call right before ``optimizer.step()``: keeps what the ratio needs when one is due.

        ``"sampled"``: the strided element subsets (a few KiB per tensor); ``"exact"``: a
        full copy of the parameters.
        """
        self._snapshot = None
        every = self.update_ratio_every
        if not (self.params and every > 0 and step % every == 0):
            return
        with torch.no_grad():
            if self.update_ratio == "exact":
                self._snapshot = [p.clone() for p in self._lists.local]
                return
            self._snapshot = self._lists.sample()
            if self._pn is None:  # not measured by collect() this step
                self._pn = self._lists.norms(self._lists.local)

    def after_step(self, stepped: bool = True) -> None:
        """Call right after ``optimizer.step()`` (or a skipped step, ``stepped=False``)."""
        self._step += 1
        snap, self._snapshot = self._snapshot, None
        wnorms, self._pn = self._pn, None
        if snap is None or not stepped or not self.params:
            return
        lists = self._lists
        with torch.no_grad():
            if self.update_ratio == "exact":
                diffs = list(torch._foreach_sub(lists.local, snap))
                copies = lists.param_copies
                self._set_ratio(lists.layer_sq(lists.norms(diffs), None, copies),
                                lists.layer_sq(lists.norms(snap), None, copies))
                return
            sq = lists.sample_sq(snap)
            if wnorms is None:  # (set with the snapshot; None only after a state_reset)
                return
            copies = lists.param_copies
            self._set_ratio(lists.layer_sum(sq, None, copies),
                            lists.layer_sum(wnorms.square(), None, copies))

    def _set_ratio(self, dsq: torch.Tensor, wsq: torch.Tensor) -> None:
        """The pending update ratios from per-layer ``||dw||^2`` and ``||w||^2``; sharded, the
        two sums themselves, summed over the ranks with the next step's norms."""
        if self._lists.shards is not None:
            self._pending_ratio = torch.cat([dsq, wsq])
        else:
            self._pending_ratio = dsq.sqrt() / wsq.sqrt().clamp_min(1e-12)

    def state_reset(self) -> None:
        """Forget pending measurements (after a rollback)."""
        self._pending_ratio = None
        self._snapshot = None
        self._pn = None
        self._act.clear()

    def remove(self) -> None:
        """Remove the forward hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def activation_stats(x: torch.Tensor) -> torch.Tensor:
    """``[mean, std, abs-max, excess kurtosis]`` of a tensor, on its device.

    Two fused reductions (``var_mean``, ``aminmax``) and one centred fourth moment computed in
    place in a single temporary; nothing leaves the device.

    Examples
    --------
    >>> import torch
    >>> s = activation_stats(torch.tensor([-1.0, 1.0, -1.0, 1.0]))
    >>> [round(v, 4) for v in s.tolist()]
    [0.0, 1.0, 1.0, -2.0]
    """
    return _finish_stats(_moments(x)[None])[0]


def _moments(x: torch.Tensor) -> torch.Tensor:
    """``[mean, variance, min, max, centred fourth moment]`` of ``x`` (the hook's part)."""
    x = x.detach().float().reshape(-1)
    var, m = torch.var_mean(x, correction=0)
    lo, hi = torch.aminmax(x)
    c = x - m
    c.square_().square_()  # (x - m)^4, in place: the one temporary
    return torch.stack([m, var, lo, hi, c.mean()])


def _finish_stats(mom: torch.Tensor) -> torch.Tensor:
    """:func:`activation_stats` of every row of ``(layers, 5)`` :func:`_moments`: one set of
    element-wise ops for all hooked layers (the same arithmetic per element)."""
    var = mom[:, 1]
    kurt = mom[:, 4] / var.square().clamp_min(1e-24) - 3.0
    return torch.stack([mom[:, 0], var.sqrt(), torch.maximum(mom[:, 3], -mom[:, 2]), kurt], 1)
