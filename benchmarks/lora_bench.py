"""LoRA against full fine-tuning on one model, side by side: step time, peak memory, optimizer state, sync bytes.

    python benchmarks/lora_bench.py                          # make bench: SmolLM2-135M-Instruct, rank 8
    python benchmarks/lora_bench.py --model-path random --layers 4 --steps 2   # a quicker, random model

Both variants run the trainer's own path (:class:`lightning_agentrl.module.AgentRLModule`): ``configure_model``,
``configure_optimizers`` (the optimizer holds what requires grad), ``accumulate_gradients`` on the same packed
batch (random tokens; behavior log-probs from the model itself, so the PPO ratios start at 1), gradient clipping
and the optimizer step, and :func:`lightning_agentrl.lora.engine_weights` for what one weight sync sends. Under LoRA each adapted layer runs
the fused adapter function of :mod:`lightning_agentrl.lora_linear` (peft's own forward where that would not be exact:
dropout, ZeRO-3, autocast), as ``fit`` does. The
model is ``--model-path`` (a ``model.path``: by default the real SmolLM2-135M-Instruct, 30 layers, H 576, I 1536,
vocabulary 49,152, tied embeddings), or with ``random`` a randomly initialized Llama of the shape the flags give.
Each variant runs
in a process of its own, so its peak resident memory (``VmHWM``) is its own: the model, the gradients, Adam's
moments and the activations of one step.

Measured per variant: seconds per step (the median of ``--steps`` after one warm-up step), wall and CPU time,
and the CPU time of its stages (the forward pass alone, without gradients; the backward pass, the forward and
backward minus it; the optimizer update: clipping, step, zeroing), peak memory, bytes of optimizer state after a step, bytes sent per
weight sync. Targets (rank 8): steps >= 1.3x faster, >= 5x
fewer optimizer-state bytes, >= 20x fewer bytes per sync. Writes ``benchmarks/results/lora/lora.json`` and prints
one line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.record import write_record

RESULTS = Path(__file__).resolve().parent / "results" / "lora" / "lora.json"
TARGETS = {"step_speedup": 1.3, "optimizer_ratio": 5.0, "sync_ratio": 20.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default="smollm2-135m-instruct",
                        help="model.path of the model to train, or `random` for a random Llama of the shape below")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (model.lora_rank)")
    parser.add_argument("--alpha", type=float, default=16.0, help="model.lora_alpha")
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M: 30)")
    parser.add_argument("--hidden", type=int, default=576, help="hidden size")
    parser.add_argument("--intermediate", type=int, default=1536, help="MLP size")
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size")
    parser.add_argument("--episodes", type=int, default=4, help="episodes in the batch (one group)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per episode (half of them actions)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant, after one warm-up")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--variant", choices=["full", "lora"], help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--model", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace, folder: Path) -> None:
    """A random Llama of the requested shape, saved as an HF folder (no tokenizer: the trainer needs none)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(1, args.hidden // 64)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 3),
        head_dim=64, tie_word_embeddings=True, max_position_embeddings=4096,
    )
    LlamaForCausalLM(config).save_pretrained(folder)


