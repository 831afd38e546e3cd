"""Reasoning parsers (serve/reasoning.py): the split of an answer into reasoning and content, streamed and not,
with tool calls read from the content; the server option."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'pieceworks[serve]'")

from pieceworks.serve import reasoning, tools  # noqa: E402
from pieceworks.serve.protocol import ChatCompletionRequest  # noqa: E402
from pieceworks.serve.writers import ChatWriter, Choice, Step  # noqa: E402

SRV = SimpleNamespace(name="m", token_str=str)
REQ = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "2 + 2?"}], stream=True)


def test_split():
    r1 = "deepseek_r1"
    assert reasoning.split(r1, "Add them.\n</think>\n\n4") == ("Add them.\n", "\n\n4")
    assert reasoning.split(r1, "<think>Add.</think>4") == ("Add.", "4")
    assert reasoning.split(r1, "Still thinking") == ("Still thinking", "")  # cut off while thinking
    assert reasoning.split(r1, "Add. </thi", final=False) == ("Add. ", "")  # maybe the closing tag
    assert reasoning.split(r1, "<thi", final=False) == ("", "")
    assert reasoning.split("qwen3", "<think>Add.</think>4") == ("Add.", "4")
    assert reasoning.split("qwen3", "4, plainly") == ("", "4, plainly")  # no block: all content
    assert reasoning.split("qwen3", "<th", final=False) == ("", "")
    assert reasoning.split("qwen3", "<th") == ("", "<th")
    assert reasoning.split("glm45", "4, plainly") == ("", "4, plainly")  # GLM's thinking off: no block
    assert reasoning.split("glm45", "<think>Add.</think>4") == ("Add.", "4")
    seed = "seed_oss"  # DeepSeek-R1's reading, Seed-OSS's tags
    assert reasoning.split(seed, "Add.</seed:think>4") == ("Add.", "4")
    assert reasoning.split(seed, "<seed:think>Add.</seed:think>4") == ("Add.", "4")
    assert reasoning.split(seed, "Add.</think>4") == ("Add.</think>4", "")  # another model's tag is text
    assert reasoning.split(seed, "Add. </seed:th", final=False) == ("Add. ", "")


def test_split_after_the_prompts_state_and_leading_blanks():
    # a block after blanks opens the answer (GLM-4.5's template leaves "\n<think>" to the model)
    assert reasoning.split("glm45", "\n<think>Add.</think>\n4") == ("Add.", "\n4")
    assert reasoning.split("qwen3", "\n", final=False) == ("", "")  # blanks: maybe before the opening tag
    assert reasoning.split("qwen3", "\n\n4") == ("", "\n\n4")
    # the template opened the block (GLM-4.7, Qwen3 Thinking-2507): reasoning up to the closing tag, for every parser
    for parser in ("qwen3", "glm45", "deepseek_r1"):
        assert reasoning.split(parser, "Add.</think>4", prompt="open") == ("Add.", "4")
        assert reasoning.split(parser, "Still thinking", prompt="open") == ("Still thinking", "")
    assert reasoning.split("qwen3", "Add.</think>4") == ("", "Add.</think>4")  # no block opened anywhere
    # the template closed one (thinking off): all content, a closing tag included
    assert reasoning.split("deepseek_r1", "4, plainly", prompt="closed") == ("", "4, plainly")
    assert reasoning.split("seed_oss", "a</seed:think>b", prompt="closed") == ("", "a</seed:think>b")


def test_prompt_state():
    text = {1: "sys", 2: "q", 5: "<think>", 6: "</think>", 7: "x", 9: " \n"}
    decode = lambda ids: "".join(text[i] for i in ids)  # noqa: E731
    state = lambda prompt: reasoning.prompt_state(prompt, (5,), (6,), decode)  # noqa: E731
    assert state([1, 5, 2, 6, 2]) == "closed"  # thinking off: an empty block closed
    assert state([1, 6, 5]) == "open" and state([1, 6, 5, 9]) == "open"  # the template opened it last
    assert state([1, 5, 7]) == "none"  # "<think>" in a message, text after it: not the answer's block
    assert state([1, 2]) == "none"


def test_tool_calls_after_a_prompt_that_closed_the_reasoning():
    """DeepSeek-V3.1's non-thinking prompt ends in </think>: the grammar of tool_choice required holds from the
    first token, and the answer (without a closing tag) is content, its calls parsed."""
    req = ChatCompletionRequest(model="m", messages=REQ.messages, tool_choice="required", tools=[
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}])
    plan = tools.plan(req, None)
    c = Choice(index=0, start=0.0, text='[{"name": "add", "arguments": {"a": 2}}]', finish_reason="stop")
    for state, calls in (("closed", 1), ("none", 0)):  # "none": deepseek_r1 reads it as reasoning cut off
        writer = ChatWriter(SRV, req, plan, "deepseek_r1", state)
        writer.note(Step(c, [], "", [], True))
        choice = writer.response("id", [[1]]).choices[0]
        assert len(choice.message.tool_calls or []) == calls, state
    assert choice.message.reasoning_content == c.text


def stream(writer: ChatWriter, deltas: list[str]) -> tuple[str, str, list]:
    c = Choice(index=0, start=0.0)
    chunks = []
    for i, d in enumerate(deltas):
        c.text += d
        c.token_ids.append(i)
        c.finish_reason = "stop" if i == len(deltas) - 1 else None
        chunks += writer.chunks("id", Step(c, [i], d, [], c.finish_reason is not None))
    deltas_ = [ch.choices[0].delta for ch in chunks]
    return ("".join(d.reasoning_content or "" for d in deltas_), "".join(d.content or "" for d in deltas_), chunks)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3", "glm45", "seed_oss"])
def test_streamed_equals_the_whole_answer(parser):
    opening, closing = reasoning.tags(parser)  # <think> </think> but for seed_oss
    pieces = [opening, "Two and", " two " + closing[:2], closing[2:-1], closing[-1] + " make", "s four."]
    thought, content, _ = stream(ChatWriter(SRV, REQ, None, parser), pieces)
    assert (thought, content) == ("Two and two ", " makes four.")
    writer = ChatWriter(SRV, REQ, None, parser)
    c = Choice(index=0, start=0.0, text="".join(pieces), finish_reason="stop")
    writer.note(Step(c, [], "", [], True))
    msg = writer.response("id", [[1]]).choices[0].message
    assert (msg.reasoning_content, msg.content) == (thought, content)
    plain = ChatWriter(SRV, REQ).response("id", [[1]])
    assert "reasoning_content" not in plain.model_dump_json()  # no parser: the field stays out


def test_tool_calls_come_from_the_content():
    req = ChatCompletionRequest(model="m", messages=REQ.messages, stream=True, tools=[
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}])
    plan = tools.plan(req, "hermes")
    pieces = ["I should call add.", "</think>", "Calling.<tool_call>", '{"name": "add", "arguments": {"a": 2}}',
              "</tool_call>"]
    thought, content, chunks = stream(ChatWriter(SRV, req, plan, "deepseek_r1"), pieces)
    assert (thought, content) == ("I should call add.", "Calling.")
    calls = [t for ch in chunks for t in ch.choices[0].delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in calls] == [("add", '{"a": 2}')]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # OpenAI's delta shapes: a call's delta holds no content key, the finishing chunk's delta is {}
    shapes = [json.loads(ch.model_dump_json())["choices"][0]["delta"] for ch in chunks]
    assert [d for d in shapes if "tool_calls" in d] == [{"tool_calls": [t.model_dump() for t in calls]}]
    assert shapes[-1] == {}
    # blanks between the reasoning and a call (Qwen3's "</think>\n\n<tool_call>") are no content, streamed or not
    blank = ["Hmm.</think>\n", "\n<tool_call>\n", '{"name": "add", "arguments": {}}\n</tool_call>']
    thought, content, chunks = stream(ChatWriter(SRV, req, plan, "deepseek_r1"), blank)
    assert (thought, content) == ("Hmm.", "")
    writer = ChatWriter(SRV, req, plan, "deepseek_r1")
    writer.note(Step(Choice(index=0, start=0.0, text="".join(blank), finish_reason="stop"), [], "", [], True))
    assert writer.response("id", [[1]]).choices[0].message.content is None
    # an answer that is all reasoning: content null, streamed (no content delta) or not, with tools or without
    for plan_ in (plan, None):
        writer = ChatWriter(SRV, req, plan_, "deepseek_r1")
        writer.note(Step(Choice(index=0, start=0.0, text="Still thinking", finish_reason="length"), [], "", [], True))
        msg = writer.response("id", [[1]]).choices[0].message
        assert (msg.reasoning_content, msg.content) == ("Still thinking", None)


def test_the_server_option():
    import argparse

    from pieceworks.serve.server import Server
    from pieceworks.serve.cli import add_serve_arguments

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert p.parse_args(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    with pytest.raises(SystemExit):
        p.parse_args(["--reasoning-parser", "o1"])
    engine = SimpleNamespace(model_name="m", tokenizer=None, max_context=8,
                             engine=SimpleNamespace(executor=SimpleNamespace(vocab_size=10)))
    with pytest.raises(ValueError, match="reasoning_parser"):
        Server(engine, reasoning_parser="o1")


def test_the_app_splits_a_real_answer(smollm2_cpu_engine, monkeypatch):
    """The SmolLM2 demo model through build_app, with and without deepseek_r1: its answer has no </think>,
    so under the parser it is all reasoning (an answer cut off while thinking), the content empty. The parser
    also holds structured outputs back until </think> (the engine's grammars learn the tags)."""
    import asyncio

    import httpx

    from pieceworks.engine import AsyncEngine
    from pieceworks.serve.app import build_app

    body = {"model": "smol", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 8,
            "temperature": 0}

    async def ask(app) -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]

    async def run() -> tuple[dict, dict, dict]:
        with AsyncEngine(smollm2_cpu_engine) as engine:
            split_app = build_app(engine, "smol", reasoning_parser="deepseek_r1")
            out = await ask(build_app(engine, "smol")), await ask(split_app)
            # a prompt that ends in a closed block (the final assistant message continued): the answer is content
            body["messages"] = [*body["messages"], {"role": "assistant", "content": "<think>Easy.</think>"}]
            body.update(add_generation_prompt=False, continue_final_message=True)
            return (*out, await ask(split_app))

    monkeypatch.setattr(smollm2_cpu_engine.grammars, "reasoning", None)  # restored: the engine is shared
    plain, split, closed = asyncio.run(run())
    assert closed["content"] and "reasoning_content" not in closed
    tok = smollm2_cpu_engine.tokenizer
    assert smollm2_cpu_engine.grammars.reasoning == tuple(tuple(tok.encode(t, add_special_tokens=False))
                                                          for t in ("<think>", "</think>"))
    assert "reasoning_content" not in plain and plain["content"]
    assert split["reasoning_content"] == plain["content"] and split["content"] is None  # all reasoning: null


