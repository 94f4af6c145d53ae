"""Credit assignment: which tokens get credit, and how much.

Every estimator here is a pure function on tensors (no Lightning, no I/O). Shapes:

    B  trajectories (episodes) in the batch
    G  trajectories of one task in one group (``group_ids`` marks them)
    K  turns of all trajectories, flattened; turns of a trajectory are contiguous and in order
    N  packed tokens of the whole batch

Episode-level estimators (``grpo``, ``rloo``, ``reinforce_decay``) return ``Tensor[B]``: every action
token of trajectory ``i`` later receives the same ``A_i`` through ``expand_to_tokens``. Step-level
estimators (``gigpo``, ``gae``) return ``Tensor[K]``, expanded with the token's turn index.

Worked example (SPEC §3), one group, rewards ``R = [1, 0, 1, 1]``:

>>> import torch
>>> R, g = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.zeros(4, dtype=torch.long)
>>> [round(a, 3) for a in grpo(R, g).tolist()]
[0.577, -1.732, 0.577, 0.577]
>>> [round(a, 3) for a in grpo(R, g, std="sample").tolist()]
[0.5, -1.5, 0.5, 0.5]
>>> [round(a, 3) for a in rloo(R, g).tolist()]
[0.333, -1.0, 0.333, 0.333]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor

StdKind = Literal["population", "sample", "none"]


# ----------------------------------------------------------------------------------------------
# group bookkeeping
# ----------------------------------------------------------------------------------------------


def _check_1d(name: str, x: Tensor, length: int | None = None) -> None:
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
    if length is not None and x.numel() != length:
        raise ValueError(f"{name} has {x.numel()} entries, expected {length}")


def _group_stats(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-element group size, mean, population variance and "all equal" flag (float64).

    values[B] float, group_ids[B] int -> four Tensor[B] (each element gets its group's value).
    """
    _check_1d("values", values)
    _check_1d("group_ids", group_ids, values.numel())
    if group_ids.dtype.is_floating_point:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    v = values.detach().to(torch.float64)
    size = torch.zeros(num_groups, dtype=torch.float64, device=v.device).index_add_(
        0, inverse, torch.ones_like(v)
    )
    total = torch.zeros_like(size).index_add_(0, inverse, v)
    mean = total / size
    centered = v - mean[inverse]
    var = torch.zeros_like(size).index_add_(0, inverse, centered * centered) / size
    # Exact equality, not var < eps: a group of identical rewards must give exactly 0 advantage.
    vmax = torch.full_like(size, -math.inf).scatter_reduce_(0, inverse, v, reduce="amax")
    vmin = torch.full_like(size, math.inf).scatter_reduce_(0, inverse, v, reduce="amin")
    constant = vmax == vmin
    return size[inverse], mean[inverse], var[inverse], constant[inverse]


