"""How each model family writes tool calls in its replies: one registry, one small class per wire format.

A reply may hold several calls, and an argument may be any JSON value. A format reads the calls out of a
reply's text (:meth:`CallFormat.read`, ``(name, arguments)`` pairs, nothing where the reply holds no call,
:class:`ToolCallError` where one is malformed) and writes calls the way the
family does (:meth:`CallFormat.write`, for a template that writes no ``tool_calls`` itself). Checking the
calls against the tools offered is :func:`~lightning_agentrl.envs.tools.parse_tool_calls`'s.

The family is found from the tokenizer (:func:`resolve_call_format`): the chat template renders an
assistant message with a probe call, and the format that reads that probe back is the family's; a template
that writes no calls is recognised by its vocabulary's call token (``<|python_tag|>``, ``[TOOL_CALLS]``,
``<|call|>``, ...), else the calls are the product's own text format (``<tool_call>`` JSON, what the built-in
tool descriptions teach). ``env.tool_call_format`` names a format and skips the search; a template that
writes calls in no known format is an error that names the setting.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolCall:
    """One call of a tool, checked against the tools offered (:func:`~lightning_agentrl.envs.tools.parse_tool_calls`)."""

    name: str
    arguments: dict


class ToolCallError(ValueError):
    """The action does not contain one well-formed call of a known tool."""


RawCall = tuple[str, Any]  # (name, arguments) as the reply writes them, not yet checked against the tools


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    if not math.isfinite(value := float(text)):
        raise ValueError(f"{text} is too large for a JSON number")
    return value


DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite)
"""``json``'s decoder without Python's ``NaN``/``Infinity`` extension, nor ``1e999`` read as infinity: a call holding
one is malformed (a tool, or the gateway's client, would otherwise get a value JSON cannot write back)."""


def _json(text: str, what: str) -> Any:
    try:
        return DECODER.decode(text)
    except json.JSONDecodeError as err:
        raise ToolCallError(f"{what} is not valid JSON: {err.msg} at char {err.pos}") from None
    except ValueError as err:
        raise ToolCallError(f"{what} is not valid JSON: {err}") from None
    except RecursionError:  # a sampled reply can nest deeper than the parser's stack
        raise ToolCallError(f"{what} nests too deeply to be read") from None


def value_of(text: str) -> Any:
    """An argument written as text (XML formats) whose tool declares no type: JSON where it reads as JSON, else
    the text itself.

    >>> value_of("5"), value_of('[1, "a"]'), value_of("ls -la")
    (5, [1, 'a'], 'ls -la')
    """
    try:
        return DECODER.decode(text)
    except (ValueError, RecursionError):
        return text


Span = tuple[int, int, tuple[str, ...]]


def tagged(text: str, opening: str, closing: str) -> Iterator[tuple[int, int, str]]:
    """``(start, end, body)`` of each ``opening ... closing`` pair, the body up to the first ``closing`` after the
    opening (a lazy regex's match) and the scan going on after it; stops at an opening with no closing after it.
    Each tag is located once: linear in ``text``, where a regex retried at each of n unclosed openings is O(n^2).

    >>> list(tagged("a<t>x</t><t>y", "<t>", "</t>"))
    [(1, 9, 'x')]
    """
    pos = 0
    while (start := text.find(opening, pos)) != -1:
        stop = text.find(closing, start + len(opening))
        if stop == -1:
            return
        pos = stop + len(closing)
        yield start, pos, text[start + len(opening):stop]


def _named(payload: Any, arguments_key: str = "arguments") -> RawCall:
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        raise ToolCallError('a tool call is a JSON object {"name": ..., "arguments": {...}}')
    return payload["name"], payload.get(arguments_key, payload.get("arguments", payload.get("parameters", {})))


class CallFormat:
    """One family's wire format. ``marker``: a token of the family's vocabulary that only this format uses
    (how a template that writes no calls is still recognised); ``arguments_as_text``: the template concatenates
    ``arguments`` as a JSON string (DeepSeek's), rather than writing an object with ``tojson``; ``typed``: False
    where values are written as text (XML formats), read as JSON unless the tool declares a string."""

    name: ClassVar[str]
    marker: ClassVar[str | None] = None
    arguments_as_text: ClassVar[bool] = False
    typed: ClassVar[bool] = True  # False: every argument value is text, read as its tool's type when checked

    def spans(self, text: str) -> Iterator[Span]:
        """``(start, end, parts)`` of each call written in ``text``; linear in the text (each tag located once, the
        scan stops where no closing tag is left: a sampled reply of thousands of open tags must not hold the
        event loop)."""
        raise NotImplementedError

    def read(self, text: str) -> list[RawCall]:
        return [self.read_one(*parts) for _, _, parts in self.spans(text)]

    def read_one(self, *parts: str) -> RawCall:
        raise NotImplementedError

    def content(self, text: str) -> str:
        """The reply without its calls (what OpenAI's ``content`` holds)."""
        kept, pos = [], 0
        for start, end, _ in self.spans(text):
            kept.append(text[pos:start])
            pos = end
        return ("".join(kept) + text[pos:]).strip()

    def write(self, calls: list[ToolCall]) -> str:
        raise NotImplementedError


class Hermes(CallFormat):
    """Hermes, Qwen2.5, Qwen3 (and the product's own tool text); one tagged JSON object per call::

        <tool_call>
        {"name": "read_file", "arguments": {"path": "a.py"}}
        </tool_call>
        <tool_call>
        {"name": "run", "arguments": {"command": "ls", "timeout": 5}}
        </tool_call>

    A list of calls inside one pair of tags (SmolLM2's training data) is read as those calls.
    """

    name = "hermes"

    def spans(self, text: str) -> Iterator[Span]:
        return ((start, end, (body,)) for start, end, body in tagged(text, "<tool_call>", "</tool_call>"))

    def read(self, text: str) -> list[RawCall]:
        calls = []
        for _, _, (body,) in self.spans(text):
            payload = _json(body, "the tool call")
            calls.extend(_named(p) for p in (payload if isinstance(payload, list) else [payload]))
        return calls

    def write(self, calls: list[ToolCall]) -> str:
        return "\n".join(f'<tool_call>\n{json.dumps({"name": c.name, "arguments": c.arguments})}\n</tool_call>'
                         for c in calls)


class Qwen3Coder(CallFormat):
    """Qwen3-Coder's XML (a string argument written as is, any other as JSON)::

        <tool_call>
        <function=run>
        <parameter=command>
        ls -la
        </parameter>
        <parameter=timeout>
        5
        </parameter>
        </function>
        </tool_call>
    """

    name = "qwen3_coder"
    typed = False

    @staticmethod
    def _headed(body: str) -> tuple[str, str] | None:
        """``name>rest`` -> (name, rest); None where the name is empty or runs over a line."""
        head, sep, rest = body.partition(">")
        return (head.strip(), rest) if sep and head.strip() and "\n" not in head else None

    def spans(self, text: str) -> Iterator[Span]:
        for start, end, body in tagged(text, "<function=", "</function>"):
            if headed := self._headed(body):
                yield start, end, headed

    def read_one(self, name: str, body: str) -> RawCall:
        arguments = {}
        for _, _, parameter in tagged(body, "<parameter=", "</parameter>"):
            if headed := self._headed(parameter):
                value = headed[1].removeprefix("\n")
                arguments[headed[0]] = value.removesuffix("\n")
        return name, arguments

    def content(self, text: str) -> str:
        return re.sub(r"<tool_call>\s*</tool_call>", "", super().content(text)).strip()

    def write(self, calls: list[ToolCall]) -> str:
        def parameter(key, value):
            return f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"

        return "\n".join(f"<tool_call>\n<function={c.name}>\n" + "".join(parameter(k, v) for k, v in c.arguments.items())
                         + "</function>\n</tool_call>" for c in calls)


class Glm45(CallFormat):
    """GLM-4.5 / GLM-4.6: the name after the tag, then key and value pairs (a string value as is)::

        <tool_call>run
        <arg_key>command</arg_key>
        <arg_value>ls -la</arg_value>
        <arg_key>timeout</arg_key>
        <arg_value>5</arg_value>
        </tool_call>
    """

    name = "glm45"
    typed = False
    marker = "<arg_key>"
    head = re.compile(r"\s*([^\s<]+)\s*")

    def spans(self, text: str) -> Iterator[Span]:
        for start, end, body in tagged(text, "<tool_call>", "</tool_call>"):
            if (head := self.head.match(body)) and (pairs := self.pairs(body, head.end())) is not None:
                yield start, end, (head.group(1), pairs)

    @staticmethod
    def pairs(body: str, pos: int) -> dict | None:
        """The ``<arg_key>k</arg_key><arg_value>v</arg_value>`` pairs from ``pos`` to the end of ``body``, None
        where anything else is there (not a call of this format)."""
        arguments, blank = {}, re.compile(r"\s*")
        while (pos := blank.match(body, pos).end()) < len(body):
            key_end = body.find("</arg_key>", pos) if body.startswith("<arg_key>", pos) else -1
            value = blank.match(body, key_end + 10).end() if key_end != -1 else -1
            value_end = body.find("</arg_value>", value) if body.startswith("<arg_value>", value) else -1
            if value_end == -1:
                return None
            arguments[body[pos + 9:key_end].strip()] = body[value + 11:value_end]
            pos = value_end + 12
        return arguments

    def read_one(self, name: str, arguments: dict) -> RawCall:
        return name, arguments

    def write(self, calls: list[ToolCall]) -> str:
        def pair(key, value):
            return f"<arg_key>{key}</arg_key>\n<arg_value>{value if isinstance(value, str) else json.dumps(value)}</arg_value>\n"

        return "".join(f"<tool_call>{c.name}\n" + "".join(pair(k, v) for k, v in c.arguments.items()) + "</tool_call>"
                       for c in calls)


class DeepSeekV3(CallFormat):
    """DeepSeek V3 / R1: each call's arguments in a fenced JSON block between the family's tokens::

        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>run
        ```json
        {"command": "ls"}
        ```<｜tool▁call▁end｜>
        <｜tool▁call▁begin｜>function<｜tool▁sep｜>read_file
        ```json
        {"path": "a.py"}
        ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    """

    name = "deepseek_v3"
    marker = "<｜tool▁calls▁begin｜>"
    arguments_as_text = True
    begin, sep, end = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    kind = re.compile(r"\w*")

    def spans(self, text: str) -> Iterator[Span]:
        for start, stop, body in tagged(text, self.begin, self.end):
            # the last begin before the end opens the call (an unclosed one before it is text)
            body = body[body.rfind(self.begin) + len(self.begin):] if self.begin in body else body
            name_at = self.kind.match(body).end()
            fence = body.find("\n```", name_at) if body.startswith(self.sep, name_at) else -1
            arguments = fence + 4 + body.startswith("json", fence + 4) * 4
            if fence != -1 and body.startswith("\n", arguments) and body.endswith("\n```") and arguments < len(body) - 4:
                yield start, stop, (body[name_at + len(self.sep):fence], body[arguments + 1:-4])

    def read_one(self, name: str, arguments: str) -> RawCall:
        return name.strip(), _json(arguments, "the tool call's arguments")

    def content(self, text: str) -> str:
        return re.sub(r"<｜tool▁calls▁(?:begin|end)｜>", "", super().content(text)).strip()

    def write(self, calls: list[ToolCall]) -> str:
        return "<｜tool▁calls▁begin｜>" + "\n".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{c.name}\n```json\n{json.dumps(c.arguments)}\n```<｜tool▁call▁end｜>"
            for c in calls) + "<｜tool▁calls▁end｜>"


