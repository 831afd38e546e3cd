"""Tool calls in chat completions (serve/tools.py) without a model: the plan and its refusals, the schema that
holds required and named choices to calls, the hermes parser, what streams as content, and what reaches the
chat template. The server runs them end to end in test_serve.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'pieceworks[serve]'")

from pieceworks.serve import json_text, mapping, prompts, tool_pairs, tool_parsers, tools  # noqa: E402
from pieceworks.serve.protocol import BadRequest, ChatCompletionRequest  # noqa: E402
from pieceworks.serve.writers import ChatWriter, Choice, Step  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "the time"}}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=MSGS, **kw)


def refused(req, param, match, parser=None):
    with pytest.raises(BadRequest, match=match) as exc:
        tools.plan(req, parser)
    assert exc.value.param == param


def test_plans_and_refusals():
    assert tools.plan(chat(), None) is None and tools.plan(chat(tool_choice="none"), None) is None
    refused(chat(tool_choice="required"), "tool_choice", "needs tools")
    refused(chat(tools=[WEATHER]), "tool_choice", "--tool-call-parser hermes")  # auto is the default
    refused(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
            "one of the tools")
    refused(chat(tools=[WEATHER, WEATHER], tool_choice="required"), "tools", "its own name")
    refused(chat(tools=[{"type": "function", "function": {"name": "f", "extra": 1}}], tool_choice="none"), "tools",
            "must be")
    refused(chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}], tool_choice="none"),
            "tools", "JSON schema")
    for props in (None, [], {"city": "string"}):  # the parsers that type values read each argument's schema
        refused(chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": props}}}], tool_choice="none"), "tools", "object of JSON schemas")
    assert tools.plan(chat(tools=[WEATHER]), "hermes").mode == "auto"
    named = tools.plan(chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}),
                       None)
    assert (named.mode, named.name) == ("named", "get_time")
    # a function without parameters takes an empty object
    assert tools.structured_outputs(named).json == {"type": "object", "properties": {}}
    required = tools.plan(chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), None)
    schema = tools.structured_outputs(required).json
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [{"const": "get_weather"},
                                                                           {"const": "get_time"}]
    with pytest.raises(BadRequest, match="leave out response_format") as exc:
        mapping.sampling_params(chat(tools=[WEATHER], tool_choice="required",
                                     response_format={"type": "json_object"}), 8, 100, required)
    assert exc.value.param == "tool_choice"


def test_parse_each_mode():
    named = tools.ToolPlan("named", [WEATHER], name="get_weather")
    content, calls = tool_parsers.parse(named, '{"city": "Paris"}')
    assert content is None and [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    assert tool_parsers.parse(named, '{"city": "Pa') == ('{"city": "Pa', [])  # cut off by max_tokens: content
    required = tools.ToolPlan("required", [WEATHER, TIME])
    _, calls = tool_parsers.parse(required, '[{"name": "get_time", "arguments": {}}, '
                                     '{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_time", {}),
                                                                       ("get_weather", {"city": "Oslo"})]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    auto = tools.ToolPlan("auto", [WEATHER], parser="hermes")
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    content, calls = tool_parsers.parse(auto, text)
    assert content == "Let me check.\n" and [json.loads(c["arguments"])["city"] for c in calls] == ["Paris", "Rome"]
    assert tool_parsers.parse(auto, "No tools needed.") == ("No tools needed.", [])
    assert tool_parsers.parse(auto, "<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def test_llama3_json_calls():
    auto = tools.ToolPlan("auto", [WEATHER], parser="llama3_json")
    content, calls = tool_parsers.parse(auto, ' {"name": "get_weather", "parameters": {"city": "Paris"}}; '
                                       '{"name": "get_time", "parameters": {}}')
    assert content is None and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    _, calls = tool_parsers.parse(auto, '<|python_tag|>{"name": "get_time", "arguments": {"tz": "UTC"}}')
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_time", '{"tz": "UTC"}')]
    for text in ("It is sunny.", '{"city": "Paris"}', '{"name": "John Smith", "age": 30}', '{"name": "f"}'):
        assert tool_parsers.parse(auto, text) == (text, []), text  # no arguments: an answer (vLLM's reading)
        assert not any(tool_parsers.streamed(auto, text[:i]) for i in range(len(text) + 1)), text


def test_streamed_and_whole_answers_agree_on_calls_that_need_care():
    """Each answer streamed a character at a time gives the calls `parse` gives the whole answer, and those are
    vLLM's parsers' calls for it: a llama3_json call followed by text (the text left out), a Qwen3-Coder value
    without its </parameter> (it ends at the next parameter or the function's end); an object with a second
    "name" is no call (json.loads would take the second where the first streamed)."""
    srv = SimpleNamespace(name="m", token_str=str)
    props = {"city": {"type": "string"}, "days": {"type": "integer"}}
    coder_tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
                                                                                       "properties": props}}}
    cases = [
        ("llama3_json", [WEATHER], '{"name": "get_weather", "parameters": {"city": "Paris"}}\nLet me know!',
         [("get_weather", '{"city": "Paris"}')]),
        ("llama3_json", [WEATHER], '{"name": "get_weather", "parameters": {}}; {"name": "get_time", "parameters": '
         '{}} <|eot_id|>', [("get_weather", "{}"), ("get_time", "{}")]),
        ("qwen3_coder", [coder_tool], "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n"
         "</tool_call>", [("get_weather", '{"city": "Paris"}')]),
        ("qwen3_coder", [coder_tool], "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>"
         "\n3\n</parameter>\n</function>\n</tool_call>", [("get_weather", '{"city": "Paris", "days": 3}')]),
        ("hermes", [WEATHER], '<tool_call>{"name": "get_weather", "arguments": {}, "name": "x"}</tool_call>', []),
    ]
    for parser, tool_list, text, want in cases:
        plan = tools.ToolPlan("auto", tool_list, parser=parser)
        content, calls = tool_parsers.parse(plan, text)
        assert [(c["name"], c["arguments"]) for c in calls] == want, text
        assert content == (None if want else text), text
        if want:
            _, chunks = _stream(ChatWriter(srv, chat(tools=tool_list, stream=True), plan), list(text))
            assert [c[1:] for c in _calls(chunks)] == [list(w) for w in want], text
            assert not "".join(ch.choices[0].delta.content or "" for ch in chunks), text


def test_visible_prefix_holds_back_a_possible_call():
    for text, n in (("Hello", 5), ("Hello <tool", 6), ("Hi <tool_call>{", 3), ("a<", 1), ("a<b", 3), ("", 0)):
        assert tool_parsers.visible_prefix(text) == n, text
    for text, n in (("", 0), ("  ", 0), (' {"na', 0), ("<|py", 0), ("Sunny", 5), (" Sun {", 6)):
        assert tool_parsers.visible_prefix(text, "llama3_json") == n, text


def _stream(writer, deltas):
    c = Choice(index=0, start=0.0)
    chunks = []
    for i, d in enumerate(deltas):
        c.text += d
        c.token_ids.append(i)
        last = i == len(deltas) - 1
        c.finish_reason = "stop" if last else None
        chunks += writer.chunks("id", Step(c, [i], d, [], last))
    return c, chunks


def _calls(chunks) -> list[list]:
    """The streamed calls put together as a client does: [id, name, arguments] per index."""
    out: list[list] = []
    for ch in chunks:
        for t in ch.choices[0].delta.tool_calls or []:
            if t.index == len(out):  # a call's first delta: its id and name
                assert t.id and t.type == "function" and t.function.name
                out.append([t.id, t.function.name, ""])
            else:  # later ones: more of its arguments
                assert t.index < len(out) and t.id is None and t.function.name is None
            out[t.index][2] += t.function.arguments
    return out


def test_streamed_auto_content_stops_at_the_call():
    srv = SimpleNamespace(name="m", token_str=str)
    req = chat(tools=[WEATHER], stream=True)
    plan = tools.plan(req, "hermes")
    deltas = ["Sure", ". <tool", '_call>{"name": "get_weather", ', '"arguments": {"ci', 'ty": "Paris"}}</tool_call>']
    writer = ChatWriter(srv, req, plan)
    c, chunks = _stream(writer, deltas)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    calls = _calls(chunks)
    assert content == "Sure. " and [c[1:] for c in calls] == [["get_weather", '{"city": "Paris"}']]
    # the name streams in the step its arguments begin (not before: an object without them is no call), before
    # the rest of them
    steps = [next(i for i, ch in enumerate(chunks) if ch.choices[0].delta.tool_calls and f(ch)) for f in (
        lambda ch: ch.choices[0].delta.tool_calls[0].function.name, lambda ch: "Paris" in str(ch))]
    assert steps[0] < steps[1] and "ci" in chunks[steps[0]].choices[0].delta.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    writer2 = ChatWriter(srv, req, plan)
    writer2.note(Step(c, [], "", [], True))
    msg = writer2.response("id", [[1]]).choices[0]
    assert msg.message.content == "Sure. " and msg.message.tool_calls[0].function.name == "get_weather"
    assert msg.finish_reason == "tool_calls"
    # no call: everything held back streams by the end
    _, chunks = _stream(ChatWriter(srv, req, plan), ["a <", "b"])
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "a <b"
    assert chunks[-1].choices[0].finish_reason == "stop"
    llama = tools.plan(req, "llama3_json")
    _, chunks = _stream(ChatWriter(srv, req, llama), [' {"name": "get_weather",', ' "parameters": {"city": "Oslo"}}'])
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert [c[1:] for c in _calls(chunks)] == [["get_weather", '{"city": "Oslo"}']]
    _, chunks = _stream(ChatWriter(srv, req, llama), ["It", " is", " sunny."])
    assert [ch.choices[0].delta.content for ch in chunks[:3]] == ["It", " is", " sunny."]


def test_auto_without_parallel_calls_keeps_the_first():
    """parallel_tool_calls false under auto (the model is not held to one call): the first call, streamed or not
    (vLLM's)."""
    srv = SimpleNamespace(name="m", token_str=str)
    two = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    for parallel, want in ((None, ["get_weather", "get_time"]), (False, ["get_weather"])):
        req = chat(tools=[WEATHER, TIME], stream=True, parallel_tool_calls=parallel)
        plan = tools.plan(req, "hermes")
        c, chunks = _stream(ChatWriter(srv, req, plan), [two[:40], two[40:90], two[90:]])
        assert [x[1] for x in _calls(chunks)] == want, parallel
        writer = ChatWriter(srv, req, plan)
        writer.note(Step(c, [], "", [], True))
        message = writer.response("id", [[1]]).choices[0].message
        assert [t.function.name for t in message.tool_calls] == want, parallel


def test_tools_and_tool_turns_reach_the_template():
    seen = {}

    class Tok:
        chat_template = "t"

        def apply_chat_template(self, messages, **kw):
            seen.update(messages=messages, **kw)
            return [1, 2]

    turns = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                    {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}]
    req = ChatCompletionRequest(model="m", messages=turns, tools=[WEATHER], tool_choice="required")
    assert prompts.chat_prompt(req, Tok(), tools.plan(req, None)) == [1, 2]
    assert seen["tools"][0]["function"]["name"] == "get_weather"
    assert seen["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert seen["messages"][2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}
    bad = ChatCompletionRequest(model="m", messages=MSGS + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])
    with pytest.raises(BadRequest, match="not JSON"):
        prompts.chat_prompt(bad, Tok())


def test_the_parser_option():
    import argparse

    from pieceworks.serve.server import Server
    from pieceworks.serve.cli import add_serve_arguments

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert p.parse_args(["--tool-call-parser", "hermes"]).tool_call_parser == "hermes"
    assert p.parse_args([]).tool_call_parser is None
    with pytest.raises(SystemExit):
        p.parse_args(["--tool-call-parser", "pythonic"])
    engine = SimpleNamespace(model_name="m", tokenizer=None, max_context=8,
                             engine=SimpleNamespace(executor=SimpleNamespace(vocab_size=10)))
    assert Server(engine, tool_call_parser="hermes").tool_call_parser == "hermes"
    with pytest.raises(ValueError, match="tool_call_parser"):
        Server(engine, tool_call_parser="pythonic")


DS_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"


def test_deepseek_calls():
    v3 = tools.ToolPlan("auto", [WEATHER, TIME], parser="deepseek_v3")
    text = ("Checking.<｜tool▁calls▁begin｜>" + DS_CALL.format("get_weather", '{"city": "Paris"}') + "\n"
            + DS_CALL.format("get_time", "{}") + "<｜tool▁calls▁end｜>")
    content, calls = tool_parsers.parse(v3, text)
    assert content == "Checking." and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    v31 = tools.ToolPlan("auto", [WEATHER], parser="deepseek_v31")
    text31 = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Rome"}<｜tool▁call▁end｜>'
    content, calls = tool_parsers.parse(v31, text31)
    assert content is None and [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Rome"}')]
    # each format's blocks are no calls to the other parser; broken arguments, no name, no calls: text stays
    for plan, t in ((v3, text31), (v31, text), (v3, "Sunny."), (v31, "<｜tool▁call▁begin｜>f<｜tool▁sep｜>{oops"),
                    (v31, '<｜tool▁call▁begin｜><｜tool▁sep｜>{"a": 1}'),
                    (v3, DS_CALL.format("get_weather", '{"city": "Paris"}').replace("```json", "json")),
                    (v31, '<｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": 1} and<｜tool▁call▁end｜>'),
                    (v3, DS_CALL.format("get_weather", '{"city": "Paris"} and'))):
        assert tool_parsers.parse(plan, t) == (t, []), t
    # a section cut off after a whole call still holds it
    assert tool_parsers.parse(v3, "<｜tool▁calls▁begin｜>" + DS_CALL.format("get_time", "{}"))[1][0]["name"] == "get_time"
    for t, n in (("Hi <｜tool", 3), ("Hi<｜tool▁calls▁begin｜>", 2), ("a<｜tool▁call▁begin｜>", 1), ("abc <", 4),
                 ("abc", 3)):
        assert tool_parsers.visible_prefix(t, "deepseek_v3") == n, t


def test_streamed_deepseek_call():
    srv = SimpleNamespace(name="m", token_str=str)
    req = chat(tools=[WEATHER], stream=True)
    plan = tools.plan(req, "deepseek_v3")
    call = "<｜tool▁calls▁begin｜>" + DS_CALL.format("get_weather", '{"city": "Oslo"}') + "<｜tool▁calls▁end｜>"
    _, chunks = _stream(ChatWriter(srv, req, plan), ["Let me look", " it up.", call[:9], call[9:]])
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Let me look it up."
    assert [c[1:] for c in _calls(chunks)] == [["get_weather", '{"city": "Oslo"}']]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_special_markers_are_kept_for_auto_requests(caplog):
    """Where the tokenizer marks a parser's markers special (dropped by decoding), the server keeps special tokens
    in the text of auto requests only, as vLLM's mistral and internlm parsers do."""
    from pieceworks.serve.server import Server

    class Tok:  # drops the strings in `special` when skip_special_tokens is set, as HF tokenizers do
        def __init__(self, special):
            self.special = special

        def encode(self, text, add_special_tokens=True):
            return [text]

        def decode(self, ids, skip_special_tokens=False):
            return "".join(t for t in ids if not (skip_special_tokens and t in self.special))

    assert tool_parsers.lost_markers(Tok(set()), "deepseek_v3") == []
    assert tool_parsers.lost_markers(Tok({tool_parsers.DS_OPEN}), "deepseek_v31") == [tool_parsers.DS_OPEN]
    assert tool_parsers.lost_markers(Tok({"[TOOL_CALLS]"}), "mistral") == ["[TOOL_CALLS]"]
    assert tool_parsers.lost_markers(Tok({"<arg_value>", "</arg_value>"}), "glm45") == ["<arg_value>", "</arg_value>"]
    engine = SimpleNamespace(model_name="m", tokenizer=Tok({"[TOOL_CALLS]"}), max_context=8,
                             engine=SimpleNamespace(executor=SimpleNamespace(vocab_size=10),
                                                    grammars=SimpleNamespace(set_reasoning=lambda *a: None)))
    with caplog.at_level("INFO", logger="pieceworks.serve"):
        srv = Server(engine, tool_call_parser="mistral")
    assert srv.keep_special and "[TOOL_CALLS]" in caplog.text
    assert not Server(engine, tool_call_parser="hermes").keep_special
    req = chat(tools=[WEATHER])
    for choice, skip in ((None, False), ("required", True)):  # auto keeps them; held calls keep the client's choice
        plan = tools.plan(chat(tools=[WEATHER], tool_choice=choice), "mistral", srv.keep_special)
        assert mapping.sampling_params(req, 8, 100, plan).skip_special_tokens is skip, choice
    assert mapping.sampling_params(req, 8, 100, tools.plan(req, "mistral", False)).skip_special_tokens


def test_templates_that_read_arguments_as_text():
    import jinja2

    # DeepSeek-V3's template adds an earlier call's arguments to a string; Hugging Face's convention passes objects
    src = ("{% for m in messages %}{% for c in m.get('tool_calls') or [] %}"
           "{{ c['function']['name'] + ':' + c['function']['arguments'] }}{% endfor %}{% endfor %}")

    class Tok:
        chat_template = src

        def apply_chat_template(self, messages, **kw):
            return [ord(ch) for ch in jinja2.Environment().from_string(src).render(messages=messages)]

    turns = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
    req = ChatCompletionRequest(model="m", messages=turns)
    assert "".join(map(chr, prompts.chat_prompt(req, Tok()))) == 'get_weather:{"city": "Paris"}'
    # a TypeError without earlier tool calls is the template's own fault: a 400
    Tok.chat_template = src = "{{ 1 + 'a' }}"
    with pytest.raises(BadRequest, match="TypeError"):
        prompts.chat_prompt(chat(), Tok())


TRICKY = '{"code": "if (a) { f(\\"}\\"); }", "n": [1, {"x": null}], "s": "é 😀 ]"}'
# the key / value formats type their values by the schema: "n" is a list only where the schema says so
TYPED_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}, "n": {"type": "array"}}}}}


