"""Shared machinery for bank detectors: validation, state arrays and the thin class.

Every detector in this package is one Numba kernel with the signature::

    kernel(X, miss, state, buf, params, scores, alarms) -> None

* ``X``      float64 ``(T, n_inputs, n_series)`` -- the observations, one row per step.
* ``miss``   bool    ``(T, n_inputs, n_series)`` -- ``True`` where a value was *not logged*
  (a null in a recorded run).  A missing value neither scores nor enters the state.
* ``state``  float64 ``(n_fields, n_series)``    -- running statistics, updated in place.
* ``buf``    float64 ``(k, n_series)``           -- ring buffers / histograms (``k`` may be 0).
* ``params`` float64 ``(n_params,)``             -- ``params[0]`` is the threshold and
  ``params[1]`` the freeze-on-alarm flag; the rest are the detector's own hyperparameters,
  in the order of its :attr:`BankDetector.param_layout` (a ``NamedTuple``; the kernel reads
  ``params[P.alpha]`` with ``P = indices(layout)``, see ``detectors/_kernel.py``).
* ``scores`` float64 ``(T, n_series)`` and ``alarms`` bool ``(T, n_series)`` -- outputs.

Streaming :meth:`BankDetector.update` calls the *same* kernel with ``T == 1``; batch
:meth:`BankDetector.update_many` calls it once for the whole array.  Streaming and batch
therefore agree bit for bit by construction.

Conventions shared by all kernels:

* score against the state *before* the update (test-then-train);
* a non-finite input gives ``score = +inf`` and an alarm, and never enters the state;
* a missing input gives ``score = nan`` and no alarm;
* ``alarm = score > threshold``; while warming up the score is ``0.0``;
* with ``freeze_on_alarm`` a series in alarm does not update its statistics.

The missing / non-finite / freeze rules are shared inline helpers
(``detectors/_kernel.py``: ``skip_value``, ``skip_pair``, ``learns``).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._params import Bool, Constraint, Float, Int
from ._state import STATE_VERSION, CheckedState, StateCheck, check_snapshot
from .dispatch import call
from .validation import check_bool, check_float, check_int

#: batch updates up to this many input values run the interpreted twin while the kernel is
#: not compiled yet (a short replay need not wait for LLVM); larger ones compile at once
TWIN_MAX_VALUES = 50_000

__all__ = ["COMMON_PARAMETERS", "BankDetector", "BoolArray", "CheckedState", "FloatArray",
           "LOG_FLOOR", "MAD_SCALE", "MEAN_AD_SCALE", "STATE_VERSION", "check_bool", "check_float",
           "check_int"]

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]

#: floor applied before ``log(x)`` in log-space detectors (one value for every detector)
LOG_FLOOR = 1e-30
#: Gaussian sigma per *median* absolute deviation (MAD): sigma = MAD * this
MAD_SCALE = 1.4826
#: Gaussian sigma per *mean* absolute deviation: E|X - mu| = sigma * sqrt(2 / pi)
MEAN_AD_SCALE = 1.2533141373155001  # math.sqrt(math.pi / 2.0)

Kernel = Callable[..., None]


#: the arguments every detector takes (declared on :class:`BankDetector`)
COMMON_PARAMETERS = ("n_series", "threshold", "freeze_on_alarm")


class BankDetector:
    """Base class: a bank of ``n_series`` independent online detectors sharing hyperparameters.

    Subclasses define :attr:`kernel`, :attr:`n_inputs`, :attr:`param_layout`,
    :meth:`_init_state` (and :meth:`_init_buf`, :meth:`_check_state`) and declare their
    hyperparameters in :attr:`parameter_constraints`; ``__init__`` is then the signature and
    ``super().__init__(**arguments(locals()))``.  The registry's entry (default alarm
    :attr:`kind`, :attr:`tuning_grid`, docs :attr:`summary`) is declared on the class too.

    Parameters
    ----------
    n_series
        Number of series in the bank (e.g. one per layer).  More can be added later with
        :meth:`grow`.
    threshold
        ``alarm = score > threshold``.
    freeze_on_alarm
        If ``True`` a series in alarm does not update its running statistics.
    **hyperparameters
        A declared detector's own arguments, checked against :attr:`parameter_constraints`.
    """

    #: the Numba kernel (see module docstring)
    kernel: ClassVar[Kernel]
    #: number of input streams per series (2 for e.g. train/val divergence)
    n_inputs: ClassVar[int] = 1
    #: names of the inputs, used in error messages and by the monitor
    input_names: ClassVar[tuple[str, ...]] = ("x",)
    #: argument name -> :class:`~detectors._params.Constraint`, in the order they are checked
    #: (a bound may name a parameter declared before it).  A subclass declares its own
    #: arguments (and may re-declare ``threshold`` / ``freeze_on_alarm``); they are merged
    #: after its parent's.  ``__init__``'s checks, :attr:`hyperparameters`, the kernel values
    #: of choices, :meth:`set_threshold` and the docs' parameter tables come from here.
    parameter_constraints: ClassVar[Mapping[str, Constraint]] = {
        "n_series": Int(0), "threshold": Float(), "freeze_on_alarm": Bool()}
    #: names of the hyperparameters (besides n_series / threshold / freeze_on_alarm); derived
    #: from :attr:`parameter_constraints` for a class that declares them
    hyperparameters: ClassVar[tuple[str, ...]] = ()
    #: the hyperparameters whose value shapes the state (a snapshot taken with other values is
    #: incompatible); the others (threshold, alpha, ...) may differ and this detector's win
    state_hyperparameters: ClassVar[tuple[str, ...]] = ()
    #: version of this class's ``state`` rows; bumped when rows are appended (a snapshot
    #: records it as ``"state_version"``, absent = 1)
    state_version: ClassVar[int] = 1
    #: older state versions -> their number of state rows: a snapshot of such a version loads
    #: with the rows added since set to their fresh values (:meth:`_init_state`), which each
    #: detector documents as its "uncalibrated" fallback
    legacy_state_rows: ClassVar[Mapping[int, int]] = {}
    #: the ``params`` layout: a ``NamedTuple`` class whose fields, in order, name the entries of
    #: the kernel's float64 ``params`` array, ``threshold`` and ``freeze_on_alarm`` first (see
    #: ``detectors/_kernel.py``); ``None``: the subclass overrides :meth:`_extra_params`
    param_layout: ClassVar[type[tuple[float, ...]] | None] = None
    #: the registry's default alarm kind (``None``: inferred from the bound signals, see
    #: ``stability.config.config.infer_kind``)
    kind: ClassVar[str | None] = None
    #: offline tuning grid (``replay.tuning``): parameter -> values tried besides the threshold
    tuning_grid: ClassVar[Mapping[str, tuple[Any, ...]]] = {}
    #: one paragraph, how it works: the detector's row in the docs' tables
    summary: ClassVar[str] = ""
    n_series: int
    threshold: float
    freeze_on_alarm: bool
    #: whether this class (or a parent) declares its own :attr:`parameter_constraints`;
    #: ``__init__`` then checks every argument and allocates the state itself
    _declared: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("parameter_constraints")
        if own is None:
            return
        inherited = next(b.__dict__["parameter_constraints"] for b in cls.__mro__[1:]
                         if "parameter_constraints" in b.__dict__)
        merged = {**inherited, **own}
        cls.parameter_constraints = merged
        cls.hyperparameters = tuple(k for k in merged if k not in COMMON_PARAMETERS)
        cls._declared = True
        args = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        if sorted(args) != sorted(merged):
            raise TypeError(
                f"{cls.__name__}: __init__ takes {args} but parameter_constraints declares "
                f"{list(merged)}; declare every argument once."
            )

    def uses_log_row(self) -> bool:
        """Whether the kernel reads ``log x`` from a *log row* when the caller appends one.

        A kernel of one input that does may be given ``X`` of shape ``(T, 2, n)``: row 0 the
        values, row 1 ``math.log(x)`` wherever ``x > 0`` (anything elsewhere); it then reads
        the logs it needs there instead of calling ``log`` again, with bit-identical results.
        The monitor's fused step computes one log row per input run and shares it between the
        banks that read the same values (e.g. ``grad_norm/*``: an EWMA and a coherent jump).
        """
        return False

    def __init__(self, n_series: int = 1, threshold: float = 6.0, freeze_on_alarm: bool = False,
                 **hyperparameters: Any):
        given = {"n_series": n_series, "threshold": threshold,
                 "freeze_on_alarm": freeze_on_alarm, **hyperparameters}
        name = type(self).__name__
        rules = type(self).parameter_constraints
        unknown = [k for k in given if k not in rules]
        if unknown:
            raise TypeError(f"{name}() got unexpected keyword argument(s) {unknown}.")
        for key, rule in rules.items():
            if key not in given:
                raise TypeError(f"{name}() is missing its declared argument {key!r}.")
            setattr(self, key, rule.check(name, key, given[key], self))
        if type(self)._declared:
            self._setup()

    # ------------------------------------------------------------------ subclass hooks
    def _extra_params(self) -> list[float]:
        """Detector-specific hyperparameters, in the order the kernel reads them.

        By default the fields of :attr:`param_layout` after ``threshold, freeze_on_alarm``:
        the value of :meth:`_param_values` where it has the field, else the attribute of the
        same name as its declared constraint gives it to the kernel (a :class:`Choice`'s
        mapped number), else as a float.
        """
        layout = self.param_layout
        if layout is None:
            return []
        fields: tuple[str, ...] = layout._fields  # type: ignore[attr-defined]
        given = self._param_values()
        unknown = set(given) - set(fields)
        if unknown:
            raise TypeError(f"{type(self).__name__}: no params field(s) {sorted(unknown)}.")
        rules = self.parameter_constraints
        return [float(given[f]) if f in given
                else rules[f].kernel_value(getattr(self, f)) if f in rules
                else float(getattr(self, f)) for f in fields[2:]]

    def _param_values(self) -> dict[str, float]:
        """Values of :attr:`param_layout` fields that are not plain attributes (e.g. an enum
        mapped to a float)."""
        return {}

    def _init_state(self, n: int) -> FloatArray:
        """Fresh state for ``n`` series, shape ``(n_fields, n)``."""
        raise NotImplementedError

    def _init_buf(self, n: int) -> FloatArray:
        """Fresh buffer for ``n`` series, shape ``(k, n)``; ``k = 0`` when unused."""
        return np.zeros((0, n))

    def _check_state(self, c: StateCheck) -> None:
        """Raise ``ValueError`` (via ``c``) if a loaded ``state`` / ``buf`` breaks an invariant
        the kernel relies on; shapes are already checked."""
        raise NotImplementedError

    def _upgrade_rows(self, version: int, state: FloatArray) -> FloatArray:
        """``state`` of an older ``version`` (rows already appended) in this version's meaning:
        for a row whose values changed meaning without a new row.  Default: unchanged."""
        return state

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        """Allocate state, buffers and output arrays; called at the end of ``__init__``."""
        n = self.n_series
        self._params_arr = np.array(
            [self.threshold, float(self.freeze_on_alarm), *self._extra_params()], dtype=np.float64
        )
        self._state = self._init_state(n)
        self._buf = self._init_buf(n)
        self._alloc_outputs(n)

    def _alloc_outputs(self, n: int) -> None:
        self._score1 = np.zeros((1, n))
        self._alarm1 = np.zeros((1, n), dtype=np.bool_)
        self._miss1 = np.zeros((1, self.n_inputs, n), dtype=np.bool_)

    @property
    def params(self) -> FloatArray:
        """The packed parameter vector passed to the kernel (read-only copy)."""
        return self._params_arr.copy()

    # ------------------------------------------------------------------ input checks
    def _as_step(self, inputs: tuple[ArrayLike, ...]) -> FloatArray:
        name = type(self).__name__
        if len(inputs) != self.n_inputs:
            raise ValueError(
                f"{name}.update() takes {self.n_inputs} input(s) "
                f"({', '.join(self.input_names)}); got {len(inputs)}."
            )
        n = self.n_series
        x = np.empty((1, self.n_inputs, n))
        for j, v in enumerate(inputs):
            try:
                a = np.asarray(v, dtype=np.float64)
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"{name}.update(): input '{self.input_names[j]}' must be numeric; got {v!r}."
                ) from exc
            if a.ndim == 0:
                if n != 1:
                    raise ValueError(
                        f"{name}.update(): a scalar was given for a bank of {n} series; "
                        f"pass an array of shape ({n},)."
                    )
                x[0, j, 0] = a
            elif a.shape != (n,):
                raise ValueError(
                    f"{name}.update(): input '{self.input_names[j]}' has shape {a.shape}; "
                    f"expected ({n},)."
                )
            else:
                x[0, j] = a
        return x

    def _as_batch(self, inputs: tuple[ArrayLike, ...]) -> FloatArray:
        name = type(self).__name__
        if len(inputs) != self.n_inputs:
            raise ValueError(
                f"{name}.update_many() takes {self.n_inputs} input(s) "
                f"({', '.join(self.input_names)}); got {len(inputs)}."
            )
        arrays = []
        for j, v in enumerate(inputs):
            try:
                a = np.asarray(v, dtype=np.float64)
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"{name}.update_many(): input '{self.input_names[j]}' must be numeric."
                ) from exc
            if a.ndim == 1 and self.n_series == 1:
                a = a[:, None]
            if a.ndim != 2 or a.shape[1] != self.n_series:
                raise ValueError(
                    f"{name}.update_many(): input '{self.input_names[j]}' has shape {a.shape}; "
                    f"expected (steps, {self.n_series})."
                )
            arrays.append(a)
        t = arrays[0].shape[0]
        if any(a.shape[0] != t for a in arrays):
            raise ValueError(f"{name}.update_many(): inputs have different numbers of steps.")
        return np.ascontiguousarray(np.stack(arrays, axis=1))

    # ------------------------------------------------------------------ public API
    def update(self, *inputs: ArrayLike, missing: ArrayLike | None = None) -> BoolArray:
        """Score one step for every series, then update the state.

        Parameters
        ----------
        *inputs
            One array of shape ``(n_series,)`` (or a scalar when ``n_series == 1``) per input.
        missing
            Optional boolean mask ``(n_inputs, n_series)`` (or ``(n_series,)`` for single-input
            detectors): ``True`` where the value was not logged on this step.

        Returns
        -------
        numpy.ndarray
            Boolean alarms, shape ``(n_series,)``.  The scores are in :attr:`score`.
        """
        x = self._as_step(inputs)
        miss = self._miss1
        if missing is None:
            miss[...] = False
        else:
            miss[0] = np.asarray(missing, dtype=np.bool_).reshape(self.n_inputs, self.n_series)
        call(type(self).kernel,  # interpreted until compiled: detectors/dispatch.py
             x, miss, self._state, self._buf, self._params_arr, self._score1, self._alarm1)
        return self._alarm1[0]

    def update_array(self, x: FloatArray, miss: BoolArray) -> None:
        """Fast path for the monitor: ``x``/``miss`` already shaped ``(1, n_inputs, n_series)``.

        No validation is done; results are in :attr:`score` and :attr:`alarm`.
        """
        call(type(self).kernel,  # interpreted until compiled: detectors/dispatch.py
             x, miss, self._state, self._buf, self._params_arr, self._score1, self._alarm1)

    def update_many_array(
        self, x: FloatArray, miss: BoolArray, scores: FloatArray, alarms: BoolArray
    ) -> None:
        """Fast path for the monitor's replay: :meth:`update_many` without validation or copies.

        ``x`` (float64) and ``miss`` (bool) are C-contiguous ``(steps, n_inputs, n_series)``;
        the outputs are written into ``scores`` / ``alarms`` (``(steps, n_series)``).
        """
        if x.shape[0]:
            kernel = type(self).kernel
            if x.size <= TWIN_MAX_VALUES:  # a short run: interpreted until compiled (dispatch)
                call(kernel, x, miss, self._state, self._buf, self._params_arr, scores, alarms)
            else:
                kernel(x, miss, self._state, self._buf, self._params_arr, scores, alarms)
            self._score1[0] = scores[-1]
            self._alarm1[0] = alarms[-1]

    def update_many(
        self, *inputs: ArrayLike, missing: ArrayLike | None = None
    ) -> tuple[FloatArray, BoolArray]:
        """Process a whole ``(steps, n_series)`` array per input in one kernel call.

        Returns
        -------
        scores, alarms
            Arrays of shape ``(steps, n_series)``, identical to a loop of :meth:`update`.
        """
        x = self._as_batch(inputs)
        t = x.shape[0]
        if missing is None:
            miss = np.zeros(x.shape, dtype=np.bool_)
        else:
            m = np.asarray(missing, dtype=np.bool_)
            if m.ndim == 2 and self.n_inputs == 1:
                m = m[:, None, :]
            if m.ndim == 1 and self.n_inputs == 1 and self.n_series == 1:
                m = m[:, None, None]
            if m.shape != x.shape:
                raise ValueError(
                    f"{type(self).__name__}.update_many(): 'missing' has shape {m.shape}; "
                    f"expected {x.shape}."
                )
            miss = np.ascontiguousarray(m)
        scores = np.empty((t, self.n_series))
        alarms = np.empty((t, self.n_series), dtype=np.bool_)
        if t:
            type(self).kernel(x, miss, self._state, self._buf, self._params_arr, scores, alarms)
            self._score1[0] = scores[-1]
            self._alarm1[0] = alarms[-1]
        return scores, alarms

    def bind_outputs(self, scores: FloatArray, alarms: BoolArray) -> None:
        """Write the outputs of :meth:`update` / :meth:`update_array` into the caller's arrays.

        ``scores`` (float64) and ``alarms`` (bool) have shape ``(1, n_series)`` and may be views
        of larger arrays (the monitor binds slices of its own).  Their current contents become
        :attr:`score` / :attr:`alarm`, so copy the last outputs in first to keep them.
        :meth:`grow`, :meth:`reset` and loading a state allocate fresh arrays (bind again).
        """
        n = self.n_series
        if scores.shape != (1, n) or scores.dtype != np.float64:
            raise ValueError(
                f"{type(self).__name__}.bind_outputs(): scores must be float64 of shape "
                f"(1, {n}); got {scores.dtype} {scores.shape}."
            )
        if alarms.shape != (1, n) or alarms.dtype != np.bool_:
            raise ValueError(
                f"{type(self).__name__}.bind_outputs(): alarms must be bool of shape "
                f"(1, {n}); got {alarms.dtype} {alarms.shape}."
            )
        self._score1 = scores
        self._alarm1 = alarms

    @property
    def score(self) -> FloatArray:
        """Scores of the last step, shape ``(n_series,)`` (``nan`` = missing)."""
        return self._score1[0]

    @property
    def alarm(self) -> BoolArray:
        """Alarms of the last step, shape ``(n_series,)``."""
        return self._alarm1[0]

    def grow(self, n_new: int) -> None:
        """Append ``n_new`` fresh series (e.g. a layer that appeared after the first step)."""
        n_new = check_int(type(self).__name__, "n_new", n_new, 0)
        if n_new == 0:
            return
        self._state = np.ascontiguousarray(
            np.concatenate([self._state, self._init_state(n_new)], axis=1)
        )
        self._buf = np.ascontiguousarray(np.concatenate([self._buf, self._init_buf(n_new)], axis=1))
        old_s, old_a = self._score1, self._alarm1
        self.n_series += n_new
        self._alloc_outputs(self.n_series)
        self._score1[0, : old_s.shape[1]] = old_s[0]
        self._alarm1[0, : old_a.shape[1]] = old_a[0]

    def reset(self) -> None:
        """Forget everything seen so far (hyperparameters are kept)."""
        self._setup()

    def get_params(self) -> dict[str, Any]:
        """Hyperparameters under their argument names."""
        out: dict[str, Any] = {
            "n_series": self.n_series,
            "threshold": self.threshold,
            "freeze_on_alarm": self.freeze_on_alarm,
        }
        for h in self.hyperparameters:
            out[h] = getattr(self, h)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain-data snapshot: hyperparameters, state arrays and the last outputs.

        Arrays are copied, so later updates do not change a snapshot.
        """
        return {
            "version": STATE_VERSION,
            "class": type(self).__name__,
            "state_version": type(self).state_version,
            "params": self.get_params(),
            "state": self._state.copy(),
            "buf": self._buf.copy(),
            "score": self._score1[0].copy(),
            "alarm": self._alarm1[0].copy(),
        }

    def validate_state_dict(self, state: Any) -> CheckedState:
        """Check a snapshot against this detector; return its arrays (copies) or raise.

        Nothing of the detector changes.  A snapshot is *compatible* when it is a mapping of
        the same class and a supported version, its ``state`` / ``buf`` arrays are numeric with
        this detector's shapes, the hyperparameters that shape the state
        (:attr:`state_hyperparameters`, e.g. a ring's ``window``) are the same, and the
        detector's own invariants hold (ring positions and counts are integers in range,
        statistics are finite where they must be).

        Raises
        ------
        ValueError
            Naming the first incompatible field.
        """
        return check_snapshot(self, state)

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True) -> None:
        """Restore the statistics of a snapshot produced by :meth:`state_dict`.

        Precedence: **this detector's hyperparameters win** (``threshold``, ``alpha``, ...
        are kept, whatever the snapshot says); the snapshot contributes its statistics and
        its number of series, and only when :meth:`validate_state_dict` finds them compatible.
        Arrays may be NumPy arrays or nested lists (e.g. after a JSON round trip); they are
        copied.

        Parameters
        ----------
        state
            A snapshot of the same class.
        strict
            ``True`` (default): an incompatible snapshot raises ``ValueError`` and nothing
            changes.  ``False``: it is reported with a ``UserWarning`` and the detector
            re-warms (fresh statistics, its current number of series).
        """
        try:
            checked = self.validate_state_dict(state)
        except ValueError as exc:
            if strict:
                raise
            warnings.warn(f"{exc} Re-warming: statistics reset.", UserWarning, stacklevel=2)
            self.reset()
            return
        self.apply_state(checked)

    def apply_state(self, checked: CheckedState) -> None:
        """Install the arrays returned by :meth:`validate_state_dict` (no further checks)."""
        self.n_series = checked.n_series
        self._state, self._buf = checked.state, checked.buf
        self._alloc_outputs(checked.n_series)
        self._score1[0] = checked.score
        self._alarm1[0] = checked.alarm

    def select_series(self, checked: CheckedState, index: list[int | None]) -> CheckedState:
        """Series ``index[k]`` of a validated snapshot as series ``k`` (``None``: fresh).

        Used to keep the statistics of the series two layouts share (e.g. the monitor's
        ``strict=False`` resume after the set of layers changed).
        """
        n = len(index)
        st, buf = self._init_state(n), self._init_buf(n)
        score = np.full(n, np.nan)
        alarm = np.zeros(n, dtype=np.bool_)
        for k, j in enumerate(index):
            if j is not None:
                st[:, k] = checked.state[:, j]
                buf[:, k] = checked.buf[:, j]
                score[k] = checked.score[j]
                alarm[k] = checked.alarm[j]
        return CheckedState(n, st, buf, score, alarm)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> BankDetector:
        """A detector built with the snapshot's own hyperparameters, then loaded.

        Use this to *continue* a saved detector; :meth:`load_state_dict` keeps the
        hyperparameters of the detector it is called on.
        """
        params = state.get("params", {}) if isinstance(state, Mapping) else None
        if not isinstance(params, Mapping):
            raise ValueError(f"{cls.__name__}.from_state_dict(): 'params' must be a mapping.")
        kw = {k: v for k, v in params.items()
              if k in ("n_series", "threshold", "freeze_on_alarm") or k in cls.hyperparameters}
        try:
            det = cls(**kw)
        except TypeError as exc:
            raise ValueError(f"{cls.__name__}.from_state_dict(): {exc}") from None
        det.load_state_dict(state)
        return det

    def set_threshold(self, threshold: float) -> None:
        """Change the alarm threshold (checked as declared) without touching the statistics."""
        rule = self.parameter_constraints["threshold"]
        self.threshold = rule.check(type(self).__name__, "threshold", threshold, self)
        self._params_arr[0] = self.threshold

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({args})"