def _normalize_in_groups(values: Tensor, group_ids: Tensor, std: StdKind, eps: float) -> Tensor:
    """(v - group mean) / (group std + eps), or mean-only for std="none"; constant groups -> 0."""
    if std not in ("population", "sample", "none"):
        raise ValueError(f"std must be 'population', 'sample' or 'none', got {std!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    size, mean, var, constant = _group_stats(values, group_ids)
    centered = values.detach().to(torch.float64) - mean
    if std == "population":
        adv = centered / (var.sqrt() + eps)
    elif std == "sample":
        # Bessel's correction (torch.std's default); a singleton group is constant, handled below.
        sample_var = var * size / (size - 1).clamp(min=1)
        adv = centered / (sample_var.sqrt() + eps)
    else:
        adv = centered
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.to(values.dtype if values.dtype.is_floating_point else torch.float32)


# ----------------------------------------------------------------------------------------------
# episode-level estimators
# ----------------------------------------------------------------------------------------------


def grpo(rewards: Tensor, group_ids: Tensor, std: StdKind = "population", eps: float = 1e-6) -> Tensor:
    """GRPO group-normalized advantage (https://arxiv.org/abs/2402.03300), or Dr.GRPO's mean-only.

    ``A_i = (R_i - mean_g(R)) / (std_g(R) + eps)`` over the trajectories of ``i``'s group ``g``.

    - ``std="population"``: divide by G (the GRPO paper's std; SPEC vector [+0.577, -1.732, ...]).
    - ``std="sample"``: divide by G-1 (``torch.std``'s default, as in several trainers; [+0.5, -1.5, ...]).
    - ``std="none"``: Dr.GRPO (https://arxiv.org/abs/2503.20783) drops the std: ``A_i = R_i - mean``.
      Dividing by the std up-weights groups whose rewards barely differ (easy or hopeless tasks).

    Groups whose rewards are all equal (all-correct / all-wrong, or of size 1) carry no signal and
    get exactly 0. Advantages sum to zero within each group.

    Shapes: rewards[B] float, group_ids[B] int64 -> Tensor[B] (rewards' dtype).
    """
    return _normalize_in_groups(rewards, group_ids, std, eps)


def rloo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """REINFORCE leave-one-out baseline (https://arxiv.org/abs/2402.14740; DeepSWE's estimator).

    ``A_i = R_i - (1 / (G - 1)) * sum_{j != i} R_j  =  G / (G - 1) * (R_i - mean_g(R))``; no std.
    The baseline does not contain ``R_i`` itself, so it is unbiased. A group of size 1 gives 0.

    Shapes: rewards[B] float, group_ids[B] int64 -> Tensor[B].
    """
    size, mean, _, constant = _group_stats(rewards, group_ids)
    centered = rewards.detach().to(torch.float64) - mean
    adv = centered * size / (size - 1).clamp(min=1)
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.to(rewards.dtype)


def reinforce_decay(
    rewards: Tensor,
    group_ids: Tensor,
    num_turns: Tensor,
    gamma: float,
    *,
    baseline: Literal["mean", "leave_one_out"] = "mean",
) -> Tensor:
    """REINFORCE with a length decay on correct trajectories (Kimi-Researcher,
    https://moonshotai.github.io/Kimi-Researcher/), then a group baseline.

    1. Shape the reward: a *correct* trajectory (``R_i > 0``) gets ``R'_i = R_i * gamma ** T_i`` with
       ``T_i = num_turns[i]``; others keep ``R'_i = R_i``. Among correct paths, shorter ones now earn
       more, so the policy is pushed toward fewer turns without ever ranking a wrong path above a
       correct one (for ``0 < gamma <= 1`` and ``R_i > 0``, ``R'_i`` stays > 0).
    2. Subtract a group baseline, no std: ``A_i = R'_i - mean_g(R')`` (``baseline="mean"``) or the
       leave-one-out mean (``baseline="leave_one_out"``, as ``rloo``). Constant groups give 0.

    Kimi applies the decay per step (``r * gamma^(T - t)``); here it is applied once per episode, the
    form SPEC §3 asks for, so every action token of a trajectory still shares one advantage.

    Shapes: rewards[B] float, group_ids[B] int64, num_turns[B] int -> Tensor[B].
    """
    _check_1d("num_turns", num_turns, rewards.numel())
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    if (num_turns < 0).any():
        raise ValueError("num_turns must be >= 0")
    decay = torch.pow(torch.full_like(rewards, gamma, dtype=torch.float64), num_turns.to(torch.float64))
    shaped = torch.where(rewards > 0, rewards.to(torch.float64) * decay, rewards.to(torch.float64))
    if baseline == "mean":
        return grpo(shaped, group_ids, std="none").to(rewards.dtype)
    if baseline == "leave_one_out":
        return rloo(shaped, group_ids).to(rewards.dtype)
    raise ValueError(f"baseline must be 'mean' or 'leave_one_out', got {baseline!r}")


def starpo_s_keep(rewards: Tensor, group_ids: Tensor, keep_fraction: float) -> Tensor:
    """StarPO-S variance filtering (RAGEN, https://arxiv.org/abs/2504.20073): keep whole groups.

    Groups are ranked by their within-group reward std (population); the top
    ``ceil(keep_fraction * num_groups)`` are kept (at least one). Ties keep the group that appears
    first. Low-variance groups carry little signal and, RAGEN reports, drive the "Echo Trap".

    Shapes: rewards[B] float, group_ids[B] int64 -> BoolTensor[B] (True = keep this trajectory).
    """
    if not 0.0 < keep_fraction <= 1.0:
        raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
    _, _, var, _ = _group_stats(rewards, group_ids)
    unique_ids, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = unique_ids.numel()
    if num_groups == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device)
    group_std = torch.zeros(num_groups, dtype=torch.float64, device=rewards.device)
    group_std.scatter_(0, inverse, var.sqrt())
    # Order groups by first appearance so that ties resolve to batch order.
    first_pos = torch.full((num_groups,), rewards.numel(), dtype=torch.long, device=rewards.device)
    first_pos.scatter_reduce_(0, inverse, torch.arange(rewards.numel(), device=rewards.device), reduce="amin")
    by_appearance = torch.argsort(first_pos)
    order = by_appearance[torch.argsort(group_std[by_appearance], descending=True, stable=True)]
    num_keep = max(1, math.ceil(keep_fraction * num_groups - 1e-9))
    kept_groups = torch.zeros(num_groups, dtype=torch.bool, device=rewards.device)
    kept_groups[order[:num_keep]] = True
    return kept_groups[inverse]


