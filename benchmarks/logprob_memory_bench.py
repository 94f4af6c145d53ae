"""Peak memory of the chunked log-prob path against full logits, forward + backward, on CPU.

    python benchmarks/logprob_memory_bench.py                     # make bench
    python benchmarks/logprob_memory_bench.py --cases 32000x8192 --hidden 256

For each case ``VOCABxTOKENS`` a packed sequence of TOKENS positions with hidden size ``--hidden``
has 10% action tokens (``--action-frac``, spread at random) whose log-probs a loss needs:

- full logits: ``log_softmax(hidden @ W.T)`` over every position (``[TOKENS, VOCAB]`` float32, what
  a model's ``forward`` returns), then the action positions gathered;
- chunked: :func:`lightning_agentrl.algorithms.logprobs.token_logprobs` on the action positions
  only, ``--chunk`` of them at a time (the trainer's ``trainer.logprob_chunk_tokens``), each chunk's
  logits recomputed in the backward pass.

Both run forward and backward with the same seeded upstream gradient (log-probs only, no entropy).
Peak memory is the process's resident high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs``; blocks above 1 MiB mmapped, so freed ones leave the resident set) above
its resident size just before the call, so it counts everything
the call allocates: the logits and their gradients, and the gradients of the hidden states and of
``W`` that both paths must return (``grad_bytes``, listed apart). Checked: the largest absolute
difference of the log-probs and of both gradients (target <= 1e-5). Target: >= 8x less peak.
Logit memory does not depend on ``--hidden``; a small one keeps the matmuls quick on 2 cores.
Writes ``benchmarks/results/logprob_memory/logprob_memory.json`` and prints one line.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import platform
import re
import time
from pathlib import Path

import torch

from benchmarks.record import write_record
from lightning_agentrl.algorithms.logprobs import token_logprobs
from lightning_agentrl.settings import TrainerSettings

RESULTS = Path(__file__).resolve().parent / "results" / "logprob_memory" / "logprob_memory.json"
TOLERANCE, TARGET_RATIO = 1e-5, 8.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="32000x8192,152064x2048", help="VOCABxTOKENS, comma-separated")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size H")
    parser.add_argument("--action-frac", type=float, default=0.1, help="share of positions that need a log-prob")
    parser.add_argument("--chunk", type=int, default=TrainerSettings.model_fields["logprob_chunk_tokens"].default,
                        help="chunk size of the chunked path (positions); default: the trainer's logprob_chunk_tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    try:
        args.cases = [tuple(int(x) for x in case.split("x")) for case in args.cases.split(",")]
    except ValueError:
        parser.error(f"--cases: expected VOCABxTOKENS[,VOCABxTOKENS...], got {args.cases!r}")
    if not 0 < args.action_frac <= 1:
        parser.error(f"--action-frac must be in (0, 1], got {args.action_frac}")
    return args


def fixed_mmap_threshold(num_bytes: int = 1 << 20) -> None:
    """Serve every allocation above ``num_bytes`` by its own mmap, returned to the system when freed.
    glibc otherwise raises the threshold after each freed large block (up to 32 MiB), keeps smaller
    freed blocks in its heap, and the resident high-water mark then counts memory no longer in use."""
    M_MMAP_THRESHOLD = -3
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, num_bytes)


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def peak_bytes_of(call) -> tuple[int, object]:
    """Run ``call()``; return the resident high-water mark above the resident size before it."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    before = _status_kib("VmRSS")
    result = call()
    return (_status_kib("VmHWM") - before) * 1024, result


def full_logits(hidden, weight, targets, action_at):
    logprobs_all = torch.log_softmax(hidden @ weight.T, dim=-1)  # [N, V]
    return logprobs_all[action_at].gather(-1, targets[:, None])[:, 0]


def chunked(hidden, weight, targets, action_at, chunk: int):
    return token_logprobs(hidden[action_at], weight, targets, chunk_size=chunk, compute_entropy=False)[0]


def run_path(path, hidden, weight, targets, action_at, upstream, **kwargs) -> dict:
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    def forward_backward():
        started = time.perf_counter()
        logprobs = path(h, w, targets, action_at, **kwargs)
        (logprobs * upstream).sum().backward()
        return logprobs.detach(), time.perf_counter() - started

    peak, (logprobs, seconds) = peak_bytes_of(forward_backward)
    return {"peak": peak, "seconds": seconds, "logprobs": logprobs, "grad_hidden": h.grad, "grad_weight": w.grad}


def warm_up(args: argparse.Namespace) -> None:
    """One small call of each path first, so that one-off costs (lazy imports, thread pools) are not
    counted in the first measured path's peak."""
    h, w = torch.randn(64, args.hidden), torch.randn(100, args.hidden)
    at, y = torch.arange(0, 64, 8), torch.zeros(8, dtype=torch.long)
    for path, kwargs in ((chunked, {"chunk": 4}), (full_logits, {})):
        run_path(path, h, w, y, at, torch.ones(8), **kwargs)


def measure(vocab: int, tokens: int, args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, args.hidden, generator=gen)
    weight = torch.randn(vocab, args.hidden, generator=gen) * args.hidden**-0.5
    num_actions = max(1, round(tokens * args.action_frac))
    action_at = torch.randperm(tokens, generator=gen)[:num_actions].sort().values
    targets = torch.randint(0, vocab, (num_actions,), generator=gen)
    upstream = torch.randn(num_actions, generator=gen)
    chunk = run_path(chunked, hidden, weight, targets, action_at, upstream, chunk=args.chunk)
    full = run_path(full_logits, hidden, weight, targets, action_at, upstream)
    diffs = {key: float((chunk[key] - full[key]).abs().max()) for key in ("logprobs", "grad_hidden", "grad_weight")}
    grad_bytes = 4 * (hidden.numel() + weight.numel())
    return {
        "vocab": vocab, "tokens": tokens, "hidden": args.hidden, "action_tokens": num_actions, "chunk": args.chunk,
        "full_logits_bytes": 4 * tokens * vocab,
        "peak_full_mib": round(full["peak"] / 2**20, 1), "peak_chunked_mib": round(chunk["peak"] / 2**20, 1),
        "ratio": round(full["peak"] / chunk["peak"], 1),
        "grad_bytes_mib": round(grad_bytes / 2**20, 1),
        "ratio_without_grads": round((full["peak"] - grad_bytes) / max(chunk["peak"] - grad_bytes, 1), 1),
        "seconds_full": round(full["seconds"], 2), "seconds_chunked": round(chunk["seconds"], 2),
        "max_abs_diff": diffs, "within_tolerance": max(diffs.values()) <= TOLERANCE,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    fixed_mmap_threshold()
    warm_up(args)
    rows = [measure(vocab, tokens, args) for vocab, tokens in args.cases]
    write_record(args.out, config=None, overrides=None, seed=None, record={
        "machine": platform.processor() or platform.machine(), "threads": args.threads,
        "action_frac": args.action_frac, "tolerance": TOLERANCE, "target_ratio": TARGET_RATIO,
        "measure": "resident high-water mark (VmHWM) above the resident size before forward + backward; "
                   "glibc mmap threshold fixed at 1 MiB",
        "rows": rows,
    })
    parts = [f"V={r['vocab']} x {r['tokens']} tokens: {r['peak_full_mib']} -> {r['peak_chunked_mib']} MiB "
             f"({r['ratio']}x, max diff {max(r['max_abs_diff'].values()):.1e})" for r in rows]
    print(f"logprob_memory (target {TARGET_RATIO:g}x less, diff <= {TOLERANCE:g}): " + "; ".join(parts))


if __name__ == "__main__":
    main()
