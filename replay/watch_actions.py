"""The tools :class:`replay.watch.Watcher` acts with on a judged step: shell hooks, the control
file, the echoed line.

Hook specs (``--on KIND=COMMAND``, :func:`parse_hooks`) name an intervention type, ``alarm``
(every alarm step) or ``any`` (every intervention); the watcher (its "acting" section) runs them
through a :class:`HookRunner`, writes the control file atomically and echoes one line per
decision (:func:`format_decision`). A failing
or hanging command, or an unwritable control file, is reported and never stops the watcher.

Hooks never hold the watcher up (:class:`HookRunner`): each command starts in its own process
group and runs while the watcher goes on reading (at most ``max_running`` at once, the rest
queued, a bounded queue); one running past ``hook_timeout`` is killed with its whole process
group (``sh -c`` children included).  On SIGTERM the watcher kills what is still running and
exits; at the end of ``--once`` it waits for them (up to ``hook_timeout``).
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping

from stability.outputs.safe_files import atomic_write, json_object
from stability.types import INTERVENTION_TYPES, Decision

__all__ = ["HOOK_KINDS", "HookRunner", "format_decision", "parse_hooks"]

logger = logging.getLogger("stability.watch")

#: hook names: intervention types plus ``alarm`` (every alarm step) and ``any`` (every
#: intervention)
HOOK_KINDS = tuple(sorted(INTERVENTION_TYPES)) + ("alarm", "any")


def parse_hooks(specs: Iterable[str]) -> dict[str, str]:
    """``["stop=CMD", ...]`` -> ``{"stop": "CMD"}`` (kinds: :data:`HOOK_KINDS`).

    >>> parse_hooks(["stop=touch STOP", "skip_step=echo $STABILITY_STEP"])
    {'stop': 'touch STOP', 'skip_step': 'echo $STABILITY_STEP'}
    >>> parse_hooks(["halt=x"])
    Traceback (most recent call last):
    ...
    ValueError: --on halt=x: unknown kind 'halt'; known: alert, checkpoint, reduce_lr, rollback, set_clip, skip_step, stop, alarm, any
    """  # noqa: E501
    out: dict[str, str] = {}
    for spec in specs:
        kind, sep, cmd = spec.partition("=")
        kind = kind.strip()
        if not sep or not cmd.strip():
            raise ValueError(f"--on {spec}: expected KIND=COMMAND")
        if kind not in HOOK_KINDS:
            raise ValueError(f"--on {spec}: unknown kind {kind!r}; known: {', '.join(HOOK_KINDS)}")
        out[kind] = cmd
    return out


def _atomic_write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically: an ``O_EXCL`` temporary file with a random name,
    replacing only a file of ours (a JSON object) -- see :mod:`stability.outputs.safe_files`."""
    atomic_write(path, text.encode("utf-8"), ours=json_object)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(proc: subprocess.Popen[bytes], grace: float = 0.5) -> None:
    """SIGTERM the process group of ``proc``, SIGKILL it after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # the group leader exited; its children may linger: end them too
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class HookRunner:
    """Shell hooks run concurrently, each in its own process group, bounded in time and number.

    :meth:`start` never waits; :meth:`reap` (every poll) collects finished hooks, kills those
    past ``timeout`` (the whole group) and starts queued ones; :meth:`finish` waits for the
    rest; :meth:`cancel` kills them (SIGTERM).  ``on_failure(label, message)`` is called for
    every hook that fails, times out or is dropped.
    """

    def __init__(self, timeout: float, on_failure: Callable[[str, str], None],
                 max_running: int = 4, max_queued: int = 256) -> None:
        self.timeout = float(timeout)
        self.on_failure = on_failure
        self.max_running = int(max_running)
        self.max_queued = int(max_queued)
        self.running: list[tuple[str, subprocess.Popen[bytes], float]] = []
        self.queued: collections.deque[tuple[str, str, dict[str, str]]] = collections.deque()

    def start(self, label: str, cmd: str, env: Mapping[str, str]) -> None:
        """Queue ``cmd`` (started at once when a slot is free)."""
        if len(self.queued) >= self.max_queued:
            self.on_failure(label, "dropped: too many hooks waiting")
            return
        self.queued.append((label, cmd, dict(env)))
        self.reap()

    def reap(self) -> None:
        """Collect finished hooks, kill timed-out ones, start queued ones (never waits)."""
        now = time.monotonic()
        still = []
        for label, proc, deadline in self.running:
            rc = proc.poll()
            if rc is None and now >= deadline:
                _kill_group(proc)
                self.on_failure(label, f"timed out after {self.timeout:g} s (killed with its "
                                       "process group)")
            elif rc is None:
                still.append((label, proc, deadline))
            elif rc != 0:
                self.on_failure(label, f"exited with status {rc}")
        self.running = still
        while self.queued and len(self.running) < self.max_running:
            label, cmd, env = self.queued.popleft()
            try:
                proc = subprocess.Popen(cmd, shell=True, env=env, start_new_session=True)
            except OSError as exc:
                self.on_failure(label, f"failed to start: {exc}")
                continue
            self.running.append((label, proc, time.monotonic() + self.timeout))

    def finish(self, timeout: float | None = None) -> None:
        """Wait for every hook (queued ones too) up to ``timeout`` seconds, then cancel."""
        end = time.monotonic() + (self.timeout if timeout is None else timeout)
        while (self.running or self.queued) and time.monotonic() < end:
            self.reap()
            time.sleep(0.02)
        self.cancel()

    def cancel(self) -> None:
        """Kill every running hook's process group (all signalled at once, SIGKILL after
        0.2 s); drop the queued ones (reported)."""
        live = [(label, proc) for label, proc, _ in self.running if proc.poll() is None]
        for _, proc in live:
            _signal_group(proc, signal.SIGTERM)
        end = time.monotonic() + 0.2
        for label, proc in live:
            try:
                proc.wait(max(end - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                pass
            _kill_group(proc, grace=0.0)  # (the leader's children too)
            self.on_failure(label, "killed: the watcher is stopping")
        self.running = []
        while self.queued:
            self.on_failure(self.queued.popleft()[0], "not run: the watcher is stopping")


def format_decision(d: Decision) -> str:
    """One line for a decision with alarms or interventions.

    >>> from stability.types import Alarm, SkipStep
    >>> format_decision(Decision(7, (Alarm(7, "loss_spike", "loss", 9.1234, 6.0, "warning",
    ...                                    "ewma_z"),), (SkipStep(7, "L1"),)))
    'step 7: loss_spike on loss (ewma_z 9.12 > 6) -> skip_step'
    """
    parts = [f"{a.kind} on {a.signal} ({a.detector} {a.score:.3g} > {a.threshold:.3g})"
             for a in d.alarms[:3]]
    if len(d.alarms) > 3:
        parts.append(f"+{len(d.alarms) - 3} more")
    text = f"step {d.step}: " + ("; ".join(parts) if parts else "no alarm")
    if d.interventions:
        text += " -> " + ", ".join(i.type for i in d.interventions)
    return text
