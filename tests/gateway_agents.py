"""Agents written against the OpenAI API, as users write them (the `openai` package, nothing of ours), that the
gateway tests train unchanged (``env.agent: tests.gateway_agents:<name>``).

Each task says what its agent does (``mode``) and whether it streams. The tool agent asks the policy with an
``add`` tool, runs the call it gets, sends the result back (the assistant message as the client returned it),
reads the answer, then starts a fresh conversation (the framework dropped its history: a new segment).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from openai import AsyncOpenAI, AuthenticationError, BadRequestError, OpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "string", "description": "a number"},
                                                     "b": {"type": "string", "description": "a number"}},
                   "required": ["a", "b"]}}}]


def _question(task: dict) -> list[dict]:
    return [{"role": "system", "content": "You add numbers with the add tool."},
            {"role": "user", "content": task["question"]}]


def _add(call) -> str:
    arguments = json.loads(call.function.arguments)
    return str(float(arguments["a"]) + float(arguments["b"]))


async def _ask(client: AsyncOpenAI, messages: list[dict], stream: bool, **kwargs):
    """One call; the assistant message, whether streamed (the SDK's own accumulator) or not."""
    if stream:  # accumulated by the SDK's own stream state (its snapshot: a cut reply is no error here)
        state = ChatCompletionStreamState()
        async for chunk in await client.chat.completions.create(model="any", messages=messages, stream=True, **kwargs):
            state.handle_chunk(chunk)
        completion = state.current_completion_snapshot
    else:
        completion = await client.chat.completions.create(model="any", messages=messages, **kwargs)
    return completion.choices[0]


KEYS: dict[str, str] = {}  # base URL -> API key of every episode this process ran


async def _check_the_door(client: AsyncOpenAI, base_url: str) -> None:
    """The endpoint lists its model, refuses n != 1 as OpenAI does, and refuses another episode's key (401)."""
    assert [model.id for model in (await client.models.list()).data] == ["policy"]
    try:
        await client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], n=2)
        raise AssertionError("n=2 was served")
    except BadRequestError as err:
        assert err.status_code == 400 and err.param == "n", err
    others = [key for url, key in KEYS.items() if url != base_url]
    if others:
        try:
            await AsyncOpenAI(base_url=base_url, api_key=others[0], max_retries=0).models.list()
            raise AssertionError("another episode's key was accepted")
        except AuthenticationError as err:
            assert err.status_code == 401, err


async def tool_agent(task: dict, base_url: str, api_key: str) -> float:
    """Multi-turn: a tool call round-tripped, the answer, then a fresh conversation."""
    KEYS[base_url] = api_key
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages, stream = _question(task), task.get("stream", False)
    choice = await _ask(client, messages, stream, tools=TOOLS, max_tokens=40)
    await _check_the_door(client, base_url)
    reward = 0.0
    if choice.message.tool_calls:
        call = choice.message.tool_calls[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": _add(call)})
        answer = await _ask(client, messages, stream, tools=TOOLS, max_completion_tokens=40)
        reward = 1.0 if "5" in (answer.message.content or "") else 0.0
    await _ask(client, [{"role": "user", "content": "Say 5."}], stream, max_tokens=8)  # history dropped
    await client.close()
    return reward


NUMBER_TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}]


async def parallel_tools_agent(task: dict, base_url: str, api_key: str) -> float:
    """Runs every call of a reply (numbers as JSON numbers), sends one result per call, reads the answer; its
    reward is how many calls it got in one reply (-1 where an argument was not a number)."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = _question(task)
    choice = await _ask(client, messages, False, tools=NUMBER_TOOLS, max_tokens=120)
    calls = choice.message.tool_calls or []
    if calls:
        messages.append(choice.message.model_dump(exclude_none=True))
        for call in calls:
            arguments = json.loads(call.function.arguments)
            if not all(isinstance(arguments[k], int | float) for k in "ab"):
                return -1.0
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])})
        await _ask(client, messages, False, tools=NUMBER_TOOLS, max_tokens=40)
    await client.close()
    return float(len(calls))


def faulty_agent(task: dict, base_url: str, api_key: str) -> float:
    """What can go wrong with an agent, by ``task["mode"]`` (a plain function with the synchronous client: it
    runs in a worker thread)."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    mode = task["mode"]
    if mode == "silent":  # never calls the model
        return 1.0
    if mode == "long":  # past the context budget: OpenAI's context_length_exceeded
        client.chat.completions.create(model="any", messages=_question(task), max_tokens=4)
        try:
            client.chat.completions.create(model="any", messages=[{"role": "user", "content": "x " * 3000}])
        except BadRequestError as err:
            return 1.0 if err.code == "context_length_exceeded" else -1.0
        return -1.0
    client.chat.completions.create(model="any", messages=_question(task), max_tokens=4)
    if mode == "hang":  # past any time limit, in a thread nothing can interrupt
        time.sleep(600)
    if mode == "raise":
        raise RuntimeError("the agent's own bug\nKeyError: 'answer'")
    return float("nan")  # mode == "nan"


def main() -> None:
    """``python -m tests.gateway_agents``: the command agent (task on stdin, OPENAI_* from the environment,
    ``{"reward": R}`` last on stdout). Mode ``hang`` starts a child that writes its pid and sleeps, then hangs."""
    task = json.loads(sys.stdin.read())
    if task.get("mode") == "hang":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(task["pid_file"], "w") as f:
            f.write(str(child.pid))
        time.sleep(600)
    client = OpenAI(max_retries=0)  # reads OPENAI_BASE_URL and OPENAI_API_KEY, as agents do
    text = ""
    for chunk in client.chat.completions.create(model="any", messages=_question(task), max_tokens=8, stream=True):
        text += "".join(choice.delta.content or "" for choice in chunk.choices)
    print("some log line of the agent")
    print(json.dumps({"reward": 1.0 if text else 0.0, "pid": os.getpid()}))


if __name__ == "__main__":
    main()


def smolagents_agent(task: dict, base_url: str, api_key: str) -> float:
    """smolagents' tool-calling agent as its docs build it, pointed at the episode's URL (a plain function: the
    library is synchronous). It writes its own history (tool calls and results as text): a new segment per call."""
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def add(a: str, b: str) -> str:
        """Add two numbers.

        Args:
            a: a number
            b: a number
        """
        return str(float(a) + float(b))

    model = OpenAIServerModel(model_id="policy", api_base=base_url, api_key=api_key, max_tokens=40)
    agent = ToolCallingAgent(tools=[add], model=model, max_steps=2, verbosity_level=0)
    return 1.0 if "5" in str(agent.run(task["question"])) else 0.0
