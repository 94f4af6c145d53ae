"""AtomicCheckpointIO: a write killed half-way leaves the previous checkpoint loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_agentrl.checkpoint_io import TEMP_SUFFIX, AtomicCheckpointIO, StepCheckpoint, atomic_torch_save

REPO_ROOT = Path(__file__).resolve().parents[1]
# Many small tensors: torch.save writes one zip record per storage from a Python loop, so the file
# grows over ~1 s instead of in one burst, which leaves time to kill the writer mid-write.
WRITER = textwrap.dedent(
    """
    import sys, torch
    from lightning_agentrl.checkpoint_io import atomic_torch_save
    path, mode = sys.argv[1], sys.argv[2]
    state = {"version": 2, "state_dict": {f"w{i}": torch.full((256,), float(i)) for i in range(100_000)}}
    print("ready", flush=True)
    if mode == "atomic":
        atomic_torch_save(state, path)
    else:
        torch.save(state, path)
    """
)
FULL_SIZE = 100_000 * 1024  # lower bound of the finished file: the tensor bytes alone
PARTIAL_SIZE = 1 << 20  # kill past this: well into the tensor data, far beyond the old tiny checkpoint


def _kill_writer_mid_write(target: Path, mode: str) -> int:
    """Start a writer of a ~110 MB checkpoint onto ``target``; SIGKILL it once the file it writes
    holds more than PARTIAL_SIZE but fewer than FULL_SIZE bytes. Returns the size of that file at the kill."""
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(target), mode],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert writer.poll() is None, "the writer finished before it could be killed mid-write"
            if mode == "atomic":
                written = [p for p in target.parent.iterdir() if p.name.endswith(TEMP_SUFFIX)]
            else:
                written = [target]
            sizes = [p.stat().st_size for p in written if p.exists()]
            if sizes and PARTIAL_SIZE < max(sizes) < FULL_SIZE:
                writer.send_signal(signal.SIGKILL)
                writer.wait()
                return max(sizes)
            time.sleep(0.001)
        raise AssertionError("the writer never started writing")
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()


@pytest.mark.slow
def test_killed_atomic_write_keeps_previous_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    previous = {"version": 1, "state_dict": {"w": torch.arange(10.0)}}
    AtomicCheckpointIO().save_checkpoint(previous, target)

    partial_size = _kill_writer_mid_write(target, "atomic")

    assert PARTIAL_SIZE < partial_size < FULL_SIZE
    loaded = AtomicCheckpointIO().load_checkpoint(target)
    assert loaded["version"] == 1
    assert torch.equal(loaded["state_dict"]["w"], torch.arange(10.0))
    leftovers = [p.name for p in tmp_path.iterdir() if p != target]
    assert len(leftovers) == 1 and leftovers[0].startswith(".last.ckpt.")  # the killed write's temp file
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["last.ckpt"]


@pytest.mark.slow
def test_killed_plain_torch_save_corrupts_the_checkpoint(tmp_path: Path) -> None:
    """The same kill against a plain ``torch.save``: shows that the harness does catch a torn write."""
    target = tmp_path / "last.ckpt"
    torch.save({"version": 1}, target)

    _kill_writer_mid_write(target, "plain")

    with pytest.raises(RuntimeError):
        torch.load(target)


def test_failed_save_leaves_target_and_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    atomic_torch_save({"version": 1}, target)

    with pytest.raises(Exception):  # noqa: B017 - whatever pickle raises, the target must survive
        atomic_torch_save({"version": 2, "unpicklable": lambda: None}, target)

    assert torch.load(target) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_storage_options_are_rejected_for_local_paths(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="storage_options"):
        AtomicCheckpointIO().save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"a": 1})


class _RecordingIO(AtomicCheckpointIO):
    """Records the paths it wrote, to check which files ModelCheckpoint routes through it."""

    def __init__(self) -> None:
        super().__init__()
        self.saved: list[str] = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):  # type: ignore[no-untyped-def]
        self.saved.append(os.path.basename(path))
        super().save_checkpoint(checkpoint, path, storage_options)


class _Linear(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(
    root: Path, io: AtomicCheckpointIO, save_last: bool | str, max_steps: int, ckpt_path: str | None = None,
    checkpoint: ModelCheckpoint | None = None,
):
    checkpoint = checkpoint or ModelCheckpoint(dirpath=root, save_last=save_last, every_n_train_steps=2)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        plugins=[io],
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(_Linear(), DataLoader(torch.randn(16, 4), batch_size=2), ckpt_path=ckpt_path)
    return trainer


def test_model_checkpoint_last_goes_through_atomic_io_and_ignores_temp_files(tmp_path: Path) -> None:
    io = _RecordingIO()
    _fit(tmp_path, io, save_last=True, max_steps=4)
    assert "last.ckpt" in io.saved  # save_last=True writes last.ckpt itself, through the CheckpointIO
    # What a write killed mid-way leaves behind; resuming from "last" must not pick it up.
    (tmp_path / f".last.ckpt.0badc0de{TEMP_SUFFIX}").write_bytes(b"torn write")

    resumed = _fit(tmp_path, AtomicCheckpointIO(), save_last=True, max_steps=6, ckpt_path="last")

    assert resumed.global_step == 6
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 6


def test_save_last_link_points_at_an_atomically_written_checkpoint(tmp_path: Path) -> None:
    io = _RecordingIO()
    _fit(tmp_path, io, save_last="link", max_steps=4)
    last = tmp_path / "last.ckpt"
    assert last.is_symlink()
    assert os.readlink(last) in io.saved and "last.ckpt" not in io.saved
    assert torch.load(last, weights_only=False)["global_step"] == 4


def test_step_checkpoint_writes_one_file_per_save_a_final_one_and_resumes_from_the_link(tmp_path: Path) -> None:
    """Every 2 steps of 5: steps 2 and 4, and 5 at the end; the newest two kept; ``last.ckpt`` an atomic
    link to the newest, never written itself; a resume from it continues and relinks."""
    io = _RecordingIO()
    _fit(tmp_path, io, save_last="link", max_steps=5, checkpoint=StepCheckpoint(tmp_path, 2))
    last = tmp_path / "last.ckpt"
    assert io.saved == ["step_step=2.ckpt", "step_step=4.ckpt", "step_step=5.ckpt"]
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["last.ckpt", "step_step=4.ckpt", "step_step=5.ckpt"]
    assert last.is_symlink() and os.readlink(last) == "step_step=5.ckpt"
    assert not list(tmp_path.glob(f"*{TEMP_SUFFIX}"))

    resumed = _fit(tmp_path, AtomicCheckpointIO(), save_last="link", max_steps=7, ckpt_path=str(last),
                   checkpoint=StepCheckpoint(tmp_path, 2))
    assert resumed.global_step == 7
    assert os.readlink(last) == "step_step=7.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 7
    assert sorted(p.name for p in tmp_path.glob("step_*.ckpt")) == ["step_step=6.ckpt", "step_step=7.ckpt"]


def test_a_checkpoint_written_to_a_linked_last_replaces_the_link_not_its_target(tmp_path: Path) -> None:
    """A signal's stop writes ``last.ckpt`` directly: the step file it linked to must stay as it was."""
    _fit(tmp_path, AtomicCheckpointIO(), save_last="link", max_steps=2, checkpoint=StepCheckpoint(tmp_path, 2))
    atomic_torch_save({"global_step": 99}, tmp_path / "last.ckpt")
    assert not (tmp_path / "last.ckpt").is_symlink()
    assert torch.load(tmp_path / "step_step=2.ckpt", weights_only=False)["global_step"] == 2