class Mistral(CallFormat):
    """Mistral: ``[TOOL_CALLS]`` then a JSON list of calls (v3 tokenizers), or each call as its name and its
    arguments after ``[ARGS]`` (v11 and later)::

        [TOOL_CALLS][{"name": "run", "arguments": {"command": "ls"}}, {"name": "read_file", "arguments": {"path": "a.py"}}]
        [TOOL_CALLS]run[ARGS]{"command": "ls"}[TOOL_CALLS]read_file[ARGS]{"path": "a.py"}
    """

    name = "mistral"
    marker = "[TOOL_CALLS]"
    pattern = re.compile(r"\[TOOL_CALLS\]\s*(?:([^\s\[{]+)\s*\[ARGS\]\s*)?")

    def read(self, text: str) -> list[RawCall]:
        calls, pos = [], 0
        while match := self.pattern.search(text, pos):
            try:
                payload, pos = DECODER.raw_decode(text, match.end())
            except ValueError as err:
                raise ToolCallError(f"the tool call is not valid JSON: {getattr(err, 'msg', err)}") from None
            except RecursionError:
                raise ToolCallError("the tool call nests too deeply to be read") from None
            if match.group(1):
                calls.append((match.group(1), payload))
            else:
                calls.extend(_named(p) for p in (payload if isinstance(payload, list) else [payload]))
        return calls

    def content(self, text: str) -> str:
        start = text.find("[TOOL_CALLS]")
        return (text if start == -1 else text[:start]).strip()

    def write(self, calls: list[ToolCall]) -> str:
        return "[TOOL_CALLS]" + json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls])


