"""The run folder's resume policy: which checkpoint ``--resume last`` continues from, whether a
checkpoint is intact, what a resume may not change, and when a new run refuses a folder.

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

import yaml

from lightning_agentrl.run_layout import LAST_CHECKPOINT, RunLayout
from lightning_agentrl.settings import Settings, SettingsError

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
    last = checkpoint_dir / LAST_CHECKPOINT
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


def check_run_dir(settings: Settings) -> Path:
    """The run folder, refusing a resume without a checkpoint and a new run over an old one."""
    run_dir = Path(settings.run.dir)
    layout = RunLayout(run_dir)
    checkpoints = checkpoint_candidates(layout.checkpoints)  # a dangling last.ckpt link counts
    if settings.run.resume == "last" and not checkpoints:
        raise SettingsError(f"run.resume=last but there is no checkpoint at {layout.last_checkpoint}")
    if settings.run.resume == "never":
        check_new_run_dir(layout, checkpoints)
    if settings.run.resume == "last":
        check_resume_keeps(settings, run_dir)
    return run_dir


def check_new_run_dir(layout: RunLayout, checkpoints: list[Path]) -> None:
    """A new run refuses a folder holding a previous run's outputs: checkpoints, trajectories or (rank 0
    alone) an MLflow run. Its files would mix with the new run's, and a resume would continue the wrong run.
    Other processes skip the MLflow record: Lightning starts them after rank 0 has written it, and other
    nodes start while it may be writing it."""
    trajectories, record = layout.trajectories, layout.mlflow_run_id
    found = [*checkpoints[:1]]
    if trajectories.is_dir() and any(trajectories.iterdir()):
        found.append(trajectories)
    if _first_process() and record.exists():
        found.append(record)
    if not found:
        return
    held = ", ".join(str(path) for path in found)
    if checkpoints:
        ways = "pass --resume last to continue it, or choose another run.dir"
    else:  # killed before its first checkpoint: nothing to resume from
        ways = "it has no checkpoint to continue from (--resume last needs one): choose another run.dir or delete this one"
    raise SettingsError(f"run.dir: {layout.root} already holds a run ({held}); {ways}")


def _first_process() -> bool:
    """Whether this is the run's first process, before the Trainer exists to say so: the variables that
    Lightning's launcher, torchrun and SLURM set for the others (unset for a single process)."""
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


_LAYOUT = "a resume keeps the strategy and the number of processes (ZeRO checkpoints and the rollout state are per rank)"
_SAMPLER = ("a resume keeps the sampling distribution: the episodes restored from the checkpoint carry log-probs "
            "of the old one, and their importance weights would be wrong")
_ADAPTERS = ("a resume keeps the LoRA adapters' shapes and scale (the checkpoint holds them and their optimizer "
             "state; another scale would change the model they make)")
KEPT_ON_RESUME = {
    ("trainer", "strategy"): _LAYOUT, ("trainer", "devices"): _LAYOUT, ("trainer", "num_nodes"): _LAYOUT,
    ("engine", "temperature"): _SAMPLER, ("engine", "top_p"): _SAMPLER, ("engine", "top_k"): _SAMPLER,
    ("engine", "logprobs"): _SAMPLER,
    ("model", "lora_rank"): _ADAPTERS, ("model", "lora_target_modules"): _ADAPTERS, ("model", "lora_alpha"): _ADAPTERS,
}
"""Settings a resume may not change, each with the reason."""


def check_resume_keeps(settings: Settings, run_dir: Path) -> None:
    """A resume keeps the settings of :data:`KEPT_ON_RESUME`; a field the run's settings file lacks (written
    before the field existed) had its default."""
    previous = last_run_settings(run_dir)
    if previous is None:
        return
    def before(section: str, field: str):
        return previous.get(section, {}).get(field, type(getattr(settings, section)).model_fields[field].default)

    # under the softmax rule the filters decide what is sampled, not the log-probs recorded
    softmax = before("engine", "logprobs") == settings.engine.logprobs == "softmax"
    for (section, field), reason in KEPT_ON_RESUME.items():
        old, new = before(section, field), getattr(getattr(settings, section), field)
        if old != new and not (softmax and field in ("top_p", "top_k")):
            raise SettingsError(
                f"{section}.{field}: the run in {run_dir} ran with {old!r}, this resume asks for {new!r}; "
                f"{reason} (resume with {old!r}, or start a new run.dir)"
            )
    if (before("trainer", "value_lr") is None) != (settings.trainer.value_lr is None):
        raise SettingsError(
            f"trainer.value_lr: the run in {run_dir} ran with {before('trainer', 'value_lr')!r}, this resume asks for "
            f"{settings.trainer.value_lr!r}; a resume keeps whether the value head has a learning rate of its own (its "
            "optimizer state is then a parameter group of its own), though it may change the rate (resume with a "
            "value set, or unset, as before, or start a new run.dir)"
        )
    old_path = before("model", "path")
    if settings.model.lora and _resolved(old_path) != _resolved(settings.model.path):
        raise SettingsError(
            f"model.path: the run in {run_dir} trained LoRA adapters on {old_path!r}, this resume asks for "
            f"{settings.model.path!r}; its checkpoint holds the adapters only, not the base they adapt (resume with "
            f"{old_path!r}, or start a new run.dir)"
        )


def _resolved(model_path: str) -> str:
    """A local model folder as an absolute path (a run's settings file holds it so), anything else as it is."""
    return str(Path(model_path).resolve()) if Path(model_path).exists() else model_path


def last_settings_file(run_dir: str | Path) -> Path | None:
    """The settings the run in ``run_dir`` last ran with: its newest ``settings.resume-*.yaml``, else
    its ``settings.yaml`` (each is a complete resolved dump); None if it has neither."""
    layout = RunLayout(run_dir)
    resumes = layout.resume_settings_files()
    path = resumes[-1] if resumes else layout.settings_file
    return path if path.exists() else None


def last_run_settings(run_dir: Path) -> dict | None:
    path = last_settings_file(run_dir)
    return yaml.safe_load(path.read_text()) if path is not None else None


__all__ = [
    "KEPT_ON_RESUME",
    "check_resume_keeps",
    "check_run_dir",
    "checkpoint_candidates",
    "checkpoint_problem",
    "last_run_settings",
    "last_settings_file",
    "resume_checkpoint",
]
