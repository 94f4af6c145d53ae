"""Command line: ``python -m lightning_agentrl {fit,sft,validate,plan,inspect,credit,export,evaluate} ...``.

    python -m lightning_agentrl fit --config configs/smoke.yaml [--resume last] [--section.field=value ...]
    python -m lightning_agentrl sft --config configs/sft_keydoor.yaml      # a warm start on demonstrations (sft.*)
    python -m lightning_agentrl validate --config configs/smoke.yaml      # settings, inputs, services [--offline]
    python -m lightning_agentrl plan --config configs/gpu_zero2.yaml --gpus 8 --gpu-memory 80GiB  # memory per GPU
    python -m lightning_agentrl inspect runs/smoke                          # a run folder or a .jsonl file
    python -m lightning_agentrl credit runs/smoke                           # advantages of every estimator
    python -m lightning_agentrl export runs/smoke/checkpoints/last.ckpt out/  # a HF model from any checkpoint
    python -m lightning_agentrl evaluate runs/smoke --split test --samples 4  # success and pass@k of a policy
    python -m lightning_agentrl fit --help                                  # every setting, documented
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from lightning_agentrl.settings import SettingsError, load_settings, settings_help


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_agentrl", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("fit", "train a policy"), ("validate", "check settings and print them resolved"),
                       ("sft", "warm-start a policy on demonstrations of the training tasks (the sft section)")):
        p = sub.add_parser(
            name,
            help=text,
            add_help=False,
            description=f"{text}. Overrides: --section.field=value (see the list below).",
        )
        p.add_argument("--config", type=Path, help="YAML settings file")
        if name != "sft":
            p.add_argument("--resume", choices=["never", "last"], help="same as --run.resume")
        p.add_argument("-h", "--help", action="store_true", help="show this help and every setting")
        if name == "validate":
            p.add_argument("--offline", action="store_true", help="skip the network checks (services, hub)")
    p = sub.add_parser(
        "plan",
        help="memory per GPU (or, on CPU, of the training process) of every part of a run (no weights are loaded)",
        description="Memory per GPU of every part of a run, from the model's config.json and the settings; for a "
        "run on CPU (and neither --gpus nor --gpu-memory) the training process's resident memory instead. "
        "Exit status 1 when it does not fit on its GPUs. Overrides: --section.field=value.",
    )
    p.add_argument("--config", type=Path, help="YAML settings file")
    p.add_argument("--gpus", type=int, help="GPUs per node, like trainer.devices; the total is this x trainer.num_nodes "
                   "(default: trainer.devices, or the visible GPUs)")
    p.add_argument("--gpu-memory", help="memory of one GPU, e.g. 80GiB or 141GB (default: the first GPU's, else 80GiB)")
    p.add_argument("--model-config", type=Path, help="a config.json to use instead of model.path's")
    p.add_argument("--episode-tokens", type=int, help="CPU runs: tokens of one episode (default: env.max_context_tokens)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p = sub.add_parser("inspect", help="print trajectories with the trained (mask=1) tokens highlighted")
    p.add_argument("path", type=Path, help="a run folder, its trajectories/ folder, or a .jsonl file")
    p.add_argument("--index", type=int, default=0, help="which trajectory of the file (default 0)")
    p.add_argument("--all", action="store_true", help="print every trajectory of the file")
    p.add_argument("--model", help="tokenizer folder (default: the run's policy/ or the tiny model)")
    p = sub.add_parser("credit", help="per-turn advantages of every estimator for a saved batch")
    p.add_argument("path", type=Path, help="a run folder or a step_*.jsonl file")
    p.add_argument("--gamma", type=float, default=0.95, help="GiGPO discount (default 0.95)")
    p.add_argument("--omega", type=float, default=1.0, help="GiGPO step-advantage weight (default 1.0)")
    p.add_argument("--similarity", type=float, default=None, help="GiGPO LCS similarity threshold (default exact)")
    p = sub.add_parser("export", help="write a checkpoint's policy as a Hugging Face model folder")
    p.add_argument("checkpoint", type=Path, help="a .ckpt file or a DeepSpeed checkpoint folder (e.g. last.ckpt)")
    p.add_argument("out", type=Path, help="the folder to write (config, safetensors, tokenizer)")
    p.add_argument("--dtype", default=None, help="cast weights, e.g. bfloat16 (default: as stored)")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run: write its peft adapter folder instead of the merged model")
    p = sub.add_parser(
        "evaluate",
        help="success and pass@k of a saved policy on a split of the tasks",
        description="Play --samples episodes of every task of --split with a saved policy, through the run's engine "
        "and sandbox service, and print success and pass@k. Overrides: --section.field=value (e.g. --engine.kind=vllm).",
    )
    p.add_argument("path", type=Path, help="a run folder (its policy/ and settings) or a policy folder")
    p.add_argument("--split", choices=["train", "test", "all"], default="test", help="which tasks (default test)")
    p.add_argument("--samples", type=int, default=4, help="episodes per task: the k of pass@k (default 4)")
    p.add_argument("--config", type=Path, help="YAML settings for a policy folder (a run folder brings its own)")
    p.add_argument("--out", type=Path, help="write evaluation.json, trajectories.jsonl and the logs here")
    p.add_argument("--json", action="store_true", help="print the scores as JSON")
    return parser


def _evaluate(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    from lightning_agentrl.evaluate import evaluate_policy

    try:
        scores = evaluate_policy(args.path, split=args.split, samples=args.samples, config=args.config,
                                 overrides=overrides, out=args.out)
    except (SettingsError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if scores["episodes"] == 0:
        print(f"error: no episode was played: the {args.split} split has no task (env.tasks)", file=sys.stderr)
        return 2
    if scores["infra_errors"] == scores["episodes"]:
        print(f"error: every one of the {scores['episodes']} episodes was broken by infrastructure (sandbox or "
              f"inference server); nothing was scored (logs in --out)", file=sys.stderr)
        return 3
    for warning in scores["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(scores, indent=2))
        return 0
    k = scores["samples_per_task"]
    print(f"{scores['policy']} on {scores['tasks']} {args.split} tasks x {k} samples ({scores['engine']} engine)")
    print(f"  success     {scores['success']:.3f}")
    print(f"  pass@{k:<6d} {scores['pass_at_k']:.3f}")
    print(f"  submitted   {scores['submitted_frac']:.3f}")
    print(f"  called model {scores['called_model_frac']:.3f} (episodes with at least one reply of the policy)")
    print(f"  episodes    {scores['episodes']} ({scores['infra_errors']} broken by infrastructure, not scored)")
    kinds = ", ".join(f"{kind} {count}" for kind, count in scores["timeouts"].items())
    print("  ended       " + ", ".join(f"{reason} {count}" + (f" ({kinds})" if reason == "timeout" else "")
                                       for reason, count in scores["terminations"].items()))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from rich.console import Console
    from transformers import AutoTokenizer

    from lightning_agentrl.render import print_trajectory
    from lightning_agentrl.trajectory import load_trajectories

    path: Path = args.path
    files = sorted(path.rglob("step_*.jsonl")) if path.is_dir() else [path]
    if not files or not files[-1].exists():
        print(f"error: no trajectory files under {path}", file=sys.stderr)
        return 2
    trajectories = load_trajectories(files[-1])
    if not trajectories:
        print(f"error: {files[-1]} holds no trajectories", file=sys.stderr)
        return 2
    tokenizer_path = args.model
    if tokenizer_path is None:
        from lightning_agentrl.run_layout import RunLayout

        run = RunLayout(path if path.is_dir() and RunLayout(path).settings_file.exists() else files[-1].parent.parent)
        if run.policy.exists():
            tokenizer_path = str(run.policy)
        else:
            from lightning_agentrl.models.resolve import resolve_model_path

            config = run.settings_file
            tokenizer_path = resolve_model_path(load_settings(config if config.exists() else None))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    console = Console()
    console.print(f"[bold]{files[-1]}[/bold]: {len(trajectories)} trajectories")
    chosen = trajectories if args.all else [trajectories[args.index]]
    for trajectory in chosen:
        print_trajectory(trajectory, tokenizer, console)
    return 0


def _resume_base(overrides: list[str]) -> Path | None:
    """``fit --run.dir X --resume last`` without ``--config``: the settings the run last ran with
    (its ``settings.yaml``, or its newest ``settings.resume-*.yaml``) are the base; overrides apply
    on top."""
    from lightning_agentrl.resume import last_settings_file
    from lightning_agentrl.settings import parse_overrides

    run = parse_overrides(overrides).get("run", {})
    if run.get("resume") != "last":
        return None
    if "dir" not in run:
        raise SettingsError("--resume last without --config needs --run.dir=<the run folder>")
    base = last_settings_file(run["dir"])
    if base is None:
        raise SettingsError(f"--resume last: {run['dir']} holds no settings.yaml; is it a run folder?")
    return base


def _plan(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    from lightning_agentrl.plan import (
        host_plan_for,
        on_gpu,
        parse_bytes,
        plan_for,
        print_host_plan,
        print_plan,
    )

    try:
        settings = load_settings(args.config, overrides)
        if args.gpus is not None and args.gpus < 1:
            raise SettingsError(f"--gpus must be >= 1, got {args.gpus}")
        if args.episode_tokens is not None and args.episode_tokens < 1:
            raise SettingsError(f"--episode-tokens must be >= 1, got {args.episode_tokens}")
        gpu_bytes = parse_bytes(args.gpu_memory) if args.gpu_memory else None
        if args.gpus is None and gpu_bytes is None and not on_gpu(settings):  # a CPU run: its host memory
            host = host_plan_for(settings, episode_tokens=args.episode_tokens, model_config=args.model_config)
            if args.json:
                print(json.dumps(host.to_dict(), indent=2))
            else:
                print_host_plan(host)
            return 0
        if args.episode_tokens is not None:
            raise SettingsError("--episode-tokens plans a CPU run's memory; a GPU plan counts episodes at "
                                "env.max_context_tokens")
        plan = plan_for(settings, num_gpus=args.gpus, gpu_bytes=gpu_bytes, model_config=args.model_config)
    except (SettingsError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print_plan(plan)
    return 0 if plan.fits else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in ("inspect", "credit", "export"):
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return {"inspect": _inspect, "credit": _credit, "export": _export}[args.command](args)
    if args.command == "plan":
        return _plan(args, rest)
    if args.command == "evaluate":
        return _evaluate(args, rest)
    if args.help:
        print(f"usage: python -m lightning_agentrl {args.command} [--config FILE] [--resume last] [--section.field=value ...]\n")
        print("Settings (YAML section.field, AGENTRL_SECTION__FIELD, or --section.field=value):")
        print("\n".join(settings_help()))
        return 0
    if getattr(args, "resume", None):
        rest.append(f"--run.resume={args.resume}")
    try:
        settings = load_settings(args.config or _resume_base(rest), rest)
    except SettingsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.command == "validate":
        return _validate(settings, offline=args.offline)
    return _fit(settings, sft=args.command == "sft")


def _export(args: argparse.Namespace) -> int:
    from lightning_agentrl.export import export_policy

    try:
        print(export_policy(args.checkpoint, args.out, dtype=args.dtype, adapter=args.adapter))
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _credit(args: argparse.Namespace) -> int:
    from lightning_agentrl.credit import print_report

    try:
        return print_report(args.path, gamma=args.gamma, omega=args.omega, similarity=args.similarity)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _validate(settings, *, offline: bool) -> int:
    import yaml

    from lightning_agentrl.preflight import describe_model, preflight

    try:
        codec = preflight(settings, network=not offline)
        if settings.model.lora:  # the adapters fit the model's layers (fit checks it at the same point)
            from lightning_agentrl.lora import check_lora
            from lightning_agentrl.models.resolve import resolve_model_path

            check_lora(settings.model, resolve_model_path(settings))
    except SettingsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    lines, warnings = describe_model(settings, codec)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print("".join(f"# {line}\n" for line in lines), end="")  # YAML comments: the output stays the settings file
    print(yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _fit(settings, *, sft: bool = False) -> int:
    """``fit`` (or ``sft``): train, then print where everything went; exit 2 for settings, 3 for a failed
    dependency, 128 + n for signal n."""
    from rich.console import Console

    from lightning_agentrl.shutdown import RunInterrupted, RunStopped
    from lightning_agentrl.train import fit

    console = Console(stderr=True)
    try:
        if sft:
            from lightning_agentrl.sft import sft as train
        else:
            train = fit
        result = train(settings)
    except SettingsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RunStopped as err:  # a signal (128 + its number) or a dependency that failed mid-run (3)
        print(f"{'' if isinstance(err, RunInterrupted) else 'error: '}{err}", file=sys.stderr)
        return err.exit_status
    except Exception as err:
        line = _dependency_failure(err, settings)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 3
    if not result.is_global_zero:
        return 0
    signal = ""
    if result.num_without_signal:
        signal = (f", [bold yellow]no learning signal in {result.num_without_signal} of {result.num_batches} "
                  "steps[/bold yellow] (every advantage 0: see the warning above)")
    console.print(f"[bold green]done[/bold green]: {result.global_step} optimizer steps in {result.run_dir}{signal}",
                  soft_wrap=True)  # one line: the folder is pasted from it
    console.print(f"  checkpoint: {result.checkpoint}")
    console.print(f"  policy:     {result.policy_dir}")
    if result.tracking_uri:
        console.print(f"  MLflow:     {result.tracking_uri} (run {result.mlflow_run_id})", soft_wrap=True)
        # quoted for the shell (a run.dir with spaces), unwrapped and without markup: a line to paste
        command = f"mlflow ui --backend-store-uri {shlex.quote(result.tracking_uri)} --host 127.0.0.1"
        console.print(f"              {command}", soft_wrap=True, markup=False, highlight=False)
    return 0


def _dependency_failure(err: BaseException, settings) -> str | None:
    """One line for a failure of the disk or the tracking server mid-run (exit 3), or None for a bug.
    Checkpoints are written atomically, so the newest intact one stays for ``--resume last``."""
    import errno

    chain = []
    while err is not None and len(chain) < 16:
        chain.append(err)
        err = err.__cause__ or err.__context__
    for item in chain:
        if isinstance(item, OSError) and item.errno in (errno.ENOSPC, errno.EDQUOT):
            return (f"run.dir: no space left for {settings.run.dir} ({item}); free some and continue with "
                    "--resume last from the newest intact checkpoint")
        if type(item).__name__ == "MlflowException" or type(item).__module__.startswith("mlflow"):
            return (f"tracking.uri: the tracking server failed during the run ({type(item).__name__}: "
                    f"{str(item).splitlines()[0] if str(item) else ''}); continue with --resume last")
    return None


if __name__ == "__main__":
    sys.exit(main())