def _pairs(template: str) -> str:
    """TRICKY's arguments as key / value pairs, each `template` formatted with the key and the value (a string as
    written, anything else as JSON)."""
    return "".join(template.format(k, v if isinstance(v, str) else json.dumps(v))
                   for k, v in json.loads(TRICKY).items())


ANSWERS = {  # (plan, answer, content) with two calls (one for named) whose arguments need a real JSON scan
    "hermes": (tools.ToolPlan("auto", [WEATHER], parser="hermes"),
               f'Hi.\n<tool_call>\n{{"name": "get_weather", "arguments": {TRICKY}}}\n</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "Hi.\n"),
    "llama3_json": (tools.ToolPlan("auto", [WEATHER], parser="llama3_json"),
                    f'<|python_tag|>{{"name": "get_weather", "parameters": {TRICKY}}}; '
                    '{"name": "get_time", "parameters": {}}', None),
    "deepseek_v3": (tools.ToolPlan("auto", [WEATHER], parser="deepseek_v3"),
                    "So.<｜tool▁calls▁begin｜>" + DS_CALL.format("get_weather", TRICKY) + "\n"
                    + DS_CALL.format("get_time", "{}") + "<｜tool▁calls▁end｜>", "So."),
    "deepseek_v31": (tools.ToolPlan("auto", [WEATHER], parser="deepseek_v31"),
                     f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{TRICKY}<｜tool▁call▁end｜>"
                     '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None),
    "mistral": (tools.ToolPlan("auto", [WEATHER], parser="mistral"),
                f'So.[TOOL_CALLS][{{"name": "get_weather", "arguments": {TRICKY}}}, '
                '{"name": "get_time", "arguments": {}}]', "So."),
    "mistral_v11": (tools.ToolPlan("auto", [WEATHER], parser="mistral"),
                    f"[TOOL_CALLS]get_weather[ARGS]{TRICKY}[TOOL_CALLS]get_time[ARGS]{{}}", None),
    "glm45": (tools.ToolPlan("auto", [WEATHER], parser="glm45"),
              "Hi.\n<tool_call>get_weather\n" + _pairs("<arg_key>{}</arg_key>\n<arg_value>{}</arg_value>\n")
              + "</tool_call><tool_call>get_time</tool_call>", "Hi.\n"),
    "qwen3_coder": (tools.ToolPlan("auto", [TYPED_WEATHER], parser="qwen3_coder"),
                    "Hi.\n<tool_call>\n<function=get_weather>\n" + _pairs("<parameter={}>\n{}\n</parameter>\n")
                    + "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
                    "Hi.\n"),
    "seed_oss": (tools.ToolPlan("auto", [TYPED_WEATHER], parser="seed_oss"),
                 "Hi.\n<seed:tool_call>\n<function=get_weather>\n" + _pairs("<parameter={}>{}</parameter>\n")
                 + "</function>\n</seed:tool_call><seed:tool_call><function=get_time></function></seed:tool_call>",
                 "Hi.\n"),
    "required": (tools.ToolPlan("required", [WEATHER, TIME]),
                 f'[{{"name": "get_weather", "arguments": {TRICKY}}}, {{"name": "get_time", "arguments": {{}}}}]',
                 None),
    "named": (tools.ToolPlan("named", [WEATHER], name="get_weather"), TRICKY, None),
}


@pytest.mark.parametrize("fmt", sorted(ANSWERS))
def test_calls_stream_as_they_are_written(fmt):
    plan, answer, content = ANSWERS[fmt]
    got_content, calls = tool_parsers.parse(plan, answer)
    want = [["get_weather", TRICKY], ["get_time", "{}"]][: 1 if fmt == "named" else 2]
    assert got_content == content and [[c["name"], c["arguments"]] for c in calls] == want
    # every prefix of the answer: the calls so far are prefixes of the finished ones
    grew = 0
    for n in range(len(answer) + 1):
        now = tool_parsers.streamed(plan, answer[:n])
        assert len(now) <= len(want), answer[:n]
        for (name, args), (w_name, w_args) in zip(now, want):
            assert name == w_name and w_args.startswith(args), (answer[:n], args)
        grew += bool(now) and 0 < len(now[0][1]) < len(TRICKY)
    assert grew > len(TRICKY) // 2  # the first call's arguments stream, not only at its end
    # through the writer, in uneven pieces: the client's calls equal the finished answer's
    srv = SimpleNamespace(name="m", token_str=str)
    req = chat(tools=[WEATHER, TIME], stream=True)
    cuts = sorted({0, len(answer), *range(3, len(answer), 7)})
    _, chunks = _stream(ChatWriter(srv, req, plan), [answer[a:b] for a, b in zip(cuts, cuts[1:])])
    assert [c[1:] for c in _calls(chunks)] == want
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == (content or "")
    # OpenAI's: "tool_calls" for auto and required, "stop" for a named function, streamed or not
    reason = "stop" if fmt == "named" else "tool_calls"
    writer = ChatWriter(srv, req, plan)
    writer.note(Step(Choice(index=0, start=0.0, text=answer, finish_reason="stop"), [], "", [], True))
    assert chunks[-1].choices[0].finish_reason == writer.response("id", [[1]]).choices[0].finish_reason == reason


def test_a_closing_marker_inside_an_argument_string_is_text():
    """hermes: `</tool_call>` inside an argument's string does not end the block (it is looked for after the call
    object); streamed, the arguments grow to the finished call's."""
    srv = SimpleNamespace(name="m", token_str=str)
    req = chat(tools=[WEATHER], stream=True)
    plan = tools.plan(req, "hermes")
    answer = '<tool_call>{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}</tool_call>'
    content, calls = tool_parsers.parse(plan, answer)
    assert content is None and [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "a</tool_call>b"}')]
    _, chunks = _stream(ChatWriter(srv, req, plan), [answer[:60], answer[60:75], answer[75:]])
    assert [x[1:] for x in _calls(chunks)] == [["get_weather", '{"city": "a</tool_call>b"}']]


def test_mistral_calls():
    plan = ANSWERS["mistral"][0]
    _, calls = tool_parsers.parse(plan, "[TOOL_CALLS]get_time{}")  # v11 calls without [ARGS]
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_time", "{}")]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in tool_parsers.parse(plan, ANSWERS["mistral"][1])[1])
    for t in ("[TOOL_CALLS]get time{}", '[TOOL_CALLS]f[ARGS]{"a": 1} b[TOOL_CALLS]g{}',
              '[TOOL_CALLS][{"name": "f"}[TOOL_CALLS]g{}', "[TOOL_CALLS]f[ARGS][TOOL_CALLS]g{}", "[TOOL_CALLS]"):
        assert tool_parsers.parse(plan, t) == (t, []), t
    # text after the last call is left out (vLLM's "trailing data after json"); a marker inside a string is text
    for t, want in (('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]\nextra trailing data', [("f", '{"a": 1}')]),
                    ('[TOOL_CALLS]f[ARGS]{"a": 1}\nDone.', [("f", '{"a": 1}')]),
                    ('[TOOL_CALLS]f[ARGS]{"a": "x [TOOL_CALLS] y"}[TOOL_CALLS]g{}',
                     [("f", '{"a": "x [TOOL_CALLS] y"}'), ("g", "{}")]),
                    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": "[TOOL_CALLS]"}}]',
                     [("f", '{"a": "[TOOL_CALLS]"}')])):
        content, calls = tool_parsers.parse(plan, t)
        assert content is None and [(c["name"], c["arguments"]) for c in calls] == want, t
    assert tool_parsers.visible_prefix("Hi [TOOL", "mistral") == 3
    srv = SimpleNamespace(name="m", token_str=str)
    _, chunks = _stream(ChatWriter(srv, chat(tools=[WEATHER], stream=True), plan), ["[TOOL_CALLS]get_t", "ime{}"])
    assert all(len(c[0]) == 9 and c[0].isalnum() for c in _calls(chunks)) and _calls(chunks)


def test_glm45_calls():
    """GLM-4.5 / 4.7: arguments built from key / value pairs; a value is JSON unless its schema types it a string
    (the template writes strings raw) or it is no JSON; blanks between the parts are GLM-4.5's, none GLM-4.7's."""
    typed = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "zip": {"type": ["string", "null"]}, "days": {"type": "integer"}}}}}
    plan = tools.ToolPlan("auto", [typed], parser="glm45")
    pairs = {"city": "123", "zip": "[1]", "days": " 3\n", "x": "NaN", "y": "true", "z": "{bad"}
    text = "<tool_call>f" + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in pairs.items())
    content, calls = tool_parsers.parse(plan, text + "</tool_call>")
    assert content is None and [c["name"] for c in calls] == ["f"]
    assert json.loads(calls[0]["arguments"]) == {"city": "123", "zip": "[1]", "days": 3, "x": "NaN", "y": True,
                                                 "z": "{bad"}
    assert tool_parsers.streamed(plan, text) == [("f", calls[0]["arguments"][:-1])]  # open: no closing brace yet
    # null is null where the schema allows it (the template writes None as null), a string where it types a string
    nulls = "<tool_call>f<arg_key>zip</arg_key><arg_value>null</arg_value><arg_key>city</arg_key><arg_value>null" \
            "</arg_value><arg_key>days</arg_key><arg_value>null</arg_value></tool_call>"
    assert json.loads(tool_parsers.parse(plan, nulls)[1][0]["arguments"]) == {"zip": None, "city": "null", "days": None}
    for t in ("<tool_call>f<arg_key>a</arg_key>oops<arg_value>1</arg_value></tool_call>",  # text between the parts
              "<tool_call>f x<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",  # no name
              "<tool_call>f<arg_key>a</arg_key></tool_call>",
              "<tool_call>f<arg_key>a</arg_key><arg_value>1</tool_call>",
              "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value>"):  # cut off: no calls, the text is content
        assert tool_parsers.parse(plan, t) == (t, []), t
    for t in ("<tool_call>f<arg_key>a</arg_key>oops", "<tool_call>f\nzz"):  # no call, though not closed yet
        assert tool_parsers.streamed(plan, t) == [], t
    assert tool_parsers.streamed(plan, "<tool_call>f\n<arg_key>a</ar") == [("f", "")]
    assert tool_parsers.visible_prefix("Hi <tool_c", "glm45") == 3
    assert tool_pairs.markers("glm45") == ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                                           "</arg_value>")