def test_the_server_holds_structured_outputs_until_its_parsers_closing_tag():
    from pieceworks.serve.server import Server

    seen = []
    engine = SimpleNamespace(model_name="m", tokenizer=object(), max_context=8,
                             engine=SimpleNamespace(executor=SimpleNamespace(vocab_size=10),
                                                    grammars=SimpleNamespace(set_reasoning=lambda *a: seen.append(a))))
    for parser in ("qwen3", "seed_oss"):
        Server(engine, reasoning_parser=parser)
    assert seen == [("<think>", "</think>"), ("<seed:think>", "</seed:think>")]


def test_completions_apply_structured_outputs_from_the_first_token_under_a_reasoning_parser(smollm2_cpu_engine,
                                                                                           monkeypatch):
    """/v1/completions parses no reasoning, so its structured outputs are not held back for one (a chat answer's
    are, until the closing tag)."""
    import asyncio

    import httpx

    pytest.importorskip("llguidance")
    from pieceworks.engine import AsyncEngine
    from pieceworks.serve.app import build_app

    body = {"model": "smol", "prompt": "Answer yes or no:", "max_tokens": 10, "temperature": 0,
            "structured_outputs": {"choice": ["yes", "no"]}}

    async def run() -> str:
        with AsyncEngine(smollm2_cpu_engine) as engine:
            app = build_app(engine, "smol", reasoning_parser="qwen3")
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

    monkeypatch.setattr(smollm2_cpu_engine.grammars, "reasoning", None)  # restored: the engine is shared
    assert asyncio.run(run()) in ("yes", "no")
