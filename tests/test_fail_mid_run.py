"""The run's own failures after start-up: batches with nothing to train, a killed engine process, a full disk or
a tracking server failing mid-run each end the run with one error line. Real processes, no mocks."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.failing import error_line, start_fit, wait_for


def test_batches_with_nothing_to_train_take_no_step_and_stop_the_run(tmp_path):
    """Every episode truncated and filtered out: no optimizer step, the rollout service is not stalled
    by the missing weight update, and after rollout.max_empty_steps such batches the run stops."""
    run = tmp_path / "run"
    process = start_fit(run, "--env.max_turns=1", "--rollout.truncation=filter", "--rollout.max_empty_steps=2",
                        "--trainer.max_steps=3")
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 3, output[-3000:]
    assert error_line(output).startswith("error: 2 batches in a row held no trainable token (rollout.max_empty_steps=2)")
    assert "step 0 (skipped batch 1): no trainable token" in output
    # both batches of step 0 are on disk: the first set aside, the second as the step's
    assert (run / "trajectories" / "superseded_step_000000_1.jsonl").exists()
    assert (run / "trajectories" / "step_000000.jsonl").exists()
    assert not (run / "checkpoints" / "last.ckpt").exists()  # nothing was trained, nothing to save


def descendants(pid: int) -> list[tuple[int, str]]:
    table = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    children: dict[int, list[tuple[int, str]]] = {}
    for row in table:
        child, parent, args = row.split(None, 2)
        children.setdefault(int(parent), []).append((int(child), args))
    found, todo = [], [pid]
    while todo:
        for child, args in children.get(todo.pop(), []):
            found.append((child, args))
            todo.append(child)
    return found


@pytest.mark.slow
def test_a_killed_vllm_engine_process_stops_the_run_with_a_clear_error(tmp_path):
    pytest.importorskip("vllm")
    run = tmp_path / "run"
    process = start_fit(run, "--engine.kind=vllm", "--trainer.max_steps=4")
    wait_for(run / "trajectories" / "step_000000.jsonl", process, timeout=600)
    engine_cores = [pid for pid, args in descendants(process.pid) if "EngineCore" in args]
    assert engine_cores, descendants(process.pid)
    for pid in engine_cores:
        os.kill(pid, signal.SIGKILL)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 3, output[-3000:]
    assert error_line(output).startswith("error: the rollout service stopped")
    assert "EngineDeadError" in error_line(output)
    assert not (run / "summary.json").exists()


def test_a_full_disk_or_a_tracking_server_failing_mid_run_is_one_error_line():
    import errno

    from mlflow.exceptions import MlflowException

    from lightning_agentrl.__main__ import _dependency_failure
    from lightning_agentrl.settings import load_settings

    settings = load_settings(overrides=["--run.dir=/tmp/some-run"])
    try:  # torch's writer wraps the OSError as a RuntimeError, as on a full disk
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos") from inner
    except RuntimeError as err:
        assert _dependency_failure(err, settings).startswith("run.dir: no space left for /tmp/some-run")
    assert _dependency_failure(MlflowException("API request to runs/get failed"), settings).startswith(
        "tracking.uri: the tracking server failed during the run (MlflowException: API request")
    assert _dependency_failure(KeyError("a bug"), settings) is None  # a bug keeps its traceback


def test_a_gradient_that_is_not_finite_stops_the_run_before_it_reaches_the_weights(tmp_path):
    """A weight turned NaN before the second step (what an overflow in the forward pass does) makes that step's
    gradient norm NaN: the run stops there (exit 3 on the command line) with a line naming the step and the
    settings to look at, takes no optimizer step, and the checkpoint it leaves is finite."""
    import lightning as L
    import torch

    from lightning_agentrl.module import NonFiniteGradient
    from tests.fitting import SOLVE, learn_settings, scripted_fit

    class Poison(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 1:
                with torch.no_grad():
                    pl_module.policy.get_input_embeddings().weight[:, 0] = float("nan")

    settings = learn_settings(tmp_path, "--trainer.max_steps=3")
    with pytest.raises(NonFiniteGradient, match=r"step 1: the gradient norm is nan \(no optimizer step\)") as err:
        scripted_fit(settings, {"e0": SOLVE}, callbacks=[Poison()])
    assert err.value.exit_status == 3 and "trainer.lr" in str(err.value)
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert state and all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())
