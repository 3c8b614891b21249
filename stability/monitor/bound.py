"""Bound inputs: a caller writes each step's values straight into the monitor's slot vector.

:meth:`Monitor.observe() <stability.monitor.monitor.Monitor.observe>` converts a dict of metrics
and a
dict of per-layer arrays into the slot vector every step (~2.3 µs with 20 scalars and 5
families of 128 layers).  A caller that logs the same metrics every step (a trainer adapter,
a hand-written loop) can instead bind them once::

    inp = mon.bind_inputs(["loss", "lr", "grad_norm"], families={"grad_norm": layers})
    inp.values[:] = loss, lr, gnorm          # or inp["loss"] = loss
    np.copyto(inp.arrays["grad_norm"], per_layer_norms)
    decision = mon.observe_bound(step)

:class:`BoundInputs` holds writable float64 views into the monitor's slot vector (a scalar
vector in key order, one ``(n_layers,)`` array per family) and persistent presence masks;
:meth:`BoundMixin.observe_bound` marks the bound slots present (one memory copy of the mask)
and runs the same step as ``observe()``.

Semantics (exactly those of ``observe()`` with the same dict):

* a value in a view is an observation, NaN and inf included (the ``nonfinite`` guard sees
  them); a key whose ``present`` flag is ``False`` is *not logged* on that step -- like a key
  left out of the dict or given as ``None`` -- whatever its view holds;
* the presence flags persist from step to step (``True`` after binding);
* ``observe_bound(step, metrics)`` also fills ``metrics`` (extra keys, the ``observe()`` way)
  after the bound values; a bad step is skipped exactly as ``observe()`` skips it.

The views alias the monitor's slot vector only while its slots are laid out as at binding
(``inp.zero_copy``).  A later name that grows the slot vector, or ``load_state_dict``,
replaces it: the views keep working -- they are then copied into the new vector each step
(``zero_copy`` turns ``False``; bind again for new views).  A binding whose slots are not one
contiguous block (names already bound in another order) copies the same way from the start.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stability.monitor.layout import CAPPED, SCRATCH

__all__ = ["BoundInputs", "resolve_slots"]


class BoundInputs:
    """Writable views of one set of bound inputs (see :meth:`BoundMixin.bind_inputs`).

    Attributes
    ----------
    keys, families
        The bound metric names (as given) and family names, in binding order.
    values
        ``(len(keys),)`` float64: this step's value of each key.
    present
        ``(len(keys),)`` bool: ``False`` = the key is not logged (persists across steps).
    arrays
        Family name -> ``(n_layers,)`` float64: this step's per-layer values.
    family_present
        Family name -> ``(n_layers,)`` bool: per-layer presence (persists across steps).
    family_matrix
        ``(len(families), n_layers)`` float64 view of all family arrays at once (one row per
        family, in binding order) when they have the same length and lie one after another
        (always so for a fresh binding), else ``None``.
    zero_copy
        ``True`` while the views are the monitor's own slots (no copy per step).
    """

    def __init__(self, mon: Any, keys: list[str], families: list[str],
                 key_slots: list[int], fam_slots: list[np.ndarray]) -> None:
        self.keys = tuple(keys)
        self.families = tuple(families)
        self._mon = mon
        self._index = {k: i for i, k in enumerate(keys)}
        slots = np.concatenate([np.asarray(key_slots, dtype=np.int64), *fam_slots])
        n = slots.size
        # zero copy: the pieces (the keys, each family) are runs of consecutive slots that
        # tile one block [lo, hi); their views are then views of the slot vector itself
        pieces, at = [], 0
        for p in ([list(key_slots)] if key_slots else []) + [fs.tolist() for fs in fam_slots]:
            pieces.append((p, at))
            at += len(p)
        lo = int(slots.min()) if n else 0
        block = (n > 0 and all(p == list(range(p[0], p[0] + len(p))) for p, _ in pieces)
                 and sorted(slots.tolist()) == list(range(lo, lo + n)))
        offs = [p[0] - lo if block else a for p, a in pieces]
        data = mon._vals[lo:lo + n] if block else np.zeros(n)
        mask = np.ones(n, dtype=np.bool_)
        self._block: slice | None = slice(lo, lo + n) if block else None
        self._data, self._mask = data, mask
        self._mask_mv = memoryview(mask.view(np.uint8))  # type: ignore[arg-type]
        #: slot of each entry of ``_data`` (slot order in zero-copy mode, else binding order)
        self._order = np.arange(lo, lo + n, dtype=np.int64) if block else slots
        self._names = [mon._slot_names[s] for s in self._order.tolist()]
        nk = len(key_slots)
        k0 = offs[0] if nk else 0
        self.values: np.ndarray = data[k0:k0 + nk]
        self.present: np.ndarray = mask[k0:k0 + nk]
        self.arrays: dict[str, np.ndarray] = {}
        self.family_present: dict[str, np.ndarray] = {}
        for name, fs, off in zip(families, fam_slots, offs[1 if nk else 0:], strict=True):
            self.arrays[name] = data[off:off + fs.size]
            self.family_present[name] = mask[off:off + fs.size]
        fo = offs[1 if nk else 0:]
        w = fam_slots[0].size if fam_slots else 0
        self.family_matrix: np.ndarray | None = None
        if fam_slots and w and all(fs.size == w for fs in fam_slots) and fo == list(
                range(fo[0], fo[0] + w * len(fo), w)):
            self.family_matrix = data[fo[0]:fo[0] + w * len(fo)].reshape(len(fo), w)
        self._target: Any = mon._vals  # the slot vector ``_order`` refers to

    @property
    def zero_copy(self) -> bool:
        """Whether the views are the monitor's own slots (nothing is copied per step)."""
        return self._block is not None and self._target is self._mon._vals

    def index(self, key: str) -> int:
        """Position of ``key`` in :attr:`values` / :attr:`present`."""
        return self._index[key]

    def __setitem__(self, key: str, value: float | None) -> None:
        """``inp["loss"] = x``: write one value and mark it present (``None``: not logged)."""
        i = self._index[key]
        if value is None:
            self.present[i] = False
        else:
            self.values[i] = value
            self.present[i] = True

    def __getitem__(self, key: str) -> float:
        return float(self.values[self._index[key]])

    def __repr__(self) -> str:
        return (f"BoundInputs(keys={list(self.keys)}, families={list(self.families)}, "
                f"zero_copy={self.zero_copy})")

    def _push(self) -> None:
        """Copy values and presence into the monitor's slot vector (copy mode), resolving the
        slots again (by name) if the monitor replaced its slot vector since binding."""
        mon = self._mon
        if self._target is not mon._vals:
            order = []
            for name in self._names:
                s = mon._lookup(name)
                if s <= SCRATCH:
                    raise ValueError(f"observe_bound: {name!r} is no longer bound to a detector "
                                     "(the monitor's layout changed); call bind_inputs again")
                order.append(s)
            self._order = np.asarray(order, dtype=np.int64)
            self._target = mon._vals  # (the lookups may have grown it)
            self._block = None  # the views stay where they are: copied from now on
        mon._vals[self._order] = self._data
        mon._present[self._order] = self._mask


