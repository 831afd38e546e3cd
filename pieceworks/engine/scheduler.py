"""Which requests run in the next step, and with how many tokens.

Each step (vLLM v1's rules, in nano-vllm's few lines):
1. Running requests, oldest first, each with its next tokens: one for a decode, the rest of its
   prompt for a chunked prefill, within `max_num_batched_tokens` and `max_num_seqs`. When the KV
   pool can't give a request the pages it needs, the most recently admitted running request is
   preempted by recompute (its pages are freed and it goes back to the front of the queue, to be
   prefilled again with prompt + generated tokens; its sampling state is kept), until the request
   fits or is itself the one preempted.
2. Then, unless step 1 preempted, waiting requests in arrival order: each starts from the longest
   cached prefix of its tokens (prefix caching) and is admitted when the pages its first chunk needs
   now, plus a watermark, are free; not its whole prompt + max_tokens. The first that doesn't fit
   stops admission (no overtaking, so a long prompt can't starve).
With speculative decoding (`drafter`), decode rows then get their drafts in order from the tokens and pages
left, before any waiting request is admitted.
With `scheduler.async_steps`, a request's output may end in the placeholder of a token still in
flight (`Request.pending`): it counts as generated, so no step runs beyond max_tokens.
The n completions of one request are admitted once the first has computed the prompt, so the others
find its full pages in the prefix cache instead of prefilling the prompt n times.
With `scheduler.policy: priority` both queues are kept in (priority, arrival) order instead: running
requests are served in that order and the last (the lowest priority, latest arrival) is the one
preempted; waiting requests are admitted in that order.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque

import torch

from pieceworks.config import Policy, SchedulerConfig
from pieceworks.engine.request import Request
from pieceworks.errors import RequestError

LARGE_GPU_BYTES = 70 * 2**30  # at or above: 8192 new tokens per step unless configured
PROMPT_LOGITS_STEP_TOKENS = 1024
"""Most prompt tokens per step of a request whose prompt logprobs are being computed: the step returns the
logits of each of them, [tokens, V] float32 (0.5 GiB at V = 128K)."""


def default_step_tokens(device: torch.device) -> int:
    """`scheduler.max_num_batched_tokens` when unset: 8192 on a CUDA device of at least 70 GiB, else 2048."""
    if device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory >= LARGE_GPU_BYTES:
        return 8192
    return 2048


class Scheduler:
    """Queues and admission over one executor's KV pool (`executor`: new_sequence, free,
    pages_needed, kv.allocator)."""

    def __init__(self, executor, cfg: SchedulerConfig) -> None:
        self.ex = executor
        if cfg.max_num_batched_tokens is None:
            cfg = dataclasses.replace(cfg, max_num_batched_tokens=default_step_tokens(executor.device))
        self.cfg = cfg
        self.alloc = executor.kv.allocator
        self.watermark_pages = int(cfg.watermark * self.alloc.capacity)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; (priority, arrival) order under policy priority
        self.by_priority = cfg.policy is Policy.priority
        self.structured: set[Request] = set()  # queued or running, with a grammar (structured outputs)
        self.drafter = None  # the Engine's `Speculator.draft` with speculative decoding on
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.prefix_queried_tokens = 0

    def check_priority(self, priority: object) -> None:
        """RequestError for a priority that is no int, or nonzero where the policy is fcfs."""
        if type(priority) is not int:
            raise RequestError(f"priority must be an int, got {priority!r} ({type(priority).__name__})")
        if priority and not self.by_priority:
            raise RequestError(f"priority={priority}: scheduler.policy is fcfs, which ignores priorities; set "
                               "scheduler.policy=priority, or leave priority at 0")

    def _queue(self, queue, req: Request, front: bool) -> None:
        """Put `req` in `queue` (waiting or running): in (priority, arrival) order under policy priority,
        else at the front (a preempted request) or the back."""
        if self.by_priority:
            bisect.insort(queue, req, key=_order)
        elif front:
            queue.appendleft(req)
        else:
            queue.append(req)

    def add(self, req: Request) -> None:
        self._queue(self.waiting, req, front=False)
        if req.matcher is not None:
            self.structured.add(req)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues and give its pages back (finished or aborted)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.structured.discard(req)
        self._release(req)

    def _release(self, req: Request) -> None:
        if req.seq is not None:
            if not self.ex.closed:  # a closed executor (a failed tensor-parallel step) holds no pages any more
                self.ex.free(req.seq)
            req.seq = None

    def _dequeue(self, admitted: list[Request]) -> None:
        """Take admitted requests out of `waiting`: from its front, where admission takes them in order (a
        step costs the requests it admits, not the length of the queue)."""
        waiting = self.waiting
        for req in admitted:
            if waiting[0] is req:
                waiting.popleft()
            else:  # behind a later completion of a request still waiting for its first's prompt
                waiting.remove(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        self._queue(self.waiting, req, front=True)
        self.num_preemptions += 1

    def schedule(self, preempt: bool = True) -> list[tuple[Request, list[int]]] | None:
        """The next step's (request, new tokens) pairs; empty when nothing can run. With `preempt=False`, None
        (and nothing changed) where a running request would have to be preempted: async steps, whose
        requests may end in a token still in flight, run only steps that need none."""
        tokens_left, seqs_left = self.cfg.max_num_batched_tokens, self.cfg.max_num_seqs
        out: list[tuple[Request, list[int]]] = []
        promised = 0  # pages the scheduled requests will allocate in the step
        preempted = False
        # runs for every running request every step: pages counted inline (Executor.pages_needed's
        # rule), the free count read once and again only after a preemption
        ps, free, running = self.ex.page_size, self.alloc.num_free, self.running
        i = 0
        while i < len(running) and tokens_left > 0 and seqs_left > 0:
            req = running[i]
            if req.pending:  # async steps: its in-flight token is its last (max_tokens, context limit)
                mt = req.params.max_tokens
                if (mt is not None and len(req.output) >= mt) or req.num_tokens >= self.ex.max_context:
                    i += 1
                    continue
            seq = req.seq
            kv_len = seq.kv_len
            n = min(req.num_tokens - kv_len, tokens_left)
            if req.needs_prompt_logits:
                n = min(n, PROMPT_LOGITS_STEP_TOKENS)
            need = max(0, -(-(kv_len + n) // ps) - len(seq.pages))
            if need > free - promised and not preempt:
                return None
            while need > free - promised:
                victim = running[-1]
                self._preempt(victim)
                free = self.alloc.num_free
                preempted = True
                if victim is req:
                    break
            else:
                out.append((req, req.tokens(kv_len, kv_len + n)))
                promised += need
                tokens_left -= n
                seqs_left -= 1
                i += 1
                continue
            break  # req itself was preempted: nothing after it runs either
        if preempted:
            return out
        if self.drafter is not None:
            tokens_left, taken = self._add_drafts(out, tokens_left, free - promised)
            promised += taken
        admitted: list[Request] = []  # left in `waiting` while it is iterated, taken out after
        try:
            for req in self.waiting:
                if tokens_left <= 0 or seqs_left <= 0:
                    break
                if self.alloc.prefix_caching and req.index > 0 and not req.group[0].prompt_done:
                    continue  # wait for the first completion's prompt pages, then share them
                # prompt logprobs need the logits of every prompt row: no prefix-cache reuse then
                seq = self.ex.new_sequence(None if req.needs_prompt_logits else req.tokens(0), validate=False)
                n = min(req.num_tokens - seq.kv_len, tokens_left)
                if req.needs_prompt_logits:
                    n = min(n, PROMPT_LOGITS_STEP_TOKENS)
                need = self.ex.pages_needed([seq], [n])
                watermark = self.watermark_pages if self.running else 0
                if need + watermark > self.alloc.num_free - promised:
                    self.ex.free(seq)
                    break
                admitted.append(req)
                req.seq = seq
                if req.num_cached_tokens is None:
                    req.num_cached_tokens = min(seq.num_cached_tokens, len(req.prompt))
                self.prefix_hit_tokens += seq.num_cached_tokens
                self.prefix_queried_tokens += req.num_tokens
                self._queue(self.running, req, front=False)
                out.append((req, req.tokens(seq.kv_len, seq.kv_len + n)))
                promised += need
                tokens_left -= n
                seqs_left -= 1
        finally:
            self._dequeue(admitted)
        return out

    def _add_drafts(self, out: list[tuple[Request, list[int]]], tokens_left: int, room: int) -> tuple[int, int]:
        """Speculative drafts (`drafter`) after the decode rows of `out`, in order, while the step's tokens and the
        `room` pages left last: drafts take only what every running request's own tokens left, so they never
        preempt one. Returns the tokens left and the pages the drafts take."""
        ps, taken = self.ex.page_size, 0
        for j, (req, toks) in enumerate(out):
            if tokens_left <= 0:
                break
            seq = req.seq
            if len(toks) != 1 or req.num_tokens - seq.kv_len != 1:
                continue  # a prompt's chunk
            draft = self.drafter(req, tokens_left)
            if not draft:
                continue
            more = -(-(seq.kv_len + 1 + len(draft)) // ps) - max(len(seq.pages), -(-(seq.kv_len + 1) // ps))
            if more > room - taken:
                continue
            req.draft, out[j] = draft, (req, toks + draft)
            tokens_left, taken = tokens_left - len(draft), taken + more
        return tokens_left, taken


def _order(req: Request) -> tuple[int, int]:
    return req.priority, req.arrival
