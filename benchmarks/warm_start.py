"""Format-only warm start: supervised steps on demonstrations that teach the tool-call format, not the skill.

A randomly initialized model cannot write a single valid tool call, so RL from scratch would see
reward 0 forever. The warm start trains on demonstration episodes of the copy-the-key suite
(:mod:`lightning_agentrl.envs.learn_tasks`): read key.txt -> write answer.txt -> submit. The value
written is a **random** key drawn independently of the one shown in the observation, so the demos
teach the format and the order of tools but carry no information about *what* to write: after the
warm start the success rate is chance (``1 / len(alphabet) ** key_length``), and whatever rises
above it is learned by RL.

A pretrained LLM can copy a value from its context; the random-init tiny model cannot. Optional
generic demonstrations (``echo_prob``) stand in for that pretrained skill: the user names a value
and the agent writes it to note.txt. They copy from the *user message* of another task's prompt,
never from an observation; inside the copy-the-key task the demonstrated value stays random, so
the baseline stays at chance and copying the observed key is left to RL.

Demonstrations go through the same token path as rollouts (:class:`ChatCodec`): the prompt is the
chat template's rendering of the environment's opening messages, each action is its encoding plus
the eos id (loss mask 1), each observation is the codec's scaffolding around the encoding of only
the observation text (mask 0). The loss is the mean negative log-likelihood of the mask-1 tokens:

    L = -(1 / sum_t m[t]) * sum_t m[t] * log p(y[t] | y[<t])      ids [B, T], mask [B, T]
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_agentrl.envs.coding import CodingEnv
from lightning_agentrl.envs.learn_tasks import ANSWER_FILE, KEY_FILE, PROMPT, LearnSuiteSpec
from lightning_agentrl.rollout.chat import ChatCodec

DETOUR_COMMAND = "ls"
DETOUR_OUTPUT = f"exit code 0\n{ANSWER_FILE}\n{KEY_FILE}\n"


def opening_messages(system_prompt: str | None = None, prompt: str = PROMPT) -> list[dict]:
    """The system and user messages :class:`CodingEnv` opens every episode with (tools as text)."""
    return CodingEnv.opening_messages(prompt, system_prompt)


def tool_call(name: str, **arguments: str) -> str:
    """The text of one action in the format of :mod:`lightning_agentrl.envs.tools`."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def demonstration_turns(key: str, written: str, *, detour: bool = False) -> list[tuple[str, str | None]]:
    """(action text, observation text) per turn; the last action (submit) has no observation.

    ``detour`` adds a useless ``run ls`` turn before the write (a longer episode, used to force
    truncations with a small ``env.max_turns``).
    """
    turns: list[tuple[str, str | None]] = [(tool_call("read_file", path=KEY_FILE), key + "\n")]
    if detour:
        turns.append((tool_call("run", command=DETOUR_COMMAND), DETOUR_OUTPUT))
    turns.append((tool_call("write_file", path=ANSWER_FILE, content=written), f"wrote {len(written)} characters to {ANSWER_FILE}"))
    turns.append((tool_call("submit"), None))
    return turns


NOTE_FILE = "note.txt"
ECHO_PROMPTS = (
    "Write {value} to " + NOTE_FILE + ", then submit.",
    "Please save {value} in " + NOTE_FILE + " and submit.",
    "The value is {value}. Put it in " + NOTE_FILE + ", then submit.",
)


def echo_turns(value: str) -> list[tuple[str, str | None]]:
    """A generic demonstration outside the task: write a value named in the user message to a file."""
    return [
        (tool_call("write_file", path=NOTE_FILE, content=value), f"wrote {len(value)} characters to {NOTE_FILE}"),
        (tool_call("submit"), None),
    ]


def echo_prompt(value: str, variant: int = 0) -> str:
    return ECHO_PROMPTS[variant % len(ECHO_PROMPTS)].format(value=value)


def _value_span(codec: ChatCodec, action_ids: list[int], action: str) -> tuple[int, int] | None:
    """Token span of the written value (``"content": "<value>"``) inside ``action_ids``, if any."""
    marker = '"content": "'
    if marker not in action:
        return None
    prefix = action[: action.index(marker) + len(marker)]
    for start in range(len(action_ids)):
        if codec.tokenizer.decode(action_ids[:start]) == prefix:
            value = action[len(prefix) :].split('"', 1)[0]
            for end in range(start + 1, len(action_ids) + 1):
                if codec.tokenizer.decode(action_ids[start:end]) == value:
                    return start, end
    return None


