"""The same numbers on a CUDA device as on CPU (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from lightning_agentrl.algorithms import advantages, losses, staleness
from lightning_agentrl.algorithms.logprobs import token_logprobs

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_estimators_and_losses_match_cpu_on_cuda():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (32,), generator=g).float()
    group_ids = torch.arange(32) // 8
    turn_traj = torch.arange(32).repeat_interleave(3)
    keys = [f"{i % 5}-{k}" if k < 2 else f"end-{i}" for i in range(32) for k in range(3)]
    turn_rewards = torch.zeros(96)
    turn_rewards[2::3] = rewards
    n = 500
    mask = (torch.rand(n, generator=g) < 0.5).float()
    seq_ids = torch.sort(torch.randint(0, 32, (n,), generator=g)).values
    behavior = -torch.rand(n, generator=g)
    logprobs = behavior + 0.3 * torch.randn(n, generator=g)
    proximal = behavior + 0.1 * torch.randn(n, generator=g)
    version = torch.where(mask > 0, torch.randint(0, 4, (n,), generator=g), -1)

    def run(device: str):
        d = {k: v.to(device) for k, v in dict(rewards=rewards, group_ids=group_ids, turn_traj=turn_traj,
             turn_rewards=turn_rewards, mask=mask, seq_ids=seq_ids, behavior=behavior, logprobs=logprobs,
             proximal=proximal, version=version).items()}  # fmt: skip
        episode = advantages.grpo(d["rewards"], d["group_ids"])
        turn_adv, _ = advantages.gigpo(d["turn_rewards"], d["turn_traj"], keys, d["group_ids"])
        token_adv = advantages.expand_to_tokens(episode, d["seq_ids"], d["mask"])
        weights = staleness.staleness_weight(staleness.lag(d["version"], 4), "exp", decay=0.3)
        lp = d["logprobs"].clone().requires_grad_(True)
        out = [episode, turn_adv, advantages.rloo(d["rewards"], d["group_ids"])]
        for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
            loss, _ = losses.policy_loss(lp, d["behavior"], token_adv, d["mask"], d["seq_ids"], agg=agg,
                                         proximal_logprobs=d["proximal"], is_weights=weights, is_cap=2.0,
                                         dual_clip=3.0)  # fmt: skip
            (grad,) = torch.autograd.grad(loss, lp)
            out += [loss, grad]
        return [t.detach().cpu() for t in out]

    for cpu, cuda in zip(run("cpu"), run("cuda"), strict=True):
        assert torch.allclose(cpu, cuda, atol=1e-5), (cpu - cuda).abs().max()


def test_chunked_logprobs_in_bfloat16_on_cuda():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3000, 256, generator=g)
    weight = torch.randn(32000, 256, generator=g) * 0.05
    targets = torch.randint(0, 32000, (3000,), generator=g)
    want = torch.log_softmax((hidden @ weight.T).double(), -1).gather(-1, targets[:, None])[:, 0]
    h = hidden.cuda().bfloat16().requires_grad_(True)
    w = weight.cuda().bfloat16().requires_grad_(True)
    logp, entropy = token_logprobs(h, w, targets.cuda(), chunk_size=512)
    assert logp.dtype == torch.float32 and torch.isfinite(entropy).all()
    assert (logp.double().cpu() - want).abs().max() < 0.1  # bf16 logits; reduction in fp32
    logp.sum().backward()
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
