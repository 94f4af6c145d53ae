"""How a run stops early: on a signal, or when a dependency fails, always with a non-zero exit status.

A scheduler (SLURM, Kubernetes) reads exit status 0 as success and does not requeue; Lightning's own
SIGTERM handling ends ``trainer.fit`` with a bare ``SystemExit`` (status 0). Here:

- **SIGTERM / SIGINT** (:class:`StopOnSignal`): the current optimizer step finishes, a checkpoint is
  written (unless the step's own was), and the run raises :class:`RunInterrupted`: exit status 143
  (SIGTERM) or 130 (SIGINT), and a closing line that says how to continue (``--resume last``).
  SIGINT is turned into Lightning's SIGTERM path, so every training process stops at the same step.
  A trainer waiting for rollouts is woken at once (the rollout buffer fails with :class:`StopRequested`).
- **A stuck run** still ends: a watchdog thread, fed by ``signal.set_wakeup_fd`` (so it hears the
  signal even while the main thread is blocked in C code), exits the process with the same status
  after ``trainer.stop_grace_s`` or on a second signal, after stopping the local sandbox server
  (10 s at most); that exit waits on no lock a stuck thread may hold.
- **A failed dependency** during the run raises a :class:`RunStopped` subclass whose
  ``exit_status`` the command line returns (see ``callbacks/circuit_breaker.py``).

Exit statuses: 2 settings or start-up check, 3 a dependency failed during the run, 128 + signal
number when stopped by a signal. Each of 3, 130 and 143 leaves a checkpoint ``--resume last`` continues.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import lightning as L
from typing_extensions import override

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunStopped(Exception):
    """The run stopped before ``trainer.max_steps``; ``exit_status`` is what the command line returns."""

    exit_status = 1


class RunInterrupted(RunStopped):
    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_status = 128 + signum


class RolloutFailed(RunStopped):
    """The rollout service died (e.g. an inference engine process was killed)."""

    exit_status = 3


class StopRequested(Exception):
    """Put into the rollout buffer on a signal, so a trainer waiting for rollouts stops waiting."""


class StopOnSignal(L.Callback):
    """SIGTERM/SIGINT: finish the step, checkpoint to ``checkpoint``, raise :class:`RunInterrupted` from
    :meth:`raise_if_stopped`. ``wake(error)`` is called on the first signal (the rollout buffer's
    ``fail``); ``on_hard_exit`` before a watchdog exit (stops the local sandbox server)."""

    def __init__(self, checkpoint: Path, *, grace_s: float, wake: Callable[[BaseException], None],
                 on_hard_exit: Callable[[], None] = lambda: None) -> None:
        if grace_s <= 0:
            raise ValueError(f"grace_s must be > 0, got {grace_s}")
        self.checkpoint = Path(checkpoint)
        self.grace_s = grace_s
        self.wake = wake
        self.on_hard_exit = on_hard_exit
        self.signum: int | None = None
        self._forwarded = False  # a SIGTERM this handler raised itself (for a SIGINT)
        self._previous: dict[int, object] = {}
        self._watchdog: _Watchdog | None = None
        self._in_step = False
        self._saved_step: int | None = None

    # -- signals -----------------------------------------------------------------------------
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Before Lightning registers its SIGTERM handler, which then calls this one too.
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        self._watchdog = _Watchdog(self)

    def _on_signal(self, signum: int, frame) -> None:
        if signum == signal.SIGTERM and self._forwarded:
            self._forwarded = False
            return
        if self.signum is not None:
            return  # a second signal: the watchdog exits
        self.signum = signum
        print(f"{signal.Signals(signum).name}: finishing the step and writing a checkpoint "
              f"(another signal, or {self.grace_s:g} s, stops at once)", file=sys.stderr, flush=True)
        self.wake(StopRequested(f"stopped by {signal.Signals(signum).name}"))
        if signum == signal.SIGINT:  # Lightning stops every rank at the step's end on SIGTERM
            self._forwarded = True
            signal.raise_signal(signal.SIGTERM)

    def restore(self) -> None:
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
        self._previous = {}

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.restore()

    # -- where a checkpoint is exact ---------------------------------------------------------
    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._saved_step = trainer.global_step if trainer.ckpt_path else None

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._in_step = True

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._in_step = False

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._saved_step = trainer.global_step

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self.signum is None or self._in_step or self._saved_step == trainer.global_step:
            return
        # Lightning's SIGTERM exception reaches every rank at the same step; a woken rollout wait may
        # not, and a checkpoint is a collective: then only a single process writes one.
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(exception, SIGTERMException) or trainer.world_size == 1:
            trainer.save_checkpoint(self.checkpoint)

    def raise_if_stopped(self, error: BaseException) -> None:
        """Called with what ``trainer.fit`` raised: a signal's stop becomes :class:`RunInterrupted`, a dead
        rollout service :class:`RolloutFailed`; anything else is left to propagate."""
        from lightning_agentrl.rollout.buffer import RolloutServiceError

        self.restore()
        if self.signum is None and isinstance(error, RolloutServiceError):
            cause = error.__cause__
            raise RolloutFailed(
                f"the rollout service stopped ({error}): {type(cause).__name__}: {cause}; the last checkpoint is "
                f"{self.checkpoint if self._saved_step is not None else 'none'} (continue with --resume last)"
            ) from error
        if self.signum is None:
            return
        name = signal.Signals(self.signum).name
        if self._saved_step is None:
            where = "before the first checkpoint; run it again without --resume"
        else:
            where = f"at step {self._saved_step}, checkpoint {self.checkpoint}; continue with --resume last"
        raise RunInterrupted(self.signum, f"stopped by {name} {where}") from error

    def hard_exit(self, why: str) -> None:
        """The watchdog's exit: no checkpoint, the local sandbox server stopped, status 128 + signal."""
        status = 128 + (self.signum or signal.SIGTERM)
        # The exit itself must not wait on anything a stuck thread may hold: printing takes the lock of
        # sys.stderr (held by a thread blocked on a full pipe, say), the cleanup a server's shutdown. A
        # thread that only sleeps then exits is the last word.
        threading.Thread(target=_exit_after, args=(HARD_EXIT_CLEANUP_S + 5, status), daemon=True).start()
        message = f"error: {why}; exiting without a new checkpoint (the last one: {self.checkpoint})\n"
        with contextlib.suppress(OSError):
            os.write(sys.stderr.fileno(), message.encode())
        cleanup = threading.Thread(target=self.on_hard_exit, daemon=True)
        cleanup.start()
        cleanup.join(timeout=HARD_EXIT_CLEANUP_S)
        os._exit(status)


