"""The one boundary where messages become token ids (SPEC §5).

The prompt is rendered once with the tokenizer's chat template. After that, ids are only ever
appended: the action ids exactly as the engine sampled them, and for each observation the
template's scaffolding (encoded once, at construction) around the encoding of only the new
observation text. Nothing is ever decoded and re-encoded, so the trained ids are the sampled ids.

Everything the codec needs from a template is found by rendering small probe conversations, so
it works with any template that can hold a tool-calling conversation (ChatML/Qwen, Llama 3,
Gemma, ...), and a template that cannot is refused at construction with a
:class:`ChatTemplateError` that names the problem (never a raw Jinja error mid-run):

- **Observation role.** ``tool`` where the template renders it, else ``user`` (Gemma's template
  knows only user and model turns and raises on any other); or the role given.
- **End of turn.** What closes an assistant turn is read from the template (``<|im_end|>`` for
  Qwen, ``<|eot_id|>`` for Llama 3, ``<end_of_turn>`` for Gemma), not taken from the tokenizer's
  eos, which is often another token (a base model's ``<|endoftext|>``). Generation stops on it
  (and on the eos); an action that did not end with it is closed with it (mask 0).
- **Tools.** :attr:`ChatCodec.renders_tools` says whether the template renders the ``tools=``
  argument (Qwen, Llama 3.1+, Mistral do; many do not); the environment then passes its tools
  there instead of describing them in its own words.

Templates that rewrite earlier turns (Qwen3 drops the ``<think>`` part of every assistant turn
before the last user message) would give, on re-rendering, other ids than those sampled. They are
never re-rendered: the context keeps every action exactly as it was sampled, which is what the
policy saw when it produced the next action, and what it is trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_agentrl.envs.call_formats import resolve_call_format
from lightning_agentrl.settings import Settings, SettingsError

_ACTION = "\u2063ACTION\u2063"
_OBSERVATION = "\u2063OBSERVATION\u2063"
_PROBE_TOOL = "probe_tool_\u2063"
OBSERVATION_ROLES = ("tool", "user")
"""Observation roles tried, in order, when none is set."""


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot hold a tool-calling conversation; the message says why."""


class CallFormatError(ChatTemplateError):
    """The chat template writes tool calls in no known format (``env.tool_call_format``)."""


@dataclass(frozen=True)
class ObservationIds:
    """Ids appended after an action; all of them get loss mask 0."""

    scaffold_before: list[int]
    observation: list[int]
    scaffold_after: list[int]

    @property
    def all(self) -> list[int]:
        return self.scaffold_before + self.observation + self.scaffold_after


