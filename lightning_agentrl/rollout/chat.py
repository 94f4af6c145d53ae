"""The one boundary where messages become token ids (SPEC §5).

The prompt is rendered once with the tokenizer's chat template. After that, ids are only ever
appended: the action ids exactly as the engine sampled them, and for each observation the
template's scaffolding (encoded once, at construction) around the encoding of only the new
observation text. Nothing is ever decoded and re-encoded, so the trained ids are the sampled ids.
"""

from __future__ import annotations

from dataclasses import dataclass

_SENTINEL = "\u2063OBSERVATION\u2063"


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

    The scaffolding between the end of an assistant turn and the next generation prompt is found
    by rendering a reference conversation whose observation is a sentinel string, so it works for
    any template (ChatML, Llama 3, Qwen's ``<tool_response>`` wrapping, ...).
    """

    def __init__(self, tokenizer, observation_role: str = "tool") -> None:
        if tokenizer.chat_template is None:
            raise ValueError("the tokenizer has no chat template; set tokenizer.chat_template")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token; generation could never stop")
        self.tokenizer = tokenizer
        self.eos_token_id: int = tokenizer.eos_token_id
        end_of_turn = tokenizer.eos_token
        rendered = tokenizer.apply_chat_template(
            [
                {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A"},
                {"role": observation_role, "content": _SENTINEL},
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        after_action = rendered.split("A" + end_of_turn, 1)
        if len(after_action) != 2 or _SENTINEL not in after_action[1]:
            raise ValueError(
                f"cannot find the end of an assistant turn ({end_of_turn!r}) in the chat template; "
                "the template must end assistant messages with the eos token"
            )
        before, after = after_action[1].split(_SENTINEL, 1)
        self._before = self.encode(before)
        self._after = self.encode(after)
        self._end_of_turn = [self.eos_token_id]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Text for people (tests, logs): special tokens such as template markers dropped."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decode_action(self, ids: list[int]) -> str:
        """The text the environment parses: the action without its end-of-turn id.

        Only that id is dropped, not every special token: tokenizers that register tool tags such
        as ``<tool_call>`` as special tokens would otherwise lose them, and no call would parse.
        """
        if ids and ids[-1] == self.eos_token_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first context: system and user messages plus the generation prompt."""
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def observation_ids(self, text: str) -> ObservationIds:
        return ObservationIds(list(self._before), self.encode(text), list(self._after))

    def close_action_ids(self) -> list[int]:
        """Scaffolding that ends an action cut by the token budget (it never sampled eos)."""
        return list(self._end_of_turn)
