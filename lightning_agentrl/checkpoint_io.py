"""Checkpoint writes that a crash cannot half-finish.

A run killed while writing ``last.ckpt`` (OOM killer, preemption, Ctrl-C twice) must still resume
from the previous ``last.ckpt``. :class:`AtomicCheckpointIO` writes the new checkpoint to a temporary
file in the same folder, ``fsync``\\ s it, and ``os.replace``\\ s it onto the target: POSIX renames
within one file system are atomic, so a reader sees the old file or the new one, never a mix.
The folder is ``fsync``\\ ed too, so the rename itself survives a power loss.

Why not Lightning's own ``TorchCheckpointIO`` (2.6.6)? It serializes the whole checkpoint into
memory (a second copy of every tensor) and then writes through an fsspec transaction whose local
implementation puts the temporary file in the *system* temp folder (``tempfile.mkstemp()``) and
moves it with ``shutil.move``: when ``/tmp`` is another file system that move is a copy onto the
target, not atomic, and nothing is fsynced. Here ``torch.save`` streams straight into the
same-folder temporary file.

How ``last.ckpt`` is written: :class:`StepCheckpoint` saves one file per save, ``step_step=N.ckpt``
through this CheckpointIO (atomic), and points ``last.ckpt`` at it with a relative symlink made
under a temporary name and ``os.replace``\\ d onto ``last.ckpt`` (atomic too: a reader sees the
previous link or the new one). Lightning's own ``save_last="link"`` removes ``last.ckpt`` and then
re-creates it, and ``save_last=True`` writes a second full copy of every tensor. A checkpoint
written straight to ``last.ckpt`` (a signal's stop, the circuit breaker) replaces the link with a
file, never writes through it. The previous step file is kept until the next save completes, so a
damaged newest checkpoint still leaves an intact one for ``--resume last``.

- A leftover temporary file is named ``.<target name>.<random>.tmp``: its suffix is not ``.ckpt``
  and its name does not start with ``last``, so neither ``ckpt_path="last"`` nor a glob for
  ``*.ckpt`` picks it up. Such leftovers are only ever from killed writes (each as large as a
  checkpoint): :class:`StepCheckpoint` deletes them from its folder when a run (or a resume) starts.
- DeepSpeed strategies do not use a CheckpointIO at all: DeepSpeed writes a checkpoint *folder*
  itself, in place, so this atomicity does not extend to ZeRO checkpoints.

Example:
    >>> Trainer(plugins=[AtomicCheckpointIO()], callbacks=[StepCheckpoint(run_dir / "checkpoints", 50)])  # doctest: +SKIP
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from fsspec.utils import get_protocol
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_agentrl.run_layout import LAST_CHECKPOINT

TEMP_SUFFIX = ".tmp"


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose ``save_checkpoint`` replaces the target atomically (local paths).

    Remote URLs (``s3://``, ``gs://``, ...) go through the parent: an object store publishes an
    object only once its upload completes, which is already all-or-nothing.
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if get_protocol(str(path)) not in ("file", "local"):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        atomic_torch_save(checkpoint, path)

    @override
    def load_checkpoint(self, path: _PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The parent's load, with a failure named as the checkpoint's (``resume.py`` checks CRCs and pickles
        first, so this is the rare damage that passed them) instead of a bare unpickling error."""
        try:
            return super().load_checkpoint(path, *args, **kwargs)
        except FileNotFoundError:
            raise
        except Exception as err:  # anything torch.load raises on a damaged file (UnpicklingError, zip, even MemoryError)
            from lightning_agentrl.settings import SettingsError

            raise SettingsError(
                f"checkpoint {path} cannot be loaded ({type(err).__name__}: {err}); it is damaged: move it aside "
                f"and --resume last takes the newest intact step_*.ckpt"
            ) from err


def atomic_torch_save(obj: Any, path: _PATH) -> None:
    """``torch.save(obj, path)`` that leaves ``path`` untouched unless the whole write succeeded."""
    target = Path(str(path).removeprefix("file://"))
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    # O_EXCL: never write into someone else's file; mode 0o666 lets the umask decide, as open() does.
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())  # the data must be on disk before the rename makes it visible
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_directory(target.parent)


STEP_FILE = re.compile(r"step_step=(\d+)\.ckpt")
LEFTOVER_TEMP = re.compile(rf"\..+\.[0-9a-f]{{8}}{re.escape(TEMP_SUFFIX)}")
"""A temporary file of :func:`atomic_torch_save` or :func:`atomic_link` that a killed write left."""


