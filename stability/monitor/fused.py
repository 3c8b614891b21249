"""The fused monitor step: gather + every bank update + alarm count in ONE Numba call.

:meth:`stability.monitor.monitor.Monitor.observe` used to make one njit call to gather the slot
vector
into the banks' inputs (:func:`stability.monitor.binding.gather_step`) and then one dispatcher call
per
active bank (``update_array``): with 13-17 banks the Python -> Numba dispatch (argument
unboxing, ~0.5 µs per call) cost more than the arithmetic.  :func:`fused_step` does the same
work in one call:

* the gather loop of :func:`~stability.monitor.binding.gather_step` (bit for bit the same code);
* one *log row* per group of banks that read the same values and their logs (the per-layer
  grad norms feed an EWMA bank and a coherent-jump bank; :func:`log_groups`): ``math.log(x)``
  where ``x > 0``, computed once and handed to each of them as a second input row, which
  their kernels read instead of calling ``log`` again (bit-identical:
  :meth:`detectors.BankDetector.uses_log_row`);
* each active bank's kernel called through its native entry point (the address of the
  specialisation ``update_array`` would have used, :func:`kernel_address`), with its input,
  output, state, buffer and parameter arrays rebuilt from their data addresses (the bank
  table of :class:`StepBuffers`): no per-bank unboxing, no reference counting, no typed
  containers, no generated code;
* the number of alarms of the step (``0`` on a quiet step, the common case).

The step's arrays live in three packed buffers (:class:`StepBuffers`: integers, floats, flags;
the gather plan's arrays are views into them); the integer buffer's header holds the addresses
of the others and of the slot vector and mask, so the call unboxes one array, not thirteen.
One driver serves every config (its signature does not depend on the banks), so it compiles
once and is cached like the kernels; the kernels keep their single specialisation.

Safety: the driver writes through raw addresses, so :class:`FusedPlan` holds a reference to
every array it points at (they cannot be freed under it).  The monitor rebuilds the plan in
``_relayout`` -- every detector call that reallocates its arrays (``grow``, ``reset``,
``apply_state``) already forces one, because it also reallocates the output arrays the monitor
binds, and so does a new slot vector (a new name).  :func:`reference_step` is the plain path
(gather + one ``update_array`` per bank) the tests compare the driver with; it is also used
where the driver cannot be (JIT disabled, a kernel that is not a Numba dispatcher).
"""

from __future__ import annotations

import logging
import math
from typing import Any, NamedTuple

import numpy as np
from numba import carray, njit, types
from numba.core.registry import CPUDispatcher
from numba.extending import intrinsic

from detectors.dispatch import call, request
from stability.monitor.binding import gather_step

logger = logging.getLogger("stability.monitor")

__all__ = ["FusedPlan", "StepBuffers", "build_fused_plan", "capture", "fused_step",
           "gather_runs", "kernel_address", "log_groups", "reference_step", "step_buffers"]

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
#: the argument types of :func:`fused_step`: the integer buffer alone (it holds the addresses
#: of the others: each array argument of a Numba call costs ~0.05 µs of unboxing)
FUSED_ARGS = (types.Array(types.int64, 1, "C"),)

# columns of the bank table (one row per binding); _RUN: the first slot when the binding's
# inputs are consecutive slots (the common case: a family, a glob over every metric), else -1;
# _LOG: the address of the binding's (1, 2, n) input with a log row (a log group), else 0
_FN, _NIN, _NS, _ST, _STR, _BUF, _BUFR, _PAR, _PARN, _RUN, _LOG = range(11)
_NCOL = 11
#: tracked values: grad norm, LR, loss, val loss (then their presence flags)
N_TRACKED = 4
# header of the integer buffer: bindings, gathered inputs, series, log groups, then address
# and length of the slot vector, address of its mask, address and length of the float buffer,
# of the flag buffer
_HEAD = 11
_H_VALS, _H_NVALS, _H_PRESENT, _H_FLOATS, _H_NFLOATS, _H_FLAGS, _H_NFLAGS = range(4, 11)
# columns of the log-group table: first input of the group's values in X, address of its
# (2, n) block (values, logs), n, first binding of the group
_GSRC, _GDST, _GN, _GB = range(4)
_GCOL = 4


