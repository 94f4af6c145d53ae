"""Shared prefixes: a GRPO micro-batch's prompts run once per group vs once per episode.

    python benchmarks/shared_prefix_bench.py [--groups 8] [--episodes 8] [--prompt 36] [--completion 38]
                                             [--repeats 3] [--threads 1] [--out PATH]

One micro-batch of ``groups x episodes`` segments, each a group's prompt then its own completion
(random tokens), through a randomly initialised decoder of SmolLM2-135M's shape (576 wide, 30
layers, 9 heads, 3 key/value heads, 1536 intermediate, sdpa), forward + backward, by
``packed_hidden_states`` with shared prefixes and with every segment whole (``min_shared_prefix=None``),
alternating, best of ``--repeats`` in wall and in CPU seconds (the
CPU time is the steadier on a loaded machine). The ideal ratio is the token count's, ``(G * prompt + G * E *
completion) / (G * E * (prompt + completion))``.

The decoder is not the whole training step: the log-probs of the completion tokens through the tied output
embedding (``token_logprobs``, ``fit``'s chunk of 256, the loss on the log-probs only, as without an entropy
bonus) cost the same in both arms. They are timed apart (``head_s``, forward + backward, best of the
repeats of both arms), and ``step_ratio`` is the step's: ``(shared_s + head_s) / (whole_s + head_s)``.
Writes benchmarks/results/shared_prefix/shared_prefix.json and prints one summary line.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaModel

from benchmarks.record import write_record
from lightning_agentrl.algorithms.logprobs import token_logprobs
from lightning_agentrl.models.packed import MIN_SHARED_PREFIX, packed_hidden_states

RESULTS = Path(__file__).resolve().parent / "results" / "shared_prefix" / "shared_prefix.json"
SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True)


def group_pack(groups: int, episodes: int, prompt: int, completion: int, vocab: int):
    """``input_ids, position_ids, segment_ids`` ``[n]``: each group's prompt opens its episodes."""
    g = torch.Generator().manual_seed(0)
    segments = [torch.cat([p, torch.randint(0, vocab, (completion,), generator=g)])
                for p in (torch.randint(0, vocab, (prompt,), generator=g) for _ in range(groups))
                for _ in range(episodes)]
    ids = torch.cat(segments)
    positions = torch.arange(prompt + completion).repeat(len(segments))
    segment_ids = torch.arange(len(segments)).repeat_interleave(prompt + completion)
    return ids, positions, segment_ids


def forward_backward_s(decoder, pack, targets, min_shared_prefix) -> tuple[float, float, float, float, torch.Tensor]:
    """Wall and CPU seconds of one forward + backward of the decoder, the same of the log-prob head at
    ``targets`` (stream positions of the completion tokens; ``hidden[t - 1]`` predicts token ``t``), and the
    states."""
    decoder.zero_grad(set_to_none=True)
    started, started_cpu = time.perf_counter(), time.process_time()
    hidden = packed_hidden_states(decoder, *pack, min_shared_prefix=min_shared_prefix)
    head_from, head_from_cpu = time.perf_counter(), time.process_time()
    detached = hidden.detach().requires_grad_()
    logprobs, _ = token_logprobs(detached[targets - 1], decoder.embed_tokens.weight, pack[0][targets], chunk_size=256)
    logprobs.sum().backward()
    head_s, head_cpu_s = time.perf_counter() - head_from, time.process_time() - head_from_cpu
    hidden.backward(detached.grad)
    return (time.perf_counter() - started - head_s, time.process_time() - started_cpu - head_cpu_s, head_s,
            head_cpu_s, hidden.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=36)
    parser.add_argument("--completion", type=int, default=38)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    decoder = LlamaModel(LlamaConfig(**SMOLLM2_135M, attn_implementation="sdpa")).float().train()
    pack = group_pack(args.groups, args.episodes, args.prompt, args.completion, decoder.config.vocab_size)
    length = args.prompt + args.completion
    targets = (torch.arange(args.groups * args.episodes)[:, None] * length
               + torch.arange(args.prompt, length)[None]).flatten()  # every completion token
    times: dict[str, list[float]] = {"whole": [], "shared": []}
    cpu_times: dict[str, list[float]] = {"whole": [], "shared": []}
    head_times: list[float] = []
    head_cpu_times: list[float] = []
    states = {}
    for _ in range(args.repeats):  # alternating, so that a load change hits both
        for arm, minimum in (("whole", None), ("shared", MIN_SHARED_PREFIX)):
            seconds, cpu_seconds, head_s, head_cpu_s, states[arm] = forward_backward_s(decoder, pack, targets, minimum)
            times[arm].append(seconds)
            cpu_times[arm].append(cpu_seconds)
            head_times.append(head_s)
            head_cpu_times.append(head_cpu_s)
    whole_s, shared_s = min(times["whole"]), min(times["shared"])
    whole_cpu_s, shared_cpu_s = min(cpu_times["whole"]), min(cpu_times["shared"])
    head_s, head_cpu_s = min(head_times), min(head_cpu_times)
    n = pack[0].numel()
    computed = args.groups * args.prompt + args.groups * args.episodes * args.completion
    record = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
              "model": "smollm2-135m shape, random", "groups": args.groups, "episodes": args.episodes,
              "prompt": args.prompt, "completion": args.completion, "tokens": n, "tokens_computed_shared": computed,
              "whole_s": round(whole_s, 3), "shared_s": round(shared_s, 3),
              "whole_cpu_s": round(whole_cpu_s, 3), "shared_cpu_s": round(shared_cpu_s, 3),
              "all_s": {arm: [round(t, 3) for t in ts] for arm, ts in times.items()},
              "all_cpu_s": {arm: [round(t, 3) for t in ts] for arm, ts in cpu_times.items()},
              "ratio": round(shared_s / whole_s, 3), "cpu_ratio": round(shared_cpu_s / whole_cpu_s, 3),
              "head_targets": targets.numel(), "head_s": round(head_s, 3), "head_cpu_s": round(head_cpu_s, 3),
              "all_head_s": [round(t, 3) for t in head_times],
              "step_ratio": round((shared_s + head_s) / (whole_s + head_s), 3),
              "step_cpu_ratio": round((shared_cpu_s + head_cpu_s) / (whole_cpu_s + head_cpu_s), 3),
              "token_ratio": round(computed / n, 3),
              "max_abs_diff": float((states["whole"] - states["shared"]).abs().max())}
    write_record(args.out, record, config=None, overrides=None, seed=0)
    print(f"shared prefix, forward+backward of {args.groups}x{args.episodes} episodes ({args.prompt}-token prompt, "
          f"{args.completion}-token completion, {n} tokens): whole {whole_s:.2f} s -> shared {shared_s:.2f} s "
          f"({record['ratio']:.2f}x the time, {record['cpu_ratio']:.2f}x the CPU time; "
          f"tokens {record['token_ratio']:.2f}x); with the log-prob head ({head_s:.2f} s at {targets.numel()} tokens, "
          f"both arms) the step takes {record['step_ratio']:.2f}x the time ({record['step_cpu_ratio']:.2f}x the CPU "
          f"time); states within {record['max_abs_diff']:.1e}")


if __name__ == "__main__":
    main()
