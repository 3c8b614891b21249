"""The fused monitor step: gather + every bank update + alarm count in ONE Numba call.

:meth:`stability.monitor.Monitor.observe` used to make one njit call to gather the slot vector
into the banks' inputs (:func:`stability.binding.gather_step`) and then one dispatcher call per
active bank (``update_array``): with 13-17 banks the Python -> Numba dispatch (argument
unboxing, ~0.5 µs per call) cost more than the arithmetic.  :func:`fused_step` does the same
work in one call:

* the gather loop of :func:`~stability.binding.gather_step` (bit for bit the same code);
* each active bank's kernel called through its native entry point (the address of the
  specialisation ``update_array`` would have used, :func:`kernel_address`), with its state,
  buffer and parameter arrays rebuilt from their data addresses (:class:`FusedPlan`'s
  ``table``): no per-bank unboxing, no typed containers, no generated code;
* the number of alarms of the step (``0`` on a quiet step, the common case).

One driver serves every config (its signature does not depend on the banks), so it compiles
once and is cached like the kernels; the kernels keep their single specialisation.

Safety: the driver writes through raw addresses, so :class:`FusedPlan` holds a reference to
every array it points at (they cannot be freed under it).  The monitor rebuilds the plan in
``_relayout`` -- every detector call that reallocates its arrays (``grow``, ``reset``,
``apply_state``) already forces one, because it also reallocates the output arrays the monitor
binds.  :func:`reference_step` is the plain path (gather + one ``update_array`` per bank) the
tests compare the driver with; it is also used where the driver cannot be (JIT disabled, a
kernel that is not a Numba dispatcher).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numba import carray, njit, types
from numba.core.registry import CPUDispatcher
from numba.extending import intrinsic

from .binding import gather_step

__all__ = ["FusedPlan", "build_fused_plan", "capture", "fused_step", "kernel_address",
           "reference_step"]

#: the argument types of every bank kernel as ``update_array`` calls it (see detectors/_base.py)
KERNEL_ARGS = (
    types.Array(types.float64, 3, "C"),   # X      (1, n_inputs, n_series)
    types.Array(types.bool_, 3, "C"),     # miss   (1, n_inputs, n_series)
    types.Array(types.float64, 2, "C"),   # state  (n_fields, n_series)
    types.Array(types.float64, 2, "C"),   # buf    (k, n_series)
    types.Array(types.float64, 1, "C"),   # params (n_params,)
    types.Array(types.float64, 2, "C"),   # scores (1, n_series)
    types.Array(types.bool_, 2, "C"),     # alarms (1, n_series)
)
KERNEL_SIG = types.none(*KERNEL_ARGS)

# columns of FusedPlan.table (one row per binding)
_FN, _NIN, _NS, _ST, _STR, _BUF, _BUFR, _PAR, _PARN = range(9)
_NCOL = 9


@intrinsic
def _as_voidptr(typingctx, addr):  # type: ignore[no-untyped-def]
    """The integer ``addr`` as a ``void*`` (for :func:`numba.carray`)."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return types.voidptr(addr), codegen


@intrinsic
def _call_kernel(typingctx, addr, x, miss, state, buf, params, scores,  # type: ignore[no-untyped-def]
                 alarms):
    """Call the compiled bank kernel at native address ``addr`` (Numba's calling convention,
    exactly as a first-class function call does); an exception it sets is propagated."""
    args = (x, miss, state, buf, params, scores, alarms)
    if not isinstance(addr, types.Integer) or tuple(args) != KERNEL_ARGS:
        return None

    def codegen(context, builder, sig, llargs):  # type: ignore[no-untyped-def]
        fnty = context.call_conv.get_function_type(types.none, KERNEL_ARGS).as_pointer()
        fptr = builder.inttoptr(llargs[0], fnty)
        status, _ = context.call_conv.call_function(builder, fptr, types.none, KERNEL_ARGS,
                                                    list(llargs[1:]))
        with builder.if_then(status.is_error, likely=False):
            context.call_conv.return_status_propagate(builder, status)
        return context.get_dummy_value()

    return types.none(addr, *args), codegen


@njit(cache=True, error_model="numpy")
def capture(vals, present, slots, out):  # type: ignore[no-untyped-def]
    """``out[j] = vals[slots[j]]`` and ``out[k + j] = present[slots[j]]`` (``k = len(slots)``):
    the values the policy follows every step (grad norm, LR, loss, val loss), read before the
    gather clears ``present``; slot 0 is never present."""
    k = slots.shape[0]
    for j in range(k):
        out[j] = vals[slots[j]]
        out[k + j] = 1.0 if present[slots[j]] else 0.0


