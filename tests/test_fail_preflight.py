"""Start-up checks (lightning_agentrl/preflight.py): a dead or misconfigured service, or a bad input, stops
``fit`` and ``validate`` with one clear error line before any model loads. Real servers, no mocks."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from lightning_agentrl.__main__ import main
from tests.failing import DEAD, REPO, SMALL, cli, error_line, serve


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

        self.server, self.url = serve(Handler)


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


def test_a_live_sandbox_service_that_refuses_the_token_is_named(sandbox_server, capsys):
    server = sandbox_server
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


def test_a_local_sandbox_server_that_cannot_start_is_a_settings_error(tmp_path):
    from lightning_agentrl.distributed import NodeSandbox
    from lightning_agentrl.preflight import PreflightError

    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    sandbox = NodeSandbox(None, None, timeout_s=5, max_retries=0, log_dir=not_a_folder)
    with pytest.raises(PreflightError, match=r"^sandbox.url: unset, so the reference sandbox server .* did not come up"):
        sandbox.start()


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
