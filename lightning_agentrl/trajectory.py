"""Trajectories as the trainer sees them, and their packing into flat token tensors.

One *episode* is one attempt at a task. It is recorded as one or more *segments* (a new segment
starts when history is summarized, SPEC §4); each segment is one token sequence that the policy
saw as its context. Per token we keep the id, the loss mask (1 = sampled by the policy), the
behavior log-prob (NaN where mask 0) and the policy version that sampled it (-1 where mask 0).
Per turn we keep the action span, the turn reward and the environment's state key (GiGPO).

Packing legend (see :func:`pack`):
    B  episodes in the batch        S  segments (B <= S)
    K  turns (all segments)         N  packed tokens (all segments, no padding)
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator


class TerminationReason(StrEnum):
    """Why an episode ended. Exactly one per episode (SPEC §4)."""

    SUBMITTED = "submitted"
    MAX_TURNS = "max_turns"
    MAX_CONTEXT = "max_context"
    TIMEOUT = "timeout"
    TOOL_ERROR = "tool_error"
    SANDBOX_ERROR = "sandbox_error"
    SCORING_TIMEOUT = "scoring_timeout"
    """The agent submitted and the hidden tests ran past the task's scoring time limit: reward 0, decided up
    front (SPEC §4). Not a truncation: the agent finished, so no filter or bootstrap applies."""
    UNSCORABLE_WORKSPACE = "unscorable_workspace"
    """The agent submitted a workspace it made too large, too deep or too slow to snapshot for scoring: reward 0.
    The agent's doing, not the service's (never ``sandbox_error``) and not a budget's (no filter or bootstrap)."""
    ENGINE_ERROR = "engine_error"  # an inference server died or was unreachable; excluded like sandbox_error
    AGENT_ERROR = "agent_error"
    """An external agent (``env.kind: gateway``) raised, exited non-zero or returned no finite reward: its own
    fault, not the policy's; excluded like sandbox_error, and counted by the circuit breaker as one."""

    @property
    def infrastructure(self) -> bool:
        """The episode was broken by a service (sandbox or inference server) or an external agent's code, not
        ended by the policy: it is excluded from training and from evaluation scores."""
        return self in (TerminationReason.SANDBOX_ERROR, TerminationReason.ENGINE_ERROR, TerminationReason.AGENT_ERROR)

    @property
    def truncated(self) -> bool:
        """The episode was cut by a budget, not finished by the agent or broken by infrastructure."""
        return self in (TerminationReason.MAX_TURNS, TerminationReason.MAX_CONTEXT, TerminationReason.TIMEOUT)


class Turn(BaseModel):
    """One action of the policy, located in its segment's token ids: ``[action_start, action_end)``."""

    model_config = ConfigDict(extra="forbid")

    action_start: int
    action_end: int
    reward: float = 0.0
    state_key: str = ""
    state_text: str = ""
    """The environment's state as text (GiGPO similarity mode); empty for environments without one."""
    tool: str | None = None
    timings: dict[str, float] = Field(default_factory=dict)


