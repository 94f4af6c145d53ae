"""Which checkpoint ``--resume last`` continues from, and whether a checkpoint is intact.

``last.ckpt`` is written atomically by :class:`~lightning_agentrl.checkpoint_io.AtomicCheckpointIO`,
but a disk that filled up, a copy between machines cut short, or a DeepSpeed folder (written in
place, shard by shard) can still leave it truncated, and torch then fails with a raw zip error
although an intact ``step_step=N.ckpt`` lies beside it. :func:`resume_checkpoint` tries, in order,
``last.ckpt`` and then the ``step_*.ckpt`` files from the highest step down; it takes the first
intact one, warns when that is not ``last.ckpt``, and refuses with an error naming every file
when none is intact.

Intact means, without loading a tensor (a check must not cost a second copy of the model):

- a file: a zip archive (torch's format) whose central directory reads, whose every member lies
  within the file (not truncated) and matches its CRC-32 (not overwritten in place: bit rot, a
  copy that mixed two versions), and whose pickles (``data.pkl``) parse to their end. The CRCs
  cost one streamed read of the file, in 1 MiB pieces;
- a DeepSpeed folder: its ``latest`` file names a tag folder holding a ``*model_states.pt`` and
  ``*optim_states.pt`` shards, each intact as above.
"""

from __future__ import annotations

import io
import os
import pickletools
import re
import warnings
import zipfile
from pathlib import Path

from lightning_agentrl.settings import SettingsError

_STEP = re.compile(r"step=?(\d+)")


def resume_checkpoint(checkpoint_dir: Path) -> Path:
    """The newest intact checkpoint under ``checkpoint_dir``; raises :class:`SettingsError` if none is."""
    candidates = checkpoint_candidates(checkpoint_dir)
    if not candidates:
        raise SettingsError(f"run.resume=last but there is no checkpoint in {checkpoint_dir}")
    problems: list[str] = []
    for path in candidates:
        problem = checkpoint_problem(path)
        if problem is None:
            if problems:
                warnings.warn(
                    f"run.resume=last: {'; '.join(problems)}; resuming from {path} instead", stacklevel=2
                )
            return path
        problems.append(f"{path} is not usable ({problem})")
    raise SettingsError(f"run.resume=last: no intact checkpoint in {checkpoint_dir}: {'; '.join(problems)}")


def checkpoint_candidates(checkpoint_dir: Path) -> list[Path]:
    """``last.ckpt`` first, then ``step_*.ckpt`` from the highest step down."""
    last = checkpoint_dir / "last.ckpt"
    steps = [p for p in checkpoint_dir.glob("step_*.ckpt") if _STEP.search(p.name)]
    steps.sort(key=lambda p: int(_STEP.search(p.name).group(1)), reverse=True)
    return ([last] if os.path.lexists(last) else []) + steps  # a dangling link is reported, not skipped


def checkpoint_problem(path: Path) -> str | None:
    """What makes ``path`` unusable (a file or a DeepSpeed folder), or None if it is intact."""
    if path.is_dir():
        return _deepspeed_problem(path)
    if not path.is_file():  # a FIFO would block the reader forever; a dangling link names nothing
        return "not a regular file (a FIFO, a socket, a dangling link?)"
    return _zip_problem(path)


def _zip_problem(path: Path) -> str | None:
    try:
        size = path.stat().st_size
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (OSError, zipfile.BadZipFile) as err:
        return f"truncated or not a torch checkpoint: {err}"
    if not members:
        return "an empty archive"
    for member in members:
        if member.header_offset + member.compress_size > size:
            return f"truncated: member {member.filename} runs past the end of the file"
    return _content_problem(path)


def _content_problem(path: Path) -> str | None:
    """Every member's bytes match their CRC-32 and every pickle walks to its STOP opcode (no code runs)."""
    try:
        with zipfile.ZipFile(path) as archive:
            for member in archive.infolist():
                with archive.open(member) as stream:  # raises BadZipFile on a CRC mismatch at the end
                    if member.filename.endswith(".pkl"):
                        for _ in pickletools.genops(io.BytesIO(stream.read())):
                            pass
                    else:
                        while stream.read(1 << 20):
                            pass
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        return f"corrupt: {err}"
    except ValueError as err:  # pickletools: an unknown opcode or a pickle cut short
        return f"corrupt: its pickle {member.filename} does not parse ({err})"
    return None


def _deepspeed_problem(folder: Path) -> str | None:
    latest = folder / "latest"
    if not latest.is_file():
        return "a DeepSpeed checkpoint folder without its 'latest' file"
    tag = folder / latest.read_text().strip()
    if not tag.is_dir():
        return f"'latest' names {tag.name}, which is missing"
    shards = sorted(tag.glob("*.pt"))
    for kind in ("model_states", "optim_states"):
        if not any(kind in shard.name for shard in shards):
            return f"{tag.name}/ has no *{kind}.pt shard"
    for shard in shards:
        problem = _zip_problem(shard)
        if problem is not None:
            return f"{shard.relative_to(folder)}: {problem}"
    return None


__all__ = ["checkpoint_candidates", "checkpoint_problem", "resume_checkpoint"]
