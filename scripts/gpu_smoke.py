"""GPU smoke run: a few real `fit` steps of a recipe's model shape on one GPU, measured against the plan.

Runs where only torch, lightning, transformers (and this project's small pure-Python dependencies)
are installed: no vLLM, DeepSpeed or MLflow. What it does:

1. builds a random-init model with the recipe model's published shape (``plan.KNOWN_CONFIGS``, or
   ``--model-config``), in the recipe's dtype, directly on the GPU, and saves it with a tokenizer:
   a real one (``--tokenizer FOLDER``, e.g. Qwen2.5's) or, without one, the tiny local tokenizer
   (its ids are a subset of the model's vocabulary, so the model's shape stays the published one);
2. runs ``fit`` for ``--steps`` optimizer steps with the recipe's episode, batch and loss settings,
   but the torch engine (its copy of the model moved to the GPU), strategy ``auto`` on one GPU,
   bf16-true, tracking off, sdpa attention (flash_attention_2 when ``flash_attn`` imports);
3. writes ``benchmarks/results/gpu/gpu_smoke.json``: trained tokens/s (packed log-prob forward +
   backward + optimizer step, rollout time excluded), peak allocated and reserved GPU memory, and the
   memory plan's prediction for the same settings (at ``trainer.micro_batch_tokens`` and at the
   largest micro-batch the run actually formed), plus the torch engine's copy of the weights.

Usage (see scripts/gpu_smoke.sh, which also checks the environment):

    python scripts/gpu_smoke.py --recipe configs/gpu_zero2.yaml --steps 3 [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def build_model(config: dict, dtype: str, tokenizer_dir: Path | None, out: Path, device: str = "cuda") -> Path:
    """A random-init causal LM of ``config``'s shape (built on the GPU) + a tokenizer, saved to ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lightning_agentrl.models.tiny import build_tiny_model

    if (out / "config.json").exists():
        return out
    model_config = AutoConfig.for_model(**config)
    if tokenizer_dir is None:
        tokenizer_dir = build_tiny_model(REPO / ".cache" / "lightning_agentrl")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if len(tokenizer) > model_config.vocab_size:
        raise SystemExit(f"tokenizer has {len(tokenizer)} ids, the model's vocabulary only {model_config.vocab_size}")
    model_config.eos_token_id = tokenizer.eos_token_id
    model_config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(0)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(model_config, dtype=getattr(torch, dtype))
        except TypeError:  # transformers < 4.56 names it torch_dtype
            model = AutoModelForCausalLM.from_config(model_config, torch_dtype=getattr(torch, dtype))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out