HARD_EXIT_CLEANUP_S = 10.0
"""Longest wait for the cleanup (stopping the local sandbox server) before a watchdog exit."""


def _exit_after(seconds: float, status: int) -> None:
    time.sleep(seconds)
    os._exit(status)


class _Watchdog:
    """Hears SIGTERM/SIGINT through ``signal.set_wakeup_fd`` (written by the C-level handler, even when
    the main thread never runs Python again) and exits the process if the run does not stop in time."""

    def __init__(self, owner: StopOnSignal) -> None:
        self.owner = owner
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stop-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline: float | None = None
        heard = 0
        while not self._closed.is_set():
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([self._reader], [], [], timeout)
            if self._closed.is_set():
                return
            if not readable:
                self.owner.hard_exit(f"the run did not stop within {self.owner.grace_s:g} s of the signal "
                                     f"(trainer.stop_grace_s)")
            data = self._reader.recv(64)
            if not data:
                return
            for signum in data:
                if signum not in STOP_SIGNALS:
                    continue
                heard += 1
                # a SIGINT is forwarded as one SIGTERM: that one is not the user's second signal
                if heard == 2 and self.owner.signum == signal.SIGINT and signum == signal.SIGTERM:
                    continue
                if deadline is None:
                    deadline = time.monotonic() + self.owner.grace_s
                elif heard >= 2:
                    self.owner.hard_exit("a second signal")

    def close(self) -> None:
        self._closed.set()
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(self._previous_fd)
        self._writer.close()  # wakes the thread's select
        self._thread.join(timeout=5)
        self._reader.close()


__all__ = ["RolloutFailed", "RunInterrupted", "RunStopped", "StopOnSignal", "StopRequested"]