class GptOss(CallFormat):
    """gpt-oss (OpenAI's harmony format): a call is a ``commentary`` message addressed to ``functions.<name>``,
    ended by ``<|call|>`` (a stop token: one call per reply as sampled, several in a rendered history)::

        <|channel|>analysis<|message|>I should list the files.<|end|><|start|>assistant<|channel|>commentary to=functions.run <|constrain|>json<|message|>{"command": "ls"}<|call|>

    The recipient may also open the header: ``<|start|>assistant to=functions.run<|channel|>commentary json<|message|>``.

    >>> GptOss().read('<|start|>assistant to=functions.run<|channel|>commentary json<|message|>{"command": "ls"}<|call|>')
    [('run', {'command': 'ls'})]
    """

    name = "gpt_oss"
    marker = "<|call|>"
    recipient = re.compile(r"to=functions\.([\w.-]+)")

    def spans(self, text: str) -> Iterator[Span]:
        # the recipient may come before the channel or after it; whatever header follows, up to the message
        pos, found = 0, {"<|message|>": -1, "<|end|>": -1, "<|call|>": -1}

        def following(token: str, at: int) -> int:  # each token located once for all the recipients before it
            if found[token] < at and found[token] != len(text):
                found[token] = len(text) if (i := text.find(token, at)) == -1 else i
            return found[token]

        while match := self.recipient.search(text, pos):
            message = following("<|message|>", match.end())
            if message == len(text):
                return
            pos = match.end()
            if min(following("<|end|>", pos), following("<|call|>", pos)) < message:
                continue
            pos = following("<|call|>", message)
            yield match.start(), min(pos + 8, len(text)), (match.group(1), text[message + 11:pos])
            pos += 8

    def read_one(self, name: str, arguments: str) -> RawCall:
        return name, _json(arguments.strip(), "the tool call's arguments")

    def content(self, text: str) -> str:
        final = re.search(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|end\|>|<\|return\|>|$)", text, re.DOTALL)
        return final.group(1).strip() if final else ""

    def write(self, calls: list[ToolCall]) -> str:
        return "".join(f"<|start|>assistant<|channel|>commentary to=functions.{c.name} <|constrain|>json<|message|>"
                       f"{json.dumps(c.arguments)}<|call|>" for c in calls)


