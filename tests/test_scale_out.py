"""``fit`` with two training processes (gloo on CPU) under every strategy, as users run it.

Each strategy trains the tiny test recipe (tests/fixtures/tiny_bugfix.yaml) for 2 steps with 2
processes, then resumes from the run folder alone (no config, no strategy flags) for a third step.
Deterministic sampling makes the first step's episodes the same in every run, so each strategy's first
step must equal one process training on the whole batch: the same loss and the same gradient norm. A
resume with another process count is refused, and 2 nodes x 1 process (NODE_RANK=0/1 on this machine)
train like 1 node x 2 processes, each node with its own sandbox server.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sandbox_server.launch import free_port

REPO = Path(__file__).resolve().parent.parent
TASKS = ["binary_search_first", "balanced_brackets_unclosed"]
STRATEGIES = {
    "ddp": ["--trainer.strategy=ddp"],
    "zero2": ["--trainer.strategy=deepspeed_stage_2"],
    "zero2-offload": ["--trainer.strategy=deepspeed_stage_2", "--trainer.offload_optimizer=true"],
    # ZeRO-3 also evaluates: held-out episodes run on a full copy of the partitioned policy
    "zero3": ["--trainer.strategy=deepspeed_stage_3", "--eval.every_n_steps=2", "--eval.split=all",
              "--eval.samples_per_task=1"],
}

# A test's timeout covers its module fixture: two 2-process fits (about 2 x 1 min on 2 idle cores).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.skipif(
    __import__("importlib").util.find_spec("deepspeed") is None, reason="needs deepspeed (extra: cpu-engines)"
)]


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_model_path) -> Path:
    root = tmp_path_factory.mktemp("scale")
    for name in TASKS:
        shutil.copytree(REPO / "tasks" / "bugfix" / name, root / "tasks" / name)
    return root


def fit(root: Path, run: str, *overrides: str, config: bool = True, env: dict | None = None,
        wait: bool = True, quiet: bool = False):
    command = [sys.executable, "-m", "lightning_agentrl", "fit", f"--run.dir={root / run}", *overrides]
    if config:
        command[4:4] = [
            "--config", str(REPO / "tests" / "fixtures" / "tiny_bugfix.yaml"),
            f"--env.tasks={root / 'tasks'}", "--env.split=all", f"--model.cache_dir={REPO / '.cache' / 'lightning_agentrl'}",
            "--trainer.accelerator=cpu", "--trainer.threads=1", "--trainer.max_steps=2", "--trainer.lr=1e-3",
            "--algorithm.entropy_coef=0.01", "--engine.max_new_tokens=24", "--env.max_turns=2",
        ]
    full_env = {**os.environ, "PYTHONHASHSEED": "0", **(env or {})}
    if not wait:  # quiet: nobody reads its output (a pipe nobody reads would block it)
        out = subprocess.DEVNULL if quiet else subprocess.PIPE
        return subprocess.Popen(command, cwd=REPO, env=full_env, stdout=out, stderr=out, text=True)
    return subprocess.run(command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=600)


def ok(done) -> None:
    assert done.returncode == 0, done.stderr[-4000:]


def metric(run_dir: Path, key: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    return {m.step: m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)}


def groups(run_dir: Path, step: int) -> list[int]:
    lines = (run_dir / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()
    return sorted(json.loads(line)["group_id"] for line in lines)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


@pytest.fixture(scope="module")
def one_process(root) -> Path:
    ok(fit(root, "one"))
    return root / "one"


@pytest.fixture(scope="module", params=list(STRATEGIES))
def two_processes(request, root) -> tuple[str, Path]:
    """A 2-step run with 2 processes, then a resume from the run folder alone to step 3."""
    name = request.param
    ok(fit(root, name, "--trainer.devices=2", *STRATEGIES[name]))
    ok(fit(root, name, "--resume", "last", "--trainer.max_steps=3", config=False))
    return name, root / name


def test_two_processes_train_like_one_and_resume(two_processes, one_process):
    name, run = two_processes
    one = {key: metric(one_process, key) for key in ("loss/total", "policy/grad_norm", "tokens/train")}
    two = {key: metric(run, key) for key in one}
    # step 0: the same episodes; the loss, its denominators and the gradient of the whole step
    assert two["tokens/train"][0] == one["tokens/train"][0] > 0
    assert two["loss/total"][0] == pytest.approx(one["loss/total"][0], abs=1e-5), name
    assert two["policy/grad_norm"][0] == pytest.approx(one["policy/grad_norm"][0], rel=1e-4), name
    assert one["policy/grad_norm"][0] > 0
    # callbacks log the step of all ranks, as one process does (counts summed, not rank 0's share)
    for key in ("tokens/turns_checked", "staleness/num_kept", "termination/max_turns", "reward/mean"):
        assert metric(run, key)[0] == pytest.approx(metric(one_process, key)[0]), key
    # both ranks' whole groups were trained on and saved by rank 0; the resume went on from group 4
    assert groups(run, 0) == [0] * 4 + [1] * 4
    assert groups(run, 2) == [4] * 4 + [5] * 4
    assert sorted(metric(run, "loss/total")) == [0, 1, 2]
    assert metric(run, "mismatch/logprob_max")[0] < 1e-4  # the trainer saw the full output embedding
    if name == "zero3":
        assert sorted(metric(run, "eval/success")) == [0, 2, 3]  # before step 0, every 2 steps, at the end


def test_rank_zero_alone_writes_a_full_policy_and_the_checkpoint_exports_it(two_processes, tiny_model_path):
    name, run = two_processes
    assert len(list(run.glob("settings.resume-*.yaml"))) == 1 and (run / "settings.yaml").exists()
    assert not list(run.glob("sandbox_server.node*.log"))  # one node, one sandbox server
    policy, base = weights(run / "policy"), weights(tiny_model_path)
    assert {k: v.shape for k, v in policy.items()} == {k: v.shape for k, v in base.items()}  # gathered, not shards
    assert any(not torch.equal(policy[k], base[k]) for k in base)  # trained
    out = run.parent / f"{name}-export"
    done = subprocess.run([sys.executable, "-m", "lightning_agentrl", "export", str(run / "checkpoints" / "last.ckpt"),
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    ok(done)
    exported = weights(out)
    assert max(float((exported[k] - policy[k]).abs().max()) for k in policy) < 1e-6
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # a plain Hugging Face folder


def test_a_resume_with_another_process_count_or_strategy_is_refused(two_processes):
    name, run = two_processes
    if name != "ddp":
        pytest.skip("the refusal is checked once, on the DDP run")
    done = fit(run.parent, name, "--resume", "last", "--trainer.max_steps=4", "--trainer.devices=1", config=False)
    assert done.returncode == 2
    assert "trainer.devices: the run" in done.stderr and "ran with 2" in done.stderr and "asks for 1" in done.stderr
    done = fit(run.parent, name, "--resume", "last", "--trainer.strategy=deepspeed_stage_2", config=False)
    assert done.returncode == 2 and "'ddp'" in done.stderr and "'deepspeed_stage_2'" in done.stderr
    assert sorted(metric(run, "loss/total")) == [0, 1, 2]  # nothing ran


def test_two_nodes_of_one_process_train_like_one_process(root, one_process):
    """2 nodes x 1 process as torchrun or SLURM start them (each node its own command), here on one
    machine: the same first step as one process, and one sandbox server per node."""
    port = str(free_port())
    nodes = [
        fit(root, "nodes", "--trainer.num_nodes=2", "--trainer.strategy=ddp", wait=False,
            env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(rank), "LOCAL_RANK": "0"})
        for rank in (0, 1)
    ]
    for node in nodes:
        _, stderr = node.communicate(timeout=600)
        assert node.returncode == 0, stderr[-4000:]
    run = root / "nodes"
    assert (run / "sandbox_server.log").exists() and (run / "sandbox_server.node1.log").exists()
    assert groups(run, 0) == [0] * 4 + [1] * 4
    assert metric(run, "loss/total")[0] == pytest.approx(metric(one_process, "loss/total")[0], abs=1e-5)


def test_several_updates_per_batch_with_two_processes(root):
    """PPO epochs over mini-batches under DDP: each rank's share splits into whole-group mini-batches
    with denominators summed over ranks, every rank takes the same updates (a rank out of step would
    hang the collectives), and a training step stays one rollout batch."""
    run = "ppo-epochs"
    ok(fit(root, run, "--trainer.devices=2", "--trainer.strategy=ddp", "--rollout.groups_per_step=4",
           "--trainer.ppo_epochs=2", "--trainer.mini_batches=2"))
    updates = metric(root / run, "train/optimizer_updates")
    assert updates == {0: 4.0, 1: 4.0}
    assert all(math.isfinite(v) for v in metric(root / run, "loss/total").values())
    assert metric(root / run, "mismatch/logprob_max")[0] < 1e-4  # proximal log-probs from before the updates
    assert sorted(groups(root / run, 0)) == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4


def test_throughput_counts_the_tokens_of_every_rank(root):
    """Each rank trains its share of the batch: tokens per second is the whole step's, not rank 0's half."""
    run = root / "throughput"
    ok(fit(root, "throughput", "--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.max_steps=1"))
    lines = (run / "trajectories" / "step_000000.jsonl").read_text().splitlines()
    tokens = sum(len(segment["token_ids"]) for line in lines for segment in json.loads(line)["segments"])
    assert len({json.loads(line)["group_id"] for line in lines}) == 2 and tokens > 0  # both ranks' groups
    logged = metric(run, "throughput/tokens_per_s")[0] * metric(run, "time/step_s")[0]  # step 0
    assert logged == pytest.approx(tokens, rel=1e-9)


def test_zero3_with_two_processes_runs_the_privileged_critic_in_chunks(root):
    """The privileged critic's second forward runs in chunks of whole segments (each after its hidden tests) of
    about a micro-batch: at 1,200 tokens a micro-batch holds two episodes of one task, whose critic stream is two
    chunks for the longer task and one for the shorter. Under ZeRO-3 every forward gathers the weights on every
    rank, so the ranks must run as many: the run finishes (no collective left waiting) and the critic trained."""
    run = root / "zero3-critic"
    ok(fit(root, run.name, "--trainer.devices=2", "--trainer.strategy=deepspeed_stage_3", "--model.value_head=true",
           "--algorithm.advantage=gae", "--algorithm.privileged_critic=true", "--trainer.micro_batch_tokens=1200"))
    assert len(metric(run, "time/critic_forward_s")) == 2
    assert all(value > 0 for value in metric(run, "time/critic_forward_s").values())
    assert all(0 < value < 1e3 for value in metric(run, "policy/grad_norm").values())
