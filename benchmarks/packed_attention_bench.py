"""Packed attention: length buckets vs the whole pack under one ``[n, n]`` block mask.

    python benchmarks/packed_attention_bench.py [--segments 16,64] [--length 195] [--threads 1]

For each segment count, ``segments`` sequences of ``length`` tokens are packed into one
micro-batch of the tiny model (sdpa) and run forward + backward both ways; the best of 3 repeats
is reported with the speedup and the largest difference of the hidden states. Writes
benchmarks/results/packed_attention/packed_attention.json and prints one summary line.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from benchmarks.record import write_record
from lightning_agentrl.models.packed import block_mask_hidden_states, packed_hidden_states
from lightning_agentrl.models.tiny import build_tiny_model

RESULTS = Path(__file__).resolve().parent / "results" / "packed_attention" / "packed_attention.json"


def best_seconds(hidden_states, *args, repeats: int = 3) -> tuple[float, torch.Tensor]:
    times, out = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        out = hidden_states(*args)
        out.sum().backward()
        times.append(time.perf_counter() - started)
    return min(times), out.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segments", default="16,64")
    parser.add_argument("--length", type=int, default=195)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(".cache/lightning_agentrl"), attn_implementation="sdpa")
    decoder = model.float().get_decoder()
    rows = []
    for count in (int(c) for c in args.segments.split(",")):
        n = count * args.length
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(args.length).repeat(count)
        segments = torch.arange(count).repeat_interleave(args.length)
        block_s, block = best_seconds(block_mask_hidden_states, decoder, ids, positions, segments)
        bucket_s, bucket = best_seconds(packed_hidden_states, decoder, ids, positions, segments)
        rows.append({"segments": count, "length": args.length, "block_mask_s": round(block_s, 3),
                     "buckets_s": round(bucket_s, 3), "speedup": round(block_s / bucket_s, 1),
                     "max_abs_diff": float((block - bucket).abs().max())})
    write_record(RESULTS, config=None, overrides=None, seed=None, record={"machine": platform.processor() or platform.machine(), "threads": args.threads,
                           "rows": rows})
    print("packed attention, forward+backward: " + "; ".join(
        f"{r['segments']}x{r['length']} tokens {r['block_mask_s']} s -> {r['buckets_s']} s ({r['speedup']}x)"
        for r in rows))


if __name__ == "__main__":
    main()