def render_demonstration(
    codec: ChatCodec,
    turns: list[tuple[str, str | None]],
    system_prompt: str | None = None,
    prompt: str = PROMPT,
    *,
    value_in_loss: bool = True,
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 = action) of one demonstration, built like a rollout.

    ``value_in_loss=False`` masks the written value's tokens out (mask 0): the demonstration then
    says nothing about *what* to write, only how.
    """
    return render_turns(codec, opening_messages(system_prompt, prompt), turns,
                        mask_span=None if value_in_loss else _value_span)


def render_turns(codec: ChatCodec, opening: list[dict], turns: list[tuple[str, str | None]], *, mask_span=None):
    """Token ids and loss mask (1 = action) of an episode opening with ``opening`` (the environment's
    messages) and going on with ``turns``; ``mask_span(codec, action_ids, action)`` may name a span of an
    action to leave out of the loss."""
    ids = codec.prompt_ids(opening)
    mask = [0] * len(ids)
    for action, observation in turns:
        action_ids = codec.encode(action) + [codec.eos_token_id]
        action_mask = [1] * len(action_ids)
        span = None if mask_span is None else mask_span(codec, action_ids, action)
        if span is not None:
            action_mask[span[0] : span[1]] = [0] * (span[1] - span[0])
        ids += action_ids
        mask += action_mask
        if observation is not None:
            obs = codec.observation_ids(observation).all
            ids += obs
            mask += [0] * len(obs)
    return ids, mask


def random_key(spec: LearnSuiteSpec, rng: random.Random) -> str:
    return "".join(rng.choice(spec.alphabet) for _ in range(spec.key_length))


def make_demonstrations(
    codec: ChatCodec,
    keys: list[str],
    spec: LearnSuiteSpec,
    *,
    num: int,
    seed: int = 0,
    detour_prob: float = 0.0,
    echo_prob: float = 0.0,
    system_prompt: str | None = None,
    value_in_loss: bool = True,
) -> list[tuple[list[int], list[int]]]:
    """``num`` demonstrations over ``keys`` (cycled); the written value is random, never copied.

    With probability ``echo_prob`` a demonstration is instead a generic one outside the task
    (:func:`echo_turns`: copy a value from the *user message* into a ``run`` call), the kind of
    skill a pretrained model brings; no demonstration ever copies from an observation.
    """
    if not keys:
        raise ValueError("make_demonstrations needs at least one key")
    for name, value in (("detour_prob", detour_prob), ("echo_prob", echo_prob)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    rng = random.Random(seed)
    demos = []
    for i in range(num):
        if rng.random() < echo_prob:
            value = random_key(spec, rng)
            prompt = echo_prompt(value, rng.randrange(len(ECHO_PROMPTS)))
            demos.append(render_demonstration(codec, echo_turns(value), system_prompt, prompt))
            continue
        key = keys[i % len(keys)]
        turns = demonstration_turns(key, random_key(spec, rng), detour=rng.random() < detour_prob)
        demos.append(render_demonstration(codec, turns, system_prompt, value_in_loss=value_in_loss))
    return demos


def masked_nll(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean NLL of the mask-1 tokens. logits [B, T, V] predict input_ids [B, T] shifted by one; mask [B, T]."""
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    target_lp = logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    m = mask[:, 1:].to(target_lp.dtype)
    return -(target_lp * m).sum() / m.sum().clamp(min=1.0)


@dataclass(frozen=True)
class WarmStartResult:
    path: Path
    steps: int
    final_loss: float
    seconds: float


def warm_start(
    model_path: str | Path,
    out_dir: str | Path,
    keys: list[str],
    spec: LearnSuiteSpec,
    *,
    steps: int = 150,
    batch_size: int = 16,
    lr: float = 2e-3,
    seed: int = 0,
    detour_prob: float = 0.0,
    echo_prob: float = 0.0,
    system_prompt: str | None = None,
    value_in_loss: bool = True,
) -> WarmStartResult:
    """Train ``model_path`` on format-only demonstrations; save model and tokenizer to ``out_dir``."""

    def demonstrations(codec: ChatCodec, num: int):
        return make_demonstrations(
            codec, keys, spec, num=num, seed=seed, detour_prob=detour_prob, echo_prob=echo_prob,
            system_prompt=system_prompt, value_in_loss=value_in_loss,
        )

    return train_on_demonstrations(model_path, out_dir, demonstrations, steps=steps, batch_size=batch_size, lr=lr,
                                   seed=seed)