# ----------------------------------------------------------------------------------------------
# step-level estimators
# ----------------------------------------------------------------------------------------------


def discounted_returns(turn_rewards: Tensor, turn_traj: Tensor, gamma: float) -> Tensor:
    """``R_t = sum_{k >= t} gamma^(k - t) r_k`` within each trajectory.

    Shapes: turn_rewards[K] float, turn_traj[K] int64 (contiguous per trajectory) -> Tensor[K] float64.
    """
    _check_turn_layout(turn_traj, turn_rewards.numel())
    rewards = turn_rewards.detach().to(torch.float64).tolist()
    traj = turn_traj.tolist()
    out = [0.0] * len(rewards)
    running = 0.0
    for k in range(len(rewards) - 1, -1, -1):
        is_last_turn = k == len(rewards) - 1 or traj[k + 1] != traj[k]
        running = rewards[k] + (0.0 if is_last_turn else gamma * running)
        out[k] = running
    return torch.tensor(out, dtype=torch.float64, device=turn_rewards.device)


def _check_turn_layout(turn_traj: Tensor, num_turns: int) -> None:
    _check_1d("turn_traj", turn_traj, num_turns)
    if num_turns > 1 and (turn_traj[1:] < turn_traj[:-1]).any():
        raise ValueError(
            "turn_traj must be non-decreasing: the turns of a trajectory are contiguous and in order"
        )


def lcs_similarity(a: str, b: str) -> float:
    """Longest-common-subsequence ratio ``2 * |LCS(a, b)| / (|a| + |b|)`` in [0, 1]; 1 iff a == b.

    O(|a| * |b|) time; meant for short state summaries, not whole files.
    """
    if a == b:
        return 1.0
    if not a or not b:
        return 0.0
    if len(a) < len(b):
        a, b = b, a
    previous = [0] * (len(b) + 1)
    for char_a in a:
        current = [0]
        for j, char_b in enumerate(b):
            current.append(previous[j] + 1 if char_a == char_b else max(previous[j + 1], current[j]))
        previous = current
    return 2.0 * previous[-1] / (len(a) + len(b))


