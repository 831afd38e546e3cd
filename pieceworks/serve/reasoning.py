"""Reasoning in chat completions: a thinking model's `<think>...</think>` part as `reasoning_content`.

`pieceworks serve --reasoning-parser P` splits each chat answer into the reasoning and the content, as
vLLM's parsers of the same names and DeepSeek's API (`message.reasoning_content`, `delta.reasoning_content`):

- `deepseek_r1` (DeepSeek-R1 and its distillations, whose chat template opens `<think>` itself): the answer
  is reasoning up to `</think>` (an opening `<think>` is dropped) and content after it; an answer without
  `</think>` is all reasoning (it was cut off while thinking).
- `qwen3` (Qwen3, and models that write the whole block themselves): reasoning only inside a `<think>` block
  that opens the answer; an answer that does not start with `<think>` is all content. `glm45` (GLM-4.5 / 4.6 /
  4.7, the name their model cards give vLLM and SGLang) reads answers the same way.
- `seed_oss` (Seed-OSS): `deepseek_r1`'s reading with Seed-OSS's tags, `<seed:think>` and `</seed:think>`.

Structured outputs (response_format, tool calls held by a schema) start after the closing tag where the prompt
has not closed a reasoning block already (`Grammars.set_reasoning`): the model thinks freely first.
Tool calls (serve/tools.py) are read from the content. Streamed, text that may still become a tag is held
back until the next step decides it (or the answer ends).
"""

from __future__ import annotations

THINK = ("<think>", "</think>")
_TAGS = {"seed_oss": ("<seed:think>", "</seed:think>")}


def tags(parser: str) -> tuple[str, str]:
    """The parser's opening and closing tags (the server starts structured outputs after the closing one)."""
    return _TAGS.get(parser, THINK)


def held_tail(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag` (it may still become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def split(parser: str, text: str, final: bool = True) -> tuple[str, str]:
    """(reasoning, content) of an answer so far. Not `final`: both end before anything that may still turn out
    to be a tag, so each grows as the answer does (what streams is never taken back)."""
    opening, closing = tags(parser)
    if not final and len(text) < len(opening) and opening.startswith(text):
        return "", ""  # maybe the opening tag
    if text.startswith(opening):
        body = text[len(opening):]
    elif parser in ("qwen3", "glm45"):
        return "", text
    else:
        body = text
    end = body.find(closing)
    if end >= 0:
        return body[:end], body[end + len(closing):]
    return (body if final else body[: len(body) - held_tail(body, closing)]), ""