def resolve_slots(mon: Any, keys: list[str], families: list[str]) -> tuple[list[int], list[Any]]:
    """Slots of ``keys`` and of each family's layers; ``ValueError`` on anything observe()
    would not feed to a detector (unknown names, a full bank, the same signal twice)."""
    key_slots = []
    for k in keys:
        if not isinstance(k, str):
            raise TypeError(f"bind_inputs: metric names must be strings; got {k!r}")
        s = mon._lookup(k)
        if s == SCRATCH:
            raise ValueError(f"bind_inputs: {k!r} matches no detector binding of the config "
                             "(observe() would ignore it); leave it out or pass it as an extra "
                             "metric to observe_bound()")
        if s == CAPPED or s < 0:
            raise ValueError(f"bind_inputs: {k!r}: every binding it matches holds max_series="
                             f"{mon.max_series} series")
        key_slots.append(s)
    fam_slots = []
    for name in families:
        fam = mon._families.get(name)
        if fam is None:
            raise KeyError(f"bind_inputs: family {name!r} is not declared (pass families="
                           "{name: layers} or call declare_family first)")
        if (fam.slots <= SCRATCH).any():
            raise ValueError(f"bind_inputs: family {name!r}: some layers match no detector "
                             "binding or a full bank")
        fam_slots.append(fam.slots.copy())
    every = np.concatenate([np.asarray(key_slots, dtype=np.int64), *fam_slots])
    if np.unique(every).size != every.size:
        names = [*keys, *(f"{f}/{x}" for f in families for x in mon._families[f].layers)]
        seen: dict[int, str] = {}
        for nm, s in zip(names, every.tolist(), strict=True):
            if s in seen:
                raise ValueError(f"bind_inputs: {seen[s]!r} and {nm!r} are the same signal "
                                 f"({mon._slot_names[s]!r})")
            seen[s] = nm
    return key_slots, fam_slots


