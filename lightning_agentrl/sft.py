"""``python -m lightning_agentrl sft --config ...``: a supervised warm start before RL.

A pretrained instruct model that has never seen an environment's tool format gets reward 0 on every
episode (SmolLM2-135M-Instruct: 0.000 submitted on every shipped task), and RL from reward 0 has no
gradient. ``sft`` trains the policy on demonstrations first:

- **Data.** Each task of the *training* split (never a held-out one: ``env.split`` must be ``train``) is
  played ``sft.demos_per_task`` times by the environment's own solver (``Environment.demonstration``):
  its actions go through :meth:`Environment.step`, so the observations are the environment's own (a coding
  task's sandbox included). Each episode becomes token ids exactly as the rollout loop builds them
  (:mod:`lightning_agentrl.rollout.agent_loop`): the chat template's prompt with the environment's tools
  (``tools=`` where the template renders them), each action's ids and the end-of-turn id (loss mask 1), each
  observation inside the template's scaffolding (mask 0). A demonstration that ``fit`` could not produce (an
  action longer than ``engine.max_new_tokens``, more turns than ``env.max_turns``, a context past
  ``env.max_context_tokens``) is left out, and counted; so is one that does not solve its task (a reward below
  the full reward, :data:`~lightning_agentrl.callbacks.evaluation.SOLVED_REWARD`: a wrong ``solution/``),
  so a failed episode is never imitated.
- **Loss.** The mean negative log-likelihood of the mask-1 tokens of a batch (token mean, as ``fit``'s
  ``token-mean``), with ids ``y`` [T] and mask ``m`` [T] per demonstration::

      L = -(1 / sum_b sum_t m_b[t]) * sum_b sum_t m_b[t] * log p(y_b[t] | y_b[<t])

  computed one demonstration at a time (memory of one sequence) and chunked over positions
  (:func:`~lightning_agentrl.algorithms.logprobs.token_logprobs`, no ``[T, V]`` logits).
- **Outputs** as ``fit``'s: ``<run.dir>/settings.yaml``, an MLflow run (``sft/loss``, ``sft/grad_norm``,
  ``sft/action_tokens``), ``checkpoints/`` (``export`` reads them), ``policy/`` (``fit --model.path`` and
  ``evaluate`` read it) and ``demonstrations.jsonl`` (the decoded episodes, their rewards).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from dataclasses import dataclass

import lightning as L
import torch
from typing_extensions import override

from lightning_agentrl.callbacks.evaluation import SOLVED_REWARD
from lightning_agentrl.run_layout import RunLayout
from lightning_agentrl.settings import Settings, SettingsError


@dataclass(frozen=True)
class Demonstration:
    """One solved episode as training data: ``token_ids`` [T] and ``loss_mask`` [T] (1 = an action token)."""

    task_id: str
    token_ids: list[int]
    loss_mask: list[int]
    reward: float
    num_turns: int
    longest_action: int


def check_sft_settings(settings: Settings) -> None:
    """What ``sft`` refuses before any work: held-out tasks as data, a resume, several processes."""
    if settings.env.split != "train":
        raise SettingsError(f"env.split: sft learns from the training split only (held-out tasks stay unseen), got "
                            f"{settings.env.split!r}")
    if settings.run.resume != "never":
        raise SettingsError("run.resume: sft does not resume (a warm start is short); start a new run.dir")
    t = settings.trainer
    if t.devices != 1 or t.num_nodes != 1 or t.uses_deepspeed:
        raise SettingsError("trainer.devices: sft trains in one process (trainer.devices=1, trainer.num_nodes=1, no "
                            "DeepSpeed strategy)")
    if settings.env.kind == "gateway":
        raise SettingsError("env.kind: gateway episodes are played by an external agent; sft has no solver for them")


def action_targets(loss_mask: list[int]) -> torch.Tensor:
    """Positions whose next token is trained: ``t`` with ``m[t + 1] = 1`` (the hidden state at ``t``
    predicts token ``t + 1``). Shapes: loss_mask [T] -> positions [N], N = sum(m[1:]).

    >>> action_targets([0, 0, 1, 1, 0, 1]).tolist()
    [1, 2, 4]
    """
    mask = torch.tensor(loss_mask[1:], dtype=torch.bool)
    return torch.nonzero(mask).squeeze(-1)


async def play_demonstration(env, codec, rng: random.Random, *, max_observation_chars: int) -> Demonstration | None:
    """The environment's solution of its episode, as ids and mask built the way the rollout loop builds them;
    None when the environment has no solver for it."""
    from lightning_agentrl.envs.base import checked_messages, checked_step

    try:
        messages = checked_messages(env, await env.reset())
        ids = codec.prompt_ids(messages, tools=env.tools)
        mask = [0] * len(ids)
        actions = env.demonstration(rng)
        if actions is None:
            return None
        reward, longest = 0.0, 0
        for action in actions:
            action_ids = [*codec.encode(action), codec.end_of_turn_id]  # as sampled: the stop id ends the action
            ids += action_ids
            mask += [1] * len(action_ids)
            longest = max(longest, len(action_ids))
            result = checked_step(env, await env.step(action), max_observation_chars=max_observation_chars)
            if result.done:
                reward = result.reward
                break
            observation = codec.observation_ids(result.observation).all
            ids += observation
            mask += [0] * len(observation)
        return Demonstration(getattr(env.task, "id", "?"), ids, mask, reward, len(actions), longest)
    finally:
        await env.close()


def build_demonstrations(settings: Settings, codec, tasks: list, client) -> tuple[list[Demonstration], Counter]:
    """``sft.demos_per_task`` demonstrations of every task; the second value counts those left out, by reason."""
    from lightning_agentrl.envs.registry import env_class
    from lightning_agentrl.rollout.chat import native_tools

    cls, env, rng = env_class(settings.env.kind), settings.env, random.Random(settings.run.seed)
    tools_in_template = native_tools(settings, codec)

    async def play_all() -> list[Demonstration | None]:
        played = []
        for task in tasks:
            for _ in range(settings.sft.demos_per_task):
                made = cls.from_settings(task, client=client, settings=env, native_tools=tools_in_template)
                played.append(await play_demonstration(made, codec, rng, max_observation_chars=env.max_observation_chars))
        return played

    kept, left_out = [], Counter()
    for demo in asyncio.run(play_all()):
        reason = _left_out_because(settings, demo)
        if reason is None:
            kept.append(demo)
        else:
            left_out[reason] += 1
    if not kept:
        reasons = ", ".join(f"{count} {why}" for why, count in left_out.items())
        raise SettingsError(f"env.tasks: no demonstration of the {len(tasks)} training tasks in {settings.env.tasks} "
                            f"can be trained on ({reasons})")
    return kept, left_out


def _left_out_because(settings: Settings, demo: Demonstration | None) -> str | None:
    if demo is None:
        return f"without a solver ({settings.env.kind} returns no Environment.demonstration)"
    if demo.reward < SOLVED_REWARD:  # a wrong solution: imitating it would teach the failure
        return f"where the solver failed (reward below {SOLVED_REWARD:g})"
    if demo.num_turns > settings.env.max_turns:
        return f"longer than env.max_turns={settings.env.max_turns} turns"
    if demo.longest_action > settings.engine.max_new_tokens:
        return f"with an action longer than engine.max_new_tokens={settings.engine.max_new_tokens} tokens"
    if len(demo.token_ids) > settings.env.max_context_tokens:
        return f"longer than env.max_context_tokens={settings.env.max_context_tokens}"
    return None


def demonstration_batches(demos: list[Demonstration], *, steps: int, batch_size: int, seed: int) -> list[list]:
    """``steps`` batches of ``batch_size`` demonstrations: passes over a seeded shuffle, one after another."""
    rng, order, batches = random.Random(seed), [], []
    for _ in range(steps):
        batch = []
        while len(batch) < batch_size:
            if not order:
                order = list(range(len(demos)))
                rng.shuffle(order)
            batch.append(demos[order.pop()])
        batches.append(batch)
    return batches


class SFTModule(L.LightningModule):
    """The policy trained on demonstrations. Its checkpoints hold ``policy.*`` weights and the model path like
    :class:`~lightning_agentrl.module.AgentRLModule`'s, so ``export`` and ``ExportPolicy`` read them alike."""

    def __init__(self, settings: Settings, model_path: str) -> None:
        super().__init__()
        self.settings, self.model_path, self.policy = settings, model_path, None
        self.automatic_optimization = False  # one backward per demonstration: the memory of one sequence
        self.strict_loading = not settings.model.lora
        self.save_hyperparameters({"settings": settings.model_dump(mode="json"), "model_path": model_path}, logger=False)

    @override
    def configure_model(self) -> None:
        if self.policy is not None:
            return
        from lightning_agentrl.policy import load_policy

        self.policy = load_policy(self.model_path, self.settings.model, seed=self.settings.run.seed)

    @override
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.settings.model.lora:  # the frozen base comes from model.path, as in fit's checkpoints
            from lightning_agentrl.lora import trainable_names

            keep = trainable_names(self)
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}

    @override
    def configure_optimizers(self):
        t = self.settings.trainer
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.settings.sft.lr, eps=t.adam_eps, weight_decay=t.weight_decay)

    @override
    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch  # demonstrations become tensors one at a time, in training_step

    def action_logprobs(self, demo: Demonstration) -> torch.Tensor:
        """log p of each mask-1 token of ``demo`` [N]."""
        from lightning_agentrl.algorithms.logprobs import token_logprobs
        from lightning_agentrl.lora import hf_model

        model = hf_model(self.policy) if self.settings.model.lora else self.policy
        ids = torch.tensor([demo.token_ids], device=self.device)
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0]  # [T, H]
        positions = action_targets(demo.loss_mask).to(self.device)
        head = model.get_output_embeddings()
        logprobs, _ = token_logprobs(hidden[positions], head.weight, ids[0, positions + 1], compute_entropy=False,
                                     chunk_size=self.settings.trainer.logprob_chunk_tokens,
                                     lm_head_bias=getattr(head, "bias", None))
        return logprobs

    @override
    def training_step(self, batch: list[Demonstration], batch_idx: int) -> None:
        optimizer = self.optimizers()
        num_tokens = sum(sum(demo.loss_mask[1:]) for demo in batch)
        total = 0.0
        for demo in batch:
            loss = -self.action_logprobs(demo).sum() / num_tokens
            self.manual_backward(loss)
            total += float(loss.detach())
        params = [p for p in self.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.settings.trainer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.log_dict({"sft/loss": total, "sft/grad_norm": float(grad_norm), "sft/action_tokens": float(num_tokens)},
                      prog_bar=True, on_step=True, batch_size=len(batch))


def sft(settings: Settings):
    """Warm-start the policy on demonstrations as ``settings`` say; returns a :class:`~lightning_agentrl.train.FitResult`."""
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    from lightning_agentrl.callbacks.export_policy import ExportPolicy
    from lightning_agentrl.checkpoint_io import AtomicCheckpointIO, StepCheckpoint
    from lightning_agentrl.lora import check_lora
    from lightning_agentrl.models.resolve import resolve_model_path
    from lightning_agentrl.rollout.chat import chat_codec
    from lightning_agentrl.tracking import attach_logger, finish_run, tracking_uri
    from lightning_agentrl.train import FitResult, build_tasks, prepare_run

    check_sft_settings(settings)
    layout, _ = prepare_run(settings)
    tasks = build_tasks(settings)
    model_path = resolve_model_path(settings)
    check_lora(settings.model, model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    codec = chat_codec(settings, tokenizer)
    demos = _demonstrations(settings, codec, tasks, layout)
    s, t = settings.sft, settings.trainer
    batches = demonstration_batches(demos, steps=s.steps, batch_size=s.batch_size, seed=settings.run.seed)
    trainer = L.Trainer(
        max_steps=s.steps, accelerator=t.accelerator, devices=1, precision=t.precision, logger=False,
        callbacks=[StepCheckpoint(layout.checkpoints, t.checkpoint_every),
                   ExportPolicy(layout.policy, tokenizer, adapter_directory=layout.adapter)],
        plugins=[AtomicCheckpointIO()], default_root_dir=layout.root, log_every_n_steps=1, num_sanity_val_steps=0,
        limit_val_batches=0, enable_model_summary=False,
    )
    logger = attach_logger(settings, layout, trainer)
    trainer.fit(SFTModule(settings, model_path), train_dataloaders=DataLoader(batches, batch_size=None,
                                                                              collate_fn=_as_is))
    finish_run(settings, layout, trainer, logger)
    return FitResult(run_dir=layout.root, checkpoint=layout.last_checkpoint, policy_dir=layout.policy,
                     tracking_uri=tracking_uri(settings, layout) if logger is not None else None,
                     mlflow_run_id=logger.run_id if logger is not None else None, global_step=trainer.global_step)


def _as_is(batch):
    return batch


def _demonstrations(settings: Settings, codec, tasks: list, layout: RunLayout) -> list[Demonstration]:
    """The demonstrations (with the sandbox service up while they are played, where the environment uses it),
    written to ``<run.dir>/demonstrations.jsonl``; a line says how many, and what was left out."""
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

    from lightning_agentrl.sandbox import make_sandbox

    sandbox = make_sandbox(settings, layout.root)
    try:
        if sandbox.url is None:  # sandbox.url unset: the reference server on loopback, as fit starts it
            sandbox.start()
        demos, left_out = build_demonstrations(settings, codec, tasks, sandbox.make_client())
    finally:
        sandbox.close()
    with open(layout.demonstrations, "w", encoding="utf-8") as out:
        for demo in demos:
            record = {"task_id": demo.task_id, "reward": demo.reward, "turns": demo.num_turns,
                      "action_tokens": sum(demo.loss_mask), "text": codec.tokenizer.decode(demo.token_ids)}
            out.write(json.dumps(record) + "\n")
    mean_reward = sum(d.reward for d in demos) / len(demos)
    rank_zero_info(f"sft: {len(demos)} demonstrations of {len(tasks)} training tasks, mean reward {mean_reward:.2f}, "
                   f"{sum(sum(d.loss_mask) for d in demos) / len(demos):.0f} action tokens each on average"
                   + (" (played in the sandbox service)" if sandbox.uses_service else ""))
    if left_out:
        rank_zero_warn("sft: left out " + ", ".join(f"{count} {why}" for why, count in left_out.items()))
    return demos
