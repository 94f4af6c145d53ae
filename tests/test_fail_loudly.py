"""A dead dependency or a bad input stops a run with one clear error line, never a run that trains on
nothing. Real processes and real servers, no mocks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_agentrl.__main__ import main

REPO = Path(__file__).resolve().parent.parent
DEAD = "http://127.0.0.1:9"  # the discard port: nothing listens there


def cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
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
    done, seconds = cli("fit", "--config", "tests/fixtures/tiny_bugfix.yaml", f"--run.dir={tmp_path / 'run'}",
                        f"--sandbox.url={DEAD}", "--sandbox.token=x", "--trainer.max_steps=3")
    assert done.returncode == 2, done.stderr[-3000:]
    assert error_line(done.stderr).startswith(f"error: sandbox.url: the sandbox service at {DEAD} does not answer")
    assert "Traceback" not in done.stderr
    assert seconds < 120  # vs 200 s of retries before; imports dominate (a minute on a loaded machine)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_fit_with_an_unreachable_tracking_server_stops_in_seconds(tmp_path):
    done, seconds = cli("fit", "--config", "tests/fixtures/tiny_bugfix.yaml", f"--run.dir={tmp_path / 'run'}",
                        f"--tracking.uri={DEAD}")
    assert done.returncode == 2, done.stderr[-3000:]
    assert error_line(done.stderr).startswith(f"error: tracking.uri: the MLflow server at {DEAD} is unreachable")
    assert seconds < 120  # vs 200 s of retries before; imports dominate (a minute on a loaded machine)


def _serve(handler) -> tuple:
    """A threaded HTTP server on loopback answering with ``handler``: (server, base URL)."""
    import threading
    from http.server import ThreadingHTTPServer

    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


class _HealthOnlyServer:
    """An HTTP server that answers ``/health`` (200) and, on every other path, hangs, or answers 404 or 500:
    what a proxy in front of a dead MLflow, or another service on its port, looks like."""

    def __init__(self, other: str, *, search_answers: bool = False) -> None:
        from http.server import BaseHTTPRequestHandler

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                if search_answers and self.path.startswith("/api/2.0/mlflow/experiments/search"):
                    self.answer(200, b'{"experiments": []}')
                elif self.path == "/health":
                    self.answer(200, b"OK")
                elif other == "hang":
                    time.sleep(3600)
                else:
                    self.answer(int(other), b"{}")

            def answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_GET  # noqa: N815

            def log_message(self, *args):
                pass

        self.server, self.url = _serve(Handler)


def test_fit_with_a_tracking_server_that_answers_only_its_health_call_stops_in_seconds(tmp_path):
    hanging = _HealthOnlyServer("hang")
    done, seconds = cli("fit", "--config", "tests/fixtures/tiny_bugfix.yaml", f"--run.dir={tmp_path / 'run'}",
                        f"--tracking.uri={hanging.url}")
    assert done.returncode == 2, done.stderr[-3000:]
    assert error_line(done.stderr).startswith(
        f"error: tracking.uri: the MLflow server at {hanging.url} does not answer GET /api/2.0/mlflow/experiments/search "
        f"within 5 s")
    assert "Traceback" not in done.stderr
    assert seconds < 120  # vs minutes of MLflow retries in the first MLflow call; imports dominate
    assert not (tmp_path / "run" / "mlflow_run_id.txt").exists()
    start = time.monotonic()  # the check alone, without the imports: its 5 s deadline
    assert main(["validate", "--config", "tests/fixtures/tiny_bugfix.yaml", f"--tracking.uri={hanging.url}"]) == 2
    assert time.monotonic() - start < 15


def test_a_tracking_server_that_fails_after_the_start_up_check_is_one_error_line(tmp_path):
    failing = _HealthOnlyServer("500", search_answers=True)  # passes the check, then fails every call
    done, _ = cli("fit", "--config", "tests/fixtures/tiny_bugfix.yaml", f"--run.dir={tmp_path / 'run'}",
                  f"--tracking.uri={failing.url}", env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})  # the test's time
    assert done.returncode == 2, done.stderr[-3000:]
    assert error_line(done.stderr).startswith(f"error: tracking.uri: recording the run in {failing.url} failed: ")
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("status", ["404", "500"])
def test_a_tracking_uri_whose_api_fails_is_named(status, capsys):
    server = _HealthOnlyServer(status)
    assert main(["validate", "--config", "tests/fixtures/tiny_bugfix.yaml", f"--tracking.uri={server.url}"]) == 2
    assert error_line(capsys.readouterr().err).startswith(
        f"error: tracking.uri: {server.url} answered HTTP {status} to GET /api/2.0/mlflow/experiments/search")


def test_check_health_names_every_server_of_a_fleet_that_does_not_answer():
    from lightning_agentrl.preflight import PreflightError, check_health

    live, broken = _HealthOnlyServer("404"), _HealthOnlyServer("500")
    check_health("engine.server_urls", [live.url, live.url + "/"])
    with pytest.raises(PreflightError) as raised:
        check_health("engine.server_urls", [live.url, DEAD, broken.url], path="/v1/models", timeout_s=2)
    message = str(raised.value)
    assert message.startswith("engine.server_urls: 3 of 3 servers do not answer GET /v1/models within 2 s: ")
    assert f"{DEAD} (ConnectError" in message and f"{live.url} (HTTP 404)" in message
    with pytest.raises(PreflightError, match=r"^engine.server_urls: 1 of 2 servers .*: http://127.0.0.1:9 "):
        check_health("engine.server_urls", [live.url, DEAD])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("--model.path=/nonexistent/model", "error: model.path: no such folder: /nonexistent/model"),
        ("--model.path=README.md", "error: model.path: README.md is a file"),
        ("--model.path=tasks", "error: model.path: tasks has no config.json"),
        ("--model.path=not a/model id", "error: model.path: 'not a/model id' is neither a local folder nor a hub id"),
        ("--env.tasks=/nonexistent", "error: env.tasks: no such file or folder: /nonexistent"),
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
    status = main(["validate", "--config", "tests/fixtures/tiny_bugfix.yaml", *_split(override)])
    assert status == 2
    assert error_line(capsys.readouterr().err).startswith(expected)


def _split(override: str) -> list[str]:
    return ["--" + part if i else part for i, part in enumerate(override.split(" --"))]


def test_validate_offline_skips_the_network_checks_only(capsys):
    args = ["validate", "--config", "tests/fixtures/tiny_bugfix.yaml", f"--sandbox.url={DEAD}", "--sandbox.token=x"]
    assert main([*args, "--offline"]) == 0
    assert main([*args, "--offline", "--env.tasks=/nonexistent"]) == 2
    assert "env.tasks" in capsys.readouterr().err


def test_a_live_sandbox_service_that_refuses_the_token_is_named(capsys):
    from sandbox_server.launch import start_local_server

    with start_local_server() as server:
        args = ["validate", "--config", "tests/fixtures/tiny_bugfix.yaml", f"--sandbox.url={server.url}"]
        assert main([*args, f"--sandbox.token={server.token}"]) == 0
        capsys.readouterr()
        assert main([*args, "--sandbox.token=wrong"]) == 2
    assert error_line(capsys.readouterr().err).startswith(f"error: sandbox.token: the sandbox service at {server.url} refused it")


def test_a_sandbox_service_whose_judge_shares_the_agents_uid_is_refused_unless_warned(capsys, tmp_path):
    from sandbox_server.launch import start_local_server

    # A server that keeps one uid for everything (what a server not run as root gives).
    with start_local_server(sandbox_uid=-1, allow_root_commands=True) as server:
        args = ["validate", "--config", "tests/fixtures/tiny_bugfix.yaml", f"--sandbox.url={server.url}",
                f"--sandbox.token={server.token}", "--sandbox.judge_isolation=require"]
        assert main(args) == 2
        assert error_line(capsys.readouterr().err).startswith(
            f"error: sandbox.judge_isolation: the sandbox service at {server.url} runs the judge that holds the "
            "hidden tests under the agent's own uid")
        with pytest.warns(UserWarning, match="sandbox.judge_isolation=warn: .* an agent can read the tests"):
            assert main([*args, "--sandbox.judge_isolation=warn"]) == 0
        # An environment whose reward does not come from the service's judge is not held to it.
        assert main(["validate", "--config", "configs/keydoor.yaml", *args[3:]]) == 0, capsys.readouterr().err
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        fit = [sys.executable, "-m", "lightning_agentrl", "fit", *args[1:], *SMALL, "--trainer.max_steps=1"]
        done = subprocess.run([*fit, f"--run.dir={tmp_path / 'refused'}"], capture_output=True, text=True,
                              timeout=300, cwd=REPO, env=env)
        warned = subprocess.run([*fit, f"--run.dir={tmp_path / 'warned'}", "--sandbox.judge_isolation=warn"],
                                capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert error_line(done.stderr).startswith("error: sandbox.judge_isolation: ")
    assert not (tmp_path / "refused" / "checkpoints").exists()
    # warn: the run trains on that service, and says why its rewards are not to be trusted.
    assert warned.returncode == 0, warned.stderr[-2000:]
    assert "sandbox.judge_isolation=warn: the sandbox service at" in warned.stderr
    assert list((tmp_path / "warned" / "checkpoints").glob("*.ckpt"))


# -- during the run --------------------------------------------------------------------------------
SMALL = ["--engine.max_new_tokens=24", "--env.max_turns=2", "--trainer.threads=1"]


def start_fit(run_dir: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0"}
    return subprocess.Popen(
        [sys.executable, "-m", "lightning_agentrl", "fit", "--config", "tests/fixtures/tiny_bugfix.yaml", f"--run.dir={run_dir}",
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
    assert "last error: SandboxUnreachable:" in line and "unreachable" in line
    assert f"Checkpoint: {run / 'checkpoints' / 'last.ckpt'} (step 1)" in line
    assert not any(line.startswith("done") for line in output.splitlines()) and not (run / "summary.json").exists()
    import torch

    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 1


class _HangingSandbox:
    """A sandbox service that answers its health call and never anything else: a run that waits forever."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler

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

        self.server, self.url = _serve(Handler)


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_run_stuck_on_a_hanging_service_ends_on_a_signal_with_a_checkpoint(tmp_path, signum, status):
    hanging = _HangingSandbox()
    run = tmp_path / "run"
    process = start_fit(run, f"--sandbox.url={hanging.url}", "--sandbox.token=x", "--sandbox.request_timeout_s=3600",
                        "--sandbox.call_timeout_s=3600")
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
    args = ["validate", "--config", "tests/fixtures/tiny_bugfix.yaml", "--model.path=no-such-org/no-such-model"]
    assert main(args) == 2
    assert error_line(capsys.readouterr().err).startswith(
        f"error: model.path: no-such-org/no-such-model is not a local folder nor in the hub cache, and the hub ({DEAD}) is unreachable"
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(args) == 2
    assert "HF_HUB_OFFLINE is set" in capsys.readouterr().err
    assert main([*args, "--offline"]) == 0


# -- incomplete model folders ----------------------------------------------------------------------
def _model_folder(tmp_path: Path, tiny_model_path: Path, *names: str) -> Path:
    import shutil

    folder = tmp_path / "model"
    folder.mkdir()
    for name in names:
        shutil.copy(tiny_model_path / name, folder / name)
    return folder


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (["config.json"], "has no tokenizer (tokenizer.json, tokenizer.model, vocab.json, tokenizer_config.json)"),
        (["config.json", "tokenizer.json", "tokenizer_config.json"], "has no weights (*.safetensors, pytorch_model*.bin"),
        (["config.json", "tokenizer.json", "model.safetensors.index.json"],
         "lacks 1 of the 2 weight shards model.safetensors.index.json names: model-00002-of-00002.safetensors"),
    ],
)
def test_an_incomplete_model_folder_is_named_before_any_model_loads(tmp_path, tiny_model_path, files, expected, capsys):
    import json
    import shutil

    if "model.safetensors.index.json" in files:  # a sharded checkpoint whose second shard never arrived
        index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                 "b": "model-00002-of-00002.safetensors"}}
        folder = _model_folder(tmp_path, tiny_model_path, "config.json", "tokenizer.json")
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        shutil.copy(tiny_model_path / "model.safetensors", folder / "model-00001-of-00002.safetensors")
    else:
        folder = _model_folder(tmp_path, tiny_model_path, *files)
    assert main(["validate", "--config", "tests/fixtures/tiny_bugfix.yaml", f"--model.path={folder}", "--offline"]) == 2
    assert error_line(capsys.readouterr().err).startswith(f"error: model.path: {folder} {expected}")