class StepCheckpoint(ModelCheckpoint):
    """``step_step=N.ckpt`` every ``every_n_train_steps`` steps and at the end of training, the newest
    ``keep`` kept, and ``last.ckpt`` an atomic symlink to the newest (one file written per save).

    ``link_last=False`` (DeepSpeed, whose checkpoints are folders written in place) writes
    ``last.ckpt`` as a second full checkpoint instead, so nothing is ever written through a link.

    A resume keeps this layout whatever changed since the checkpoint: ``last.ckpt`` is always
    replaced, never versioned (``last-v1.ckpt``), the callback's state is found under one key
    whatever ``every_n_train_steps`` is, and step checkpoints past the newest ``keep`` are deleted by
    their step number, also those of a run folder that was moved (whose recorded paths do not match).
    """

    def __init__(self, dirpath: Path, every_n_train_steps: int, *, keep: int = 2, link_last: bool = True) -> None:
        super().__init__(
            dirpath=dirpath,
            filename="step_{step}",
            every_n_train_steps=every_n_train_steps,
            save_last="link" if link_last else True,
            save_top_k=keep,
            monitor="step",  # newest first: the top-k of the step number are the newest k
            mode="max",
            enable_version_counter=False,
        )
        self.keep = keep
        self.seconds = 0.0
        """Seconds spent saving (state gathering, write, link), summed over the run (stage timings)."""
        self.batch_end_at: float | None = None
        """``time.perf_counter()`` when this callback's ``on_train_batch_end`` (the last one) returned."""

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if trainer.is_global_zero and self.dirpath is not None and os.path.isdir(self.dirpath):
            for path in Path(self.dirpath).iterdir():
                if LEFTOVER_TEMP.fullmatch(path.name) and not path.is_dir():
                    path.unlink(missing_ok=True)  # a write killed mid-way (no write of this run is under way yet)

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        started = time.perf_counter()
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._last_global_step_saved == trainer.global_step:  # only after a save: no listing on other steps
            self._delete_older_steps(trainer)
        self.batch_end_at = time.perf_counter()
        self.seconds += self.batch_end_at - started

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        """A final checkpoint of the last step, whatever ``every_n_train_steps`` is."""
        if not self._should_skip_saving_checkpoint(trainer) and trainer.global_step > 0:
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
            self._delete_older_steps(trainer)
        super().on_train_end(trainer, pl_module)

    @property
    @override
    def state_key(self) -> str:
        return type(self).__name__  # one key: a resume with another checkpoint_every still finds the state

    def _delete_older_steps(self, trainer) -> None:
        """Delete step checkpoints past the newest ``keep`` (by step number) that Lightning's own top-k
        does not know of (a resume in a moved folder), never the one ``last.ckpt`` points to."""
        if not trainer.is_global_zero or self.dirpath is None or not os.path.isdir(self.dirpath):
            return
        steps = sorted(((int(m.group(1)), p) for p in Path(self.dirpath).iterdir()
                        if (m := STEP_FILE.fullmatch(p.name))), reverse=True)
        last = Path(self.dirpath) / LAST_CHECKPOINT
        keep_target = last.resolve() if last.is_symlink() else None
        for _, path in steps[self.keep :]:
            if path.resolve() == keep_target:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)  # a DeepSpeed checkpoint folder
            else:
                path.unlink(missing_ok=True)

    @staticmethod
    @override
    def _link_checkpoint(trainer, filepath: str, linkpath: str) -> None:
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            atomic_link(Path(filepath), Path(linkpath))
        trainer.strategy.barrier()


def atomic_link(target: Path, link: Path) -> None:
    """Make ``link`` a relative symlink to ``target`` in one ``os.replace`` (a copy where symlinks fail)."""
    temp = link.with_name(f".{link.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    try:
        os.symlink(os.path.relpath(target, link.parent), temp)
    except OSError:  # no symlinks here (Windows without the privilege): an atomic copy
        shutil.copy(target, temp)
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    os.replace(temp, link)
    _fsync_directory(link.parent)


def _fsync_directory(directory: Path) -> None:
    # Makes the rename durable across a power loss; some file systems refuse to open folders.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


__all__ = ["AtomicCheckpointIO", "StepCheckpoint", "atomic_link", "atomic_torch_save"]