class Llama3Json(CallFormat):
    """Llama 3.1 / 3.2 / 3.3 JSON calls (``parameters`` for ``arguments``), maybe after ``<|python_tag|>``,
    several separated by ``;``::

        <|python_tag|>{"name": "run", "parameters": {"command": "ls"}}; {"name": "read_file", "parameters": {"path": "a.py"}}

    With no tag, the JSON objects in the text that have a ``name`` are the calls. A brace that opens no JSON
    costs a scan to the end of the text: after 32 of them the search stops, and where a ``"name"`` is still
    ahead the reply is a malformed call (an error the agent sees), never calls silently dropped.
    """

    name = "llama3_json"
    marker = "<|python_tag|>"
    max_failed_starts = 32

    def read(self, text: str) -> list[RawCall]:
        calls, start, failed = [], text.find("{"), 0
        while start != -1:
            try:
                payload, end = DECODER.raw_decode(text, start)
            except (ValueError, RecursionError):
                payload, end, failed = None, start + 1, failed + 1
            if failed == self.max_failed_starts:
                if '"name"' in text[end:]:
                    raise ToolCallError(f"{failed} braces open no JSON before the reply's last calls; write each "
                                        f'call as {{"name": ..., "parameters": {{...}}}}, separated by ";"')
                break
            if isinstance(payload, dict) and isinstance(payload.get("name"), str):
                calls.append(_named(payload, "parameters"))
            start = text.find("{", end)
        return calls

    def content(self, text: str) -> str:
        head = text.split("<|python_tag|>", 1)[0]
        start = head.find('{"name"')
        return (head if start == -1 else head[:start]).strip()

    def write(self, calls: list[ToolCall]) -> str:
        return "<|python_tag|>" + "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}) for c in calls)


