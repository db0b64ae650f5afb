"""Function calling on the chat endpoint (`gateway.edge.tools`): each format's reader and grammar
on their own, then tools, tool_choice and tool calls in the history against a real gateway
over real workers on loopback, through the official `openai` client."""
from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import jsonschema
import llguidance
import openai
import pytest
from transformers import AutoTokenizer

from conftest import SEEDED_DRAFT_FLOOR_S, make_model, start_stack
from gateway.edge.bodies import HttpError
from gateway.edge.tools import (
    FORMATS,
    HermesCalls,
    Llama3Calls,
    MistralCalls,
    chat_messages,
    hermes_grammar,
    llama3_grammar,
    mistral_grammar,
    renders_tools,
    reply_message,
    tool_calling,
    tools_as_text,
    with_preamble,
)
from gateway.grammar import tokenizer_for
from gateway.settings import TOOL_CALL_PARSERS

DEMO_TEMPLATE = Path(__file__).resolve().parents[1] / "models" / "demo" / "chat.jinja"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 8}}, "required": ["query"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather to come in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "search the web",
                                           "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
ASK = [{"role": "user", "content": "What will the weather be in Paris for 3 days?"}]


def read(text: str, splits: list[int] | None = None, names=frozenset(SCHEMAS), parallel: bool = True,
         reader_class=HermesCalls) -> dict:
    """The message a reader (hermes unless said) makes of `text`, fed whole or cut at
    `splits`; call ids left out."""
    reader = reader_class(names, parallel)
    cuts = [0, *(splits or []), len(text)]
    pieces = [piece for a, b in zip(cuts, cuts[1:]) for piece in reader.feed(text[a:b])] + reader.end()
    message = reply_message(pieces)
    for call in message.get("tool_calls", []):
        assert call.pop("id").startswith("call_") and call.pop("type") == "function"
    return message


def read_cut_anyhow(text: str, reader_class=HermesCalls, seed: int = 0) -> dict:
    """The message `text` makes whole, checked to be the same cut at random places, and fed
    a character at a time."""
    whole = read(text, reader_class=reader_class)
    rng = random.Random(seed)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        assert read(text, cuts, reader_class=reader_class) == whole
    assert read(text, list(range(1, len(text))), reader_class=reader_class) == whole
    return whole


def call_block(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# -- the reader, the grammar and the prompt, on their own ---------------------------------------

def test_hermes_calls_are_read_out_of_the_text_however_it_is_cut():
    text = (f"Let me look.\n{call_block('get_weather', {'city': 'Oslo', 'days': 2})}\n"
            f"{call_block('search', {'query': 'rain'})}\n<tool_call>not json</tool_call> done\n")
    whole = read_cut_anyhow(text)
    assert whole["content"] == "Let me look.<tool_call>not json</tool_call> done\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["tool_calls"]] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("search", {"query": "rain"})]


def test_what_the_hermes_reader_keeps_as_text():
    plain = "no calls here <tool_ at all\n"
    assert read(plain) == {"role": "assistant", "content": plain}
    unknown = call_block("launch", {"now": True})
    assert read(unknown)["content"] == unknown and "tool_calls" not in read(unknown)
    two = call_block("search", {"query": "a"}) + "\n" + call_block("search", {"query": "b"})
    single = read(two, parallel=False)
    assert len(single["tool_calls"]) == 1 and single["content"] == call_block("search", {"query": "b"})
    # Cut off before its end tag (EOS or max_tokens): read as if closed there.
    cut = read('<tool_call>\n{"name": "search", "arguments": {"query": "x"}}')
    assert cut["content"] is None and cut["tool_calls"][0]["function"]["arguments"] == '{"query": "x"}'


@pytest.fixture
def takes(tokenizer):
    """Whether a Lark grammar takes a text whole, token by token as llguidance reads it."""
    llg = tokenizer_for(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))

    def taken(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(llg, llguidance.LLMatcher.grammar_from_lark(grammar))
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()

    return taken


def test_the_required_grammar_takes_calls_of_the_tools_only(takes):
    describe = {**SEARCH, "properties": {"query": {**SEARCH["properties"]["query"], "description": "q ::= words"}}}
    tools = tool_calling({"tools": [TOOLS[0], {"type": "function", "function": {
        "name": "search", "parameters": {"$defs": {"Q": describe}, "$ref": "#/$defs/Q"}}}]}, "hermes").tools
    many, one = hermes_grammar(tools, parallel=True), hermes_grammar(tools, parallel=False)
    weather, search = call_block("get_weather", {"city": "Lima", "days": 14}), call_block("search", {"query": "x"})
    assert takes(many, weather) and takes(many, f"{weather}\n{search}") and takes(one, search)
    assert not takes(one, f"{weather}\n{search}")
    assert not takes(many, call_block("launch", {}))
    assert not takes(many, call_block("get_weather", {"city": "Rome", "days": 2}))
    assert not takes(many, weather.replace(", ", ","))  # compact JSON, as every JSON structure here
    assert set(FORMATS) == set(TOOL_CALL_PARSERS)


def test_bad_tool_fields_are_400_naming_what_is_wrong():
    cases = [({"tool_choice": "auto"}, "only allowed with 'tools'"),
             ({"tools": [], "tool_choice": "auto"}, "non-empty list"),
             ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "needs a 'name'"),
             ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "needs a 'name'"),
             ({"tools": [TOOLS[0], TOOLS[0]]}, "more than once"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}},
              "'launch', which is not in 'tools'"),
             ({"tools": TOOLS, "tool_choice": "sometimes"}, "'tool_choice' is one of"),
             ({"tools": [{"type": "function", "function": {"name": "a", "returns": {}}}]}, "returns"),
             ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "true or false")]
    for body, message in cases:
        with pytest.raises(HttpError, match=message) as refused:
            tool_calling(body, "hermes")
        assert refused.value.status == 400


