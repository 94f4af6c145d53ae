"""Signals and checkpoints: a signal or a deadlock ends a run with a checkpoint within its grace period; a damaged
checkpoint is named, and the resume continues from the newest intact one. Real processes, no mocks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.failing import REPO, SMALL, cli, error_line, start_fit, summary_step, wait_for


def test_a_deadlocked_run_exits_after_the_grace_period(tmp_path, tiny_model_path):
    script = (
        "import sys, threading, lightning as L\n"
        "from lightning_agentrl.__main__ import main\n"
        "import lightning_agentrl.train as train\n"
        "class Deadlock(L.Callback):\n"
        "    def on_train_batch_end(self, *args):\n"
        "        print('deadlocked', flush=True); threading.Event().wait()\n"
        "fit = train.fit\n"
        "train.fit = lambda settings, **kw: fit(settings, callbacks=[Deadlock()])\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-c", script, "fit", "--config", "tests/fixtures/tiny_bugfix.yaml", f"--run.dir={run}", *SMALL,
         "--trainer.stop_grace_s=3", "--trainer.max_steps=1"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    for line in process.stdout:
        if "deadlocked" in line:
            break
    start = time.monotonic()
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 143, output[-3000:]
    assert 3 <= time.monotonic() - start < 20
    assert "error: the run did not stop within 3 s of the signal (trainer.stop_grace_s)" in output


def logged_losses(run_dir: Path) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    history = sorted(client.get_metric_history(run_id, "loss/total"), key=lambda m: m.timestamp)
    return {m.step: m.value for m in history}


def two_tasks(root: Path) -> Path:
    import shutil

    for name in ("binary_search_first", "balanced_brackets_unclosed"):
        shutil.copytree(REPO / "tasks" / "bugfix" / name, root / "tasks" / name)
    return root / "tasks"


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.slow
def test_sigterm_mid_step_checkpoints_exits_143_and_resume_continues_exactly(tmp_path):
    args = [f"--env.tasks={two_tasks(tmp_path)}", "--env.split=all", "--trainer.max_steps=4",
            "--trainer.checkpoint_every=3", "--algorithm.entropy_coef=0.01", "--trainer.lr=1e-3"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    process = start_fit(straight, *args)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-3000:]

    process = start_fit(stopped, *args)
    wait_for(stopped / "trajectories" / "step_000001.jsonl", process)  # step 2 is running
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=300)
    last = stopped / "checkpoints" / "last.ckpt"
    assert process.returncode == 143, output[-3000:]
    # no step checkpoint before step 3: this one was written on the signal
    assert f"stopped by SIGTERM at step 2, checkpoint {last}; continue with --resume last" in output
    assert not (stopped / "summary.json").exists()

    intact = last.read_bytes()
    truncate(last)
    refused, _ = cli("fit", "--config", "tests/fixtures/tiny_bugfix.yaml", f"--run.dir={stopped}", *SMALL, *args, "--resume", "last")
    assert refused.returncode == 2
    assert error_line(refused.stderr).startswith(f"error: run.resume=last: no intact checkpoint in {last.parent}: {last}")
    last.write_bytes(intact)

    process = start_fit(stopped, *args, "--resume", "last")
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-3000:]
    expected, got = logged_losses(straight), logged_losses(stopped)
    assert sorted(got) == sorted(expected) == [0, 1, 2, 3]
    for step in (2, 3):  # the steps after the signal
        assert got[step] == pytest.approx(expected[step], abs=1e-6), (step, got, expected)


def corrupt_pickle(path: Path) -> None:
    """Overwrite bytes inside the checkpoint's ``data.pkl`` in place: the zip stays whole, the pickle is garbage."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        member = next(m for m in archive.infolist() if m.filename.endswith("data.pkl"))
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[member.header_offset + 26: member.header_offset + 30])
    start = member.header_offset + 30 + name_len + extra_len
    data[start + 2: start + 12] = b"\xff" * 10
    path.write_bytes(bytes(data))