@pytest.mark.parametrize("change", ["every_n", "moved_folder", "old_layout"])
def test_a_resume_after_a_change_keeps_last_on_the_newest_step(tmp_path: Path, change: str) -> None:
    """``last.ckpt`` never goes versioned (``last-v1.ckpt``) and never stays on an older step: after a
    resume with another ``every_n_train_steps``, from a moved run folder, or over a run whose ``last.ckpt``
    is a file (the layout before step checkpoints); step files past the newest two are deleted."""
    first = tmp_path / "first"
    if change == "old_layout":
        _fit(first, AtomicCheckpointIO(), save_last=True, max_steps=4)  # last.ckpt a file, step files by epoch
    else:
        _fit(first, AtomicCheckpointIO(), save_last="link", max_steps=4, checkpoint=StepCheckpoint(first, 1))
    root = first
    if change == "moved_folder":
        root = tmp_path / "moved"
        first.rename(root)
    every = 3 if change == "every_n" else 1
    resumed = _fit(root, AtomicCheckpointIO(), save_last="link", max_steps=7, ckpt_path=str(root / "last.ckpt"),
                   checkpoint=StepCheckpoint(root, every))
    assert resumed.global_step == 7
    last = root / "last.ckpt"
    assert last.is_symlink() and os.readlink(last) == "step_step=7.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 7
    assert not list(root.glob("last-v*.ckpt"))
    # every 1: steps 5, 6, 7 written; every 3: step 6 and the final 7; either way the newest two stay
    assert sorted(p.name for p in root.glob("step_*.ckpt")) == ["step_step=6.ckpt", "step_step=7.ckpt"]


def test_step_checkpoint_deletes_the_temp_files_of_killed_writes_when_a_run_starts(tmp_path: Path) -> None:
    """A write killed mid-way leaves a checkpoint-sized ``.<name>.<hex>.tmp``; the next run in the folder
    (a resume) deletes it at setup, and nothing else."""
    _fit(tmp_path, AtomicCheckpointIO(), save_last="link", max_steps=2, checkpoint=StepCheckpoint(tmp_path, 2))
    leftovers = [tmp_path / f".step_step=4.ckpt.0badc0de{TEMP_SUFFIX}", tmp_path / f".last.ckpt.12345678{TEMP_SUFFIX}"]
    for path in leftovers:
        path.write_bytes(b"torn write")
    mine = tmp_path / f"notes{TEMP_SUFFIX}"  # not a name this module writes
    mine.write_text("keep")

    resumed = _fit(tmp_path, AtomicCheckpointIO(), save_last="link", max_steps=4, ckpt_path=str(tmp_path / "last.ckpt"),
                   checkpoint=StepCheckpoint(tmp_path, 2))
    assert resumed.global_step == 4
    assert not any(path.exists() for path in leftovers)
    assert mine.read_text() == "keep"
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["last.ckpt", "step_step=2.ckpt", "step_step=4.ckpt"]