def test_a_template_without_tools_gets_them_in_hermes_text(tokenizer):
    def render_with(template: str):
        return lambda messages, **kwargs: tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=True, **kwargs)

    listing = "{% if tools %}{{ tools | tojson }}\n{% endif %}" + DEMO_TEMPLATE.read_text()
    assert renders_tools(render_with(listing)) and not renders_tools(render_with(DEMO_TEMPLATE.read_text()))
    history = chat_messages([*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "x"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "warm"}])
    assert history[1]["tool_calls"][0]["function"]["arguments"] == {"query": "x"}  # an object, as templates take
    calling = tool_calling({"tools": TOOLS}, "hermes")
    assert calling is not None
    plain = with_preamble(tools_as_text(history, "hermes"), FORMATS["hermes"].preamble(calling.tools, calling.parallel))
    assert [m["role"] for m in plain] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in plain[0]["content"] and "<tool_call>" in plain[0]["content"]
    assert plain[2]["content"] == call_block("search", {"query": "x"})
    assert plain[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response>"


def llama3_call(name: str, arguments: dict) -> str:
    return json.dumps({"name": name, "parameters": arguments})


def test_llama3_json_calls_are_read_however_the_text_is_cut():
    """vLLM's `llama3_json`: a reply that begins with `{` (or `<|python_tag|>`) is calls,
    `; ` apart, held until it is whole; "arguments" reads as "parameters" does."""
    text = f"  <|python_tag|>{llama3_call('get_weather', {'city': 'Oslo', 'days': 2})}; " \
           f"{json.dumps({'name': 'search', 'arguments': {'query': 'rain'}})}\n"
    whole = read_cut_anyhow(text, Llama3Calls)
    assert whole["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["tool_calls"]] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("search", {"query": "rain"})]
    single = read(text, parallel=False, reader_class=Llama3Calls)
    assert len(single["tool_calls"]) == 1 and single["content"] == '{"name": "search", "arguments": {"query": "rain"}}'
    # Anything else is text, whole: prose, a tool it does not have, JSON that is not calls.
    for plain in ["The weather is {fine}.", llama3_call("launch", {"now": True}), '{"name": "search"', "{} junk",
                  f"{llama3_call('search', {'query': 'a'})} and more"]:
        assert read(plain, reader_class=Llama3Calls) == {"role": "assistant", "content": plain}, plain


def test_a_llama3_text_reply_is_sent_as_it_comes():
    reader = Llama3Calls(frozenset(SCHEMAS), True)
    assert reader.feed(" ") == [] and reader.feed("<|python") == []  # may still become calls
    assert reader.feed("_tag|>") == [] and reader.end() != []
    reader = Llama3Calls(frozenset(SCHEMAS), True)
    assert [p.text for p in reader.feed(" Hello")] == [" Hello"]
    assert [p.text for p in reader.feed(" there")] == [" there"]


def test_mistral_calls_are_read_after_their_marker_however_the_text_is_cut():
    calls = [{"name": "get_weather", "arguments": {"city": "Lima", "days": 3}}, {"name": "search", "arguments": {}}]
    text = f"Checking. [TOOL_CALLS]{json.dumps(calls)}"
    whole = read_cut_anyhow(text, MistralCalls)
    assert whole["content"] == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["tool_calls"]] == [
        ("get_weather", {"city": "Lima", "days": 3}), ("search", {})]
    single = read(text, parallel=False, reader_class=MistralCalls)
    assert len(single["tool_calls"]) == 1 and json.loads(single["content"][len("Checking."):]) == calls[1:]
    for plain in ["no calls [TOOL here", "[TOOL_CALLS]not json", '[TOOL_CALLS][{"name": "launch", "arguments": {}}]']:
        assert read(plain, reader_class=MistralCalls) == {"role": "assistant", "content": plain}, plain


def test_each_format_s_grammar_takes_its_calls_of_the_tools_only(takes):
    tools = tool_calling({"tools": TOOLS}, "hermes").tools
    weather, search = {"city": "Lima", "days": 14}, {"query": "x"}
    llama3 = [llama3_call("get_weather", weather), llama3_call("search", search)]
    assert takes(llama3_grammar(tools, True), "; ".join(llama3)) and takes(llama3_grammar(tools, False), llama3[1])
    assert not takes(llama3_grammar(tools, False), "; ".join(llama3))
    assert not takes(llama3_grammar(tools, True), llama3_call("launch", {}))
    assert not takes(llama3_grammar(tools, True), llama3_call("get_weather", {"city": "Rome", "days": 2}))
    mistral = [{"name": "get_weather", "arguments": weather}, {"name": "search", "arguments": search}]
    assert takes(mistral_grammar(tools, True), f"[TOOL_CALLS]{json.dumps(mistral)}")
    assert takes(mistral_grammar(tools, False), f"[TOOL_CALLS]{json.dumps(mistral[:1])}")
    assert not takes(mistral_grammar(tools, False), f"[TOOL_CALLS]{json.dumps(mistral)}")
    assert not takes(mistral_grammar(tools, True), json.dumps(mistral))  # the marker first
    # What each format's grammar makes, its reader reads back as the same calls.
    for parser, text in (("llama3_json", "; ".join(llama3)), ("mistral", f"[TOOL_CALLS]{json.dumps(mistral)}")):
        message = read(text, reader_class=FORMATS[parser].reader)
        assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [weather, search]


def test_a_template_without_tools_gets_each_format_s_own_calls():
    history = chat_messages([*ASK, {"role": "assistant", "content": "Looking.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "x"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    calling = tool_calling({"tools": TOOLS}, "llama3_json")
    assert calling is not None
    llama3 = with_preamble(tools_as_text(history, "llama3_json"),
                           FORMATS["llama3_json"].preamble(calling.tools, calling.parallel))
    assert '"parameters": dictionary' in llama3[0]["content"] and '"get_weather"' in llama3[0]["content"]
    assert llama3[2]["content"] == "Looking.\n" + llama3_call("search", {"query": "x"})
    mistral = tools_as_text(history, "mistral")
    assert mistral[1]["content"] == 'Looking.\n[TOOL_CALLS][{"name": "search", "arguments": {"query": "x"}}]'
    assert FORMATS["mistral"].preamble(calling.tools, False).startswith("[AVAILABLE_TOOLS]")


# -- over HTTP ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tool_stack(model_dirs, tmp_path_factory):
    """The demo chat template over a target and a close draft like the session's, with a
    context of 2,048: the tools' preamble alone takes the session target's 256 tokens."""
    root = tmp_path_factory.mktemp("tool-models")
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["target"])
    dirs = {"target": root / "target", "close": root / "close"}
    make_model(dirs["target"], tokenizer, seed=1, context=2048)
    make_model(dirs["close"], tokenizer, seed=2, noise_from=dirs["target"], noise=0.05)
    running = start_stack(dirs, drafts=("close",), http_port=0, chat_template=DEMO_TEMPLATE,
                          draft_step_floor_s=SEEDED_DRAFT_FLOOR_S)
    yield running
    running.close()


@pytest.fixture(scope="module")
def client(tool_stack):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{tool_stack.gateway.servicer.http.port}/v1", api_key="unused",
                         max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def valid_calls(calls) -> list[tuple[str, dict]]:
    """Each call's name and arguments, checked against its function's schema."""
    read = []
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        read.append((call.function.name, arguments))
    return read


def test_a_named_tool_choice_gives_valid_arguments_sampled(client, model):
    for seed in range(1, 11):
        reply = client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, temperature=0.8, seed=seed, max_tokens=120,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = choice_of(reply)
        assert choice.message.content is None and choice.finish_reason == "stop"  # OpenAI's, for a named call
        assert [name for name, _ in valid_calls(choice.message.tool_calls)] == ["get_weather"]


@pytest.mark.parametrize("parser, seeds", [("hermes", 10), ("llama3_json", 3), ("mistral", 3)])
def test_required_gives_a_valid_tool_call_sampled(tool_stack, client, model, monkeypatch, parser, seeds):
    """`required` in each --tool-call-parser format (the setting swapped on the running
    gateway, which reads it per request): generated in that format, with that format's
    preamble in the prompt (the demo template renders no tools), and read back as valid calls."""
    core = tool_stack.gateway.servicer.core
    monkeypatch.setattr(core, "settings", replace(core.settings, tool_call_parser=parser))
    for seed in range(1, seeds + 1):
        reply = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, temperature=0.8, seed=seed,
                                               max_tokens=400)
        choice = choice_of(reply)
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(valid_calls(choice.message.tool_calls)) == 1


def test_required_with_parallel_calls_gives_valid_ones(client, model):
    """One call or more, each valid. A random model seldom ends after a call (the grammar
    allows EOS or another call), so a reply may reach max_tokens inside its last call."""
    for seed in range(1, 4):
        reply = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                               temperature=0.8, seed=seed, max_tokens=500)
        choice = choice_of(reply)
        calls = choice.message.tool_calls
        whole = calls if choice.finish_reason == "tool_calls" else calls[:-1]
        assert choice.finish_reason in ("tool_calls", "length") and calls and len(valid_calls(whole)) == len(whole)


def choice_of(reply):
    assert reply.usage.model_extra["speculation"]["num_drafts"] >= 0
    return reply.choices[0]


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "search"}}, "required"])
def test_greedy_under_a_tool_grammar_equals_speculation_off(client, model, tool_choice):
    # Greedy, a random model repeats its call without end: one call (parallel_tool_calls false).
    replies = [client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                              temperature=0, max_tokens=200, parallel_tool_calls=False,
                                              extra_body={"speculation": {"mode": m}})
               for m in ("auto", "off")]
    calls = [[(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] for r in replies]
    assert calls[0] == calls[1] and valid_calls(replies[0].choices[0].message.tool_calls)
    assert replies[0].usage.model_extra["speculation"]["num_drafts"] > 0  # it did speculate


def test_a_streamed_named_call_reassembles_to_valid_arguments(client, model):
    named = {"type": "function", "function": {"name": "get_weather"}}
    with client.chat.completions.stream(model=model, messages=ASK, tools=TOOLS, tool_choice=named, temperature=0.8,
                                        seed=7, max_tokens=120) as stream:
        final = stream.get_final_completion()
    assert valid_calls(final.choices[0].message.tool_calls)[0][0] == "get_weather"
    # The deltas as OpenAI sends them: the call's id, type and name first, its arguments in pieces after.
    chunks = list(client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=named,
                                                 temperature=0, max_tokens=120, stream=True))
    entries = [entry for chunk in chunks for entry in chunk.choices[0].delta.tool_calls or []]
    assert entries[0].id.startswith("call_") and entries[0].function.name == "get_weather"
    assert all(e.index == 0 and e.id is None and e.function.name is None for e in entries[1:]) and len(entries) > 2
    whole = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=named,
                                           temperature=0, max_tokens=120)
    assert "".join(e.function.arguments for e in entries) == whole.choices[0].message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_streamed_required_reply_equals_the_whole_one(client, model):
    asked = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=400,
                 parallel_tool_calls=False)
    whole = client.chat.completions.create(**asked).choices[0]
    with client.chat.completions.stream(**asked) as stream:
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
           [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert final.finish_reason == whole.finish_reason == "tool_calls" and not final.message.content


def test_an_agent_loop_calls_a_tool_and_answers(client, model):
    messages: list = list(ASK)
    asked = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=400, parallel_tool_calls=False)
    messages.append(asked.choices[0].message)  # sent back as the official client writes it
    for call in asked.choices[0].message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny"})})
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=16)
    assert isinstance(final.choices[0].message.content, str) and final.choices[0].finish_reason in ("stop", "length")
    # The same history without tools (a follow-up): still rendered, the calls as text.
    followed = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=4)
    assert followed.choices[0].message.tool_calls is None


def test_bad_tool_requests_get_400_with_the_reason(client, model):
    cases = [(dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "launch"}}), "not in 'tools'"),
             (dict(tools=[{"type": "function", "function": {"parameters": WEATHER}}]), "needs a 'name'"),
             (dict(tool_choice="required"), "only allowed with 'tools'"),
             (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
              "cannot be combined with tools"),
             (dict(messages=[*ASK, {"role": "tool", "content": "sunny"}]), "tool_call_id")]
    for fields, message in cases:
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(**{"model": model, "messages": ASK, "max_tokens": 4, **fields})