def test_qwen3_coder_calls():
    """Qwen3-Coder: `<function=NAME>` and `<parameter=KEY>` blocks, each value between newlines (one of each is the
    template's); a value is a string unless the schema types it a number, integer or boolean it is, or an object or
    array whose JSON it is; a parameter the schema does not name is a string (as vLLM's qwen3_coder parser)."""
    props = {"path": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"},
             "opts": {"type": "object"}, "ids": {"type": ["array", "null"]}, "m": {"type": "integer"}}
    tool = {"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": props}}}
    plan = tools.ToolPlan("auto", [tool], parser="qwen3_coder")
    values = {"path": "\n 12 \n\n", "n": "\n7\n", "x": "\n-1.5e3\n", "ok": "\nTrue\n", "opts": '\n{"a": [1]}\n',
              "ids": "\nnull\n", "m": "\n7.5\n", "free": "\n{}\n"}
    body = "".join(f"<parameter={k}>{v}</parameter>\n" for k, v in values.items())
    text = f"Sure.\n<tool_call>\n<function=edit>\n{body}</function>\n</tool_call>"
    content, calls = tool_parsers.parse(plan, text)
    assert content == "Sure.\n" and [c["name"] for c in calls] == ["edit"]
    assert json.loads(calls[0]["arguments"]) == {"path": " 12 \n", "n": 7, "x": -1500.0, "ok": True, "opts": {"a": [1]},
                                                 "ids": None, "m": "7.5", "free": "{}"}
    cut = text[: text.index("</function>")]
    assert tool_parsers.streamed(plan, cut) == [("edit", calls[0]["arguments"][:-1])]
    assert tool_parsers.streamed(plan, cut[: cut.index("<parameter=ok>") + 5]) == [
        ("edit", calls[0]["arguments"][: calls[0]["arguments"].index(', "ok"')])]
    # "null" in any case is null for every type, as vLLM's qwen3_coder parser reads it (the template writes None so)
    pairs = (("path", "null"), ("n", "NULL"), ("ok", "Null"), ("free", "null"), ("x", " null"))
    nulls = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in pairs)
    assert json.loads(tool_parsers.parse(plan, f"<tool_call>\n<function=edit>\n{nulls}</function>\n</tool_call>")[1][0][
        "arguments"]) == {"path": None, "n": None, "ok": None, "free": None, "x": " null"}
    # a closed call may leave out </function>; text after it, or a block without <function=, is no call
    missing = "<tool_call><function=edit><parameter=n>1</parameter></tool_call>"
    assert json.loads(tool_parsers.parse(plan, missing)[1][0]["arguments"]) == {"n": 1}
    for t in ("<tool_call><function=edit></function> x</tool_call>", '<tool_call>{"name": "edit"}</tool_call>',
              "<tool_call><function=edit><parameter=n>1</tool_call>",
              "<tool_call><function=a b></function></tool_call>"):
        assert tool_parsers.parse(plan, t) == (t, []), t
    for t in ("<tool_call><function=ed", "<tool_call>\n<func"):
        assert tool_parsers.streamed(plan, t) == [], t
    assert tool_parsers.streamed(plan, "<tool_call><function=edit>\n<parameter=n>\n1\n</para") == [("edit", "")]
    seed = tools.ToolPlan("auto", [tool], parser="seed_oss")  # Seed-OSS: the same calls in <seed:tool_call> blocks
    assert tool_parsers.parse(seed, text) == (text, [])
    seed_text = text.replace("<tool_call>", "<seed:tool_call>").replace("</tool_call>", "</seed:tool_call>")
    assert [c["arguments"] for c in tool_parsers.parse(seed, seed_text)[1]] == [calls[0]["arguments"]]
    assert tool_parsers.visible_prefix("So <seed:tool", "seed_oss") == 3
    assert tool_parsers.lost_markers(type("Tok", (), {
        "encode": lambda self, t, add_special_tokens=False: [t],
        "decode": lambda self, ids, skip_special_tokens=False: "" if ids == ["<tool_call>"] else ids[0]})(),
        "qwen3_coder") == ["<tool_call>"]


