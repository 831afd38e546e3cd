"""Engine outputs to OpenAI response objects: what a choice accumulates, and one writer per endpoint
(the whole response, or its server-sent chunks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pieceworks.serve.protocol import CompletionRequest
from pieceworks.serve.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
)
from pieceworks.serve.reasoning import split as split_reasoning
from pieceworks.serve.tool_parsers import call_id, parse, streamed, visible_prefix
from pieceworks.serve.tools import ToolPlan


@dataclass
class Choice:
    """What one choice (prompt i, completion j) accumulates from the engine's outputs."""

    index: int
    start: float
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    first_token_at: float | None = None
    prompt_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with echo and logprobs


@dataclass
class Step:
    """One engine output as the response writers see it: the choice and what this step added."""

    choice: Choice
    new_token_ids: list[int]
    text_delta: str
    new_logprobs: list[dict[int, float]]
    finished: bool


def top(d: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(d.items(), key=lambda kv: -kv[1])[:k]



def usage(prompts: list[list[int]], choices: list[Choice]) -> UsageInfo:
    p = sum(len(x) for x in prompts)
    c = sum(len(ch.token_ids) for ch in choices)
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


class Writer:
    """Turns steps into one endpoint's response objects; it also remembers the choices for the usage."""

    def __init__(self, srv: Any, req: Any):
        self.srv, self.req = srv, req
        self.choices: dict[int, Choice] = {}

    def note(self, step: Step) -> None:
        self.choices[step.choice.index] = step.choice

    def ordered(self) -> list[Choice]:
        return [self.choices[k] for k in sorted(self.choices)]

    def usage_chunk(self, rid: str, prompts: list[list[int]]) -> Any:
        raise NotImplementedError

    def start(self, rid: str) -> list[Any]:
        return []


class CompletionWriter(Writer):
    """`echo_texts`: with `echo`, each prompt's text, put before its choices' text (and its tokens before
    their logprobs, the first with none, as OpenAI's); with echo and max_tokens 0, the one token the
    engine generates is left out (only the prompt is scored)."""

    def __init__(self, srv: Any, req: CompletionRequest, echo_texts: list[str] | None = None):
        super().__init__(srv, req)
        self.offsets: dict[int, int] = {}
        self.echo_texts = echo_texts if req.echo else None
        self.generated = not (req.echo and req.max_tokens == 0)
        self.echoed: set[int] = set()

    def _logprobs(self, index: int, token_ids: list[int],
                  lps: list[dict[int, float] | None]) -> CompletionLogprobs | None:
        if self.req.logprobs is None:
            return None
        out = CompletionLogprobs()
        start = self.echo_texts is not None and index not in self.offsets  # the echoed prompt's first token
        for i, (tid, d) in enumerate(zip(token_ids, lps)):
            s = self.srv.token_str(tid, first=start and i == 0)
            out.tokens.append(s)
            out.token_logprobs.append(None if d is None else d.get(tid))
            tops = None
            if d is not None:
                best = dict(top(d, self.req.logprobs))
                if tid in d:  # the chosen token too: up to logprobs + 1 entries (OpenAI's)
                    best[tid] = d[tid]
                tops = {self.srv.token_str(t): v for t, v in best.items()}
            out.top_logprobs.append(tops)
            out.text_offset.append(self.offsets.get(index, 0))
            if self.srv.tokenizer is not None:  # without one the text is empty: every offset is 0
                self.offsets[index] = self.offsets.get(index, 0) + len(s)
        return out

    def _parts(self, c: Choice, text: str, ids: list[int], lps: list) -> tuple[str, list[int], list, list[int]]:
        """(text, logprob token ids, their logprobs, generated ids) of a choice's response or chunk: the
        echoed prompt first where it is due (once per choice), the generated part where it is kept."""
        if not self.generated:
            text, ids, lps = "", [], []
        if self.echo_texts is None or c.index in self.echoed:
            return text, ids, lps, ids
        self.echoed.add(c.index)
        echo = self.echo_texts[c.index // (self.req.n or 1)]
        prompt_lps = c.prompt_logprobs or [None] * len(c.prompt_ids)
        return echo + text, c.prompt_ids + ids, prompt_lps + lps, ids

    def chunks(self, rid: str, step: Step) -> list[CompletionChunk]:
        self.note(step)
        c = step.choice
        if not (step.new_token_ids or step.text_delta or step.finished):
            return []
        text, lp_ids, lps, ids = self._parts(c, step.text_delta, step.new_token_ids, step.new_logprobs)
        choice = CompletionChoice(index=c.index, text=text, logprobs=self._logprobs(c.index, lp_ids, lps),
                                  finish_reason=c.finish_reason if step.finished else None,
                                  token_ids=ids if self.req.return_token_ids else None)
        return [CompletionChunk(id=rid, model=self.srv.name, choices=[choice])]

    def _usage(self, prompts: list[list[int]]) -> UsageInfo:
        return usage(prompts, self.ordered() if self.generated else [])

    def usage_chunk(self, rid: str, prompts: list[list[int]]) -> CompletionChunk:
        return CompletionChunk(id=rid, model=self.srv.name, choices=[], usage=self._usage(prompts))

    def response(self, rid: str, prompts: list[list[int]]) -> CompletionResponse:
        choices = []
        for c in self.ordered():
            text, lp_ids, lps, ids = self._parts(c, c.text, c.token_ids, c.logprobs)
            choices.append(CompletionChoice(index=c.index, text=text, finish_reason=c.finish_reason,
                                            logprobs=self._logprobs(c.index, lp_ids, lps),
                                            token_ids=ids if self.req.return_token_ids else None))
        return CompletionResponse(id=rid, model=self.srv.name, choices=choices, usage=self._usage(prompts))


class ChatWriter(Writer):
    """With a reasoning parser (serve/reasoning.py) a choice's text splits into reasoning and content; with a
    tool plan (serve/tools.py) whose output may hold tool calls, a finished choice's content is parsed into
    content and calls (serve/tool_parsers.py). Streamed, content stops where calls may begin, and each call
    streams from the step its name is complete: a first delta with its id and name, then its arguments as they
    are written. A call cut off by max_tokens keeps what streamed of it, and the answer's text then arrives as
    content (the finished choice does not parse as calls)."""

    def __init__(self, srv: Any, req: Any, tool_plan: ToolPlan | None = None, reasoning: str | None = None,
                 prompt_state: str = "none"):
        super().__init__(srv, req)
        self.tools = tool_plan if tool_plan is not None and tool_plan.parses else None
        self.reasoning, self.prompt_state = reasoning, prompt_state
        self.shown: dict[int, tuple[int, int]] = {}  # per choice: reasoning and content streamed so far
        self.sent: dict[int, list[str]] = {}  # per choice: each call's arguments streamed so far

    def _split(self, c: Choice, final: bool) -> tuple[str, str]:
        if self.reasoning is None:
            return "", c.text
        return split_reasoning(self.reasoning, c.text, final, self.prompt_state)

    def _message(self, c: Choice) -> tuple[str | None, str | None, list[dict[str, str]], str | None]:
        """A finished choice's reasoning, content, tool calls and finish_reason ("tool_calls" where it called
        tools)."""
        thought, text = self._split(c, True)
        thought = thought or None  # no reasoning (or no parser): the field stays out
        content, calls = (text, []) if self.tools is None else parse(self.tools, text)
        if self.reasoning is not None and not content:
            content = None  # an answer that is all reasoning (vLLM's reasoning parsers: `content or None`)
        if self.tools is None:
            return thought, content, [], c.finish_reason
        calls = calls if self.tools.parallel else calls[:1]  # parallel_tool_calls false: the first call (vLLM's)
        # OpenAI's finish_reason: "tool_calls" for auto and required, "stop" for a named function (as vLLM's)
        called = calls and c.finish_reason == "stop" and self.tools.mode != "named"
        return thought, content, calls, "tool_calls" if called else c.finish_reason

    def _deltas(self, step: Step) -> tuple[str, str, list[DeltaToolCall], str | None]:
        """The reasoning, content and call pieces a step may stream, and, once finished, the finish_reason."""
        c = step.choice
        t_shown, shown = self.shown.get(c.index, (0, 0))
        if not step.finished:
            thought, text = self._split(c, False)
            calls: list[tuple[str, str]] = []
            if self.tools is None:
                upto = len(text)
            else:
                upto = shown if self.tools.constrains else max(shown, visible_prefix(text, self.tools.parser))
                if not text[:upto].strip():  # blanks alone wait: before calls the content is null (`parse`)
                    upto = shown
                calls = streamed(self.tools, text)[: None if self.tools.parallel else 1]
            self.shown[c.index] = (len(thought), upto)
            return thought[t_shown:], text[shown:upto], self._call_deltas(c.index, calls), None
        thought, content, found, reason = self._message(c)
        rest = (content or "")[shown:]  # the content begins with what streamed: it ends before any call
        self.shown[c.index] = (len(thought or ""), shown + len(rest))
        calls = [(t["name"], t["arguments"]) for t in found]
        return (thought or "")[t_shown:], rest, self._call_deltas(c.index, calls), reason

    def _call_deltas(self, index: int, calls: list[tuple[str, str]]) -> list[DeltaToolCall]:
        """What is new in a choice's calls (name, arguments so far): a new call's first delta (id, name and its
        arguments so far), then the arguments' growth; `streamed` makes each a prefix of the finished call's."""
        sent = self.sent.setdefault(index, [])
        out = []
        for i, (name, arguments) in enumerate(calls):
            if i == len(sent):
                out.append(DeltaToolCall(index=i, id=call_id(self.tools.parser), type="function",
                                         function=DeltaFunctionCall(name=name, arguments=arguments)))
                sent.append(arguments)
            elif len(arguments) > len(sent[i]) and arguments.startswith(sent[i]):
                out.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=arguments[len(sent[i]):])))
                sent[i] = arguments
        return out

    def _logprobs(self, token_ids: list[int], lps: list[dict[int, float]]) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        k = self.req.top_logprobs or 0
        content = []
        for tid, d in zip(token_ids, lps):
            s = self.srv.token_str(tid)
            tops = [TopLogprob(token=self.srv.token_str(t), logprob=v, bytes=self.srv.token_bytes(t))
                    for t, v in top(d, k)]
            content.append(ChatLogprobToken(token=s, logprob=d.get(tid, float("nan")), bytes=self.srv.token_bytes(tid),
                                            top_logprobs=tops))
        return ChatLogprobs(content=content)

    def start(self, rid: str) -> list[ChatCompletionChunk]:
        n = self.req.n or 1
        return [ChatCompletionChunk(id=rid, model=self.srv.name,
                                    choices=[ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                                          content=""))])
                for i in range(n)]

    def chunks(self, rid: str, step: Step) -> list[ChatCompletionChunk]:
        self.note(step)
        c = step.choice
        ids = step.new_token_ids if self.req.return_token_ids else None
        if self.tools is None and self.reasoning is None:
            thought, text, calls, reason = "", step.text_delta, [], c.finish_reason
        else:
            thought, text, calls, reason = self._deltas(step)
        out = []
        if step.new_token_ids or text or thought:
            out.append(ChatCompletionChunk(id=rid, model=self.srv.name, choices=[ChatStreamChoice(
                index=c.index, delta=DeltaMessage(content=text, reasoning_content=thought or None),
                logprobs=self._logprobs(step.new_token_ids, step.new_logprobs), token_ids=ids)]))
        if calls:
            out.append(ChatCompletionChunk(id=rid, model=self.srv.name, choices=[ChatStreamChoice(
                index=c.index, delta=DeltaMessage(tool_calls=calls))]))
        if step.finished:
            out.append(ChatCompletionChunk(id=rid, model=self.srv.name, choices=[ChatStreamChoice(
                index=c.index, delta=DeltaMessage(), finish_reason=reason)]))
        return out

    def usage_chunk(self, rid: str, prompts: list[list[int]]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=rid, model=self.srv.name, choices=[], usage=usage(prompts, self.ordered()))

    def response(self, rid: str, prompts: list[list[int]]) -> ChatCompletionResponse:
        choices = []
        for c in self.ordered():
            thought, content, calls, reason = self._message(c)
            out = [ToolCallOut(id=t["id"], function=FunctionCallOut(name=t["name"], arguments=t["arguments"]))
                   for t in calls]
            message = ChatMessageOut(content=content, reasoning_content=thought, tool_calls=out or None)
            choices.append(ChatChoice(index=c.index, message=message,
                                      finish_reason=reason, logprobs=self._logprobs(c.token_ids, c.logprobs),
                                      token_ids=c.token_ids if self.req.return_token_ids else None))
        return ChatCompletionResponse(id=rid, model=self.srv.name, choices=choices,
                                      usage=usage(prompts, self.ordered()))
