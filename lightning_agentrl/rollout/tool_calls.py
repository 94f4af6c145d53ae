"""The tool-call format the agent writes, and its parser.

An action is free text that contains one call::

    I will read the file first.
    <tool_call>{"name": "read_file", "arguments": {"path": "utils.py"}}</tool_call>

This is the Hermes/Qwen convention, so instruction-tuned models already know it. Only the first
call of an action is executed. A malformed call is not an exception for the episode: the parser
raises :class:`ToolCallError`, and the environment shows its message to the agent as the
observation (the agent can correct itself).
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

    def render(self) -> str:
        args = ", ".join(f'"{k}": <{v}>' for k, v in self.parameters.items())
        return f'- {self.name}: {self.description}\n  <tool_call>{{"name": "{self.name}", "arguments": {{{args}}}}}</tool_call>'


CODING_TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec("read_file", "show a file of the workspace", {"path": "relative path"}),
    ToolSpec(
        "write_file", "replace a file's whole content", {"path": "relative path", "content": "new text"}
    ),
    ToolSpec(
        "run", "run a shell command in the workspace, e.g. the visible tests", {"command": "shell command"}
    ),
    ToolSpec("submit", "finish; hidden tests decide the reward", {}),
)


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
    """
    match = CALL_PATTERN.search(text)
    if match is None:
        raise ToolCallError("no <tool_call>...</tool_call> found in the reply")
    try:
        payload = json.loads(match.group(1))
    except json.JSONDecodeError as err:
        raise ToolCallError(f"the tool call is not valid JSON: {err.msg} at char {err.pos}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        raise ToolCallError('a tool call is a JSON object {"name": ..., "arguments": {...}}')
    arguments = payload.get("arguments", {})
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
