"""One loss across ranks: R processes x B/R episodes give the gradient of 1 process x B episodes.

Real processes (torchrun, gloo). Each rank holds whole groups, computes its share of the step with
the step's global denominators, and the gradients are averaged over ranks as DDP and ZeRO do.
The ranks get episodes of different lengths, so one runs more micro-batches than the other and
the zero-loss backward passes that keep the collectives in step are exercised too.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sandbox_server.launch import free_port

REPO = Path(__file__).resolve().parent.parent

CASES = {
    "token-mean": ["--algorithm.aggregation=token-mean"],
    "seq-mean-token-mean": ["--algorithm.aggregation=seq-mean-token-mean"],
    "seq-mean-token-sum": ["--algorithm.aggregation=seq-mean-token-sum"],
    "gae-critic": ["--algorithm.aggregation=token-mean", "--model.value_head=true", "--algorithm.advantage=gae"],
}

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from tests.test_module import make_batch
    from lightning_agentrl.batching import micro_batches
    from lightning_agentrl.module import AgentRLModule
    from lightning_agentrl.settings import load_settings
    from lightning_agentrl.trajectory import pack

    model_path, out, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    rank = int(os.environ["RANK"])
    common = ["--trainer.micro_batch_tokens=64", "--algorithm.entropy_coef=0.01", "--algorithm.kl_coef=0.0"]

    def grads(module, batch):
        module.zero_grad(set_to_none=True)
        log = module.accumulate_gradients(batch)
        return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}, log

    result = {}
    modules = {}
    for name, overrides in cases.items():
        torch.manual_seed(0)
        module = AgentRLModule(load_settings(overrides=common + overrides), model_path)
        module.configure_model()
        if module.value_head is not None:  # a head that predicts something (at 0 explained variance is 0 everywhere)
            torch.nn.init.normal_(module.value_head.weight, std=0.02)
            torch.nn.init.constant_(module.value_head.bias, 0.3)
        modules[name] = module
    policy = modules["token-mean"].policy
    long = make_batch(policy, [1, 0, 1, 1], seed=1, turns=3).trajectories           # group 0
    short = [t.model_copy(update={"group_id": 1, "episode_id": "s" + t.episode_id})  # group 1
             for t in make_batch(policy, [0, 1, 0, 0], seed=2, turns=1).trajectories]
    # the reference: one process, the whole step, before any process group exists
    reference = {name: grads(module, pack(long + short)) for name, module in modules.items()}

    dist.init_process_group("gloo")
    share = pack(long if rank == 0 else short)
    for name, module in modules.items():
        g, log = grads(module, share)
        for tensor in g.values():
            dist.all_reduce(tensor)
            tensor /= dist.get_world_size()  # DDP and ZeRO average gradients over ranks
        g_ref, log_ref = reference[name]
        assert set(g) == set(g_ref), (name, set(g) ^ set(g_ref))
        result[name] = {
            "max_grad_diff": max(float((g[k] - g_ref[k]).abs().max()) for k in g),
            "max_grad": max(float(g_ref[k].abs().max()) for k in g_ref),
            "loss": [log["loss/total"], log_ref["loss/total"]],
            "tokens": [log["tokens/train"], log_ref["tokens/train"]],
            "micro_batches": len(micro_batches(share.episode_ids, 64)),
            "explained_variance": [log.get("value/explained_variance"), log_ref.get("value/explained_variance")],
        }
    gathered = [None, None]
    dist.all_gather_object(gathered, result)
    if rank == 0:
        json.dump(gathered, open(out, "w"))
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def two_rank_gradients(tmp_path_factory, tiny_model_path):
    root = tmp_path_factory.mktemp("ddp-grad")
    script, out = root / "worker.py", root / "out.json"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        str(script), str(tiny_model_path), str(out), json.dumps(CASES),
    ]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_the_gradient_of_one(two_rank_gradients, case):
    rank0, rank1 = (ranks[case] for ranks in two_rank_gradients)
    assert rank0["max_grad"] > 1e-4  # a real gradient, not zeros compared with zeros
    for rank in (rank0, rank1):
        assert rank["max_grad_diff"] < 1e-6, rank
        assert rank["loss"][0] == pytest.approx(rank["loss"][1], abs=1e-6)  # the step's loss, summed
        assert rank["tokens"][0] == rank["tokens"][1]  # global action-token count
    # uneven shares: the rank with fewer micro-batches ran zero-loss backward passes
    assert rank0["micro_batches"] > rank1["micro_batches"]


def test_two_ranks_give_the_critics_explained_variance_of_one(two_rank_gradients):
    """Pooled over the ranks from their sums, not the mean of each rank's own value (which is not the batch's)."""
    for ranks in two_rank_gradients:
        two, one = ranks["gae-critic"]["explained_variance"]
        assert one is not None and not math.isnan(one) and abs(one) > 1e-3
        assert two == pytest.approx(one, rel=1e-6)
