"""The torch engine's sampling step: one batched inverse-CDF draw against one ``torch.multinomial`` per row.

    python benchmarks/sampling_bench.py [--rows 64] [--vocab 32000] [--steps 64] [--threads 2]

Both sides sample ``--rows`` requests, each with its own seed, for ``--steps`` decode steps from the
same filtered distribution (``sampling_logits`` at temperature 0.8, top-p 0.9 over random logits):

- batched (the engine today): :func:`lightning_agentrl.rollout.engine.inverse_cdf_sample` on every
  row at once, from uniforms drawn per request up front (``_request_uniforms``);
- per row (the engine before): one ``torch.multinomial`` per row and step, each from the row's own
  seeded ``torch.Generator``.

Both are exact samplers of the same distribution (tests/rollout/test_sampling.py checks the engine's
frequencies); this measures only their cost. It also times the top-p filter itself
(``sampling_logits``, run at every decode step and on every trained token): the full sort of the
vocabulary against the head shortcut (the rule decided from the 512 most likely ids when the
nucleus lies inside them, as after any warm start; tests/algorithms/test_logprobs.py checks they
keep the same ids), on peaked logits (Zipf, as a language model's: the head decides) and on the bench's
Gaussian ones (a flat tail: the nucleus holds thousands of ids, so the head fails and the sort runs
after it), at 2k, 32k and 150k ids. Writes benchmarks/results/sampling/sampling.json and prints one
line: milliseconds per decode step on each side and the speed-up (the best of ``--repeats``).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "sampling" / "sampling.json"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.record import write_record  # noqa: E402
from lightning_agentrl.algorithms import logprobs as logprobs_module  # noqa: E402
from lightning_agentrl.algorithms.logprobs import sampling_logits  # noqa: E402
from lightning_agentrl.rollout.engine import SamplingParams, _request_uniforms, inverse_cdf_sample  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="requests decoded together")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=64, help="decode steps (new tokens per request)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS))
    return parser.parse_args(argv)


def batched(logprobs: list[torch.Tensor], rows: int, steps: int) -> None:
    params = [SamplingParams(max_new_tokens=steps, temperature=0.8, top_p=0.9, seed=i) for i in range(rows)]
    uniforms = _request_uniforms(params)
    for step, lp in enumerate(logprobs):
        inverse_cdf_sample(lp, uniforms[:, step])


def per_row(logprobs: list[torch.Tensor], rows: int, steps: int) -> None:
    generators = [torch.Generator().manual_seed(i) for i in range(rows)]
    for lp in logprobs:
        for i in range(rows):
            torch.multinomial(lp[i].exp(), 1, generator=generators[i])


def best_ms_per_step(fn, logprobs, args) -> float:
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        fn(logprobs, args.rows, args.steps)
        times.append((time.perf_counter() - started) / args.steps * 1e3)
    return min(times)


def zipf_logits(rows: int, vocab: int, exponent: float = 1.5) -> torch.Tensor:
    """Logits of a peaked next-token distribution, as a language model's: the r-th most likely id has
    probability proportional to r ** -exponent (Zipf), the ids in a random order per row."""
    gen = torch.Generator().manual_seed(2)
    ranked = -exponent * torch.arange(1, vocab + 1, dtype=torch.float32).log()
    return torch.stack([ranked[torch.randperm(vocab, generator=gen)] for _ in range(rows)])


def filter_ms(z: torch.Tensor, repeats: int) -> dict:
    """Milliseconds of one ``sampling_logits`` call (T 0.8, top-p 0.9) on logits ``z``: the full sort against
    the head shortcut (the best of ``repeats`` x 10 calls)."""
    head = logprobs_module._HEAD_SIZE
    result = {}
    for name, size in (("sort", 0), ("head", head)):
        logprobs_module._HEAD_SIZE = size
        try:
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                for _ in range(10):
                    sampling_logits(z, 0.8, top_p=0.9)
                times.append((time.perf_counter() - started) / 10 * 1e3)
        finally:
            logprobs_module._HEAD_SIZE = head
        result[name] = round(min(times), 3)
    result["speedup"] = round(result["sort"] / result["head"], 2)
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    logprobs = [
        torch.log_softmax(sampling_logits(torch.randn(args.rows, args.vocab) * 3, 0.8, top_p=0.9), dim=-1)
        for _ in range(args.steps)
    ]
    ms = {name: best_ms_per_step(fn, logprobs, args) for name, fn in (("per_row", per_row), ("batched", batched))}
    record = {
        "machine": platform.machine(), "threads": args.threads, "rows": args.rows, "vocab": args.vocab,
        "steps": args.steps, "ms_per_step": ms,
        "speedup": round(ms["per_row"] / ms["batched"], 2),
        "top_p_filter_ms": {
            f"{kind} {args.rows}x{vocab}": filter_ms(make(args.rows, vocab), args.repeats)
            for vocab in sorted({args.vocab, 2048, 151936})
            for kind, make in (("zipf", zipf_logits), ("gaussian", lambda r, v: torch.randn(r, v) * 3))
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_record(args.out, record, config=None, overrides=None, seed=None)
    print(f"sampling {args.rows} rows x vocab {args.vocab}: per row {ms['per_row']:.2f} ms/step, "
          f"batched {ms['batched']:.2f} ms/step: {record['speedup']}x")
    for shape, filt in record["top_p_filter_ms"].items():
        print(f"top-p filter {shape}: full sort {filt['sort']:.2f} ms, head {filt['head']:.2f} ms: {filt['speedup']}x")


if __name__ == "__main__":
    main()
