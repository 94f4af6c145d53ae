"""A dead dependency or a bad input stops a run with one clear error line, never a run that trains on
nothing. Real processes and real servers, no mocks."""

from __future__ import annotations

import os
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
    assert seconds < 30
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_fit_with_an_unreachable_tracking_server_stops_in_seconds(tmp_path):
    done, seconds = cli("fit", "--config", "configs/smoke.yaml", f"--run.dir={tmp_path / 'run'}",
                        f"--tracking.uri={DEAD}")
    assert done.returncode == 2, done.stderr[-3000:]
    assert error_line(done.stderr).startswith(f"error: tracking.uri: the MLflow server at {DEAD} is unreachable")
    assert seconds < 30


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
