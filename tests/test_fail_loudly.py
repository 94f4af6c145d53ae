"""A dead dependency or a bad input stops a run with one clear error line, never a run that trains on
nothing. Real processes and real servers, no mocks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_agentrl.__main__ import main

REPO = Path(__file__).resolve().parent.parent
DEAD = "http://127.0.0.1:9"  # the discard port: nothing listens there


def cli(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "lightning_agentrl", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - start


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


# -- start-up checks -------------------------------------------------------------------------------
def test_fit_with_an_unreachable_sandbox_service_stops_in_seconds_before_any_model_loads(tmp_path):
    done, seconds = cli("fit", "--config", "configs/smoke.yaml", f"--run.dir={tmp_path / 'run'}",
                        f"--sandbox.url={DEAD}", "--sandbox.token=x", "--trainer.max_steps=3")
    assert done.returncode == 2, done.stderr[-3000:]
    assert error_line(done.stderr).startswith(f"error: sandbox.url: the sandbox service at {DEAD} does not answer")
    assert "Traceback" not in done.stderr
    assert seconds < 60  # vs 200 s of retries before; imports dominate on a loaded machine
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_fit_with_an_unreachable_tracking_server_stops_in_seconds(tmp_path):
    done, seconds = cli("fit", "--config", "configs/smoke.yaml", f"--run.dir={tmp_path / 'run'}",
                        f"--tracking.uri={DEAD}")
    assert done.returncode == 2, done.stderr[-3000:]
    assert error_line(done.stderr).startswith(f"error: tracking.uri: the MLflow server at {DEAD} is unreachable")
    assert seconds < 60  # vs 200 s of retries before; imports dominate on a loaded machine


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("--model.path=/nonexistent/model", "error: model.path: no such folder: /nonexistent/model"),
        ("--model.path=README.md", "error: model.path: README.md is a file"),
        ("--model.path=tasks", "error: model.path: tasks has no config.json"),
        ("--model.path=not a/model id", "error: model.path: 'not a/model id' is neither a local folder nor a hub id"),
        ("--env.tasks=/nonexistent", "error: env.tasks: no such folder: /nonexistent"),
        ("--env.tasks=configs", "error: env.tasks: configs: no task folders"),
        ("--env.tasks=tasks/bugfix/binary_search_first --env.split=test",
         "error: env.split: no test tasks in tasks/bugfix/binary_search_first"),
        ("--eval.every_n_steps=1 --eval.split=test --env.split=all --env.tasks=tasks/bugfix/binary_search_first",
         "error: eval.split: no test tasks in tasks/bugfix/binary_search_first"),
        (f"--sandbox.url={DEAD}", "error: sandbox.token: sandbox.url is set but no token is"),
        (f"--sandbox.url={DEAD} --sandbox.token=x", f"error: sandbox.url: the sandbox service at {DEAD}"),
        (f"--tracking.uri={DEAD}", f"error: tracking.uri: the MLflow server at {DEAD} is unreachable"),
        ("--tracking.uri=sqlite:////nonexistent/dir/mlflow.db",
         "error: tracking.uri: the folder of the sqlite store does not exist: /nonexistent/dir"),
    ],
)
def test_validate_names_the_setting_of_a_bad_input_or_a_dead_service(override, expected, capsys):
    status = main(["validate", "--config", "configs/smoke.yaml", *_split(override)])
    assert status == 2
    assert error_line(capsys.readouterr().err).startswith(expected)


def _split(override: str) -> list[str]:
    return ["--" + part if i else part for i, part in enumerate(override.split(" --"))]


def test_validate_offline_skips_the_network_checks_only(capsys):
    args = ["validate", "--config", "configs/smoke.yaml", f"--sandbox.url={DEAD}", "--sandbox.token=x"]
    assert main([*args, "--offline"]) == 0
    assert main([*args, "--offline", "--env.tasks=/nonexistent"]) == 2
    assert "env.tasks" in capsys.readouterr().err


def test_a_live_sandbox_service_that_refuses_the_token_is_named(capsys):
    from sandbox_server.launch import start_local_server

    with start_local_server() as server:
        args = ["validate", "--config", "configs/smoke.yaml", f"--sandbox.url={server.url}"]
        assert main([*args, f"--sandbox.token={server.token}"]) == 0
        capsys.readouterr()
        assert main([*args, "--sandbox.token=wrong"]) == 2
    assert error_line(capsys.readouterr().err).startswith(f"error: sandbox.token: the sandbox service at {server.url} refused it")


# -- during the run --------------------------------------------------------------------------------
SMALL = ["--engine.max_new_tokens=24", "--env.max_turns=2", "--trainer.threads=1"]


def start_fit(run_dir: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0"}
    return subprocess.Popen(
        [sys.executable, "-m", "lightning_agentrl", "fit", "--config", "configs/smoke.yaml", f"--run.dir={run_dir}",
         *SMALL, *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"{path} never appeared: {process.poll()}"


def summary_step(run_dir: Path) -> int:
    import json

    return json.loads((run_dir / "summary.json").read_text())["global_step"]


def test_sandbox_service_killed_mid_run_trips_the_breaker_with_a_checkpoint(tmp_path):
    from sandbox_server.launch import start_local_server

    run = tmp_path / "run"
    with start_local_server() as server:
        process = start_fit(run, f"--sandbox.url={server.url}", f"--sandbox.token={server.token}",
                            "--trainer.max_steps=4")
        wait_for(run / "trajectories" / "step_000000.jsonl", process)  # step 1's groups wait for its weights
        server.stop()
        output, _ = process.communicate(timeout=300)
    assert process.returncode == 3, output[-3000:]
    line = error_line(output)
    assert line.startswith("error: the sandbox service failed: every episode of the step (8) ended with sandbox_error;")
    assert "last error: SandboxInfraError:" in line and "unreachable" in line
    assert f"Checkpoint: {run / 'checkpoints' / 'last.ckpt'} (step 1)" in line
    assert "done" not in output and not (run / "summary.json").exists()
    import torch

    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 1


class _HangingSandbox:
    """A sandbox service that answers its health call and never anything else: a run that waits forever."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                if self.path != "/v1/health":
                    time.sleep(3600)
                body = b'{"status": "ok"}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):  # noqa: N802
                time.sleep(3600)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_run_stuck_on_a_hanging_service_ends_on_a_signal_with_a_checkpoint(tmp_path, signum, status):
    hanging = _HangingSandbox()
    run = tmp_path / "run"
    process = start_fit(run, f"--sandbox.url={hanging.url}", "--sandbox.token=x", "--sandbox.request_timeout_s=3600")
    wait_for(run / "mlflow_run_id.txt", process)
    time.sleep(8)  # trainer.fit is running, the trainer waits for rollouts that never come
    start = time.monotonic()
    process.send_signal(signum)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == status, output[-3000:]
    assert time.monotonic() - start < 60
    assert f"stopped by {signal.Signals(signum).name} at step 0, checkpoint {run / 'checkpoints' / 'last.ckpt'}; continue with --resume last" in output
    assert (run / "checkpoints" / "last.ckpt").exists()


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
        [sys.executable, "-c", script, "fit", "--config", "configs/smoke.yaml", f"--run.dir={run}", *SMALL,
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


# -- signals and checkpoints -----------------------------------------------------------------------
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
    refused, _ = cli("fit", "--config", "configs/smoke.yaml", f"--run.dir={stopped}", *SMALL, *args, "--resume", "last")
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


def test_a_truncated_last_ckpt_resumes_from_the_newest_intact_step_checkpoint(tmp_path):
    run = tmp_path / "run"
    process = start_fit(run, "--trainer.max_steps=1")
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-3000:]
    truncate(run / "checkpoints" / "last.ckpt")
    process = start_fit(run, "--trainer.max_steps=2", "--resume", "last")
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-3000:]
    assert f"{run / 'checkpoints' / 'last.ckpt'} is not usable (truncated" in output
    assert f"resuming from {run / 'checkpoints' / 'step_step=1.ckpt'} instead" in output
    assert summary_step(run) == 2


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