def test_a_damaged_last_ckpt_resumes_from_the_newest_intact_step_checkpoint(tmp_path):
    """``last.ckpt`` with a corrupt ``data.pkl`` inside an intact zip, and a truncated newer step checkpoint:
    the resume names both and continues from the intact one."""
    import shutil

    run = tmp_path / "run"
    process = start_fit(run, "--trainer.max_steps=2")
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-3000:]
    checkpoints = run / "checkpoints"
    assert os.readlink(checkpoints / "last.ckpt") == "step_step=2.ckpt"  # one file per save, the previous kept
    corrupt_pickle(checkpoints / "last.ckpt")  # through the link: step 2 is damaged too
    shutil.copy(checkpoints / "step_step=1.ckpt", checkpoints / "step_step=5.ckpt")
    truncate(checkpoints / "step_step=5.ckpt")
    process = start_fit(run, "--trainer.max_steps=3", "--resume", "last")
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-3000:]
    assert re.search(rf"{re.escape(str(checkpoints / 'last.ckpt'))} is not usable \(corrupt: Bad CRC-32 for file "
                     rf"'[^']*data.pkl'\)", output), output[-3000:]
    assert f"{checkpoints / 'step_step=5.ckpt'} is not usable (truncated" in output
    assert f"{checkpoints / 'step_step=2.ckpt'} is not usable (corrupt" in output
    assert f"resuming from {checkpoints / 'step_step=1.ckpt'} instead" in output
    assert summary_step(run) == 3


def test_checkpoint_integrity_of_files_and_deepspeed_folders(tmp_path):
    import torch

    from lightning_agentrl.resume import checkpoint_problem, resume_checkpoint

    good = tmp_path / "good.ckpt"
    torch.save({"w": torch.ones(1000)}, good)
    assert checkpoint_problem(good) is None
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(good.read_bytes()[:-200])
    assert "truncated" in checkpoint_problem(bad)

    folder = tmp_path / "checkpoints" / "last.ckpt"
    (folder / "checkpoint").mkdir(parents=True)
    assert "without its 'latest' file" in checkpoint_problem(folder)
    (folder / "latest").write_text("checkpoint")
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (folder / "checkpoint" / name).write_bytes(good.read_bytes())
    assert checkpoint_problem(folder) is None
    step = tmp_path / "checkpoints" / "step_step=7.ckpt"
    step.write_bytes(good.read_bytes())
    assert resume_checkpoint(folder.parent) == folder
    (folder / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"PK\x03\x04 cut")
    with pytest.warns(UserWarning, match=r"optim_states.pt: truncated.*resuming from .*step_step=7.ckpt instead"):
        assert resume_checkpoint(folder.parent) == step
    shard = folder / "checkpoint" / "mp_rank_00_model_states.pt"
    (folder / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(good.read_bytes())
    corrupt_pickle(shard)
    assert checkpoint_problem(folder) == "checkpoint/mp_rank_00_model_states.pt: corrupt: Bad CRC-32 for file 'good/data.pkl'"


def test_a_rewritten_pickle_with_valid_crcs_is_caught_and_a_failed_load_names_the_file(tmp_path):
    import zipfile

    import torch

    from lightning_agentrl.checkpoint_io import AtomicCheckpointIO
    from lightning_agentrl.resume import checkpoint_problem
    from lightning_agentrl.settings import SettingsError

    good, bad = tmp_path / "good.ckpt", tmp_path / "bad.ckpt"
    torch.save({"w": torch.ones(10), "global_step": 3}, good)
    with zipfile.ZipFile(good) as source, zipfile.ZipFile(bad, "w") as target:
        for member in source.infolist():  # a new archive: every CRC matches, the pickle is cut and padded
            data = source.read(member)
            target.writestr(member, data[: len(data) // 2] + b"garbage!" if member.filename.endswith(".pkl") else data)
    assert checkpoint_problem(bad).startswith("corrupt: its pickle good/data.pkl does not parse (")
    with pytest.raises(SettingsError, match=rf"^checkpoint {bad} cannot be loaded \(.*\); it is damaged: move it aside"):
        AtomicCheckpointIO().load_checkpoint(bad)
    assert AtomicCheckpointIO().load_checkpoint(good)["global_step"] == 3


def test_a_last_ckpt_that_is_a_fifo_or_a_dangling_link_is_named_not_waited_on(tmp_path):
    import os

    import torch

    from lightning_agentrl.resume import checkpoint_candidates, checkpoint_problem

    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    torch.save({"w": torch.ones(10)}, checkpoints / "step_step=1.ckpt")
    os.mkfifo(checkpoints / "last.ckpt")  # reading it would block forever
    assert "not a regular file" in checkpoint_problem(checkpoints / "last.ckpt")
    (checkpoints / "last.ckpt").unlink()
    (checkpoints / "last.ckpt").symlink_to(tmp_path / "gone.ckpt")
    assert checkpoint_candidates(checkpoints)[0].name == "last.ckpt"  # reported, not skipped
    assert "not a regular file" in checkpoint_problem(checkpoints / "last.ckpt")