class Segment(BaseModel):
    """One context window of an episode: the exact ids the policy was conditioned on and sampled."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    # None in JSON where mask is 0 (NaN is not JSON); NaN once packed.
    behavior_logprobs: list[float | None] = Field(default_factory=list)
    policy_versions: list[int] = Field(default_factory=list)
    turns: list[Turn] = Field(default_factory=list)

    @model_validator(mode="after")
    def _aligned(self) -> Segment:
        n = len(self.token_ids)
        for name in ("loss_mask", "behavior_logprobs", "policy_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"segment.{name} has {len(getattr(self, name))} entries for {n} tokens")
        return self

    def extend(self, ids: list[int], *, mask: int, logprobs: list[float] | None = None, version: int = -1) -> None:
        """Append ids; actions (mask 1) carry their behavior logprobs and policy version."""
        if mask:
            assert logprobs is not None and len(logprobs) == len(ids)
            self.behavior_logprobs.extend(logprobs)
            self.policy_versions.extend([version] * len(ids))
        else:
            self.behavior_logprobs.extend([None] * len(ids))
            self.policy_versions.extend([-1] * len(ids))
        self.token_ids.extend(ids)
        self.loss_mask.extend([mask] * len(ids))

    @property
    def num_action_tokens(self) -> int:
        return sum(self.loss_mask)


class Trajectory(BaseModel):
    """One episode: identity, segments, outcome. Round-trips through JSON (``inspect``, artifacts)."""

    model_config = ConfigDict(extra="forbid")

    episode_id: str
    task_id: str
    group_id: int
    segments: list[Segment] = Field(default_factory=list)
    reward: float = 0.0
    termination: TerminationReason | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    info: dict = Field(default_factory=dict)
    critic_context_ids: list[int] = Field(default_factory=list)
    """The environment's ``critic_context`` as ids: the critic reads them before every segment, the policy never."""

    @property
    def turns(self) -> list[Turn]:
        return [turn for segment in self.segments for turn in segment.turns]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    @property
    def num_action_tokens(self) -> int:
        return sum(s.num_action_tokens for s in self.segments)

    @property
    def min_policy_version(self) -> int:
        versions = [v for s in self.segments for v in s.policy_versions if v >= 0]
        return min(versions) if versions else -1