@njit(cache=True, error_model="numpy")
def fused_step(  # type: ignore[no-untyped-def]
    vals, present, gidx, boff, soff, X, M, S, A, active, table, tslots, tracked
):
    """One monitor step: capture the tracked values, gather, update every active bank, count
    the alarms.

    ``vals`` to ``active`` are the arguments of :func:`stability.binding.gather_step` (same
    effect); ``table`` (``FusedPlan.table``) holds one row per binding: its kernel's address,
    its number of inputs and series, and the addresses and row counts of its state, buffer
    and parameter arrays; ``tslots`` / ``tracked`` are those of :func:`capture`.  Returns the
    number of alarms the banks raised on this step.
    """
    capture(vals, present, tslots, tracked)
    gather_step(vals, present, gidx, boff, soff, X, M, S, A, active)
    for b in range(table.shape[0]):
        ns = table[b, _NS]
        if not active[b] or ns == 0:
            continue
        nin = table[b, _NIN]
        x = X[boff[b]:boff[b + 1]].reshape((1, nin, ns))
        m = M[boff[b]:boff[b + 1]].reshape((1, nin, ns))
        sc = S[soff[b]:soff[b + 1]].reshape((1, ns))
        al = A[soff[b]:soff[b + 1]].reshape((1, ns))
        st = carray(_as_voidptr(table[b, _ST]), (table[b, _STR], ns), np.float64)
        bf = carray(_as_voidptr(table[b, _BUF]), (table[b, _BUFR], ns), np.float64)
        pa = carray(_as_voidptr(table[b, _PAR]), (table[b, _PARN],), np.float64)
        _call_kernel(table[b, _FN], x, m, st, bf, pa, sc, al)
    n = 0
    for i in range(A.shape[0]):
        if A[i]:
            n += 1
    return n


def kernel_address(kernel: Any) -> int:
    """Native entry point of ``kernel``'s :data:`KERNEL_SIG` specialisation (compiled or loaded
    from the cache if needed: the one ``update_array`` uses); ``0`` if it is not a Numba
    dispatcher (e.g. ``NUMBA_DISABLE_JIT=1``)."""
    if not isinstance(kernel, CPUDispatcher):
        return 0
    cres: Any = kernel.get_compile_result(KERNEL_SIG)
    addr = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
    return int(addr) if addr else 0


class FusedPlan(NamedTuple):
    """The table :func:`fused_step` reads, and the arrays its addresses point into."""

    table: np.ndarray        # int64 (n_bindings, 9)
    keep: tuple[Any, ...]    # every array (and kernel) the table points at: kept alive


def _c_float(a: Any, ndim: int) -> bool:
    return (type(a) is np.ndarray and a.dtype == np.float64 and a.ndim == ndim
            and a.flags.c_contiguous and a.flags.writeable and a.flags.aligned)


def build_fused_plan(dets: list[Any], n_inputs: list[int], n_series: list[int]
                     ) -> FusedPlan | None:
    """The :class:`FusedPlan` of the banks ``dets`` (in binding order), or ``None`` when one of
    them cannot be driven natively (then the monitor uses :func:`reference_step`).

    ``dets[b]`` must be bound to the monitor's output vectors (``bind_outputs``) and hold
    ``n_series[b]`` series of ``n_inputs[b]`` inputs.
    """
    table = np.zeros((len(dets), _NCOL), dtype=np.int64)
    keep: list[Any] = []
    for b, det in enumerate(dets):
        kernel = type(det).kernel
        st, buf, par = det._state, det._buf, det._params_arr
        if not (_c_float(st, 2) and _c_float(buf, 2) and _c_float(par, 1)):
            return None
        ns = n_series[b]
        if st.shape[1] != ns or buf.shape[1] != ns:
            return None
        addr = kernel_address(kernel) if ns else 1  # an empty bank is never called
        if not addr:
            return None
        table[b] = (addr, n_inputs[b], ns, st.ctypes.data, st.shape[0], buf.ctypes.data,
                    buf.shape[0], par.ctypes.data, par.shape[0])
        keep.extend((kernel, st, buf, par))
    return FusedPlan(table, tuple(keep))


def reference_step(vals: np.ndarray, present: np.ndarray, plan: Any,
                   calls: list[tuple[Any, Any, Any]], tslots: np.ndarray, tracked: np.ndarray
                   ) -> int:
    """The plain step :func:`fused_step` must equal: :func:`capture`,
    :func:`~stability.binding.gather_step`, then one ``update_array`` per active binding
    (``calls[b]``), then the alarm count.

    ``plan`` is the monitor's :class:`~stability.monitor_layout.GatherPlan`.
    """
    capture(vals, present, tslots, tracked)
    gather_step(vals, present, *plan)
    for (update, x, m), on in zip(calls, plan.active.tolist(), strict=True):
        if on:
            update(x, m)
    return int(np.count_nonzero(plan.alarms))