class ChatCodec:
    """Token ids for prompts and observations, derived from any HF tokenizer's chat template.

    ``observation_role``: the role tool results are rendered in; None = the first of
    :data:`OBSERVATION_ROLES` the template renders. ``call_format``: ``env.tool_call_format``, resolved into
    :attr:`call_format` (:func:`~lightning_agentrl.envs.call_formats.resolve_call_format`).
    """

    def __init__(self, tokenizer, observation_role: str | None = None, call_format: str = "auto") -> None:
        if tokenizer.chat_template is None:
            raise ChatTemplateError("the tokenizer has no chat template (set tokenizer.chat_template)")
        self.tokenizer = tokenizer
        self._render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], what="a system message")
        self.observation_role, between, after = self._probe_observation(observation_role)
        closing = self._render(
            [{"role": "user", "content": "U"}, {"role": "assistant", "content": _ACTION}],
            generation_prompt=False, what="an assistant turn",
        ).split(_ACTION, 1)[-1]
        self.end_of_turn_id = self._end_of_turn_id(closing, between)
        end_text = tokenizer.decode([self.end_of_turn_id])
        self._before = self.encode(between[len(end_text):])
        self._after = self.encode(after)
        self._joint = self._probe_joint()
        eos = tokenizer.eos_token_id
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(
            [self.end_of_turn_id, *([eos] if eos is not None else [])]
        ))
        self.renders_tools = self._renders_tools()
        try:  # how replies write tool calls: the template's own format (envs/call_formats.py)
            self.call_format = resolve_call_format(call_format, tokenizer)
        except ValueError as err:
            raise CallFormatError(str(err)) from None

    # -- probing the template ----------------------------------------------------------------
    def _render(self, messages: list[dict], *, generation_prompt: bool = True, what: str, **kwargs) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
            )
        except Exception as err:  # jinja2's TemplateError, or what a template raises itself
            reason = " ".join(str(err).split())  # one line, whatever the template raised
            raise ChatTemplateError(f"the chat template cannot render {what}: {type(err).__name__}: {reason}") from None

    def _probe_observation(self, role: str | None) -> tuple[str, str, str]:
        """The observation role, the text between an action and the observation, and the text after it."""
        problems = []
        for candidate in OBSERVATION_ROLES if role is None else (role,):
            conversation = [
                {"role": "user", "content": "U"},
                {"role": "assistant", "content": _ACTION},
                {"role": candidate, "content": _OBSERVATION},
            ]
            try:
                rendered = self._render(conversation, what=f"an observation in role {candidate!r}")
            except ChatTemplateError as err:
                problems.append(str(err))
                continue
            if _ACTION not in rendered or _OBSERVATION not in rendered.split(_ACTION, 1)[1]:
                problems.append(f"the chat template drops messages in role {candidate!r}")
                continue
            between, after = rendered.split(_ACTION, 1)[1].split(_OBSERVATION, 1)
            return candidate, between, after
        raise ChatTemplateError("no observation role works (env.observation_role): " + "; ".join(problems))

    def _probe_joint(self) -> list[int]:
        """What the template writes between two results of one action's calls (Qwen puts both in one turn); a
        template that refuses two in a row (Gemma's roles must alternate) gets them in one message, a blank line apart."""
        result = {"role": self.observation_role, "content": _OBSERVATION}
        conversation = [{"role": "user", "content": "U"}, {"role": "assistant", "content": _ACTION}, result,
                        {**result, "content": _OBSERVATION + "2"}]
        try:
            rendered = self._render(conversation, what="two results in a row")
        except ChatTemplateError:
            return self.encode("\n\n")
        joint = rendered.split(_ACTION, 1)[1].split(_OBSERVATION, 1)[1]
        return self.encode(joint.split(_OBSERVATION + "2", 1)[0]) if _OBSERVATION + "2" in joint else self.encode("\n\n")

    def _end_of_turn_id(self, closing: str, between: str) -> int:
        """The special token that starts what the template writes after an assistant's content."""
        ids = self.encode(closing)
        special = set(self.tokenizer.all_special_ids) | {
            i for i, token in self.tokenizer.added_tokens_decoder.items() if token.special
        }
        if not ids or ids[0] not in special:
            raise ChatTemplateError(
                f"the chat template ends an assistant turn with {closing!r}, which does not start with a special "
                "token: generation could not stop at the end of a turn"
            )
        if self.encode(between)[:1] != ids[:1]:  # ids, not decoded text: some tokens decode to other text
            raise ChatTemplateError(
                "the chat template closes an assistant turn differently when a tool result follows it: "
                f"{between!r} does not start with {self.tokenizer.decode(ids[:1])!r}"
            )
        return ids[0]

    def _renders_tools(self) -> bool:
        probe = {"type": "function", "function": {"name": _PROBE_TOOL, "description": "probe", "parameters": {
            "type": "object", "properties": {}, "required": []}}}
        try:
            rendered = self._render([{"role": "user", "content": "U"}], what="tools", tools=[probe])
        except ChatTemplateError:
            return False
        return _PROBE_TOOL in rendered

    # -- ids -----------------------------------------------------------------------------------
    @property
    def eos_token_id(self) -> int:
        """The id that ends an assistant turn (:attr:`end_of_turn_id`): the template's, which need
        not be the tokenizer's eos."""
        return self.end_of_turn_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Text for people (tests, logs): special tokens such as template markers dropped."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decode_action(self, ids: list[int]) -> str:
        """The text the environment parses: the action without its stop id.

        Only that id is dropped, not every special token: tokenizers that register tool tags such
        as ``<tool_call>`` as special tokens would otherwise lose them, and no call would parse.
        """
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The first context: system and user messages plus the generation prompt; ``tools`` (JSON
        schemas) go to the template's ``tools=`` argument (only where :attr:`renders_tools`)."""
        kwargs = {"tools": tools} if tools else {}
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
        if hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def observation_ids(self, text: str, *more: str) -> ObservationIds:
        """A tool result's ids; with ``more``, one action's several results, joined as the template joins them."""
        ids = self.encode(text)
        for result in more:
            ids += self._joint + self.encode(result)
        return ObservationIds(list(self._before), ids, list(self._after))

    def close_action_ids(self, action_ids: list[int]) -> list[int]:
        """What ends an action that did not end with the end-of-turn id (cut by the token budget, or
        stopped on the tokenizer's eos); nothing for one that did."""
        return [] if action_ids and action_ids[-1] == self.end_of_turn_id else [self.end_of_turn_id]


def chat_codec(settings: Settings, tokenizer):
    """The model's chat template as a :class:`ChatCodec`; a template that cannot hold the episode's
    conversation is a :class:`SettingsError` naming the setting."""
    env = settings.env
    try:
        codec = ChatCodec(tokenizer, observation_role=env.observation_role, call_format=env.tool_call_format)
    except ChatTemplateError as err:
        setting = "env.observation_role" if env.observation_role is not None else "model.path"
        setting = "env.tool_call_format" if isinstance(err, CallFormatError) else setting
        raise SettingsError(f"{setting}: unsupported chat template of {settings.model.path}: {err}") from None
    if env.tool_format == "template" and not codec.renders_tools:
        raise SettingsError(
            f"env.tool_format: the chat template of {settings.model.path} does not render tools (tools=); "
            "use `auto` or `text`"
        )
    return codec


def native_tools(settings: Settings, codec) -> bool:
    """Whether the environment gives its tools to the chat template (``env.tool_format``)."""
    return settings.env.tool_format != "text" and codec.renders_tools