def save_trajectories(trajectories: list[Trajectory], path: str | Path) -> None:
    """Write one JSON object per line."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for t in trajectories:
            f.write(t.model_dump_json() + "\n")


def load_trajectories(path: str | Path) -> list[Trajectory]:
    with open(path, encoding="utf-8") as f:
        return [Trajectory.model_validate(json.loads(line)) for line in f if line.strip()]


@dataclass
class RolloutBatch:
    """Whole groups of episodes packed into flat tensors (no padding; positions restart per segment).

    Callbacks change a batch only through ``include`` (drop episodes from the loss, they stay in
    metrics) and ``token_weights`` (importance/staleness weights).
    """

    # per token [N]
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor  # float 0/1
    behavior_logprobs: torch.Tensor  # NaN where mask 0
    policy_versions: torch.Tensor  # -1 where mask 0
    episode_ids: torch.Tensor  # episode index in [0, B)
    segment_ids: torch.Tensor  # segment index in [0, S)
    token_turn: torch.Tensor  # global turn index in [0, K), -1 outside actions
    token_weights: torch.Tensor  # multiplies the per-token loss; 1 by default
    # per episode [B]
    rewards: torch.Tensor
    group_ids: torch.Tensor
    include: torch.Tensor  # bool: takes part in the loss and the group baseline
    num_turns: torch.Tensor
    # per turn [K]
    turn_episode: torch.Tensor  # each turn's episode index
    turn_rewards: torch.Tensor
    turn_state_keys: list[str] = field(default_factory=list)
    turn_state_texts: list[str] = field(default_factory=list)
    trajectories: list[Trajectory] = field(default_factory=list)
    turn_starts: torch.Tensor | None = None  # [K] packed index of each turn's first action token
    episode_last: torch.Tensor | None = None  # [B] packed index of each episode's last token
    # per segment [S]
    segment_episode: torch.Tensor | None = None  # each segment's episode index
    # the critic's stream (only where an episode has critic context): each segment after its episode's
    # critic_context_ids; critic_index[N] is where each token of the policy's stream sits in it, and
    # critic_segment_start[S] where each segment's context begins
    critic_input_ids: torch.Tensor | None = None
    critic_position_ids: torch.Tensor | None = None
    critic_segment_ids: torch.Tensor | None = None
    critic_index: torch.Tensor | None = None
    critic_segment_start: torch.Tensor | None = None

    @property
    def num_episodes(self) -> int:
        return int(self.rewards.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def anchor_states(self, similarity: float | None) -> list[str]:
        """What GiGPO groups turns by: the state keys (hashes), or with a similarity threshold the
        state texts, whose similarity means something (that of two hashes does not)."""
        if similarity is None or not all(self.turn_state_texts):
            return self.turn_state_keys
        return self.turn_state_texts

    def to(self, device: torch.device | str) -> RolloutBatch:
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = value.to(device) if isinstance(value, torch.Tensor) else value
        return RolloutBatch(**moved)


def pack(trajectories: list[Trajectory]) -> RolloutBatch:
    """Concatenate all segments of all episodes into one flat stream.

    >>> from lightning_agentrl.trajectory import Segment, Trajectory, pack
    >>> s = Segment(); s.extend([1, 2, 3], mask=0); s.extend([4, 5], mask=1, logprobs=[-1.0, -2.0], version=0)
    >>> b = pack([Trajectory(episode_id="e", task_id="t", group_id=0, segments=[s])])
    >>> b.loss_mask.tolist(), b.position_ids.tolist()
    ([0.0, 0.0, 0.0, 1.0, 1.0], [0, 1, 2, 3, 4])
    """
    if not trajectories:
        raise ValueError("cannot pack an empty list of trajectories")
    ids, pos, mask, blp, ver, seq, seg, tturn = ([] for _ in range(8))
    turn_traj, turn_rewards, state_keys, state_texts, segment_traj, num_turns = [], [], [], [], [], []
    turn_starts, episode_last = [], []
    turn_offset = 0
    segment_index = 0
    for b, traj in enumerate(trajectories):
        traj_turns = 0
        for segment in traj.segments:
            n = len(segment.token_ids)
            turn_of_token = [-1] * n
            for k, turn in enumerate(segment.turns):
                assert 0 <= turn.action_start <= turn.action_end <= n, "turn span outside its segment"
                for t in range(turn.action_start, turn.action_end):
                    turn_of_token[t] = turn_offset + k
                turn_traj.append(b)
                turn_starts.append(len(ids) + turn.action_start)
                turn_rewards.append(turn.reward)
                state_keys.append(turn.state_key)
                state_texts.append(turn.state_text)
            turn_offset += len(segment.turns)
            traj_turns += len(segment.turns)
            ids.extend(segment.token_ids)
            pos.extend(range(n))
            mask.extend(segment.loss_mask)
            blp.extend(math.nan if lp is None else lp for lp in segment.behavior_logprobs)
            ver.extend(segment.policy_versions)
            seq.extend([b] * n)
            seg.extend([segment_index] * n)
            tturn.extend(turn_of_token)
            segment_traj.append(b)
            segment_index += 1
        num_turns.append(traj_turns)
        episode_last.append(len(ids) - 1)
    long = torch.long
    critic = _critic_stream(trajectories) if any(t.critic_context_ids for t in trajectories) else {}
    return RolloutBatch(
        **critic,
        input_ids=torch.tensor(ids, dtype=long),
        position_ids=torch.tensor(pos, dtype=long),
        loss_mask=torch.tensor(mask, dtype=torch.float32),
        behavior_logprobs=torch.tensor(blp, dtype=torch.float32),
        policy_versions=torch.tensor(ver, dtype=long),
        episode_ids=torch.tensor(seq, dtype=long),
        segment_ids=torch.tensor(seg, dtype=long),
        token_turn=torch.tensor(tturn, dtype=long),
        token_weights=torch.ones(len(ids), dtype=torch.float32),
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        group_ids=torch.tensor([t.group_id for t in trajectories], dtype=long),
        include=torch.ones(len(trajectories), dtype=torch.bool),
        num_turns=torch.tensor(num_turns, dtype=long),
        turn_episode=torch.tensor(turn_traj, dtype=long),
        turn_rewards=torch.tensor(turn_rewards, dtype=torch.float32),
        turn_state_keys=state_keys,
        turn_state_texts=state_texts,
        trajectories=list(trajectories),
        turn_starts=torch.tensor(turn_starts, dtype=long),
        episode_last=torch.tensor(episode_last, dtype=long),
        segment_episode=torch.tensor(segment_traj, dtype=long),
    )


def _critic_stream(trajectories: list[Trajectory]) -> dict[str, torch.Tensor]:
    """The critic's packed stream: every segment after its episode's ``critic_context_ids`` (positions from 0
    at the context), and where the policy's tokens and each segment's context sit in it."""
    ids, pos, seg, index, seg_start = [], [], [], [], []
    segment_index = 0
    for traj in trajectories:
        context = traj.critic_context_ids
        for segment in traj.segments:
            seg_start.append(len(ids))
            n = len(context) + len(segment.token_ids)
            index.extend(range(len(ids) + len(context), len(ids) + n))
            ids.extend([*context, *segment.token_ids])
            pos.extend(range(n))
            seg.extend([segment_index] * n)
            segment_index += 1
    long = torch.long
    return {"critic_input_ids": torch.tensor(ids, dtype=long), "critic_position_ids": torch.tensor(pos, dtype=long),
            "critic_segment_ids": torch.tensor(seg, dtype=long), "critic_index": torch.tensor(index, dtype=long),
            "critic_segment_start": torch.tensor(seg_start, dtype=long)}


# -- token-in/token-out check ---------------------------------------------------------------------
DIGESTS_KEY = "action_digests"  # Trajectory.info key: one digest per turn, in the order of ``trajectory.turns``


def action_digest(token_ids: list[int]) -> str:
    """A short fingerprint of a list of token ids (the engine's output for one request)."""
    return hashlib.blake2b(",".join(map(str, token_ids)).encode(), digest_size=8).hexdigest()


class TokenMismatchError(RuntimeError):
    """The ids recorded as an action are not the ids the engine returned for it."""


def check_token_in_token_out(batch_or_trajectories: RolloutBatch | list[Trajectory]) -> int:
    """Check every turn of every trajectory; return the number of turns checked.

    For each turn, the ids in ``[action_start, action_end)`` of its segment must hash to the digest the
    agent loop took of the engine's output, carry loss mask 1 and a behavior logprob; no token outside
    an action may carry mask 1. Cost: one hash per turn, a pass over the masks (no model, no decode).
    Raises :class:`TokenMismatchError` naming the episode and turn.
    """
    trajectories = (
        batch_or_trajectories.trajectories
        if isinstance(batch_or_trajectories, RolloutBatch)
        else batch_or_trajectories
    )
    num_checked = 0
    for trajectory in trajectories:
        digests = trajectory.info.get(DIGESTS_KEY, [])
        turns = trajectory.turns
        if len(digests) != len(turns):
            raise TokenMismatchError(
                f"episode {trajectory.episode_id}: {len(turns)} turns but {len(digests)} recorded generation digests"
            )
        index = 0
        for s, segment in enumerate(trajectory.segments):
            in_action = [False] * len(segment.token_ids)
            for turn in segment.turns:
                ids = segment.token_ids[turn.action_start : turn.action_end]
                where = f"episode {trajectory.episode_id}, segment {s}, turn {index}"
                if action_digest(ids) != digests[index]:
                    raise TokenMismatchError(f"{where}: the recorded action ids differ from the engine's output")
                span = range(turn.action_start, turn.action_end)
                if any(segment.loss_mask[t] != 1 or segment.behavior_logprobs[t] is None for t in span):
                    raise TokenMismatchError(f"{where}: an action token has mask 0 or no behavior logprob")
                for t in span:
                    in_action[t] = True
                index += 1
                num_checked += 1
            stray = [t for t, m in enumerate(segment.loss_mask) if m and not in_action[t]]
            if stray:
                raise TokenMismatchError(
                    f"episode {trajectory.episode_id}, segment {s}: {len(stray)} tokens outside any action "
                    f"have loss mask 1 (first at {stray[0]})"
                )
    return num_checked