def anchor_group_ids(
    turn_state_keys: Sequence[str], turn_task_group: Tensor, similarity_threshold: float | None = None,
    similarity: Callable[[str, str], float] | None = None,
) -> Tensor:
    """Assign each turn to an anchor-state group: same task group and same (or similar) state.

    Exact mode (``similarity_threshold=None``): identical ``turn_state_keys`` (a hash of the state).
    Similarity mode: keys hold the state text; a turn joins the first existing group (in turn order)
    of its task group whose first member has ``similarity > similarity_threshold``, else it opens a
    new group. ``similarity(a, b)`` in [0, 1]: the environment's own (``Environment.state_similarity``),
    default :func:`lcs_similarity`. (Similarity is not transitive; comparing against the group's first member keeps groups
    from drifting.)

    Shapes: turn_state_keys: K strings, turn_task_group[K] int64 -> Tensor[K] int64 in [0, num_groups).
    """
    if len(turn_state_keys) != turn_task_group.numel():
        raise ValueError(
            f"turn_state_keys has {len(turn_state_keys)} entries, expected {turn_task_group.numel()}"
        )
    task_group = turn_task_group.tolist()
    ids: list[int] = []
    if similarity_threshold is None:
        exact: dict[tuple[int, str], int] = {}
        for g, key in zip(task_group, turn_state_keys, strict=True):
            ids.append(exact.setdefault((g, key), len(exact)))
    else:
        if not 0.0 <= similarity_threshold < 1.0:
            raise ValueError(f"similarity_threshold must be in [0, 1), got {similarity_threshold}")
        similar = similarity or lcs_similarity
        representatives: dict[int, list[tuple[str, int]]] = {}
        num_groups = 0
        for g, key in zip(task_group, turn_state_keys, strict=True):
            candidates = representatives.setdefault(g, [])
            match = next(
                (gid for rep, gid in candidates if _checked_similarity(similar, rep, key) > similarity_threshold),
                None,
            )
            if match is None:
                match = num_groups
                num_groups += 1
                candidates.append((key, match))
            ids.append(match)
    return torch.tensor(ids, dtype=torch.long, device=turn_task_group.device)


def _checked_similarity(similar: Callable[[str, str], float], a: str, b: str) -> float:
    """``similar(a, b)``, refused (``ValueError``) outside [0, 1]: a distance would merge every state."""
    value = similar(a, b)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(f"state similarity {getattr(similar, '__qualname__', similar)} returned {value!r} "
                         f"for {a[:60]!r} and {b[:60]!r}; it must be a number in [0, 1]")
    return value


