"""What the fit-level path tests share: the copy-the-key suite, a recorded run, and a policy that
solves some episodes so that groups have reward variance (the random tiny model never succeeds).

:class:`TeacherForcedEngine` wraps the real engine: scripted episodes get the tokens of fixed
actions, with behavior log-probs computed by the engine's own model on exactly those tokens (the
distribution the engine samples from), so importance ratios, the token check and the lag-0
mismatch stay what they are for sampled tokens. Every other episode is sampled by the engine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lightning as L
import torch

from lightning_agentrl.algorithms.logprobs import sampling_logits
from lightning_agentrl.rollout.engine import Generation
from lightning_agentrl.settings import load_settings
from lightning_agentrl.train import fit

REPO = Path(__file__).resolve().parent.parent
LEARN_TASKS = ["train_000", "train_001"]
TINY = ["--model.tiny_hidden_size=64", "--model.tiny_num_layers=1"]


def call(name: str, **arguments: str) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


SOLVE = [call("run", command="cp key.txt answer.txt"), call("submit")]  # reward 1 on any copy-the-key task


class TeacherForcedEngine:
    """Plays ``script`` (session id ``g0-e1``, group ``g0``, episode index ``e1`` or ``*`` -> action texts, one per turn, the
    last repeated) with the wrapped torch engine's log-probs; other sessions go to the engine."""

    def __init__(self, engine, codec, script: dict[str, list[str]]) -> None:
        self.engine, self.codec, self.script = engine, codec, script
        self._turns: dict[str, int] = {}

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def actions(self, session_id: str) -> list[str] | None:
        group, episode = session_id.split("-")
        return self.script.get(session_id) or self.script.get(group) or self.script.get(episode) or self.script.get("*")

    async def generate(self, prompt_ids, sampling, session_id):
        actions = self.actions(session_id)
        if actions is None:
            return await self.engine.generate(prompt_ids, sampling, session_id)
        index = self._turns.get(session_id, 0)
        self._turns[session_id] = index + 1
        ids = (self.codec.encode(actions[min(index, len(actions) - 1)]) + [self.codec.eos_token_id])
        ids = ids[: sampling.max_new_tokens]
        # synchronous: a weight update (on this event loop) cannot land between the version and the forward
        version = self.engine.policy_version
        model = self.engine.model
        with torch.no_grad():
            logits = model(torch.tensor([list(prompt_ids) + ids], device=model.device)).logits[0].float()
        chosen_ids = torch.tensor(ids, device=logits.device)
        # the engines' log-prob rule: logits / T within the top-k and top-p nucleus, renormalized
        filtered = sampling_logits(logits[len(prompt_ids) - 1 : -1], max(sampling.temperature, 1e-6),
                                   sampling.top_p, sampling.top_k, keep_ids=chosen_ids)
        chosen = torch.log_softmax(filtered, dim=-1).gather(1, chosen_ids[:, None]).squeeze(1)
        reason = "stop" if ids[-1] == self.codec.eos_token_id else "length"
        return Generation(ids, chosen.tolist(), reason, version)

    async def update_weights(self, named_tensors, version):
        await self.engine.update_weights(named_tensors, version)

    async def close(self):
        await self.engine.close()


class StepLog(L.Callback):
    """Every trained batch and the metrics logged at its step (``trainer.callback_metrics``)."""

    def __init__(self) -> None:
        self.batches = []
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def learn_settings(root: Path, *overrides: str, tasks: list[str] = LEARN_TASKS):
    """Two copy-the-key tasks, tiny shapes, one torch thread, no MLflow; 2 steps unless overridden."""
    for name in tasks:
        if not (root / "tasks" / name).exists():
            shutil.copytree(REPO / "tasks" / "learn" / name, root / "tasks" / name)
    return load_settings(
        REPO / "tests" / "fixtures" / "tiny_bugfix.yaml",
        [f"--run.dir={root / 'run'}", f"--env.tasks={root / 'tasks'}", "--env.split=all",
         f"--model.cache_dir={REPO / '.cache' / 'lightning_agentrl'}", "--trainer.threads=1",
         "--trainer.max_steps=2", "--engine.max_new_tokens=48", "--env.max_turns=2", "--rollout.group_size=2",
         "--rollout.groups_per_step=2", "--rollout.max_in_flight=4", "--tracking.enabled=false",
         "--tracking.sample_trajectories=0", "--trainer.lr=1e-3", *TINY, *overrides],
    )


def scripted_fit(settings, script: dict[str, list[str]] | None = None, callbacks: list | tuple = ()):
    """``fit`` with ``script``'s episodes teacher-forced; returns the result and the step log."""
    from lightning_agentrl.rollout.chat import ChatCodec

    log = StepLog()

    def wrap(engine):
        if not script:
            return engine
        from transformers import AutoTokenizer

        from lightning_agentrl.train import resolve_model_path

        return TeacherForcedEngine(engine, ChatCodec(AutoTokenizer.from_pretrained(resolve_model_path(settings))), script)

    result = fit(settings, callbacks=[log, *callbacks], wrap_engine=wrap)
    return result, log


def main(argv: list[str], log: str | None = None) -> None:
    """``python -m tests.fitting OUT.json ROOT --section.field=value ...``: one scripted ``fit`` (episode 0
    of each group solves its task), its steps' metrics and turn counts written to OUT.json; with ``log``,
    stdout and stderr go to that file."""
    if log is not None:
        import os

        handle = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(handle, 1)
        os.dup2(handle, 2)
    out, root, *overrides = argv
    settings = learn_settings(Path(root), *overrides)
    # the teacher-forced solver reads the torch engine's model; vLLM rows sample every episode
    result, log = scripted_fit(settings, {"e0": SOLVE} if settings.engine.kind == "torch" else None)
    turns = [int(batch.turn_episode.numel()) for batch in log.batches]
    import resource

    cpu_s = sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))
    Path(out).write_text(json.dumps({"global_step": result.global_step, "metrics": log.metrics, "turns": turns,
                                     "cpu_s": cpu_s}))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
