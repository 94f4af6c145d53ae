"""``python -m lightning_agentrl evaluate <run dir | policy dir> --split test --samples k``.

Success and pass@k of a saved policy (a run's ``policy/`` folder, or any folder ``export`` or
``fit`` wrote) on a split of the task suite, ``k`` episodes per task, with the same engines and the
same agent loop, environment and sandbox service as training (``--engine.kind``, ``--engine.*``).

Settings: a run folder brings the settings it last ran with (tasks, budgets, engine, sampling);
a policy folder the defaults or ``--config``; ``--section.field=value`` overrides either. The
policy's weights are what the engine serves: the torch and in-process vLLM engines load the
folder, local servers (``engine.kind=vllm_server`` without ``engine.urls``) serve it, and servers
given by ``engine.urls`` reload it (through ``<out>/engine_weights``, which they must see).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from dataclasses import replace
from pathlib import Path

from lightning_agentrl.settings import ModelSettings, Settings, SettingsError, load_settings


def resolve_policy(path: str | Path) -> tuple[Path, Path | None]:
    """``(policy folder, settings file or None)`` of a run folder, a policy folder, a named model or a GGUF file
    (converted once, ``models/gguf_convert.py``)."""
    from lightning_agentrl.models.gguf_convert import GGUFError, converted_model, is_gguf_source
    from lightning_agentrl.resume import last_settings_file
    from lightning_agentrl.run_layout import RunLayout

    try:
        if is_gguf_source(str(path)):
            return converted_model(str(path), ModelSettings().cache_dir), None
    except GGUFError as err:
        raise SettingsError(f"model.path: {err}") from None
    path = Path(path)
    if (path / "config.json").exists():
        return path.resolve(), None
    settings_file = last_settings_file(path)
    if settings_file is None:
        raise SettingsError(f"{path} is neither a policy folder (config.json) nor a run folder (settings.yaml)")
    layout = RunLayout(path)
    if not (layout.policy / "config.json").exists():
        raise SettingsError(f"the run in {path} has no policy/ yet (it ends with one); write one from a checkpoint "
                            f"with `python -m lightning_agentrl export {layout.last_checkpoint} OUT`")
    return layout.policy.resolve(), settings_file


def evaluation_settings(path: str | Path, *, split: str, samples: int, config: Path | None,
                        overrides: list[str], out: Path) -> tuple[Path, Settings]:
    policy, run_settings = resolve_policy(path)
    if config is not None and run_settings is not None:
        raise SettingsError("--config applies to a policy folder; a run folder brings its own settings")
    # Evaluation trains nothing, so no log-prob rule binds the engine: a policy trained with
    # engine.logprobs=softmax (torch only) may be evaluated on vLLM unless the command asks otherwise.
    settings = load_settings(config or run_settings, [
        "--engine.logprobs=sampler", *overrides, f"--model.path={policy}", f"--eval.split={split}",
        f"--eval.samples_per_task={samples}", f"--run.dir={out}", "--run.resume=never",
    ])
    return policy, settings


def evaluate_policy(path: str | Path, *, split: str = "test", samples: int = 4, config: Path | None = None,
                    overrides: list[str] = (), out: str | Path | None = None) -> dict:
    """Play ``samples`` episodes of every ``split`` task with the policy at ``path``; return the scores
    (:func:`~lightning_agentrl.callbacks.evaluation.score_episodes`). With ``out``, the scores go to
    ``<out>/evaluation.json`` and the episodes to ``<out>/trajectories.jsonl`` (with the sandbox and
    server logs); without, a temporary folder holds the logs."""
    if samples < 1:
        raise SettingsError(f"--samples must be >= 1, got {samples}")
    from lightning_agentrl.console import quiet_libraries

    quiet_libraries()
    with tempfile.TemporaryDirectory(prefix="agentrl-evaluate-") as scratch:
        folder = Path(out) if out is not None else Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        policy, settings = evaluation_settings(path, split=split, samples=samples, config=config,
                                               overrides=list(overrides), out=folder.resolve())
        scores, trajectories = _run(policy, settings, folder)
        scores["warnings"] = [w for w in [timeout_warning(scores, settings)] if w]
        if out is not None:
            from lightning_agentrl.trajectory import save_trajectories

            (folder / "evaluation.json").write_text(json.dumps(scores, indent=2))
            save_trajectories(trajectories, folder / "trajectories.jsonl")
        return scores


def _run(policy: Path, settings: Settings, folder: Path):
    import torch
    from transformers import AutoTokenizer

    from lightning_agentrl.callbacks.evaluation import score_episodes
    from lightning_agentrl.engines import make_engine, start_local_servers
    from lightning_agentrl.envs.registry import load_env_tasks
    from lightning_agentrl.preflight import check_sandbox
    from lightning_agentrl.rollout.chat import chat_codec
    from lightning_agentrl.sandbox import make_sandbox
    from lightning_agentrl.sandbox_checks import harness_timeout, judge_policy
    from lightning_agentrl.train import build_rollout_service

    if settings.trainer.threads:  # as `fit` does: on busy cores one thread decodes several times faster
        torch.set_num_threads(settings.trainer.threads)
    try:
        tasks = load_env_tasks(settings, settings.eval.split)
    except (OSError, ValueError) as err:
        default = "" if "tasks" in settings.env.model_fields_set else " (the default; set --env.tasks or --config)"
        raise SettingsError(f"env.tasks: {err}{default}") from None
    if not tasks:
        raise SettingsError(f"--split: no {settings.eval.split} tasks in {settings.env.tasks}")
    tokenizer = AutoTokenizer.from_pretrained(policy)
    s = settings.sandbox
    sandbox = make_sandbox(settings, folder)
    servers = None
    try:
        if not sandbox.uses_service:
            pass  # the environment needs no sandbox service: none is started or checked
        elif not s.addresses:
            sandbox.start()
        else:  # the same health, token and judge-isolation checks as `fit` and `validate`
            check_sandbox(s, judge_policy(settings), harness=harness_timeout(settings))
        servers = start_local_servers(settings, str(policy), folder)
        engine = make_engine(settings, str(policy), tokenizer, urls=servers.urls if servers else None)
        service = build_rollout_service(settings, engine, sandbox, chat_codec(settings, tokenizer), tasks)
        temperature = settings.engine.temperature if settings.eval.temperature is None else settings.eval.temperature
        sampling = replace(service.sampling, temperature=temperature)
        push = bool(settings.engine.fleet_urls)  # servers run elsewhere (engine.urls, vllm_server only): they load the policy
        with EpisodeProgress(len(tasks) * settings.eval.samples_per_task) as progress:
            trajectories = asyncio.run(_play(service, tasks, settings.eval.samples_per_task, sampling,
                                             policy if push else None, on_episode=progress.add))
    finally:
        if servers is not None:
            servers.stop()
        sandbox.close()
    return {**score_episodes(trajectories), "tasks": len(tasks), "samples_per_task": settings.eval.samples_per_task,
            "engine": settings.engine.kind, "policy": str(policy)}, trajectories


async def _play(service, tasks, samples: int, sampling, push_weights_from: Path | None, on_episode=None):
    engine = service.engine
    try:
        if push_weights_from is not None:
            from safetensors.torch import load_file

            weights = {}
            for file in sorted(push_weights_from.glob("*.safetensors")):
                weights.update(load_file(str(file)))
            await engine.update_weights(weights.items(), version=engine.policy_version)
        return await service.play_episodes_async(tasks, samples_per_task=samples, sampling=sampling, tag="evaluate",
                                                 on_episode=on_episode)
    finally:
        await engine.close()


class EpisodeProgress:
    """Episodes done of the total, the success so far and the timeouts, on stderr while ``evaluate`` plays
    (a rich progress bar; on a terminal it updates in place, elsewhere its last state is printed at the end)."""

    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("evaluate"), BarColumn(), MofNCompleteColumn(), TextColumn("episodes"),
                                 TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=Console(stderr=True))
        self.task = self.progress.add_task("episodes", total=total, status="")
        self.rewards: list[float] = []
        self.num_timeouts = 0

    def add(self, trajectory) -> None:
        from lightning_agentrl.trajectory import TerminationReason

        if not (trajectory.termination is not None and trajectory.termination.infrastructure):
            self.rewards.append(trajectory.reward)
        self.num_timeouts += trajectory.termination is TerminationReason.TIMEOUT
        success = sum(self.rewards) / max(len(self.rewards), 1)
        self.progress.update(self.task, advance=1, status=f"success {success:.3f}  timeouts {self.num_timeouts}")

    def __enter__(self) -> EpisodeProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()


TIMEOUT_SETTINGS = {"generation": "generation_timeout_s", "tool": "tool_timeout_s", "episode": "episode_timeout_s"}
"""What each kind of ``timeout`` ran past (``Trajectory.info["timeout"]``): a field of ``env``."""


def timeout_warning(scores: dict, settings: Settings, *, share: float = 0.25) -> str | None:
    """A warning when at least ``share`` of the scored episodes ended with ``timeout``, naming the settings they
    ran past; None otherwise. Such episodes score 0 whatever the policy would have done."""
    scored = scores["episodes"] - scores["infra_errors"]
    timed_out = scores["terminations"].get("timeout", 0)
    if not timed_out or timed_out < share * scored:
        return None
    kinds = ", ".join(
        f"{count} {kind}" + (f" (env.{TIMEOUT_SETTINGS[kind]}={getattr(settings.env, TIMEOUT_SETTINGS[kind]):g} s)"
                             if kind in TIMEOUT_SETTINGS else "")
        for kind, count in scores["timeouts"].items()
    )
    return (f"{timed_out} of {scored} scored episodes timed out: {kinds}; they score 0 whatever the policy does. "
            "On a slow engine or busy cores raise the timeout named (or lower rollout.max_in_flight, "
            "engine.max_new_tokens), or the success measures the machine, not the policy")
