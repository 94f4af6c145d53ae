"""The tools an agent may call, and the parser that checks its calls against them (environments own their tools).

An action is free text that holds one or more calls, in its model family's format
(:mod:`lightning_agentrl.envs.call_formats`), e.g. the Hermes/Qwen convention the built-in tool text teaches::

    I will read the file first.
    <tool_call>{"name": "read_file", "arguments": {"path": "utils.py"}}</tool_call>

Every call of an action is checked (a known tool, its required arguments, no others, each of its JSON type)
and executed in order. A malformed call is not an exception for the episode: the parser raises
:class:`ToolCallError`, and the environment shows its message to the agent as the observation (the agent
can correct itself).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from lightning_agentrl.envs.call_formats import ToolCall, ToolCallError, read_calls, value_of

CALL_PATTERN = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, str] = field(default_factory=dict)  # argument name -> description
    example: dict[str, str] = field(default_factory=dict)  # argument name -> a value, for the copyable example
    # argument name -> its JSON-schema type ("any": not checked); absent = string
    types: dict[str, str] = field(default_factory=dict)
    optional: tuple[str, ...] = ()  # arguments a call may leave out

    @property
    def required(self) -> list[str]:
        return [k for k in self.parameters if k not in self.optional]

    def schema(self) -> dict:
        """The tool as a JSON schema in the OpenAI function format that chat templates' ``tools=`` take."""
        properties = {k: {"type": self.types.get(k, "string"), "description": v} for k, v in self.parameters.items()}
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": properties, "required": self.required},
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


JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict,
    "null": type(None),
}
"""JSON-schema type -> the Python types ``json.loads`` gives for it (``bool`` is refused where a number is asked)."""
STRING_OR_OTHER = "string|other"
"""The type of an argument whose schema allows a string beside other types (``anyOf``, a type list, as pydantic
and LangChain write an optional): not checked, and written as text it stays text (``"123"`` stays ``"123"``)."""


def parse_tool_calls(text: str, tools: tuple[ToolSpec, ...] = CODING_TOOLS, call_format=None) -> list[ToolCall]:
    """Every tool call in ``text``, in order, read in ``call_format`` (a
    :class:`~lightning_agentrl.envs.call_formats.CallFormat`; None: Hermes, Mistral or Llama 3 JSON) and checked
    against ``tools``. :class:`ToolCallError` when there is none or one is malformed (the agent sees why).

    >>> [c.name for c in parse_tool_calls('<tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}</tool_call>'
    ...                                    '<tool_call>{"name": "submit", "arguments": {}}</tool_call>')]
    ['read_file', 'submit']
    """
    read_in, calls = read_calls(text, call_format)
    if not calls:
        raise ToolCallError('no tool call found in the reply: write <tool_call>{"name": ..., "arguments": {...}}</tool_call>')
    return [_checked(name, arguments, tools, typed=read_in.typed) for name, arguments in calls]


def parse_tool_call(text: str, tools: tuple[ToolSpec, ...] = CODING_TOOLS, call_format=None) -> ToolCall:
    """The first tool call in ``text`` (:func:`parse_tool_calls`).

    >>> parse_tool_call('x <tool_call>{"name": "submit", "arguments": {}}</tool_call>')
    ToolCall(name='submit', arguments={})
    >>> parse_tool_call('<|python_tag|>{"name": "read_file", "parameters": {"path": "a.py"}}')
    ToolCall(name='read_file', arguments={'path': 'a.py'})
    >>> parse_tool_call('<tool_call>[{"name": "read_file", "arguments": {"path": "a.py"}}]</tool_call>')
    ToolCall(name='read_file', arguments={'path': 'a.py'})
    """
    return parse_tool_calls(text, tools, call_format)[0]


def _checked(name: str, arguments, tools: tuple[ToolSpec, ...], *, typed: bool) -> ToolCall:
    if not isinstance(arguments, dict):
        raise ToolCallError('"arguments" must be a JSON object')
    by_name = {tool.name: tool for tool in tools}
    spec = by_name.get(name)
    if spec is None:
        raise ToolCallError(f"unknown tool {name!r}; tools: {', '.join(by_name)}")
    missing = [k for k in spec.required if k not in arguments]
    if missing:
        raise ToolCallError(f"{spec.name} needs argument(s): {', '.join(missing)}")
    unknown = [k for k in arguments if k not in spec.parameters]
    if unknown:
        raise ToolCallError(f"{spec.name} takes no argument(s): {', '.join(unknown)}")
    if not typed:  # values written as text: each read as its declared type
        arguments = {k: v if spec.types.get(k, "string") in ("string", STRING_OR_OTHER) else _typed(v)
                     for k, v in arguments.items()}
    for key, value in arguments.items():
        kind = spec.types.get(key, "string")
        wanted = JSON_TYPES.get(kind)
        if wanted is not None and (not isinstance(value, wanted) or isinstance(value, bool) and kind != "boolean"):
            raise ToolCallError(f"{spec.name}: argument {key!r} must be a JSON {kind}")
    return ToolCall(spec.name, arguments)


def _typed(text: str):
    return value_of(text)