CALL_FORMATS: dict[str, CallFormat] = {f.name: f for f in (
    Qwen3Coder(), Glm45(), DeepSeekV3(), Mistral(), GptOss(), Hermes(), Llama3Json())}
"""Every known format, in the order a template's rendering is tried against them (the most specific first:
Llama 3's bare JSON would also read Hermes' tagged JSON)."""
HERMES = CALL_FORMATS["hermes"]


def read_calls(text: str, call_format: CallFormat | None) -> tuple[CallFormat, list[RawCall]]:
    """The calls in ``text`` and the format they were read in. ``call_format`` None: Hermes, then Mistral, then
    Llama 3's bare JSON (environments built without a resolved family). A family's format falls back to Hermes,
    the product's own text format, where its own reads nothing."""
    tried = (HERMES, CALL_FORMATS["mistral"], CALL_FORMATS["llama3_json"]) if call_format is None else (
        (call_format,) if call_format is HERMES else (call_format, HERMES))
    for candidate in tried:
        calls = candidate.read(text)
        if calls:
            return candidate, calls
    return tried[0], []


_PROBE = "probe_call_\u2063"
_PROBE_ARGUMENTS = {"probe_text": "a b", "probe_list": [1, {"k": True}]}


def rendered_probe(tokenizer) -> str | None:
    """An assistant message with one probe call, as the chat template writes it; None when it writes no calls."""
    # arguments as an object, else as the JSON text DeepSeek's needs; content None (DeepSeek writes calls only
    # then), else "" (templates that concatenate it)
    for arguments, content in itertools.product((_PROBE_ARGUMENTS, json.dumps(_PROBE_ARGUMENTS)), (None, "")):
        call = {"type": "function", "id": "call_probe", "function": {"name": _PROBE, "arguments": arguments}}
        messages = [{"role": "user", "content": "U"}, {"role": "assistant", "content": content, "tool_calls": [call]}]
        try:
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        except Exception:  # noqa: BLE001 - a template that raises on tool calls writes none
            continue
        if _PROBE in rendered:
            return rendered
    return None


def resolve_call_format(name: str, tokenizer) -> CallFormat:
    """``env.tool_call_format``: the format ``name``; for ``auto`` the one that reads back the chat template's own
    rendering of a probe call (:func:`rendered_probe`), else the one whose call token is in the vocabulary, else
    Hermes. ``ValueError`` when the template writes calls that no format reads."""
    if name != "auto":
        return CALL_FORMATS[name]
    rendered = rendered_probe(tokenizer) if getattr(tokenizer, "chat_template", None) else None
    if rendered is None:
        vocabulary = {token.content for token in tokenizer.added_tokens_decoder.values()}
        return next((f for f in CALL_FORMATS.values() if f.marker in vocabulary), HERMES)
    for candidate in CALL_FORMATS.values():
        try:
            read = [(n, a if candidate.typed else {k: value_of(v) for k, v in a.items()}) for n, a in candidate.read(rendered)]
            if (_PROBE, _PROBE_ARGUMENTS) in read:
                return candidate
        except ToolCallError:
            continue
    written = rendered[max(0, rendered.find(_PROBE) - 80):][:240]
    raise ValueError(f"the chat template writes tool calls in no known format ({written!r}); set it to one of "
                     f"{', '.join(CALL_FORMATS)}")