def gigpo(
    turn_rewards: Tensor,
    turn_traj: Tensor,
    turn_state_keys: Sequence[str],
    group_ids: Tensor,
    gamma: float = 0.95,
    omega: float = 1.0,
    normalize: Literal["mean_std", "mean"] = "mean_std",
    similarity_threshold: float | None = None,
    *,
    similarity: Callable[[str, str], float] | None = None,
    episode_rewards: Tensor | None = None,
    std: Literal["population", "sample"] = "population",
    eps: float = 1e-6,
) -> tuple[Tensor, dict]:
    """GiGPO: group-in-group credit with anchor states (https://arxiv.org/abs/2505.10978).

    ``A(a_t) = A^E(traj) + omega * A^S(a_t)``

    - ``A^E``: episode advantage, the group normalization of the episode return (``episode_rewards``,
      default: the sum of the trajectory's turn rewards, i.e. the final reward when it is sparse).
    - ``A^S``: turns whose action starts from the same environment state (same ``turn_state_keys``,
      same task group; or ``similarity``, default LCS, above ``similarity_threshold``) form an anchor group, at any
      turn index and in any trajectory; ``A^S`` normalizes the discounted return
      ``R_t = sum_{k>=t} gamma^(k-t) r_k`` within that group. Singleton groups get ``A^S = 0``.

    ``normalize="mean_std"`` divides both by the (population, by default) std + eps, as the paper;
    ``"mean"`` only subtracts the mean (Dr.GRPO-style). Without repeated states every anchor group is
    a singleton except the shared initial state, and GiGPO reduces to GRPO (plus that first turn).

    SPEC vector: R = [1, 0, 1, 1]; t1 and t2 share the state after turn 1, their turn-2 returns
    [0.95, 0] give A^S = [+1, -1], so t1's edit gets 0.577 + 1 = 1.577 and t2's -1.732 - 1 = -2.732.

    Shapes: turn_rewards[K] float, turn_traj[K] int64, turn_state_keys K strings, group_ids[B] int64
    -> (advantages[K] float32, stats). ``stats``: ``gigpo/anchor_hit_rate`` (fraction of turns in an
    anchor group of size >= 2), ``gigpo/num_anchor_groups``, ``gigpo/mean_anchor_group_size``,
    ``gigpo/max_anchor_group_size`` (floats), ``group_sizes`` (list of every anchor group's size),
    ``step_advantages`` (Tensor[K], A^S) and ``anchor_group_size`` (Tensor[K], the size of each
    turn's anchor group).
    """
    num_turns = turn_rewards.numel()
    _check_1d("turn_rewards", turn_rewards)
    _check_turn_layout(turn_traj, num_turns)
    if normalize not in ("mean_std", "mean"):
        raise ValueError(f"normalize must be 'mean_std' or 'mean', got {normalize!r}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    num_traj = group_ids.numel()
    if num_turns and (turn_traj.min() < 0 or turn_traj.max() >= num_traj):
        raise ValueError(f"turn_traj must index the {num_traj} trajectories of group_ids")
    std_kind: StdKind = std if normalize == "mean_std" else "none"

    if episode_rewards is None:
        episode_rewards = torch.zeros(num_traj, dtype=torch.float64, device=turn_rewards.device)
        episode_rewards.index_add_(0, turn_traj, turn_rewards.detach().to(torch.float64))
    _check_1d("episode_rewards", episode_rewards, num_traj)
    episode_adv = _normalize_in_groups(episode_rewards.to(torch.float64), group_ids, std_kind, eps)

    returns = discounted_returns(turn_rewards, turn_traj, gamma)
    anchors = anchor_group_ids(turn_state_keys, group_ids[turn_traj], similarity_threshold, similarity)
    step_adv = _normalize_in_groups(returns, anchors, std_kind, eps)  # singleton anchor groups -> 0

    advantages = (episode_adv[turn_traj] + omega * step_adv).to(torch.float32)

    if num_turns:
        group_sizes = torch.bincount(anchors)
        turn_group_size = group_sizes[anchors]
        stats = {
            "gigpo/anchor_hit_rate": float((turn_group_size >= 2).double().mean()),
            "gigpo/num_anchor_groups": float(group_sizes.numel()),
            "gigpo/mean_anchor_group_size": float(group_sizes.double().mean()),
            "gigpo/max_anchor_group_size": float(group_sizes.max()),
        }
    else:
        group_sizes = turn_group_size = torch.zeros(0, dtype=torch.long, device=turn_rewards.device)
        stats = {
            "gigpo/anchor_hit_rate": 0.0,
            "gigpo/num_anchor_groups": 0.0,
            "gigpo/mean_anchor_group_size": 0.0,
            "gigpo/max_anchor_group_size": 0.0,
        }
    stats["group_sizes"] = group_sizes.tolist()
    stats["step_advantages"] = step_adv.to(torch.float32)
    stats["anchor_group_size"] = turn_group_size
    return advantages, stats


def gae(
    turn_rewards: Tensor,
    turn_values: Tensor,
    turn_traj: Tensor,
    gamma: float,
    lam: float,
    bootstrap_values: Tensor | None = None,
    truncated: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Turn-level GAE (https://arxiv.org/abs/1506.02438), one value per turn boundary (ArCHer-style,
    https://arxiv.org/abs/2402.19446): the critic scores the state each action starts from.

    ``delta_t = r_t + gamma * V_{t+1} - V_t``,  ``A_t = delta_t + gamma * lam * A_{t+1}``,
    ``returns_t = A_t + V_t`` (the value-loss target).

    After the last turn ``V_{T+1}`` is 0 (the episode ended), except for a trajectory with
    ``truncated[i]`` when ``bootstrap_values`` is given: then ``V_{T+1} = bootstrap_values[i]``, the
    critic's value of the state where the budget ran out (SPEC §4 policy (c)). Without
    ``bootstrap_values`` a truncated trajectory also ends at 0 (policy (a)).

    Shapes: turn_rewards[K], turn_values[K] float, turn_traj[K] int64, bootstrap_values[B] float,
    truncated[B] bool -> (advantages[K], returns[K]) float32, detached.
    """
    num_turns = turn_rewards.numel()
    _check_1d("turn_rewards", turn_rewards)
    _check_1d("turn_values", turn_values, num_turns)
    _check_turn_layout(turn_traj, num_turns)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    if bootstrap_values is not None and truncated is None:
        raise ValueError("bootstrap_values needs truncated: which trajectories were cut off by the budget")
    rewards = turn_rewards.detach().to(torch.float64).tolist()
    values = turn_values.detach().to(torch.float64).tolist()
    traj = turn_traj.tolist()
    cut = truncated.tolist() if truncated is not None else None
    boot = bootstrap_values.detach().to(torch.float64).tolist() if bootstrap_values is not None else None
    advantages = [0.0] * num_turns
    running = 0.0
    for k in range(num_turns - 1, -1, -1):
        is_last_turn = k == num_turns - 1 or traj[k + 1] != traj[k]
        if is_last_turn:
            next_value = boot[traj[k]] if (boot is not None and cut is not None and cut[traj[k]]) else 0.0
            running = 0.0
        else:
            next_value = values[k + 1]
        delta = rewards[k] + gamma * next_value - values[k]
        running = delta + gamma * lam * running
        advantages[k] = running
    adv = torch.tensor(advantages, dtype=torch.float64, device=turn_rewards.device)
    returns = adv + turn_values.detach().to(torch.float64)
    return adv.to(torch.float32), returns.to(torch.float32)


def turn_end_rewards(turn_rewards: Tensor, token_turn: Tensor) -> Tensor:
    """Each turn's reward on the last of its trained tokens, 0 on every other token: the per-token
    rewards of token-level GAE. ``token_turn[M]`` lists the turn of each trained token in order (-1 for
    a trained token outside any action, as the no-mask ablation trains; it gets no reward). A turn
    with no trained token passes no reward on.

    Shapes: turn_rewards[K] float, token_turn[M] int64 -> rewards[M] float.

    Example (turn 0 has three tokens, turn 1 one):
        >>> turn_end_rewards(torch.tensor([0.5, 1.0]), torch.tensor([0, 0, 0, -1, 1])).tolist()
        [0.0, 0.0, 0.5, 0.0, 1.0]
    """
    _check_1d("token_turn", token_turn)
    is_last = torch.ones_like(token_turn, dtype=torch.bool)
    is_last[:-1] = token_turn[1:] != token_turn[:-1]
    is_last &= token_turn >= 0
    rewards = torch.zeros(token_turn.shape, dtype=turn_rewards.dtype, device=turn_rewards.device)
    return rewards.masked_scatter(is_last, turn_rewards[token_turn[is_last]])


def token_gae(
    token_rewards: Tensor,
    token_values: Tensor,
    token_traj: Tensor,
    gamma: float,
    lam: float,
    bootstrap_values: Tensor | None = None,
    truncated: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Token-level GAE (PPO's critic, verl's default ``gae``): :func:`gae` with one step per *trained*
    token, ``V_t`` the critic's value of the context before token ``t`` (the state it is sampled from).

    ``delta_t = r_t + gamma * V_{t'} - V_t``,  ``A_t = delta_t + gamma * lam * A_{t'}``, ``returns_t = A_t + V_t``,

    where ``t'`` is the episode's next *trained* token: observation tokens (tool output, template
    scaffolding) are not steps, carry no reward, value or advantage, and are skipped by the recursion, as
    verl's GAE does for a multi-turn response mask ("skip values and TD-error on observation tokens").
    ``r_t`` is a turn's reward on its last token (:func:`turn_end_rewards`), 0 elsewhere. After the
    episode's last trained token ``V`` is 0, or ``bootstrap_values[i]`` for a ``truncated`` episode.

    Shapes: token_rewards[M], token_values[M] float, token_traj[M] int64 (non-decreasing: each episode's
    tokens contiguous, in order), bootstrap_values[B], truncated[B] bool -> (advantages[M], returns[M]).
    """
    return gae(token_rewards, token_values, token_traj, gamma, lam, bootstrap_values=bootstrap_values,
               truncated=truncated)


# ----------------------------------------------------------------------------------------------
# batch statistics and token expansion
# ----------------------------------------------------------------------------------------------


def group_reward_stats(rewards: Tensor, group_ids: Tensor) -> dict[str, float]:
    """Reward statistics that say how much signal a batch carries (SPEC §3 stability, §7).

    Keys: ``reward/mean``, ``reward/std`` (population, over trajectories), ``reward/within_group_std``
    (mean over groups of the population std within each group: RAGEN's Echo-Trap signal),
    ``groups/num``, ``groups/all_correct_frac`` (all rewards == 1), ``groups/all_wrong_frac``
    (all rewards == 0), ``groups/num_zero_variance`` (all rewards equal, whatever the value).

    Shapes: rewards[B] float, group_ids[B] int64 -> dict of Python floats.
    """
    if rewards.numel() == 0:
        nan = float("nan")
        return {
            "reward/mean": nan,
            "reward/std": nan,
            "reward/within_group_std": nan,
            "groups/num": 0.0,
            "groups/all_correct_frac": nan,
            "groups/all_wrong_frac": nan,
            "groups/num_zero_variance": 0.0,
        }
    _, _, var, constant = _group_stats(rewards, group_ids)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    r = rewards.detach().to(torch.float64)
    per_group_std = torch.zeros(num_groups, dtype=torch.float64, device=r.device).scatter_(
        0, inverse, var.sqrt()
    )
    is_constant = torch.zeros(num_groups, dtype=torch.bool, device=r.device).scatter_(0, inverse, constant)
    group_value = torch.zeros(num_groups, dtype=torch.float64, device=r.device).scatter_(0, inverse, r)
    return {
        "reward/mean": float(r.mean()),
        "reward/std": float(r.std(correction=0)),
        "reward/within_group_std": float(per_group_std.mean()),
        "groups/num": float(num_groups),
        "groups/all_correct_frac": float((is_constant & (group_value == 1)).double().mean()),
        "groups/all_wrong_frac": float((is_constant & (group_value == 0)).double().mean()),
        "groups/num_zero_variance": float(is_constant.sum()),
    }


def expand_to_tokens(per_traj_or_per_turn: Tensor, index: Tensor, mask: Tensor) -> Tensor:
    """Give each action token the advantage of its trajectory (index = seq_ids) or turn (token_turn).

    ``out[n] = values[index[n]] if mask[n] else 0``. ``index`` may be -1 where ``mask`` is 0.

    Shapes: values[B] or [K] float, index[N] int64, mask[N] float 0/1 -> Tensor[N] (values' dtype).
    """
    _check_1d("values", per_traj_or_per_turn)
    _check_1d("index", index)
    _check_1d("mask", mask, index.numel())
    active = mask > 0
    if (index[active] < 0).any() or (index[active] >= per_traj_or_per_turn.numel()).any():
        raise ValueError(f"index of an action token (mask=1) is outside [0, {per_traj_or_per_turn.numel()})")
    if per_traj_or_per_turn.numel() == 0:
        return torch.zeros(index.shape, dtype=per_traj_or_per_turn.dtype, device=index.device)
    gathered = per_traj_or_per_turn[index.clamp(0, per_traj_or_per_turn.numel() - 1)]
    return torch.where(active, gathered, torch.zeros_like(gathered))