def test_a_complete_model_folder_passes_and_vllm_needs_safetensors(tmp_path, tiny_model_path, capsys):
    args = ["validate", "--config", "tests/fixtures/tiny_bugfix.yaml", "--offline"]
    assert main([*args, f"--model.path={tiny_model_path}"]) == 0
    assert main([*args, f"--model.path={tiny_model_path}", "--engine.kind=vllm"]) == 0
    capsys.readouterr()
    folder = _model_folder(tmp_path, tiny_model_path, "config.json", "tokenizer.json", "tokenizer_config.json",
                          "chat_template.jinja")
    (folder / "pytorch_model.bin").write_bytes(b"")  # the name is what counts here
    assert main([*args, f"--model.path={folder}"]) == 0
    assert main([*args, f"--model.path={folder}", "--engine.kind=vllm"]) == 2
    assert error_line(capsys.readouterr().err).startswith(
        f"error: model.path: {folder} has .bin weights only; engine.kind=vllm needs safetensors")


# -- a frozen sandbox service ----------------------------------------------------------------------
@pytest.fixture
def frozen_url():
    """A socket that takes connections (the kernel's backlog) and never answers: a frozen service."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_a_call_to_a_frozen_service_ends_within_call_timeout_whatever_the_retries(frozen_url):
    import asyncio

    from sandbox_client import SandboxClient, SandboxInfraError

    async def create() -> None:
        async with SandboxClient(frozen_url, "x", timeout_s=0.5, call_timeout_s=1.5, max_retries=4) as client:
            await client.create({"a.py": ""})

    start = time.monotonic()
    with pytest.raises(SandboxInfraError, match=r"unreachable after \d attempts within call_timeout_s=1.5 s: ReadTimeout"):
        asyncio.run(create())
    assert 1.4 <= time.monotonic() - start < 3  # not (max_retries + 1) x timeout_s and backoffs


def test_with_default_settings_a_frozen_service_ends_an_episode_within_a_minute():
    from lightning_agentrl.settings import Settings

    settings = Settings()
    s, env = settings.sandbox, settings.env
    # the pending call (a command's timeout on top), then the cleanup delete (one attempt): sandbox.call_timeout_s
    worst_episode_s = s.call_timeout_s + env.tool_timeout_s + s.request_timeout_s
    assert worst_episode_s <= 60, worst_episode_s
    with pytest.raises(Exception, match=r"sandbox.call_timeout_s \(5\) must be >= sandbox.request_timeout_s \(10\)"):
        Settings(sandbox={"call_timeout_s": 5})


def test_a_sandbox_service_frozen_mid_run_trips_the_breaker_within_its_timeouts(tmp_path):
    from sandbox_server.launch import start_local_server

    run = tmp_path / "run"
    with start_local_server() as server:
        process = start_fit(run, f"--sandbox.url={server.url}", f"--sandbox.token={server.token}",
                            "--trainer.max_steps=4", "--sandbox.request_timeout_s=3", "--sandbox.call_timeout_s=5",
                            "--env.tool_timeout_s=5")
        wait_for(run / "trajectories" / "step_000000.jsonl", process)
        os.kill(server.process.pid, signal.SIGSTOP)  # it keeps its socket: connections queue, nothing answers
        frozen_at = time.monotonic()
        try:
            output, _ = process.communicate(timeout=300)
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
    seconds = time.monotonic() - frozen_at
    assert process.returncode == 3, output[-3000:]
    line = error_line(output)
    assert line.startswith("error: the sandbox service failed: every episode of the step (8) ended with sandbox_error;")
    assert "within call_timeout_s=" in line and "ReadTimeout" in line
    assert "Checkpoint: " in line and not (run / "summary.json").exists()
    # one step of episodes, each ending within call + tool timeouts (10 s) and a 3 s delete; the rest is the
    # training step and the checkpoint on a loaded machine. Before: 5 attempts x 60 s per call.
    assert seconds < 90, seconds


def test_with_on_infra_failure_wait_a_sigterm_ends_the_wait_with_a_checkpoint(tmp_path):
    from sandbox_server.launch import start_local_server

    run = tmp_path / "run"
    with start_local_server() as server:
        process = start_fit(run, f"--sandbox.url={server.url}", f"--sandbox.token={server.token}",
                            "--trainer.max_steps=3", "--rollout.on_infra_failure=wait", "--rollout.infra_wait_s=600")
        wait_for(run / "trajectories" / "step_000000.jsonl", process)
        server.stop()
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "waiting up to 600 s for it to answer" in line:
            break
    start = time.monotonic()
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    output = "".join(lines) + output
    assert process.returncode == 143, output[-3000:]
    assert time.monotonic() - start < 30  # the wait ends at once, not after trainer.stop_grace_s (120 s)
    last = run / "checkpoints" / "last.ckpt"
    assert f"stopped by SIGTERM at step 1, checkpoint {last}; continue with --resume last" in output
    import torch

    assert torch.load(last, weights_only=False)["global_step"] == 1


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


def test_a_config_json_that_is_not_json_is_one_error_line(tmp_path, tiny_model_path, capsys):
    folder = _model_folder(tmp_path, tiny_model_path, "tokenizer.json", "tokenizer_config.json", "model.safetensors")
    (folder / "config.json").write_text('{"model_type": "llama", ')
    assert main(["validate", "--config", "tests/fixtures/tiny_bugfix.yaml", "--offline", f"--model.path={folder}"]) == 2
    assert error_line(capsys.readouterr().err).startswith(f"error: model.path: {folder} has a config.json that is not JSON")


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


@pytest.mark.parametrize("health", [
    {"isolation": {"enforced": {"judge_uid_per_sandbox": None}}},
    {"isolation": {"enforced": {"judge_uid_per_sandbox": False}}},
    {"isolation": {"enforced": {"judge_uid_per_sandbox": ""}}},
    {"isolation": {"enforced": {"judge_uid_per_sandbox": 0}}},
    {"isolation": {"enforced": []}},
    {"isolation": "none"},
    {},
])
def test_judge_isolation_is_accepted_only_when_the_service_says_how(health):
    from lightning_agentrl.preflight import PreflightError, check_judge_isolation

    with pytest.raises(PreflightError, match="^sandbox.judge_isolation: the service runs the judge"):
        check_judge_isolation(health, "require", where="the service")
    assert check_judge_isolation({"isolation": {"enforced": {"judge_uid_per_sandbox": "uids 10..19"}}},
                                 "require", where="the service")