class StepBuffers(NamedTuple):
    """The three buffers :func:`fused_step` takes and the named views into them.

    ``ints`` = header ``[n_bindings, n_inputs, n_series, n_log_groups]`` (then the addresses
    and lengths of the slot vector and mask, ``floats`` and ``flags``), ``gidx``, ``boff``,
    ``soff``, ``table`` (row-major), ``tslots``, ``groups`` (room for one log group per
    binding, row-major); ``floats`` = ``X``, ``S``, ``tracked``; ``flags`` =
    ``M``, ``A``, ``active`` -- the arguments of :func:`~stability.monitor.binding.gather_step` and
    :func:`capture`, and the bank table (one row per binding: kernel address, inputs, series,
    then address and rows of its state, buffer and parameter arrays, the first slot of its
    inputs when they are consecutive slots, else -1, and the address of its input with a log
    row, else 0) and the log-group table (:func:`log_groups`).
    """

    ints: np.ndarray
    floats: np.ndarray
    flags: np.ndarray
    gidx: np.ndarray
    boff: np.ndarray
    soff: np.ndarray
    table: np.ndarray
    tslots: np.ndarray
    groups: np.ndarray
    X: np.ndarray
    S: np.ndarray
    tracked: np.ndarray
    M: np.ndarray
    A: np.ndarray
    active: np.ndarray


def step_buffers(n_bindings: int, n_inputs: int, n_series: int) -> StepBuffers:
    """Zeroed :class:`StepBuffers` for ``n_bindings`` banks with ``n_inputs`` gathered inputs
    and ``n_series`` series in all."""
    nb, k, ns = n_bindings, n_inputs, n_series
    o = np.cumsum([_HEAD, k, nb + 1, nb + 1, nb * _NCOL, N_TRACKED, nb * _GCOL])
    ints = np.zeros(int(o[-1]), dtype=np.int64)
    floats = np.zeros(k + ns + 2 * N_TRACKED)
    flags = np.zeros(k + ns + nb, dtype=np.bool_)
    ints[:_HEAD] = (nb, k, ns, 0, 0, 0, 0, floats.ctypes.data, floats.size, flags.ctypes.data,
                    flags.size)
    return StepBuffers(ints, floats, flags, ints[o[0]:o[1]], ints[o[1]:o[2]], ints[o[2]:o[3]],
                       ints[o[3]:o[4]].reshape(nb, _NCOL), ints[o[4]:o[5]],
                       ints[o[5]:o[6]].reshape(nb, _GCOL), floats[:k], floats[k:k + ns],
                       floats[k + ns:], flags[:k], flags[k:k + ns], flags[k + ns:])


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
def gather_runs(vals, present, gidx, boff, soff, X, M, S, A, active, runs):  # type: ignore[no-untyped-def]
    """:func:`stability.monitor.binding.gather_step` (same arguments, same effect) where ``runs[b]``
    is the first slot of binding ``b``'s inputs when they are consecutive slots (``-1``
    otherwise): those are copied by plain loops the compiler vectorises instead of one
    indexed load per input."""
    n_b = boff.shape[0] - 1
    for b in range(n_b):
        lo, hi = boff[b], boff[b + 1]
        g0 = runs[b]
        any_p = False
        if g0 >= 0:
            # views, indexed from 0 by a range: no negative-index wrap-around to test, so the
            # loops vectorise
            n = hi - lo
            xs, ms = X[lo:hi], M[lo:hi]
            vs, ps = vals[g0:g0 + n], present[g0:g0 + n]
            for j in range(n):
                xs[j] = vs[j]
            for j in range(n):
                p = ps[j]
                ms[j] = not p
                any_p |= p
        else:
            for k in range(lo, hi):
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


