"""`pieceworks chat`: a conversation with a model in the terminal.

Each line read is a user message; the whole conversation goes through the tokenizer's chat template and the
answer streams as the Engine generates it (prefix caching serves the earlier turns from the KV cache).
`/reset` starts over (keeping the system message), `/exit` or end of input ends it. Ctrl-C during an answer
stops that answer (the exchange is dropped); at the prompt it ends the session. A conversation that no longer
fits the context, or one the template refuses, is reported and the message dropped; the session goes on.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from pieceworks.engine import SamplingParams
from pieceworks.errors import RequestError

HELP = "type a message and press Enter; /reset starts over, /exit (or Ctrl-D) ends"


def check_chat_model(engine: Any) -> None:
    """RequestError unless the engine's model has a tokenizer with a chat template."""
    tok = engine.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise RequestError(f"{engine.model_name} has no tokenizer with a chat template; pieceworks chat needs one "
                           "(the demo model, or a checkpoint with tokenizer files); use pieceworks run for token ids")


def chat_loop(engine: Any, params: SamplingParams, system: str | None = None, stdin: TextIO = sys.stdin,
              stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr) -> int:
    """Run the conversation on `engine` until /exit or the end of `stdin`; returns 0."""
    from pieceworks.models.tokenizer import render_chat

    check_chat_model(engine)
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    print(HELP, file=stderr)
    while True:
        if stdin.isatty():
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            messages = list(start)
            print("(the conversation starts over)", file=stderr)
            continue
        messages.append({"role": "user", "content": text})
        try:
            prompt = render_chat(engine.tokenizer, messages)
            answer = _answer(engine, prompt, params, stdout, stderr)
        except RequestError as exc:
            messages.pop()
            print(f"error: {exc}; the message was dropped (/reset starts over)", file=stderr)
            continue
        if answer is None:
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": answer})


def _answer(engine: Any, prompt: list[int], params: SamplingParams, stdout: TextIO, stderr: TextIO) -> str | None:
    """Stream one answer; its text, or None when Ctrl-C stopped it."""
    rid = engine.add_request(prompt, params)
    t0, tokens, text = time.perf_counter(), 0, ""
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid:
                    tokens, text = len(out.token_ids), out.text
                    stdout.write(out.text_delta or "")
                    stdout.flush()
    except KeyboardInterrupt:
        engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        stdout.write("\n")  # ends the partial answer's line
        print("(stopped)", file=stderr)
        return None
    stdout.write("\n")
    seconds = time.perf_counter() - t0
    print(f"({tokens} tokens, {tokens / seconds:.1f} tokens/s)", file=stderr)
    return text


def run_chat(cfg: Any, system: str | None, params: SamplingParams) -> int:
    """`pieceworks chat`: build the engine of `cfg` and talk to it on the terminal."""
    from pieceworks.engine import Engine

    with Engine.from_config(cfg) as engine:
        return chat_loop(engine, params, system)
