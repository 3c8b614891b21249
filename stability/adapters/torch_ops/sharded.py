"""Sharded parameters (``DTensor``: FSDP2 ``fully_shard``, tensor parallel) seen from one rank.

With FSDP2 every rank holds a shard of each weight and of its gradient, as a
:class:`torch.distributed.tensor.DTensor`.  The guard measures and acts on the *local* shards
(``to_local()``, plain tensors: the fused foreach ops and index tensors of
:class:`~stability.adapters.torch_ops.param_lists.ParamLists` work on them unchanged) and sums
what it measured across the ranks:

* :class:`ShardLayout` -- the local view of every parameter and the one reduction: the per-layer
  squared norms of a step go into **one** ``all_reduce`` (sum) of a small vector, so every rank
  sees the norms of the full model (the global gradient norm a clip uses, as
  ``torch.nn.utils.clip_grad_norm_`` computes it for DTensors);
* :func:`all_finite` -- "no NaN/inf in these tensors" on every rank's shards, all-reduced: a
  check before a save, or of a checkpoint before a restore, says the same on every rank;
* :func:`local_state` / :func:`shard_like` -- a state dict with its DTensors as local tensors
  (a checkpoint file per rank, loadable with ``weights_only=True``) and back, shaped like the
  model's and the optimizer's own DTensors.

An element held by several ranks (a ``Replicate`` placement on a mesh dimension, or a plain
tensor in a sharded model: every rank has it) is counted once: its squares are divided by the
number of copies before the sum.  Every mesh must span the whole world (FSDP, HSDP, FSDP + TP);
``Partial`` parameters are refused with a ``ValueError``.

Nothing here runs without an initialised process group and a DTensor parameter:
:meth:`ShardLayout.of` returns ``None`` and the caller keeps its plain path (no extra op).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["ShardLayout", "agree", "all_finite", "dtensor_type", "is_sharded", "local_state",
           "shard_like"]


def dtensor_type() -> type | None:
    """The ``DTensor`` class when a process group is initialised, else ``None`` (no import)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``tensors`` is a ``DTensor`` (in an initialised process group)."""
    dt = dtensor_type()
    return dt is not None and any(isinstance(t, dt) for t in tensors)


def _copies(t: Any, world: int) -> int:
    """How many ranks hold each local element of ``t`` (``world`` for a plain tensor)."""
    if not hasattr(t, "device_mesh"):
        return world
    mesh = t.device_mesh
    if mesh.size() != world:
        raise ValueError(f"A sharded tensor lives on a device mesh of {mesh.size()} ranks, not "
                         f"the whole world ({world}); the guard sums its norms over the world, "
                         "so every mesh must span it.")
    n = 1
    for dim, pl in enumerate(t.placements):
        if pl.is_partial():
            raise ValueError("A parameter has a Partial placement: its norm cannot be summed "
                             "from the local shards. Redistribute it (Shard or Replicate).")
        if pl.is_replicate():
            n *= mesh.size(dim)
    return n


def _measurable(g: Any) -> Any:
    """A gradient DTensor whose local shards can be summed: ``Partial`` placements (partial
    sums on each rank) are reduced to ``Replicate`` first (one collective, the same on every
    rank: placements agree across ranks)."""
    if not any(pl.is_partial() for pl in g.placements):
        return g
    from torch.distributed.tensor import Replicate

    return g.redistribute(g.device_mesh,
                          [Replicate() if pl.is_partial() else pl for pl in g.placements])


class ShardLayout:
    """The local shards of one fixed parameter list and how their measures are summed.

    Parameters
    ----------
    params : sequence of Tensor
        The parameters (``DTensor`` or plain), in the caller's order.

    Attributes
    ----------
    local : list of Tensor
        Each parameter's local shard (a view sharing its storage; the parameter itself when
        plain).
    scale : list of float
        ``1 / copies`` of each parameter (see the module docstring).
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        dist = torch.distributed
        world = dist.get_world_size()
        with torch.no_grad():
            self.local: list[torch.Tensor] = [
                p.to_local() if hasattr(p, "to_local") else p for p in params]
        self.scale = [1.0 / _copies(p, world) for p in params]

    @classmethod
    def of(cls, params: Sequence[torch.Tensor]) -> ShardLayout | None:
        """A layout when any parameter is a ``DTensor``, else ``None`` (the plain path)."""
        return cls(params) if is_sharded(params) else None

    @staticmethod
    def local_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The present gradients as their local shards (what a clip scales in place)."""
        with torch.no_grad():
            return [g.to_local() if hasattr(g, "to_local") else g
                    for p in params if (g := p.grad) is not None]

    def measured_grads(self, params: Sequence[torch.Tensor]
                       ) -> tuple[list[torch.Tensor | None], list[float]]:
        """Each parameter's gradient as local values whose squares sum over the ranks to the
        full gradient's (``None`` where there is none), and ``1 / copies`` of each present one.

        A gradient's placements need not be its parameter's (a ``Replicate`` weight can get a
        ``Shard`` gradient), so its own are read.
        """
        world = torch.distributed.get_world_size()
        out: list[torch.Tensor | None] = []
        scale: list[float] = []
        with torch.no_grad():
            for p in params:
                g = p.grad
                if g is not None and hasattr(g, "to_local"):
                    g = _measurable(g)
                    scale.append(1.0 / _copies(g, world))
                    g = g.to_local()
                elif g is not None:
                    scale.append(1.0 / world)
                out.append(g)
        return out, scale

    @staticmethod
    def reduce(vectors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Sum ``vectors`` (1-d, one dtype and device) over the ranks: one ``all_reduce``."""
        if not vectors:
            return []
        flat = torch.cat(list(vectors))
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
        return list(flat.split([v.numel() for v in vectors]))


