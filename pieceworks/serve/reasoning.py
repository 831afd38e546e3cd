"""Reasoning in chat completions: a thinking model's `<think>...</think>` part as `reasoning_content`.

`pieceworks serve --reasoning-parser P` splits each chat answer into the reasoning and the content, as
vLLM's parsers of the same names and DeepSeek's API (`message.reasoning_content`, `delta.reasoning_content`).
The prompt decides first (`prompt_state`, read from the rendered prompt's token ids):

- the chat template closed a reasoning block after its last opening tag (thinking switched off: an empty
  `<think></think>`, DeepSeek-V3.1's non-thinking prompt): the answer is all content;
- the template opened one at the prompt's end (`<think>` and nothing after it but blanks: DeepSeek-R1, GLM-4.7,
  Qwen3's Thinking-2507 models): the answer is reasoning up to the closing tag and content after it; an answer
  without it is all reasoning (it was cut off while thinking);
- otherwise the answer's own tags decide: a block that opens the answer (after blanks, e.g. GLM-4.5's
  `\n<think>`) is reasoning; an answer that does not open one is read by the parser: `deepseek_r1` (DeepSeek-R1
  and its distillations, whose older templates open `<think>` without showing it) and `seed_oss` as if the
  template had opened it, `qwen3` (Qwen3, and models that write the whole block themselves) and `glm45` (GLM-4.5
  / 4.6 / 4.7, the name their model cards give vLLM and SGLang) as all content.

`seed_oss` (Seed-OSS) uses Seed-OSS's tags, `<seed:think>` and `</seed:think>`; the others `<think>`, `</think>`.

Structured outputs (response_format, tool calls held by a schema) start after the closing tag where the prompt
has not closed a reasoning block already (`Grammars.set_reasoning`): the model thinks freely first.
Tool calls (serve/tools.py) are read from the content. Streamed, text that may still become a tag is held
back until the next step decides it (or the answer ends).
"""

from __future__ import annotations

from typing import Any

from pieceworks.engine.structured import last_index

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


def prompt_state(prompt: list[int], start: tuple[int, ...], end: tuple[int, ...], decode: Any) -> str:
    """"closed" where the prompt's last closing tag (token ids `end`) follows its last opening tag (`start`), as
    `Grammars.thinking` reads it; "open" where an opening tag follows the last closing one with nothing after it
    but blanks (`decode` turns ids into text); else "none"."""
    s, e = last_index(prompt, start), last_index(prompt, end)
    if e >= 0 and e > s:
        return "closed"
    if s >= 0 and not decode(prompt[s + len(start):]).strip():
        return "open"
    return "none"


def split(parser: str, text: str, final: bool = True, prompt: str = "none") -> tuple[str, str]:
    """(reasoning, content) of an answer so far, after a prompt in `prompt_state` `prompt`. Not `final`: both end
    before anything that may still turn out to be a tag, so each grows as the answer does (what streams is never
    taken back)."""
    if prompt == "closed":
        return "", text
    opening, closing = tags(parser)
    lead = text.lstrip()
    if not final and len(lead) < len(opening) and opening.startswith(lead):
        return "", ""  # blanks, or maybe the opening tag
    if lead.startswith(opening):
        body = lead[len(opening):]
    elif prompt == "none" and parser in ("qwen3", "glm45"):
        return "", text
    else:
        body = text
    end = body.find(closing)
    if end >= 0:
        return body[:end], body[end + len(closing):]
    return (body if final else body[: len(body) - held_tail(body, closing)]), ""