def make_batch(policy, args: argparse.Namespace):
    """One group of random episodes: a prompt, then action and observation halves; behavior log-probs of the
    policy itself."""
    import torch

    from lightning_agentrl.trajectory import Segment, TerminationReason, Trajectory, Turn, pack

    g = torch.Generator().manual_seed(1)
    vocab = policy.config.vocab_size
    trajectories = []
    half = args.tokens // 4
    for i in range(args.episodes):
        segment = Segment()
        segment.extend(torch.randint(5, vocab, (half,), generator=g).tolist(), mask=0)
        for _ in range(2):
            start = len(segment.token_ids)
            action = torch.randint(5, vocab, (half,), generator=g).tolist()
            with torch.no_grad():
                logits = policy(torch.tensor([segment.token_ids + action])).logits[0, start - 1 : -1].float()
            logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(action)[:, None]).squeeze(1).tolist()
            segment.extend(action, mask=1, logprobs=logprobs, version=0)
            segment.turns.append(Turn(action_start=start, action_end=len(segment.token_ids)))
            if len(segment.token_ids) < args.tokens:
                segment.extend(torch.randint(5, vocab, (half // 2,), generator=g).tolist(), mask=0)
        segment.turns[-1].reward = float(i % 2)
        trajectories.append(Trajectory(episode_id=f"e{i}", task_id="t", group_id=0, segments=[segment],
                                       reward=float(i % 2), termination=TerminationReason.SUBMITTED))
    return pack(trajectories)


def resolved_model(path: str) -> str:
    """The local folder of a ``model.path`` (a named model is converted once, as ``fit`` does)."""
    from lightning_agentrl.settings import load_settings
    from lightning_agentrl.train import resolve_model_path

    return resolve_model_path(load_settings(overrides=[f"--model.path={path}"]))


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run_variant(args: argparse.Namespace) -> dict:
    """One variant's measurements (in its own process)."""
    import torch

    from lightning_agentrl.lora import engine_weights
    from lightning_agentrl.module import AgentRLModule
    from lightning_agentrl.settings import load_settings

    torch.set_num_threads(args.threads)
    lora = [f"--model.lora_rank={args.rank}", f"--model.lora_alpha={args.alpha}"] if args.variant == "lora" else []
    settings = load_settings(overrides=[*lora, "--trainer.micro_batch_tokens=1000000", "--trainer.lr=1e-5"])
    module = AgentRLModule(settings, args.model)
    module.configure_model()
    optimizer = module.configure_optimizers()["optimizer"]
    batch = make_batch(module.policy, args)
    seconds, cpu_seconds, update_cpu, optimizer_cpu = [], [], [], []
    for step in range(args.steps + 1):
        started, cpu_started = time.perf_counter(), time.process_time()
        module.accumulate_gradients(batch)
        cpu_stepping = time.process_time()
        torch.nn.utils.clip_grad_norm_(module.parameters(), settings.trainer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:  # the first step warms up (allocations, Adam's state)
            seconds.append(time.perf_counter() - started)
            cpu_seconds.append(time.process_time() - cpu_started)
            update_cpu.append(cpu_stepping - cpu_started)
            optimizer_cpu.append(time.process_time() - cpu_stepping)
    forward = statistics.median(forward_cpu_seconds(module, batch) for _ in range(args.steps))
    # Adam's moments (exp_avg, exp_avg_sq); its per-tensor step counters are scalars of no weight
    state = [t for s in optimizer.state.values() for key, t in s.items() if torch.is_tensor(t) and key != "step"]
    sync = engine_weights(module.policy)
    return {
        "variant": args.variant,
        "seconds_per_step": statistics.median(seconds),
        # CPU seconds of each stage (wall time on a shared machine counts the others' load)
        "stages_cpu_s": {"forward": forward, "backward": statistics.median(update_cpu) - forward,
                         "optimizer": statistics.median(optimizer_cpu)},
        # CPU time of the process (all its threads): on a shared machine wall time also counts the others' load
        "cpu_seconds_per_step": statistics.median(cpu_seconds),
        "peak_rss_bytes": peak_rss_bytes(),
        "optimizer_state_bytes": sum(t.numel() * t.element_size() for t in state),
        "sync_bytes": sum(t.numel() * t.element_size() for t in sync.values()),
        "trainable_parameters": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "parameters": sum(p.numel() for p in module.parameters()),
        "batch_tokens": int(batch.num_tokens),
    }


def forward_cpu_seconds(module, batch) -> float:
    """CPU seconds of the policy's forward pass over the batch (hidden states and log-probs), without gradients."""
    import torch

    from lightning_agentrl.policy import hidden_states

    started = time.process_time()
    with torch.no_grad():
        targets_at = torch.nonzero(batch.loss_mask[1:] > 0).squeeze(-1) + 1
        hidden = hidden_states(module.policy, batch.input_ids, batch.position_ids, batch.segment_ids)
        module.token_logprobs_at(module.policy, hidden, batch.input_ids, targets_at)
    return time.process_time() - started


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.variant is not None:
        print(json.dumps(run_variant(args)))
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        if args.model_path == "random":
            build_model(args, model)
        else:
            model = resolved_model(args.model_path)
        child = [a for a in (argv if argv is not None else sys.argv[1:])]
        runs = {}
        for variant in ("full", "lora"):
            done = subprocess.run([sys.executable, __file__, *child, "--variant", variant, "--model", str(model)],
                                  capture_output=True, text=True, check=True)
            runs[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    full, lora = runs["full"], runs["lora"]
    ratios = {
        "step_speedup": full["seconds_per_step"] / lora["seconds_per_step"],
        "step_cpu_speedup": full["cpu_seconds_per_step"] / lora["cpu_seconds_per_step"],
        "peak_memory_ratio": full["peak_rss_bytes"] / lora["peak_rss_bytes"],
        "optimizer_ratio": full["optimizer_state_bytes"] / lora["optimizer_state_bytes"],
        "sync_ratio": full["sync_bytes"] / lora["sync_bytes"],
    }
    result = {
        "command": " ".join([Path(sys.executable).name, "benchmarks/lora_bench.py", *(argv or sys.argv[1:])]),
        "machine": f"{platform.machine()}, torch threads {args.threads}",
        "model": args.model_path,
        "load_average": os.getloadavg(),  # the machine's load (1, 5, 15 minutes) as the runs ended
        "shape": ({k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "vocab")} if args.model_path == "random"
                  else {}) | {"rank": args.rank, "alpha": args.alpha},
        "full": full, "lora": lora, "ratios": ratios, "targets": TARGETS,
        "meets_targets": {k: ratios[k] >= v for k, v in TARGETS.items()},
    }
    write_record(args.out, result, config=None, overrides=None, seed=None)
    print(f"lora r={args.rank} vs full ({full['parameters'] / 1e6:.1f}M params, {full['batch_tokens']} tokens): "
          f"step {full['seconds_per_step']:.2f}s -> {lora['seconds_per_step']:.2f}s ({ratios['step_speedup']:.2f}x; CPU "
          f"{full['cpu_seconds_per_step']:.2f}s -> {lora['cpu_seconds_per_step']:.2f}s, {ratios['step_cpu_speedup']:.2f}x), "
          f"peak {full['peak_rss_bytes'] / 2**20:.0f} -> {lora['peak_rss_bytes'] / 2**20:.0f} MiB, "
          f"optimizer {full['optimizer_state_bytes'] / 2**20:.1f} -> {lora['optimizer_state_bytes'] / 2**20:.2f} MiB "
          f"({ratios['optimizer_ratio']:.0f}x), sync {full['sync_bytes'] / 2**20:.1f} -> {lora['sync_bytes'] / 2**20:.2f} MiB "
          f"({ratios['sync_ratio']:.0f}x)")
    return result


if __name__ == "__main__":
    main()
