"""Cached tensor lists and index tensors of
:class:`~stability.adapters.torch_ops.signals.SignalCollector`.

On an accelerator a guarded step is bounded by the host when the step is short: every eager
torch op costs a dispatch (and usually a kernel launch).  :class:`ParamLists` keeps what the
collector needs per step precomputed, so that the number of dispatched ops per step does not
grow with the number of parameter tensors:

* the per-layer gradient norms are one ``torch._foreach_norm`` over all gradients, one
  ``stack`` and one ``index_add_`` into the layers with a cached index tensor
  (:meth:`ParamLists.layer_sq`), however many tensors and layers;
* the weight norms are one ``torch._foreach_norm`` over the parameters themselves (no
  per-tensor ``detach``: it runs under ``torch.no_grad()``);
* the sampled update ratio copies the tensors small enough to be taken whole with one foreach
  op, and the samples of the larger ones that are one or two strided views (a GPT's weight
  matrices: :func:`strided_pieces`) with one ``_foreach_copy_`` into reused buffers; any other
  large tensor's sample is one ``torch.take`` (there is no multi-tensor gather in PyTorch),
  before and after the update on the ratio steps.  The per-tensor scale and the order in
  which the norms are summed per layer are cached (the order of the per-tensor computation
  this replaces: the values are bit-identical).

Everything device-bound is built on the first use and rebuilt when the parameters move to
another device; the strided views when a parameter's storage changes (``p.data = ...``).  The
parameter list itself is fixed (as the collector's is).

Sharded parameters (FSDP2 ``DTensor`` s, :mod:`stability.adapters.torch_ops.sharded`): decided
once, when the lists are built.  Then every list holds the *local* shards (:attr:`ParamLists.local`,
:meth:`ParamLists.grads`), the per-layer sums count each element once (:meth:`ParamLists.layer_sum`)
and :meth:`ParamLists.reduce` sums a step's per-layer vectors over the ranks in one
``all_reduce``.  Without a DTensor :attr:`ParamLists.shards` is ``None`` and nothing changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from stability.adapters.torch_ops.sharded import ShardLayout

__all__ = ["SAMPLE_BLOCK", "ParamLists", "sample_index", "stack_f32", "strided_pieces"]

#: Contiguous elements per sampled block of the ``"sampled"`` update ratio.
SAMPLE_BLOCK = 16
#: A sample as strided views of the flattened tensor: ``(size, stride, offset)`` each.
Pieces = list[tuple[tuple[int, ...], tuple[int, ...], int]]


class ParamLists:
    """Precomputed lists and index tensors for one fixed parameter list.

    Parameters
    ----------
    params : sequence of Parameter
        The collector's parameters, in its order.
    group : sequence of int
        The layer of each parameter (``0 .. n_layers - 1``).
    n_layers : int
    samples : int
        Elements sampled per tensor for the update ratio (smaller tensors are copied whole).

    Examples
    --------
    >>> import torch
    >>> ps = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4, 2))]
    >>> pl = ParamLists(ps, [0, 0], 1, samples=4)
    >>> pl.large_pos, pl.small_pos
    ([1], [0])
    >>> [round(v, 4) for v in pl.layer_sq(pl.norms(ps), None).tolist()]
    [11.0]
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], group: Sequence[int],
                 n_layers: int, samples: int) -> None:
        self.params: list[torch.Tensor] = list(params)
        #: how the parameters are sharded (``None``: no DTensor, the plain path)
        self.shards = ShardLayout.of(self.params)
        #: what is measured: the local shards of sharded parameters, else the parameters
        self.local = self.params if self.shards is None else self.shards.local
        self.group = list(group)
        self.n_layers = int(n_layers)
        idx = [sample_index(p.shape, samples) for p in self.local]
        pieces = [None if t is None else strided_pieces(t, _block(p.shape))
                  for p, t in zip(self.local, idx, strict=True)]
        self.large_pos = [i for i, t in enumerate(idx) if t is not None]
        self.small_pos = [i for i, t in enumerate(idx) if t is None]
        # the large tensors whose sample is one or two strided views first (copied with one
        # foreach op), then the others (one torch.take each)
        strided = [i for i in self.large_pos if pieces[i] is not None]
        order = strided + [i for i in self.large_pos if pieces[i] is None]
        self.n_strided = len(strided)
        self.large: list[torch.Tensor] = [self.local[i] for i in order]
        self.small: list[torch.Tensor] = [self.local[i] for i in self.small_pos]
        self._idx_cpu: list[torch.Tensor] = [t for t in (idx[i] for i in order) if t is not None]
        self._pieces: list[Pieces] = [p for p in (pieces[i] for i in strided) if p is not None]
        # n / m of each tensor, in the parameters' order (1 for a tensor taken whole)
        self._scale_list = [1.0 if t is None else p.numel() / t.numel()
                            for p, t in zip(self.local, idx, strict=True)]
        order += self.small_pos  # the order of the sampled lists
        self._reorder = order != list(range(len(order)))
        self._perm_list = sorted(range(len(order)), key=order.__getitem__)
        self._dev: Any = None  # the device the cached tensors below are on
        self._group_idx: torch.Tensor | None = None
        self._partial: tuple[tuple[bool, ...], torch.Tensor] | None = None
        self._perm: torch.Tensor | None = None
        self._scale: torch.Tensor | None = None
        # sharded: 1 / copies of each tensor's elements, by kind: (scale, vector, device)
        self._copies_cache: dict[str, tuple[tuple[float, ...], torch.Tensor | None, Any]] = {}
        #: ``1 / copies`` of the gradients of the last :meth:`grads` (``None``: all 1)
        self.grad_copies: torch.Tensor | None = None
        self._large_idx: list[torch.Tensor] = []
        self._views_key: Any = None  # (device, data pointers) the views below were made for
        self._views: tuple[list[torch.Tensor], list[list[torch.Tensor]],
                           list[list[torch.Tensor]]] | None = None

    # ------------------------------------------------------------------ device caches
    @property
    def device(self) -> torch.device:
        """The device of the signals (the first parameter's)."""
        return self.local[0].device if self.local else torch.device("cpu")

    def _ensure(self, device: torch.device) -> None:
        if self._dev == device:
            return
        self._dev = device
        self._group_idx = torch.tensor(self.group, dtype=torch.long, device=device)
        self._partial = None
        self._perm = torch.tensor(self._perm_list, dtype=torch.long, device=device)
        self._scale = torch.tensor(self._scale_list, dtype=torch.float32, device=device)
        self._large_idx = [t.to(p.device) for t, p in zip(self._idx_cpu, self.large, strict=True)]

    def index(self, mask: tuple[bool, ...] | None) -> torch.Tensor:
        """The layer of each selected tensor (``mask``; ``None``: all of them)."""
        self._ensure(self.device)
        if mask is None:
            assert self._group_idx is not None
            return self._group_idx
        if self._partial is None or self._partial[0] != mask:
            idx = [g for g, m in zip(self.group, mask, strict=True) if m]
            self._partial = (mask, torch.tensor(idx, dtype=torch.long, device=self.device))
        return self._partial[1]

    # ------------------------------------------------------------------ reductions
    def grads(self) -> tuple[list[torch.Tensor], tuple[bool, ...] | None]:
        """The present gradients (local shards when sharded) and which parameters have one
        (``None``: all of them)."""
        if self.shards is None:
            grads_all = [p.grad for p in self.params]
        else:
            grads_all, scale = self.shards.measured_grads(self.params)
            self.grad_copies = self._copies_of(tuple(scale), "grad")
        grads = [g for g in grads_all if g is not None]
        if len(grads) == len(grads_all):
            return grads, None
        return grads, tuple(g is not None for g in grads_all)

    def local_grads(self) -> list[torch.Tensor]:
        """The present gradients, local shards when sharded (what a clip scales in place)."""
        if self.shards is None:
            return [p.grad for p in self.params if p.grad is not None]
        return self.shards.local_grads(self.params)

    def _copies_of(self, scale: tuple[float, ...], key: str) -> torch.Tensor | None:
        """``scale`` as a cached device vector (``None`` when every element counts once)."""
        cached = self._copies_cache.get(key)
        if cached is not None and cached[0] == scale and cached[2] == self.device:
            return cached[1]
        t = None if all(v == 1.0 for v in scale) else torch.tensor(
            scale, dtype=torch.float32, device=self.device)
        self._copies_cache[key] = (scale, t, self.device)
        return t

    def norms(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-tensor L2 norms as one float32 vector on :attr:`device` (one foreach op)."""
        with torch.no_grad():
            return stack_f32(torch._foreach_norm(list(tensors)), self.device)

    def layer_sq(self, norms: torch.Tensor, mask: tuple[bool, ...] | None,
                 copies: torch.Tensor | None = None) -> torch.Tensor:
        """Per-layer sums of squares of per-tensor ``norms`` (of the tensors ``mask`` selects).

        Sharded: this rank's part, each tensor's squares times ``copies`` (:attr:`grad_copies`
        for the gradients of :meth:`grads`, :attr:`param_copies` for the weights: each element
        counted once); :meth:`reduce` sums the parts.
        """
        return self.layer_sum(norms * norms, mask, copies)

    def layer_sum(self, sq: torch.Tensor, mask: tuple[bool, ...] | None,
                  copies: torch.Tensor | None = None) -> torch.Tensor:
        """Per-layer sums of per-tensor squares ``sq`` (of the tensors ``mask`` selects),
        each times ``copies`` (see :meth:`layer_sq`)."""
        out = torch.zeros(self.n_layers, device=self.device, dtype=torch.float32)
        return out.index_add_(0, self.index(mask), sq if copies is None else sq * copies)

    @property
    def param_copies(self) -> torch.Tensor | None:
        """``1 / copies`` of each weight's local elements (``None``: every one counts once)."""
        if self.shards is None:
            return None
        return self._copies_of(tuple(self.shards.scale), "param")

    def reduce(self, vectors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-layer sums of this rank summed over the ranks (sharded: one ``all_reduce`` of
        all of ``vectors`` together; else ``vectors`` as they are)."""
        if self.shards is None:
            return vectors
        return self.shards.reduce(vectors)

    # ------------------------------------------------------------------ update-ratio sample
    def sample(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A copy of the update-ratio sample: ``(gathered large ones, copies of small ones)``."""
        with torch.no_grad():
            small = list(torch._foreach_mul(self.small, 1.0)) if self.small else []
            return self._take(), small

    def _take(self, into: int = 0) -> list[torch.Tensor]:
        """The current sample of every large tensor (in :attr:`large`'s order); the strided
        ones are copied into the reused buffers ``into`` (0: before the step, 1: after)."""
        self._ensure(self.device)
        n = self.n_strided
        views = self._strided_views() if n else None
        try:
            if views is None:
                return [torch.take(p, i) for p, i in zip(self.large, self._large_idx,
                                                         strict=True)]
            srcs, flats, dsts = views
            torch._foreach_copy_(dsts[into], srcs)
            return flats[into] + [torch.take(p, i) for p, i in zip(
                self.large[n:], self._large_idx[n:], strict=True)]
        except RuntimeError:  # a parameter moved to another device on its own
            self._dev = self._views_key = None
            self._ensure(self.device)
            return [torch.take(p, i) for p, i in zip(self.large, self._large_idx, strict=True)]

    def _strided_views(self) -> tuple[list[torch.Tensor], list[list[torch.Tensor]],
                                      list[list[torch.Tensor]]] | None:
        """Views of the strided samples and two sets of buffers for their copies, rebuilt when
        a parameter's storage changed (``None``: a parameter is not contiguous: take them)."""
        params = self.large[:self.n_strided]
        key = (self._dev, [p.data_ptr() for p in params])
        if key == self._views_key:
            return self._views
        self._views_key, self._views = key, None
        if not all(p.is_contiguous() for p in params):
            return None
        srcs: list[torch.Tensor] = []
        flats: list[list[torch.Tensor]] = [[], []]
        dsts: list[list[torch.Tensor]] = [[], []]
        for p, pieces, idx in zip(params, self._pieces, self._idx_cpu, strict=False):
            base = p.detach()
            bufs = [torch.empty(idx.numel(), dtype=p.dtype, device=p.device) for _ in (0, 1)]
            at = 0
            for size, stride, offset in pieces:
                srcs.append(base.as_strided(size, stride, base.storage_offset() + offset))
                m = math.prod(size)
                for k in (0, 1):
                    dsts[k].append(bufs[k][at:at + m].view(size))
                at += m
            for k in (0, 1):
                flats[k].append(bufs[k])
        self._views = (srcs, flats, dsts)
        return self._views

    def sample_sq(self, snap: tuple[list[torch.Tensor], list[torch.Tensor]]) -> torch.Tensor:
        """``n / m * ||w_t - w_t+1||^2`` over each tensor's sample, in the parameters' order.

        ``snap`` (from :meth:`sample` before the step) is overwritten in place.
        """
        large, small = snap
        with torch.no_grad():
            if large:
                torch._foreach_sub_(large, self._take(1))  # w_t - w_t+1, no new buffers
            if small:
                torch._foreach_sub_(small, self.small)
            sq = self.norms(large + small)
        if self._reorder:
            assert self._perm is not None
            sq = sq.index_select(0, self._perm)
        assert self._scale is not None
        return sq.square() * self._scale


def _block(shape: torch.Size | tuple[int, ...]) -> int:
    """Elements per block of :func:`sample_index` for a tensor of ``shape``."""
    return min(SAMPLE_BLOCK, int(shape[-1]) if len(shape) >= 2 else math.prod(shape))


def strided_pieces(idx: torch.Tensor, block: int) -> Pieces | None:
    """``idx`` (flat indices in blocks of ``block`` contiguous ones) as at most two strided views
    ``(size, stride, offset)`` of the flat tensor, element order kept (``None``: it is not).

    Block ``i = q * S + s`` must start at ``start_0 + q * d1 + s * d2``: the blocks of evenly
    spaced rows whose column cycles through the ``S`` slots of a row (a GPT's weight matrices
    with a multiple of 256 rows).

    Examples
    --------
    >>> strided_pieces(sample_index((512, 64), 4096), 16)
    [((64, 4, 16), (512, 144, 1), 0)]
    >>> strided_pieces(sample_index((300, 64), 4096), 16) is None
    True
    """
    starts = idx.view(-1, block)[:, 0].tolist()
    nb = len(starts)
    if nb < 2:
        return [((1, 1, block), (block, block, 1), starts[0])] if starts else None
    d2 = starts[1] - starts[0]
    period = next((i for i in range(2, nb) if starts[i] - starts[i - 1] != d2), nb)
    d1 = starts[period] - starts[0] if period < nb else period * d2
    if any(v != starts[0] + (i // period) * d1 + (i % period) * d2
           for i, v in enumerate(starts)):
        return None
    q, r = divmod(nb, period)
    pieces: Pieces = [((q, period, block), (d1, d2, 1), starts[0])]
    if r:
        pieces.append(((1, r, block), (d1, d2, 1), starts[0] + q * d1))
    return pieces


def stack_f32(norms: Any, device: torch.device) -> torch.Tensor:
    """Per-tensor 0-d norms as one float32 vector on ``device`` (one conversion at most)."""
    try:
        out = torch.stack(list(norms))
    except RuntimeError:  # norms on several devices
        return torch.stack([n.to(device, torch.float32) for n in norms])
    return out if out.dtype == torch.float32 and out.device == device else out.to(
        device, torch.float32)


def sample_index(shape: torch.Size | tuple[int, ...], samples: int) -> torch.Tensor | None:
    """Flat indices of the update-ratio sample of a tensor of ``shape`` (``None``: take it all).

    About ``samples`` elements in blocks of :data:`SAMPLE_BLOCK` contiguous ones (a cache line
    each).  The blocks are spread over the rows (last dimension = a row): every row gets blocks
    when there are no more rows than blocks (the sparse rows of an embedding are all seen),
    else evenly spaced rows get one; the blocks' columns shift by one block from row to row.

    Examples
    --------
    >>> sample_index((10,), 4096) is None
    True
    >>> idx = sample_index((128, 64), 4096)
    >>> rows, cols = idx // 64, idx % 64
    >>> idx.numel(), rows.unique().numel(), cols.bincount().unique().tolist()
    (4096, 128, [64])
    """
    n = math.prod(shape)
    if n <= samples:
        return None
    cols = int(shape[-1]) if len(shape) >= 2 else n
    rows = n // cols
    b = min(SAMPLE_BLOCK, cols)
    slots = cols // b  # block-aligned places in a row
    nb = max(1, samples // b)
    starts = []
    if rows <= nb:  # every row, per_row blocks each, shifted by one slot from row to row
        per_row = min(slots, nb // rows)
        for r in range(rows):
            starts += [r * cols + b * ((j * slots // per_row + r) % slots)
                       for j in range(per_row)]
    else:  # evenly spaced rows, one block each, the slot advancing from block to block
        starts = [(i * rows // nb) * cols + b * (i % slots) for i in range(nb)]
    base = torch.tensor(starts, dtype=torch.long)
    return (base[:, None] + torch.arange(b)).reshape(-1)