def test_with_on_infra_failure_wait_the_run_waits_for_the_service_and_finishes(tmp_path):
    from sandbox_server.launch import start_local_server

    run = tmp_path / "run"
    server = start_local_server()
    process = start_fit(run, f"--sandbox.url={server.url}", f"--sandbox.token={server.token}", "--trainer.max_steps=3",
                        "--rollout.on_infra_failure=wait", "--rollout.infra_wait_s=120")
    wait_for(run / "trajectories" / "step_000000.jsonl", process)
    port = int(server.url.rsplit(":", 1)[1])
    server.stop()
    time.sleep(15)  # step 1's episodes fail; the breaker waits
    with start_local_server(port=port, token=server.token):
        output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-3000:]
    assert "waiting up to 120 s for it to answer (rollout.on_infra_failure=wait)" in output
    assert summary_step(run) == 3


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


def test_the_breaker_trips_on_a_share_over_a_full_window_or_a_step_that_failed_whole():
    import doctest

    from lightning_agentrl.callbacks import circuit_breaker

    assert doctest.testmod(circuit_breaker, raise_on_error=False, verbose=False).failed == 0
    window = circuit_breaker.SandboxErrorWindow(size=8, max_error_frac=0.5)
    for _ in range(20):  # one dead server of four behind the fleet's URL, for a long time
        assert window.add([(1, 4), (1, 4)]) is None


def test_a_local_sandbox_server_that_cannot_start_is_a_settings_error(tmp_path):
    from lightning_agentrl.distributed import NodeSandbox
    from lightning_agentrl.preflight import PreflightError

    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    sandbox = NodeSandbox(None, None, timeout_s=5, max_retries=0, log_dir=not_a_folder)
    with pytest.raises(PreflightError, match=r"^sandbox.url: unset, so the reference sandbox server .* did not come up"):
        sandbox.start()


def test_a_hub_id_that_is_not_cached_needs_a_reachable_hub(monkeypatch, capsys):
    monkeypatch.setenv("HF_ENDPOINT", DEAD)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    args = ["validate", "--config", "configs/smoke.yaml", "--model.path=no-such-org/no-such-model"]
    assert main(args) == 2
    assert error_line(capsys.readouterr().err).startswith(
        f"error: model.path: no-such-org/no-such-model is not a local folder nor in the hub cache, and the hub ({DEAD}) is unreachable"
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(args) == 2
    assert "HF_HUB_OFFLINE is set" in capsys.readouterr().err
    assert main([*args, "--offline"]) == 0
