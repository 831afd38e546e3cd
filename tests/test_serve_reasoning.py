"""Reasoning parsers (serve/reasoning.py): the split of an answer into reasoning and content, streamed and not,
with tool calls read from the content; the server option."""

from __future__ import annotations

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


def test_the_server_option():
    import argparse

    from pieceworks.serve.app import Server
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

    async def run() -> tuple[dict, dict]:
        with AsyncEngine(smollm2_cpu_engine) as engine:
            return (await ask(build_app(engine, "smol")),
                    await ask(build_app(engine, "smol", reasoning_parser="deepseek_r1")))

    monkeypatch.setattr(smollm2_cpu_engine.grammars, "reasoning", None)  # restored: the engine is shared
    plain, split = asyncio.run(run())
    tok = smollm2_cpu_engine.tokenizer
    assert smollm2_cpu_engine.grammars.reasoning == tuple(tuple(tok.encode(t, add_special_tokens=False))
                                                          for t in ("<think>", "</think>"))
    assert "reasoning_content" not in plain and plain["content"]
    assert split["reasoning_content"] == plain["content"] and split["content"] == ""


def test_the_server_holds_structured_outputs_until_its_parsers_closing_tag():
    from pieceworks.serve.app import Server

    seen = []
    engine = SimpleNamespace(model_name="m", tokenizer=object(), max_context=8,
                             engine=SimpleNamespace(executor=SimpleNamespace(vocab_size=10),
                                                    grammars=SimpleNamespace(set_reasoning=lambda *a: seen.append(a))))
    for parser in ("qwen3", "seed_oss"):
        Server(engine, reasoning_parser=parser)
    assert seen == [("<think>", "</think>"), ("<seed:think>", "</seed:think>")]