def smoke_overrides(args, model_dir: Path, run_dir: Path, attn: str) -> dict:
    """The recipe, reduced to one GPU and a few minutes; everything else is the recipe's."""
    return {
        "run": {"dir": str(run_dir)},
        "model": {"path": str(model_dir), "attn_implementation": attn, "value_head": False,
                  "lora_rank": args.lora_rank, **({"dtype": args.dtype} if args.dtype else {})},
        "engine": {"kind": "torch", "max_new_tokens": args.max_new_tokens, "max_batch_size": args.episodes},
        "env": {"max_turns": args.max_turns, "max_context_tokens": args.max_context_tokens, "summarizer": "none",
                "generation_timeout_s": 600, "episode_timeout_s": 1800},
        "rollout": {"group_size": args.episodes // 2, "groups_per_step": 2, "max_in_flight": args.episodes,
                    "max_staleness": 0, "truncation": "zero", "partial_rollout_s": None},
        "algorithm": {"advantage": "grpo", "kl_coef": 0.0, "staleness_weighting": "none",
                      "entropy_coef": args.entropy_coef},
        "trainer": {"max_steps": args.steps, "strategy": "auto", "offload_optimizer": False, "accelerator": "gpu",
                    "devices": 1, "precision": "bf16-true", "micro_batch_tokens": args.micro_batch_tokens,
                    "checkpoint_every": 1000},
        "eval": {"every_n_steps": None},
        "tracking": {"enabled": False, "sample_trajectories": 0},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", type=Path, default=REPO / "configs" / "gpu_zero2.yaml")
    parser.add_argument("--model-config", type=Path, help="config.json of the shape (default: the recipe model's)")
    parser.add_argument("--tokenizer", type=Path, help="a real tokenizer folder (default: the tiny local one)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--episodes", type=int, default=8, help="episodes per step (2 groups)")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-context-tokens", type=int, default=4096)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="model.dtype (default: the recipe's)")
    parser.add_argument("--lora-rank", type=int, default=0, help="model.lora_rank (0: full fine-tuning)")
    parser.add_argument("--entropy-coef", type=float, default=1e-3,
                        help="algorithm.entropy_coef: a loss term that is never 0, so every step runs the forward and "
                             "backward (random weights earn no reward, and a step whose advantages are all 0 skips them)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu" / "gpu_smoke.json")
    parser.add_argument("--cpu", action="store_true", help="test this script without a GPU (no memory figures)")
    args = parser.parse_args()

    import lightning as L
    import torch

    from benchmarks.record import write_record
    from lightning_agentrl.batching import micro_batches
    from lightning_agentrl.plan import DTYPE_BYTES, GiB, load_model_config, plan_for
    from lightning_agentrl.settings import load_settings
    from lightning_agentrl.train import fit

    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this smoke run is for a GPU machine (--cpu tests the script itself)")
    device = "cpu" if args.cpu else "cuda"
    sync = (lambda: None) if args.cpu else torch.cuda.synchronize
    peak = (lambda: None) if args.cpu else torch.cuda.max_memory_allocated
    recipe = load_settings(args.recipe)
    config = load_model_config(recipe, args.model_config)
    shape_name = recipe.model.path if args.model_config is None else str(args.model_config)
    cache = REPO / ".cache" / "gpu_smoke"
    tokenizer_tag = "tiny" if args.tokenizer is None else args.tokenizer.name
    model_dir = build_model(config, args.dtype or recipe.model.dtype, args.tokenizer,
                            cache / f"{shape_name.replace('/', '--')}-{tokenizer_tag}-{args.dtype or recipe.model.dtype}", device)
    try:
        import flash_attn  # noqa: F401

        attn = "flash_attention_2"
    except ImportError:
        attn = "sdpa"
    run_dir = REPO / "runs" / f"gpu_smoke-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides = smoke_overrides(args, model_dir, run_dir, attn)
    if args.cpu:
        overrides["trainer"]["accelerator"] = "cpu"
    settings = load_settings(args.recipe, copy.deepcopy(overrides))

    class Measure(L.Callback):
        """Time and tokens of each optimizer step (the packed forward/backward and the update), and the wait for its
        rollouts before it (from the end of the previous step: generation, tools and scoring not overlapped)."""

        def __init__(self) -> None:
            self.steps: list[dict] = []
            self._started = 0.0
            self._previous_end = 0.0
            self._optimizer_before = 0.0

        def on_train_start(self, trainer, pl_module) -> None:
            self._previous_end = time.perf_counter()
            trainable[0] = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            sync()
            self._started = time.perf_counter()
            self._optimizer_before = getattr(pl_module, "optimizer_s", 0.0)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            sync()
            end = time.perf_counter()
            seconds = end - self._started
            wait, self._previous_end = self._started - self._previous_end, end
            micro = micro_batches(batch.episode_ids, settings.trainer.micro_batch_tokens)
            trajectories = getattr(batch, "trajectories", []) or [None]
            mean = lambda key: sum(t.timings.get(key, 0.0) for t in trajectories if t) / len(trajectories)  # noqa: E731
            self.steps.append({
                "seconds": seconds,
                "optimizer_seconds": getattr(pl_module, "optimizer_s", 0.0) - self._optimizer_before,
                "wait_rollouts_seconds": wait,
                "episode_generation_seconds_mean": mean("generation_s"),
                "episode_tool_seconds_mean": mean("tool_s"),
                "episode_scoring_seconds_mean": mean("scoring_s"),
                "tokens": int(batch.input_ids.numel()),
                "action_tokens": int(batch.loss_mask.sum()),
                "largest_micro_batch": max(sl.stop - sl.start for sl in micro),
                "peak_allocated_bytes": peak(),
            })

    def engine_on_gpu(engine):
        engine.model.to(device)  # the torch engine's own copy: generation on the GPU, not the CPU
        return engine

    trainable = [0]
    measure = Measure()
    if not args.cpu:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    fit(settings, callbacks=[measure], wrap_engine=engine_on_gpu)
    wall = time.perf_counter() - started

    gpu_name, gpu_bytes = ("none (--cpu)", 80 * GiB) if args.cpu else (
        torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)
    plan = plan_for(settings, num_gpus=1, gpu_bytes=gpu_bytes)
    largest = max(s["largest_micro_batch"] for s in measure.steps)
    overrides["trainer"]["micro_batch_tokens"] = max(largest, 64)
    # the plan sizes micro-batches by max(micro_batch_tokens, max_context_tokens): bound both by what was seen
    overrides.setdefault("env", {})["max_context_tokens"] = max(largest, 64, settings.engine.max_new_tokens + 1)
    plan_observed = plan_for(load_settings(args.recipe, overrides), num_gpus=1, gpu_bytes=gpu_bytes)
    engine_copy = DTYPE_BYTES[settings.model.dtype] * plan.num_parameters
    timed = measure.steps[1:] or measure.steps  # the first step includes allocator warm-up
    tokens_per_s = sum(s["tokens"] for s in timed) / sum(s["seconds"] for s in timed)
    median = lambda key: sorted(s[key] for s in timed)[len(timed) // 2]  # noqa: E731
    peak_allocated = peak()
    # torch's allocated counter excludes the CUDA context and fragmentation: compare it without the reserve
    reserve = plan_observed.part("trainer reserve").gpu_bytes
    predicted = plan_observed.phase_total("train") - reserve + engine_copy
    result = {
        "recipe": str(args.recipe.relative_to(REPO) if args.recipe.is_absolute() else args.recipe),
        "model_shape": shape_name,
        "num_parameters": plan.num_parameters,
        "tokenizer": str(args.tokenizer) if args.tokenizer else "tiny local tokenizer (ids within the model's vocabulary)",
        "attn_implementation": attn,
        "gpu": gpu_name,
        "gpu_memory_bytes": gpu_bytes,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "steps": measure.steps,
        "train_tokens_per_s": round(tokens_per_s, 1),
        "median_train_step_seconds": round(median("seconds"), 3),
        "median_wait_rollouts_seconds": round(median("wait_rollouts_seconds"), 3),
        "lora_rank": args.lora_rank,
        "trainable_parameters": trainable[0],
        "wall_seconds": round(wall, 1),
        "peak_allocated_bytes": peak_allocated,
        "peak_reserved_bytes": None if args.cpu else torch.cuda.max_memory_reserved(),
        "plan": {
            "at_micro_batch_tokens": plan.to_dict(),
            "at_largest_micro_batch": plan_observed.to_dict(),
            "torch_engine_copy_on_gpu_bytes": engine_copy,
            "predicted_allocated_bytes": predicted,
            "predicted_reserved_bytes": predicted + reserve,
            "note": "plan train phase at the largest micro-batch formed, plus the torch engine's copy of the weights "
                    "(the plan counts the torch engine on CPU; this script moves it to the GPU); allocated excludes "
                    "the plan's per-process reserve, reserved includes it",
        },
        "measured_over_predicted": None if args.cpu else round(peak_allocated / predicted, 3),
        "settings": settings.model_dump(mode="json"),
    }
    write_record(args.out, result, config=result["recipe"], overrides=overrides, seed=None)
    measured = "not measured (--cpu)" if args.cpu else f"{peak_allocated / GiB:.2f} GiB allocated"
    print(f"gpu_smoke: {len(measure.steps)} steps, {tokens_per_s:,.0f} trained tokens/s, peak {measured} vs "
          f"{predicted / GiB:.2f} GiB predicted ({result['measured_over_predicted']}x) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
