"""Packed vs padded: tokens/s of the training forward + backward on heavy-tailed sequence lengths.

    python benchmarks/packing_bench.py [--sequences 48] [--median-length 96] [--sigma 1.0] [--threads 2]

``--sequences`` lengths are drawn from a lognormal distribution (median ``--median-length``, sigma
``--sigma``, clipped to [8, ``--max-length``]: a few long episodes among many short ones, as agent
rollouts are). Both sides run the tiny model (sdpa, float32) forward and backward over the same
sequences and the same loss (the sum of every token's log-prob, through the package's chunked
``token_logprobs``):

- packed: the package's own path, the sequences concatenated and cut into micro-batches of whole
  sequences of about ``--micro-batch-tokens`` (``trainer.micro_batch_tokens``,
  ``batching.micro_batches``), each run by ``packed_hidden_states`` (length buckets, no ``[n, n]`` mask);
- padded: the usual padded batch, micro-batches of ``--rows`` sequences in the batch's order, each
  right-padded to its longest sequence with an attention mask (log-probs at the padding too,
  masked out of the loss).

Throughput is real (unpadded) tokens per second; the best of ``--repeats``. Writes
benchmarks/results/packing/packing.json (lengths, padding fraction, both times, the speedup) and prints
one line. Target (issue 19): speedup >= 2.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import shlex
import sys
import time
from pathlib import Path

import torch

from benchmarks.record import write_record

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "packing" / "packing.json"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this checkout's package first


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=48)
    parser.add_argument("--median-length", type=int, default=96)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096, help="trainer.micro_batch_tokens (default 4096)")
    parser.add_argument("--rows", type=int, default=16, help="sequences per padded micro-batch")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if min(args.sequences, args.median_length, args.rows, args.repeats, args.threads) < 1:
        parser.error("--sequences, --median-length, --rows, --repeats and --threads must be at least 1")
    return args


def draw_lengths(args: argparse.Namespace) -> list[int]:
    draw = random.Random(args.seed)
    mu = math.log(args.median_length)
    return [min(args.max_length, max(8, round(draw.lognormvariate(mu, args.sigma)))) for _ in range(args.sequences)]


def logprob_sum(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from lightning_agentrl.algorithms.logprobs import token_logprobs

    logprobs, _ = token_logprobs(hidden, model.get_output_embeddings().weight, targets, compute_entropy=False)
    return logprobs


def packed_pass(model, seqs: list[torch.Tensor], micro_batch_tokens: int) -> None:
    from lightning_agentrl.batching import micro_batches
    from lightning_agentrl.models.packed import packed_hidden_states

    ids = torch.cat(seqs)
    seq_ids = torch.cat([torch.full((len(s),), i) for i, s in enumerate(seqs)])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    for sl in micro_batches(seq_ids, micro_batch_tokens):
        hidden = packed_hidden_states(model.get_decoder(), ids[sl], positions[sl], seq_ids[sl])
        same = seq_ids[sl][1:] == seq_ids[sl][:-1]  # hidden[t] predicts token t+1 of the same sequence
        logprobs = logprob_sum(model, hidden[:-1], ids[sl][1:])
        (logprobs * same).sum().backward()


def padded_pass(model, seqs: list[torch.Tensor], rows: int) -> int:
    """Forward + backward over right-padded micro-batches; returns the padded token count."""
    padded = 0
    for begin in range(0, len(seqs), rows):
        chunk = seqs[begin : begin + rows]
        longest = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), longest, dtype=torch.long)
        mask = torch.zeros(len(chunk), longest, dtype=torch.long)
        for row, s in enumerate(chunk):
            ids[row, : len(s)], mask[row, : len(s)] = s, 1
        padded += ids.numel()
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        logprobs = logprob_sum(model, hidden[:, :-1].reshape(-1, hidden.shape[-1]), ids[:, 1:].reshape(-1))
        (logprobs * (mask[:, 1:] * mask[:, :-1]).reshape(-1)).sum().backward()
    return padded


def packed_calls(lengths: list[int], args: argparse.Namespace) -> int:
    """Decoder calls of one packed pass: one per length bucket of each micro-batch."""
    from lightning_agentrl.batching import micro_batches
    from lightning_agentrl.models.packed import length_buckets

    seq_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return sum(len(length_buckets(lengths[int(seq_ids[sl][0]) : int(seq_ids[sl][-1]) + 1], sl.stop - sl.start))
               for sl in micro_batches(seq_ids, args.micro_batch_tokens))


def best_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from lightning_agentrl.models.tiny import build_tiny_model

    hf_logging.disable_progress_bar()  # one line of output
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(REPO / ".cache" / "lightning_agentrl"),
                                                 attn_implementation="sdpa").float()
    lengths = draw_lengths(args)
    generator = torch.Generator().manual_seed(args.seed)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=generator) for n in lengths]
    tokens = sum(lengths)
    padded_tokens = padded_pass(model, seqs, args.rows)  # also the warm-up of both paths' kernels
    packed_pass(model, seqs, args.micro_batch_tokens)
    load_before = os.getloadavg()[0]
    packed_s = best_seconds(lambda: packed_pass(model, seqs, args.micro_batch_tokens), args.repeats)
    padded_s = best_seconds(lambda: padded_pass(model, seqs, args.rows), args.repeats)
    record = {
        "command": shlex.join(["python", "benchmarks/packing_bench.py", *argv]),
        "host": platform.platform(), "cpu_count": os.cpu_count(), "threads": args.threads,
        "load_avg_1min": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        "lengths": {"count": len(lengths), "median_target": args.median_length, "sigma": args.sigma,
                    "min": min(lengths), "max": max(lengths), "mean": round(tokens / len(lengths), 1), "all": lengths},
        "tokens": tokens,
        "padded": {"rows_per_micro_batch": args.rows, "decoder_calls": -(-len(lengths) // args.rows),
                   "tokens_with_padding": padded_tokens,
                   "padding_fraction": round(1 - tokens / padded_tokens, 3), "seconds": round(padded_s, 6),
                   "tokens_per_s": round(tokens / padded_s, 1)},
        "packed": {"micro_batch_tokens": args.micro_batch_tokens, "decoder_calls": packed_calls(lengths, args),
                   "seconds": round(packed_s, 6),
                   "tokens_per_s": round(tokens / packed_s, 1)},
        "speedup": round(padded_s / packed_s, 2),
        "target_speedup": 2.0,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_record(out, record, config=None, overrides=None, seed=args.seed)
    print(f"packing ({len(lengths)} sequences, lengths {min(lengths)} to {max(lengths)}, mean {record['lengths']['mean']}):"
          f" padded {record['padded']['tokens_per_s']} tok/s ({record['padded']['padding_fraction']:.0%} padding),"
          f" packed {record['packed']['tokens_per_s']} tok/s, {record['speedup']}x (target 2x);"
          f" load {load_before:.1f}")


if __name__ == "__main__":
    main()