def test_json_value_ends():
    end = json_text.value_end
    for text, want in (('"ab\\"c" x', 7), ('"ab\\', None), ('"ab\\\\"', 6), ('{"a": "}"} x', 10), ('[1, [2]]', 8),
                       ("12, 3", 2), ("12", None), ("true}", 4), ('{"a": "', None), ("", None)):
        assert end(text, 0) == want, text


def test_answers_that_are_not_calls_stay_content():
    hermes = tools.ToolPlan("auto", [WEATHER], parser="hermes")
    for t in ('<tool_call>{"name": "f", "arguments": {"a": 1}} extra</tool_call>',  # text after the object
              '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>',  # closed before the object
              '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": 3}</tool_call>',
              '<tool_call>{"name": "f"} </tool_call><tool_call>[1]</tool_call>'):
        assert tool_parsers.parse(hermes, t) == (t, []), t
    assert tool_parsers.streamed(hermes, '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>') == []
    # a second arguments key: the first one's text is the call's, so what streamed stays a prefix
    twice = '<tool_call>{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}</tool_call>'
    assert [c["arguments"] for c in tool_parsers.parse(hermes, twice)[1]] == ['{"a": 1}']
    t = '<tool_call>{"name": "f", "arguments": {"a": 1}, "name": "g"}</tool_call>'  # json.loads takes the second
    assert tool_parsers.parse(hermes, t) == (t, [])
    t = '<tool_call>{"name": "f", "arguments": {"a": 1}, "arguments": {"a": 2}}</tool_call>'  # the first, as streamed
    assert [c["arguments"] for c in tool_parsers.parse(hermes, t)[1]] == ['{"a": 1}']
    deep = '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}</tool_call>"
    assert tool_parsers.parse(hermes, deep) == (deep, [])  # nested past Python's stack: content, not an exception
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}
    turn = {"role": "assistant", "content": None, "tool_calls": [call]}
    history = ChatCompletionRequest(model="m", messages=[*MSGS, turn])
    with pytest.raises(BadRequest, match="maximum recursion depth exceeded") as exc:  # a 400, not a 500
        tools.template_messages(history)
    assert exc.value.param == "messages"
    assert tool_parsers.parse(hermes, '<tool_call>{"name": "f"}</tool_call>')[1] == []
    required = tools.ToolPlan("required", [WEATHER])
    for t in ('[{"name": "f", "arguments": {}}] x', '[{"name": "f", "arguments": {}}', '{"name": "f"}'):
        assert tool_parsers.parse(required, t) == (t, []), t
    named = tools.ToolPlan("named", [WEATHER], name="get_weather")
    assert tool_parsers.parse(named, '{"a": 1} {"b": 2}') == ('{"a": 1} {"b": 2}', [])
    # cut off inside the second call: what streamed of the calls stays, the finished answer is content
    srv = SimpleNamespace(name="m", token_str=str)
    req = chat(tools=[WEATHER], stream=True)
    plan, answer, _ = ANSWERS["hermes"]
    cut = answer[: answer.rindex("{}") + 1]
    _, chunks = _stream(ChatWriter(srv, req, plan), [cut[:40], cut[40:], ""])  # cut: the last step adds nothing
    assert [c[1:] for c in _calls(chunks)] == [["get_weather", TRICKY], ["get_time", "{"]]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == cut


@settings(max_examples=300, deadline=None)
@given(fmt=st.sampled_from(sorted(ANSWERS)), cut=st.integers(0, 400),
       junk=st.text(alphabet='{}[]",:\\ ab1', max_size=8), where=st.integers(0, 400))
def test_any_text_parses_or_stays_content(fmt, cut, junk, where):
    """Cut and spliced answers never raise: they parse as calls, or the text stays content; what streams of them
    is a prefix of the calls `parse` finds, where it finds some."""
    plan, answer, _ = ANSWERS[fmt]
    text = answer[: min(cut, len(answer))]
    text = text[:where] + junk + text[where:]
    content, calls = tool_parsers.parse(plan, text)
    assert (content, calls) == (text, []) or calls
    for name, args in tool_parsers.streamed(plan, text)[: len(calls)]:
        assert calls and any(c["name"] == name and c["arguments"].startswith(args) for c in calls)