@njit(cache=True, error_model="numpy")
def fused_step(ints):  # type: ignore[no-untyped-def]
    """One monitor step: capture the tracked values, gather, compute the shared log rows,
    update every active bank, count the alarms.

    ``ints`` is the integer buffer of the packed :class:`StepBuffers`; its header holds the
    addresses of the slot vector and mask and of ``floats`` / ``flags`` (kept alive by the
    :class:`FusedPlan`).  The same effect as :func:`capture` then
    :func:`stability.monitor.binding.gather_step` on their views, then one ``update_array`` per
    active bank: a bank of a log group gets its input with the group's log row, which its
    kernel reads instead of taking the same logs again -- bit-identical, see
    :meth:`detectors.BankDetector.uses_log_row`).  Returns the number of alarms the banks
    raised on this step.
    """
    nb, k, ns_all, ng = ints[0], ints[1], ints[2], ints[3]
    fp, bp = ints[_H_FLOATS], ints[_H_FLAGS]
    vals = carray(_as_voidptr(ints[_H_VALS]), (ints[_H_NVALS],), np.float64)
    present = carray(_as_voidptr(ints[_H_PRESENT]), (ints[_H_NVALS],), np.bool_)
    floats = carray(_as_voidptr(fp), (ints[_H_NFLOATS],), np.float64)
    flags = carray(_as_voidptr(bp), (ints[_H_NFLAGS],), np.bool_)
    o1 = _HEAD + k
    o2 = o1 + nb + 1
    o3 = o2 + nb + 1
    o4 = o3 + nb * _NCOL
    o5 = o4 + N_TRACKED
    gidx, boff, soff = ints[_HEAD:o1], ints[o1:o2], ints[o2:o3]
    table = ints[o3:o4].reshape((nb, _NCOL))
    groups = ints[o5:o5 + nb * _GCOL].reshape((nb, _GCOL))
    X, S, tracked = floats[:k], floats[k:k + ns_all], floats[k + ns_all:]
    M, A, active = flags[:k], flags[k:k + ns_all], flags[k + ns_all:]
    capture(vals, present, ints[o4:o5], tracked)
    gather_runs(vals, present, gidx, boff, soff, X, M, S, A, active, table[:, _RUN])
    for g in range(ng):  # the log rows: math.log(x) where x > 0 (what the kernels read)
        if active[groups[g, _GB]]:
            n = groups[g, _GN]
            src = X[groups[g, _GSRC]:groups[g, _GSRC] + n]
            blk = carray(_as_voidptr(groups[g, _GDST]), (2, n), np.float64)
            xs, logs = blk[0], blk[1]
            for i in range(n):
                xs[i] = src[i]
            for i in range(n):
                x = xs[i]
                logs[i] = math.log(x) if x > 0.0 else 0.0
    # each bank's views are rebuilt from raw addresses: no reference counting per view
    # (FusedPlan holds the memory)
    for b in range(nb):
        ns = table[b, _NS]
        if not active[b] or ns == 0:
            continue
        nin = table[b, _NIN]
        if table[b, _LOG] != 0:  # its log group's values and log row
            x = carray(_as_voidptr(table[b, _LOG]), (1, 2, ns), np.float64)
        else:
            x = carray(_as_voidptr(fp + 8 * boff[b]), (1, nin, ns), np.float64)
        m = carray(_as_voidptr(bp + boff[b]), (1, nin, ns), np.bool_)
        sc = carray(_as_voidptr(fp + 8 * (k + soff[b])), (1, ns), np.float64)
        al = carray(_as_voidptr(bp + k + soff[b]), (1, ns), np.bool_)
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
    try:
        cres: Any = kernel.get_compile_result(KERNEL_SIG)
        if cres.signature.return_type != types.none:  # the driver's call returns nothing
            return 0
        addr = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
    except Exception:  # e.g. a kernel with another signature: the plain path calls it
        logger.debug("no native entry point for %r; plain path", kernel, exc_info=True)
        return 0
    return int(addr) if addr else 0


class FusedPlan(NamedTuple):
    """The buffers :func:`fused_step` reads, and the arrays the bank table points into."""

    args: tuple[np.ndarray]  # ``(ints,)``: the argument of :func:`fused_step`
    bufs: StepBuffers
    keep: tuple[Any, ...]    # every array (and kernel) the table points at: kept alive


def _c_float(a: Any, ndim: int) -> bool:
    return (type(a) is np.ndarray and a.dtype == np.float64 and a.ndim == ndim
            and a.flags.c_contiguous and a.flags.writeable and a.flags.aligned)


