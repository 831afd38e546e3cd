"""Engine outputs to OpenAI response objects: what a choice accumulates, and one writer per endpoint
(the whole response, or its server-sent chunks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pieceworks.serve.protocol import (
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
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
)


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
    def __init__(self, srv: Any, req: CompletionRequest):
        super().__init__(srv, req)
        self.offsets: dict[int, int] = {}

    def _logprobs(self, index: int, token_ids: list[int], lps: list[dict[int, float]]) -> CompletionLogprobs | None:
        if self.req.logprobs is None:
            return None
        out = CompletionLogprobs()
        for tid, d in zip(token_ids, lps):
            s = self.srv.token_str(tid)
            out.tokens.append(s)
            out.token_logprobs.append(d.get(tid))
            out.top_logprobs.append({self.srv.token_str(t): v for t, v in top(d, self.req.logprobs)})
            out.text_offset.append(self.offsets.get(index, 0))
            self.offsets[index] = self.offsets.get(index, 0) + len(s)
        return out

    def chunks(self, rid: str, step: Step) -> list[CompletionChunk]:
        self.note(step)
        c = step.choice
        if not (step.new_token_ids or step.text_delta or step.finished):
            return []
        choice = CompletionChoice(index=c.index, text=step.text_delta,
                                  logprobs=self._logprobs(c.index, step.new_token_ids, step.new_logprobs),
                                  finish_reason=c.finish_reason if step.finished else None,
                                  token_ids=step.new_token_ids if self.req.return_token_ids else None)
        return [CompletionChunk(id=rid, model=self.srv.name, choices=[choice])]

    def usage_chunk(self, rid: str, prompts: list[list[int]]) -> CompletionChunk:
        return CompletionChunk(id=rid, model=self.srv.name, choices=[], usage=usage(prompts, self.ordered()))

    def response(self, rid: str, prompts: list[list[int]]) -> CompletionResponse:
        choices = [CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                    logprobs=self._logprobs(c.index, c.token_ids, c.logprobs),
                                    token_ids=c.token_ids if self.req.return_token_ids else None)
                   for c in self.ordered()]
        return CompletionResponse(id=rid, model=self.srv.name, choices=choices, usage=usage(prompts, self.ordered()))


class ChatWriter(Writer):
    def _logprobs(self, token_ids: list[int], lps: list[dict[int, float]]) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        k = self.req.top_logprobs or 0
        content = []
        for tid, d in zip(token_ids, lps):
            s = self.srv.token_str(tid)
            tops = [TopLogprob(token=self.srv.token_str(t), logprob=v, bytes=list(self.srv.token_str(t).encode()))
                    for t, v in top(d, k)]
            content.append(ChatLogprobToken(token=s, logprob=d.get(tid, float("nan")), bytes=list(s.encode()),
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
        out = []
        if step.new_token_ids or step.text_delta:
            out.append(ChatCompletionChunk(id=rid, model=self.srv.name, choices=[ChatStreamChoice(
                index=c.index, delta=DeltaMessage(content=step.text_delta),
                logprobs=self._logprobs(step.new_token_ids, step.new_logprobs), token_ids=ids)]))
        if step.finished:
            out.append(ChatCompletionChunk(id=rid, model=self.srv.name, choices=[ChatStreamChoice(
                index=c.index, delta=DeltaMessage(), finish_reason=c.finish_reason)]))
        return out

    def usage_chunk(self, rid: str, prompts: list[list[int]]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=rid, model=self.srv.name, choices=[], usage=usage(prompts, self.ordered()))

    def response(self, rid: str, prompts: list[list[int]]) -> ChatCompletionResponse:
        choices = [ChatChoice(index=c.index, message=ChatMessageOut(content=c.text), finish_reason=c.finish_reason,
                              logprobs=self._logprobs(c.token_ids, c.logprobs),
                              token_ids=c.token_ids if self.req.return_token_ids else None)
                   for c in self.ordered()]
        return ChatCompletionResponse(id=rid, model=self.srv.name, choices=choices,
                                      usage=usage(prompts, self.ordered()))
