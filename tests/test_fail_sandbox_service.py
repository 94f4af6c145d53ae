"""The sandbox service failing during a run (killed, hanging, frozen, back again): the circuit breaker stops the
run with one error line and a checkpoint, or, with ``rollout.on_infra_failure=wait``, waits for it. Real
servers and processes, no mocks."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.failing import error_line, serve, start_fit, summary_step, wait_for


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

        self.server, self.url = serve(Handler)


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


def test_the_breaker_trips_on_a_share_over_a_full_window_or_a_step_that_failed_whole():
    import doctest

    from lightning_agentrl.callbacks import circuit_breaker

    assert doctest.testmod(circuit_breaker, raise_on_error=False, verbose=False).failed == 0
    window = circuit_breaker.SandboxErrorWindow(size=8, max_error_frac=0.5)
    for _ in range(20):  # one dead server of four behind the fleet's URL, for a long time
        assert window.add([(1, 4), (1, 4)]) is None


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