def build_fused_plan(bufs: StepBuffers, dets: list[Any], n_inputs: list[int],
                     n_series: list[int], vals: np.ndarray, present: np.ndarray
                     ) -> FusedPlan | None:
    """Fill the bank table of ``bufs`` for the banks ``dets`` (in binding order) and the slot
    vector ``vals`` and mask ``present`` (float64 / bool, C-contiguous, one size) the step
    reads; ``None`` when one of the banks cannot be driven natively (then the monitor uses
    :func:`reference_step`).

    ``dets[b]`` must be bound to the monitor's output vectors (``bind_outputs``, views of
    ``bufs``) and hold ``n_series[b]`` series of ``n_inputs[b]`` inputs.  The plan holds
    ``vals`` and ``present``: a monitor replacing them builds a new plan.
    """
    # cold Numba cache: the plain path (interpreted twins) until the background compiler has
    # built the driver and every bank kernel (detectors/dispatch.py); the monitor retries then
    wanted = [request(type(d).kernel, KERNEL_ARGS) for d, n in zip(dets, n_series, strict=True)
              if n]
    if not (request(fused_step, FUSED_ARGS) and all(wanted)):
        return None
    if not (_c_float(vals, 1) and type(present) is np.ndarray and present.dtype == np.bool_
            and present.shape == vals.shape and present.flags.c_contiguous
            and present.flags.writeable):
        return None
    table = bufs.table
    table[:] = 0
    bufs.ints[_H_VALS:_H_PRESENT + 1] = (vals.ctypes.data, vals.size, present.ctypes.data)
    keep: list[Any] = [vals, present]
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
        g = bufs.gidx[bufs.boff[b]:bufs.boff[b + 1]]
        run = int(g[0]) if g.size and (g == np.arange(g[0], g[0] + g.size)).all() else -1
        table[b] = (addr, n_inputs[b], ns, st.ctypes.data, st.shape[0], buf.ctypes.data,
                    buf.shape[0], par.ctypes.data, par.shape[0], run, 0)
        keep.extend((kernel, st, buf, par))
    groups = log_groups(bufs, dets, n_inputs, n_series)
    if groups:  # one (2, n) block per group: the values and their logs
        blocks = np.zeros(2 * sum(n_series[g[0]] for g in groups))
        keep.append(blocks)
        at = blocks.ctypes.data
        for row, members in zip(bufs.groups, groups, strict=False):
            n = n_series[members[0]]
            row[:] = (bufs.boff[members[0]], at, n, members[0])
            table[members, _LOG] = at
            at += 16 * n
        bufs.ints[3] = len(groups)
    return FusedPlan((bufs.ints,), bufs, tuple(keep))


def log_groups(bufs: StepBuffers, dets: list[Any], n_inputs: list[int],
               n_series: list[int]) -> list[list[int]]:
    """The bindings that read the same values and the logs of them, grouped: one log row
    per group, shared (bindings of one input gathered from the same slots whose detector
    :meth:`~detectors.BankDetector.uses_log_row`; groups of two or more, in binding order)."""
    by_slots: dict[bytes, list[int]] = {}
    for b, det in enumerate(dets):
        if n_inputs[b] == 1 and n_series[b] and det.uses_log_row():
            key = bufs.gidx[bufs.boff[b]:bufs.boff[b + 1]].tobytes()
            by_slots.setdefault(key, []).append(b)
    return [g for g in by_slots.values() if len(g) > 1]


def reference_step(vals: np.ndarray, present: np.ndarray, plan: Any,
                   calls: list[tuple[Any, Any, Any]], tslots: np.ndarray, tracked: np.ndarray
                   ) -> int:
    """The plain step :func:`fused_step` must equal: :func:`capture`,
    :func:`~stability.monitor.binding.gather_step`, then one ``update_array`` per active binding
    (``calls[b]``), then the alarm count.

    ``plan`` is the monitor's :class:`~stability.monitor.layout.GatherPlan`.
    """
    call(capture, vals, present, tslots, tracked)  # interpreted until compiled
    call(gather_step, vals, present, *plan)
    for (update, x, m), on in zip(calls, plan.active.tolist(), strict=True):
        if on:
            update(x, m)
    return int(np.count_nonzero(plan.alarms))
