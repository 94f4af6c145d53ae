"""The tool-call formats the agent may write, and their parser (environments own their tools).

An action is free text that contains one call. Three families' formats are read::

    I will read the file first.
    <tool_call>{"name": "read_file", "arguments": {"path": "utils.py"}}</tool_call>

    <tool_call>[{"name": "read_file", "arguments": {"path": "utils.py"}}]</tool_call>

    {"name": "read_file", "parameters": {"path": "utils.py"}}

    [TOOL_CALLS] [{"name": "read_file", "arguments": {"path": "utils.py"}}]

The first is the Hermes/Qwen convention (also what the built-in tool text teaches), with the list
form SmolLM2 was trained on (its function-calling data wraps a list of calls in the tags); the second is
Llama 3's JSON call (``parameters`` for ``arguments``, maybe after ``<|python_tag|>``); the third is
Mistral's. A ``<tool_call>`` tag wins; without one, the first JSON object in the text with a
``name`` is the call. Only the first call of an action is executed. A malformed call is not an
exception for the episode: the parser raises :class:`ToolCallError`, and the environment shows its
message to the agent as the observation (the agent can correct itself).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

CALL_PATTERN = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, str] = field(default_factory=dict)  # argument name -> description
    example: dict[str, str] = field(default_factory=dict)  # argument name -> a value, for the copyable example

    def schema(self) -> dict:
        """The tool as a JSON schema in the OpenAI function format that chat templates' ``tools=`` take."""
        properties = {k: {"type": "string", "description": v} for k, v in self.parameters.items()}
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": properties, "required": list(self.parameters)},
        }}

    def render(self) -> str:
        """The tool for a system prompt: its arguments, then an example call that is valid JSON as written (a
        small model copies the example it is shown; a placeholder such as ``<relative path>`` is not JSON).

        >>> print(ToolSpec("move", "walk one square", {"direction": "north or south"}, {"direction": "north"}).render())
        - move(direction: north or south): walk one square
          <tool_call>{"name": "move", "arguments": {"direction": "north"}}</tool_call>
        """
        arguments = {k: self.example.get(k, "") for k in self.parameters}
        signature = ", ".join(f"{k}: {v}" for k, v in self.parameters.items())
        return f"- {self.name}({signature}): {self.description}\n  {self.call(**arguments)}"

    def call(self, **arguments: str) -> str:
        """The text of one call, in the form :meth:`render` shows and :func:`parse_tool_call` reads (what a
        demonstration writes).

        >>> ToolSpec("move", "walk", {"direction": "a direction"}).call(direction="east")
        '<tool_call>{"name": "move", "arguments": {"direction": "east"}}</tool_call>'
        """
        if set(arguments) != set(self.parameters):
            raise ValueError(f"{self.name} takes {sorted(self.parameters)}, got {sorted(arguments)}")
        return "<tool_call>" + json.dumps({"name": self.name, "arguments": arguments}) + "</tool_call>"


CODING_TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec("read_file", "show a file of the workspace", {"path": "relative path"}, {"path": "utils.py"}),
    ToolSpec(
        "write_file", "replace a file's whole content", {"path": "relative path", "content": "new text"},
        {"path": "utils.py", "content": "def add(a, b):\n    return a + b\n"},
    ),
    ToolSpec(
        "run", "run a shell command in the workspace, e.g. the visible tests", {"command": "shell command"},
        {"command": "python -m pytest -q"},
    ),
    ToolSpec("submit", "finish; hidden tests decide the reward", {}),
)


def tool_spec(name: str, tools: tuple[ToolSpec, ...] = CODING_TOOLS) -> ToolSpec:
    """The tool of ``tools`` called ``name``."""
    return next(tool for tool in tools if tool.name == name)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


class ToolCallError(ValueError):
    """The action does not contain one well-formed call of a known tool."""


def parse_tool_call(text: str, tools: tuple[ToolSpec, ...] = CODING_TOOLS) -> ToolCall:
    """Return the first tool call in ``text``.

    >>> parse_tool_call('x <tool_call>{"name": "submit", "arguments": {}}</tool_call>')
    ToolCall(name='submit', arguments={})
    >>> parse_tool_call('<|python_tag|>{"name": "read_file", "parameters": {"path": "a.py"}}')
    ToolCall(name='read_file', arguments={'path': 'a.py'})
    >>> parse_tool_call('<tool_call>[{"name": "read_file", "arguments": {"path": "a.py"}}]</tool_call>')
    ToolCall(name='read_file', arguments={'path': 'a.py'})
    """
    payload = _call_payload(text)
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        raise ToolCallError('a tool call is a JSON object {"name": ..., "arguments": {...}}')
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if not isinstance(arguments, dict):
        raise ToolCallError('"arguments" must be a JSON object')
    by_name = {tool.name: tool for tool in tools}
    spec = by_name.get(payload["name"])
    if spec is None:
        raise ToolCallError(f"unknown tool {payload['name']!r}; tools: {', '.join(by_name)}")
    missing = [k for k in spec.parameters if k not in arguments]
    if missing:
        raise ToolCallError(f"{spec.name} needs argument(s): {', '.join(missing)}")
    unknown = [k for k in arguments if k not in spec.parameters]
    if unknown:
        raise ToolCallError(f"{spec.name} takes no argument(s): {', '.join(unknown)}")
    for key, value in arguments.items():
        if not isinstance(value, str):
            raise ToolCallError(f"{spec.name}: argument {key!r} must be a string")
    return ToolCall(spec.name, arguments)


_MAX_BARE_JSON_STARTS = 32  # braces tried as the start of a bare JSON call


def _call_payload(text: str):
    """The JSON of the first call: inside ``<tool_call>`` tags if any, else the first bare JSON object
    with a ``name`` (Llama 3 and Mistral write calls without tags)."""
    match = CALL_PATTERN.search(text)
    if match is not None:
        try:
            payload = json.loads(match.group(1))
            # SmolLM2's form: a list of calls in the tags; the first is the call
            return payload[0] if isinstance(payload, list) and payload else payload
        except json.JSONDecodeError as err:
            raise ToolCallError(f"the tool call is not valid JSON: {err.msg} at char {err.pos}") from None
        except RecursionError:  # a sampled reply can nest deeper than the parser's stack
            raise ToolCallError("the tool call nests too deeply to be read") from None
    decoder = json.JSONDecoder()
    start = text.find("{")
    for _ in range(_MAX_BARE_JSON_STARTS):  # each try scans to the end: bounded, not quadratic in the reply
        if start == -1:
            break
        try:
            payload, _ = decoder.raw_decode(text, start)
        except (json.JSONDecodeError, RecursionError):
            payload = None
        if isinstance(payload, dict) and "name" in payload:
            return payload
        start = text.find("{", start + 1)
    raise ToolCallError('no tool call found in the reply: write <tool_call>{"name": ..., "arguments": {...}}</tool_call>')
