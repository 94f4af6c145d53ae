"""TorchEngine vs VLLMEngine on the smoke workload's generation pattern, tiny model (or ``--model``).

    python benchmarks/engine_compare.py [--episodes 8] [--turns 3] [--new-tokens 48] [--engines torch,vllm]
    python benchmarks/engine_compare.py --model smollm2-135m-instruct --threads 1   # the named 135M model

Each of ``episodes`` concurrent episodes runs ``turns`` turns: all episodes ask for an action at
once (``new-tokens`` sampled ids, no early stop, a per-request seed), then each context grows by
its action plus a fixed observation, as in the agent loop. Reported per engine: startup seconds
(construction + one 1-token warm-up request) and generated tokens per second over the whole
workload. vLLM is skipped (reported as such) when ``vllm`` does not import. Both engines run in float32
(the product's default ``model.dtype``) with ``--threads`` torch threads (the machine's default when unset);
vLLM's KV cache is sized to hold every episode at its longest context, as ``fit`` sizes it. Writes
benchmarks/results/engine_compare/engine_compare.json (``engine_compare_<model>.json`` for another
``--model``) and prints one summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path

from benchmarks.record import write_record
from lightning_agentrl.rollout.engine import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "engine_compare" / "engine_compare.json"
CACHE_DIR = ".cache/lightning_agentrl"
OBSERVATION = "exit code 1\nFAILED test_visible.py::test_first - assert -1 == 1\n"


def model_folder(model: str) -> Path:
    """The local HF folder of a ``model.path``, as ``fit`` resolves it (a named model converted once)."""
    from lightning_agentrl.models.resolve import resolve_model_path
    from lightning_agentrl.settings import load_settings

    return Path(resolve_model_path(load_settings(None, [f"--model.path={model}", f"--model.cache_dir={CACHE_DIR}"])))


def make_engine(kind: str, model_path: Path, tokenizer, max_model_len: int, episodes: int):
    if kind == "torch":
        import torch
        from transformers import AutoModelForCausalLM

        from lightning_agentrl.rollout.engine import TorchEngine

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        return TorchEngine(model, pad_token_id=tokenizer.eos_token_id)
    from lightning_agentrl.rollout import vllm_engine

    per_token = vllm_engine.kv_bytes_per_token(json.loads((model_path / "config.json").read_text()), 4)
    kv_bytes = vllm_engine.kv_cache_bytes_for(episodes, max_model_len, per_token)
    return vllm_engine.VLLMEngine(str(model_path), max_model_len=max_model_len, kv_cache_memory_bytes=kv_bytes)


async def run_workload(engine, prompts: list[list[int]], observation: list[int], turns: int, new_tokens: int) -> int:
    contexts = [list(p) for p in prompts]
    generated = 0
    for turn in range(turns):
        requests = [
            engine.generate(ctx, SamplingParams(max_new_tokens=new_tokens, seed=1000 * i + turn), f"episode-{i}")
            for i, ctx in enumerate(contexts)
        ]
        for ctx, generation in zip(contexts, await asyncio.gather(*requests), strict=True):
            generated += len(generation.token_ids)
            ctx.extend(generation.token_ids + observation)
    return generated


async def measure(kind: str, model_path: Path, tokenizer, args) -> dict:
    from lightning_agentrl.rollout.chat import ChatCodec

    codec = ChatCodec(tokenizer)
    prompts = [
        codec.prompt_ids([{"role": "system", "content": "You fix bugs."},
                          {"role": "user", "content": f"Task {i}: fix utils.py::parse_date. " * (1 + i % 4)}])
        for i in range(args.episodes)
    ]
    observation = codec.observation_ids(OBSERVATION).all
    max_len = max(map(len, prompts)) + args.turns * (args.new_tokens + len(observation)) + 8
    start = time.perf_counter()
    engine = make_engine(kind, model_path, tokenizer, max_len, args.episodes)
    await engine.generate(prompts[0], SamplingParams(max_new_tokens=1, seed=0), "warm-up")
    startup_s = time.perf_counter() - start
    start = time.perf_counter()
    generated = await run_workload(engine, prompts, observation, args.turns, args.new_tokens)
    elapsed = time.perf_counter() - start
    await engine.close()
    return {"startup_s": round(startup_s, 2), "tokens": generated, "seconds": round(elapsed, 3),
            "tokens_per_s": round(generated / elapsed, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--engines", default="torch,vllm")
    parser.add_argument("--model", default="tiny", help="model.path: tiny (default) or e.g. smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of both engines (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # vLLM's CPU worker sets its own threads from it
    from transformers import AutoTokenizer

    model_path = model_folder(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    results: dict[str, dict] = {}
    load_before = round(os.getloadavg()[0], 2)
    for kind in args.engines.split(","):
        if kind == "vllm":
            try:
                import vllm  # noqa: F401
            except Exception as err:  # not installed, or installed without a usable backend
                results[kind] = {"skipped": f"vllm does not import: {type(err).__name__}: {err}"}
                continue
        results[kind] = asyncio.run(measure(kind, model_path, tokenizer, args))
    record = {"workload": vars(args), "host": platform.platform(), "cores": len(os.sched_getaffinity(0)),
              "load_avg_1min": {"before": load_before, "after": round(os.getloadavg()[0], 2)}, "engines": results}
    out = RESULTS if args.model == "tiny" else RESULTS.with_name(f"engine_compare_{Path(args.model).name.split('-')[0]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_record(out, record, config=None, overrides=None, seed=None)
    parts = [
        f"{kind}: {r['tokens_per_s']} tok/s, startup {r['startup_s']} s" if "tokens_per_s" in r else f"{kind}: skipped"
        for kind, r in results.items()
    ]
    print(f"engine_compare ({args.episodes} episodes x {args.turns} turns x {args.new_tokens} tokens): " + "; ".join(parts))


if __name__ == "__main__":
    main()
