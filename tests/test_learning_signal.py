"""A run whose policy never earns a varying reward says so, skips the work of a zero gradient, and stops.

The random tiny model never writes a valid move in the key-and-door maze (an environment without the
sandbox service): reward 0 everywhere, every group without variance, every advantage 0."""

from __future__ import annotations

import json

import lightning as L
import torch

from tests.fitting import learn_settings, scripted_fit
from tests.test_keydoor import MAP, moves


def maze_settings(root, *overrides: str):
    tasks = root / "maze.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"m{i}", "map": MAP}) + "\n" for i in range(2)))
    return learn_settings(root, "--env.kind=keydoor", f"--env.tasks={tasks}", *overrides)


class ForwardSizes(L.Callback):
    """The number of tokens of every forward pass of the policy's decoder during training steps."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.weights_before: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module):
        self.weights_before = {k: v.detach().clone() for k, v in pl_module.policy.state_dict().items()}
        pl_module.policy.get_decoder().register_forward_hook(lambda module, args, kwargs, out: self.sizes.append(
            int((args[0] if args else kwargs["input_ids"]).numel())), with_kwargs=True)


def test_a_step_without_learning_signal_skips_its_forward_and_backward_and_warns(tmp_path, recwarn):
    sizes = ForwardSizes()
    settings = maze_settings(tmp_path, "--trainer.max_steps=2", "--trainer.micro_batch_tokens=64")
    result, log = scripted_fit(settings, callbacks=[sizes])
    assert result.global_step == 2 and (result.num_batches, result.num_without_signal) == (2, 2)
    tokens = [int(batch.num_tokens) for batch in log.batches]
    assert min(tokens) > 200  # a batch is several micro-batches of 64 tokens
    # per step: the diagnostics forward of the first micro-batch (about 64 tokens) and a 2-token zero loss
    assert len(sizes.sizes) == 4 and max(sizes.sizes) < min(tokens) / 2, (sizes.sizes, tokens)
    for step in log.metrics:
        assert step["policy/grad_norm"] == 0.0 and step["loss/total"] == 0.0
        assert step["train/steps_without_signal"] >= 1
        assert 0 <= step["mismatch/logprob_max"] < 1e-4  # still measured, on the first micro-batch
        assert step["policy/entropy"] > 0
    after = result.policy_dir
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(after).state_dict()
    assert all(torch.equal(saved[k], v) for k, v in sizes.weights_before.items() if k in saved)  # a zero gradient
    warnings = [str(w.message) for w in recwarn if "no learning signal" in str(w.message)]
    assert len(warnings) == 1, warnings  # at the first such step only
    assert warnings[0].startswith("step 0: no learning signal, every advantage is 0 (every episode earned reward 0;")
    assert "rollout.max_steps_without_signal" in warnings[0]


def test_a_step_with_signal_trains_as_before(tmp_path):
    from lightning_agentrl.envs.keydoor import parse_task, solve

    settings = maze_settings(tmp_path, "--trainer.max_steps=1", "--env.max_turns=10")
    result, log = scripted_fit(settings, {"e0": moves(*solve(parse_task({"id": "m", "map": MAP}, "test")))})
    assert (result.num_batches, result.num_without_signal) == (1, 0)
    assert log.metrics[0]["policy/grad_norm"] > 0 and log.metrics[0]["train/steps_without_signal"] == 0


def test_steps_without_signal_stop_the_run_with_exit_3_and_a_short_run_says_it_in_its_closing_line(tmp_path, capsys):
    from lightning_agentrl.__main__ import main
    from tests.fitting import REPO, TINY

    maze_settings(tmp_path)  # writes the tasks
    common = ["--config", str(REPO / "tests" / "fixtures" / "tiny_bugfix.yaml"), "--env.kind=keydoor",
              f"--env.tasks={tmp_path / 'maze.jsonl'}", "--env.split=all", "--trainer.threads=1", "--engine.max_new_tokens=24", "--env.max_turns=1",
              "--rollout.group_size=2", "--rollout.max_in_flight=4", "--tracking.enabled=false", *TINY]
    assert main(["fit", *common, f"--run.dir={tmp_path / 'a'}", "--trainer.max_steps=3",
                 "--rollout.max_steps_without_signal=2"]) == 3
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: no learning signal in 2 steps in a row (rollout.max_steps_without_signal=2): every advantage was 0; "
        "the last batch: every episode earned reward 0;"), err[-2000:]
    # the stopping step is checkpointed: a resume with a higher limit goes on from step 2, not from step 1
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    assert f"Checkpoint: {last} (step 2)." in errors[0]
    import torch

    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 2
    assert main(["fit", *common, f"--run.dir={tmp_path / 'b'}", "--trainer.max_steps=1"]) == 0
    closing = [line for line in capsys.readouterr().err.splitlines() if line.startswith("done: ")]
    assert closing == [f"done: 1 optimizer steps in {tmp_path / 'b'}, no learning signal in 1 of 1 steps (every "
                       "advantage 0: see the warning above)"], closing


def test_the_limit_is_a_positive_count_or_null():
    import pytest

    from lightning_agentrl.settings import SettingsError, load_settings

    assert load_settings(None, ["--rollout.max_steps_without_signal=null"]).rollout.max_steps_without_signal is None
    assert load_settings(None, []).rollout.max_steps_without_signal == 10
    with pytest.raises(SettingsError, match="rollout.max_steps_without_signal"):
        load_settings(None, ["--rollout.max_steps_without_signal=0"])