def train_on_demonstrations(model_path, out_dir, demonstrations, *, steps: int, batch_size: int, lr: float,
                            seed: int) -> WarmStartResult:
    """``steps`` AdamW steps of :func:`masked_nll` on ``demonstrations(codec, steps * batch_size)`` (a list of
    (ids, mask)); saves the model and tokenizer to ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    codec = ChatCodec(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.train()
    demos = demonstrations(codec, steps * batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    pad = tokenizer.pad_token_id
    loss_value = float("nan")
    for step in range(steps):
        batch = demos[step * batch_size : (step + 1) * batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (ids, m) in enumerate(batch):  # right padding: padding is never a target (mask 0)
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            mask[row, : len(m)] = torch.tensor(m)
        logits = model(input_ids=input_ids, attention_mask=attention).logits
        loss = masked_nll(logits, input_ids, mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss_value = float(loss.detach())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return WarmStartResult(out, steps, loss_value, time.monotonic() - started)


def random_walk_turns(task, max_turns: int, rng: random.Random) -> tuple[list[dict], list[tuple[str, str | None]]]:
    """A rooms episode (``lightning_agentrl.envs.rooms``) walked by a uniformly random choice among the exits
    the room lists: the opening messages and (action, observation) per turn. It teaches the answer format (a
    bare direction per turn) and nothing about which exit leads to the goal; 40 steps leave about 0.7 of the
    policy's probability on the listed exits, nearly the same in every room (the hostile review's
    measurement), so the warm-started walk bumps into walls more often than a uniform walk over the exits."""
    import asyncio

    from lightning_agentrl.envs.rooms import RoomsEnv

    env = RoomsEnv(task)
    opening = asyncio.run(env.reset())
    turns: list[tuple[str, str | None]] = []
    for _ in range(rng.randint(1, max_turns)):
        action = rng.choice(list(task.rooms[env.room]))
        result = asyncio.run(env.step(action))
        turns.append((action, None if result.done else result.observation))
        if result.done:
            break
    return opening, turns


def rooms_warm_start(model_path, out_dir, tasks: list, *, max_turns: int, steps: int = 60, batch_size: int = 16,
                     lr: float = 2e-3, seed: int = 0) -> WarmStartResult:
    """Format-only warm start for the rooms worlds: random walks over the training tasks' starts."""

    def demonstrations(codec: ChatCodec, num: int):
        rng = random.Random(seed)
        return [render_turns(codec, *random_walk_turns(tasks[i % len(tasks)], max_turns, rng)) for i in range(num)]

    return train_on_demonstrations(model_path, out_dir, demonstrations, steps=steps, batch_size=batch_size, lr=lr,
                                   seed=seed)


@torch.no_grad()
def value_distribution(model, codec: ChatCodec, spec: LearnSuiteSpec, system_prompt: str | None = None) -> list[list[float]]:
    """P(first value token = v | the observed key is k), teacher-forced after a correct read, for
    single-character keys: rows k, columns v over ``spec.alphabet`` [A, A].

    A policy that copies has mass on the diagonal; one that ignores the observation has identical
    rows. Mean diagonal mass minus 1/A is how much the written value depends on the read key.
    """
    if spec.key_length != 1:
        raise ValueError("value_distribution needs single-character keys")
    candidates = [codec.encode(v) for v in spec.alphabet]
    if any(len(ids) != 1 for ids in candidates):
        raise ValueError("every alphabet character must be one token")
    rows = []
    for key in spec.alphabet:
        turns = demonstration_turns(key, spec.alphabet[0])
        ids, _ = render_demonstration(codec, turns, system_prompt)
        write_ids = codec.encode(turns[1][0]) + [codec.eos_token_id]
        start = len(ids) - len(codec.encode(turns[2][0])) - 1 - len(codec.observation_ids(turns[1][1]).all) - len(write_ids)
        value_at = start + _value_span(codec, write_ids, turns[1][0])[0]
        logits = model(input_ids=torch.tensor([ids[:value_at]])).logits[0, -1].float()
        probs = torch.softmax(logits, -1)
        rows.append([float(probs[c[0]]) for c in candidates])
    return rows