def agree(ok: bool, device: torch.device | None = None) -> bool:
    """``True`` when ``ok`` holds on every rank (one ``all_reduce``; no process group: ``ok``)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return bool(ok)
    if device is None:
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend() == "nccl" else torch.device("cpu"))
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0.5)


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """``True`` when no tensor holds a NaN or an infinity (one fused reduction, one sync).

    With ``DTensor`` s the local shards are checked and the answer is all-reduced, so every
    rank gets the same one (call it on every rank).
    """
    ts = [t.detach() for t in tensors]
    sharded = is_sharded(ts)
    if sharded:
        with torch.no_grad():
            ts = [t.to_local() if hasattr(t, "to_local") else t for t in ts]
    ok = True
    if ts:
        norms = torch._foreach_norm(ts)
        ok = bool(torch.isfinite(torch.stack([n.float().to(ts[0].device) for n in norms]))
                  .all())
    return agree(ok, ts[0].device if ts else None) if sharded else ok


def local_state(obj: Any) -> Any:
    """``obj`` (a nested state dict) with every ``DTensor`` replaced by its local shard."""
    if isinstance(obj, torch.Tensor):
        if not hasattr(obj, "to_local"):
            return obj
        with torch.no_grad():
            return obj.to_local()
    if isinstance(obj, OrderedDict):
        return OrderedDict((k, local_state(v)) for k, v in obj.items())
    if isinstance(obj, Mapping):
        return {k: local_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(local_state(v) for v in obj)
    return obj


def _like(t: Any, like: Any) -> Any:
    """The local tensor ``t`` as a ``DTensor`` shaped like ``like`` (when ``like`` is one and
    ``t`` has its local shape), else ``t``."""
    if not (isinstance(t, torch.Tensor) and hasattr(like, "to_local")):
        return t
    if t.dim() == 0 or tuple(t.shape) != tuple(like.to_local().shape):
        return t
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t.to(like.device), like.device_mesh, like.placements,
                              run_check=False, shape=like.shape, stride=like.stride())


def shard_like(model_sd: Mapping[str, Any], model_like: Mapping[str, Any],
               optimizer_sd: Any = None, params: Sequence[torch.Tensor] = ()
               ) -> tuple[dict[str, Any], Any]:
    """A saved :func:`local_state` back as ``DTensor`` s, ready for ``load_state_dict``.

    ``model_like`` is the model's own ``state_dict()``: an entry that is a DTensor there
    gets its mesh, placements and global shape.  The optimizer's per-parameter state is
    matched to ``params`` (its parameters, in ``param_groups`` order, as ``state_dict()``
    numbers them): a tensor of the local shape of a DTensor parameter becomes a DTensor like
    it (scalars such as Adam's ``step`` stay plain).
    """
    model_out = {k: _like(v, model_like.get(k)) for k, v in model_sd.items()}
    if not isinstance(optimizer_sd, Mapping) or not isinstance(optimizer_sd.get("state"),
                                                               Mapping):
        return model_out, optimizer_sd
    state = {}
    for i, st in optimizer_sd["state"].items():
        p = params[i] if isinstance(i, int) and 0 <= i < len(params) else None
        state[i] = ({k: _like(v, p) for k, v in st.items()} if isinstance(st, Mapping)
                    else st)
    return model_out, {**optimizer_sd, "state": state}

