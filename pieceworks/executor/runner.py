"""The Executor: owns model + kernel table + KV pool (built by `executor/build.py`), and runs one step
top to bottom.

A step (`Executor.forward`): validate the batch -> reserve KV pages -> build the step's metadata and
choose its graph mode -> plan the attention backend -> run the model (eagerly, through piecewise
graphs, or by replaying a full decode graph) -> logits -> commit the new tokens to their sequences.
A step that fails gives back the pages it took: the pool and every sequence stay as they were.

One thread at a time: the backends' plan state and the KV pool are shared by every step, so a call
into `forward`, `new_sequence` or `free` while another thread is inside one of them raises
RuntimeError instead of waiting (a silent interleaving would give wrong tokens). Serving stacks that
share one model between threads or coroutines use `pieceworks.AsyncEngine`, whose single loop thread
runs every step.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import torch

from pieceworks.backends.registry import KernelTable
from pieceworks.config import Config
from pieceworks.core.batch import ForwardBatch, ForwardMode, GraphMode, Sequence, StepMetadata
from pieceworks.core.context import ForwardContext, forward_context
from pieceworks.errors import BatchError, OutOfPages
from pieceworks.executor import distributed  # here: an import inside the leader's step costs ~1 us a step
from pieceworks.executor.build import build_executor, executor_from_config, model_dir_of, release_executor
from pieceworks.executor.inputs import (as_token_ids, check_batch, logit_rows, num_logit_rows, step_inputs,
                                         take_previous_ids)
from pieceworks.executor.kv_cache import KVPool, block_keys, release_pages, reserve_pages, truncate_sequence
from pieceworks.models.base import context_limit
from pieceworks.util import OneThread


class Executor:
    """Owns the model, its kernel table and the KV cache; the caller owns scheduling.

    Build with `Executor.from_config(...)`. Then either drive steps yourself (`new_sequence`,
    `forward(ForwardBatch(...))`, `free`) or use the conveniences `generate` and `score`. Calls from a
    second thread while one runs are refused (RuntimeError); see the module docstring.
    """

    def __init__(self, cfg: Config, model: Any, table: KernelTable, kv: KVPool, device: torch.device,
                 model_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.model = model
        self.table = table
        self.kv = kv
        self.device = device
        self.model_dir = model_dir
        self.page_size = kv.page_size
        self.vocab_size = model.vocab_size
        self.max_context = min(context_limit(model, cfg.model.max_context, warn=True),
                               kv.allocator.capacity * kv.page_size)
        self._ids = itertools.count()
        self._live: dict[int, Sequence] = {}
        self._busy = OneThread(lambda what: (
            f"Executor.{what} called while another thread is running a step on this executor; an Executor (and an "
            "Engine) serves one thread at a time. Share one model between threads or coroutines through "
            "pieceworks.AsyncEngine, or give each thread its own executor"))
        self._tokenizer = None
        self.greedy_ids: torch.Tensor | None = None
        """After a step that replayed a decode graph: int64 [num_seqs] on the device, each row's greedy
        token of the returned logits (-1 for a row with NaN or inf; `cuda_graph.greedy_token_ids`),
        computed inside the graph. A view of the graph's static output, valid until the next step.
        None after any other step."""
        self._prev_ids: torch.Tensor | None = None  # the ids the next step's placeholders read (`feed_ids`)
        self.piecewise = None
        self.decode_graphs = None
        self.extend_graphs = None  # executor.extend_graph: full graphs for small extend and mixed steps
        self.groups = None  # parallel.group.ProcessGroups of a tensor-parallel rank
        self.workers = None  # parallel.workers.WorkerGroup of an in-process launch's leader
        self.rendezvous: str | None = None  # that launch's torch.distributed file-store directory
        self._closed = False  # after close(): no steps (a tensor-parallel rank can't run its shard alone)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_config(cls, cfg: str | os.PathLike | dict | Config | None = None,
                    overrides: list[str] | None = None, *, progress: bool = True) -> "Executor":
        """Build an executor from a YAML path, dict or Config, plus dotlist overrides.

        With `parallel.tensor_parallel_size` N > 1 the executor is the leader (rank 0) of N ranks, each
        holding a shard of the model: started here as N - 1 worker processes, or, under `torchrun
        --nproc-per-node N`, the other torchrun processes (on those, this call serves the leader's steps
        and exits the process when the leader closes). Close it (`close()`, or use it as a context
        manager) to stop the workers; a leader never closed stops them when it is collected or at
        interpreter exit.

        Raises:
            ConfigError: bad configuration (including a parallel layout the model or the machine can't
                take), before anything is allocated. SelectionError: a configured backend can't serve.
            ValueError: a bad checkpoint (nothing half-built is returned).
            WorkerDied: a worker process failed while building its shard (its error is in the message).
        """
        return executor_from_config(cls, cfg, overrides, progress)

    @staticmethod
    def resolve_model_dir(cfg: Config, progress: bool) -> Path | None:
        """The model directory of model.path (a bundled demo model is converted into the cache first)."""
        return model_dir_of(cfg, progress)

    @classmethod
    def build(cls, cfg: Config, progress: bool, device: torch.device, model_dir: Path | None,
              groups: Any = None) -> "Executor":
        """One rank's executor on `device`, of the model in `model_dir` (or model.arch's): the whole
        model, or with `groups` (`parallel.group.ProcessGroups`) that rank's shard."""
        return build_executor(cls, cfg, progress, device, model_dir, groups)

    # ---------------------------------------------------------------- sequences
    def new_sequence(self, prompt: list[int] | None = None, *, validate: bool = True) -> Sequence:
        """A new sequence handle; empty, or holding the longest cached prefix of `prompt`.

        With `kv_cache.prefix_caching` and a `prompt` (token ids), the sequence starts holding the
        cached full pages that match the prompt's leading tokens, shared read-only with whoever else
        holds them: `seq.tokens` is that prefix (a multiple of the page size, and always shorter than
        the prompt, so the step that feeds the rest yields the last token's logits), and
        `seq.num_cached_tokens` its length. The caller then feeds `prompt[seq.kv_len:]`. `validate=False`
        skips the conversion of `prompt` to a list of ints, for callers whose prompt is one already (the
        Engine's scheduler, as `forward`'s `validate`).
        """
        with self._busy.held("new_sequence"):
            if self._closed:
                raise self._closed_error()
            seq = Sequence(id=next(self._ids))
            alloc = self.kv.allocator
            if prompt is not None and alloc.prefix_caching:
                if validate:
                    prompt = as_token_ids(prompt, f"sequence {seq.id}")
                usable = (len(prompt) - 1) // self.page_size  # never the whole prompt
                pages, keys = alloc.lookup(prompt[: usable * self.page_size], self.page_size)
                alloc.share(pages)
                n = len(pages) * self.page_size
                seq.pages, seq.block_keys = pages, keys
                seq.tokens, seq.num_cached_tokens = prompt[:n], n
            self._live[seq.id] = seq
            return seq

    def free(self, seq: Sequence) -> None:
        """Drop a sequence's hold on its KV pages (pages shared with other sequences stay with them;
        cached ones stay in the prefix cache until the pool needs them). Freeing twice is an error; the
        handle is dead after this call whatever happens."""
        with self._busy.held("free"):
            if self._closed:
                raise self._closed_error()
            if not isinstance(seq, Sequence):
                raise BatchError(f"free() takes a Sequence handle of Executor.new_sequence(), not "
                                 f"{type(seq).__name__} {seq!r}")
            if seq.freed or self._live.get(seq.id) is not seq:
                raise BatchError(f"sequence {seq.id} was already freed (or belongs to another executor)")
            pages = seq.pages
            seq.pages, seq.block_keys, seq.freed = [], [], True
            del self._live[seq.id]
            self.kv.allocator.free(pages)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Cut `seq` back to its first `num_tokens` tokens, as if the later ones had never been fed (speculative
        decoding drops the KV of rejected draft tokens this way): the pages past them are given back, and the
        next step feeds the sequence from token `num_tokens` on.

        Raises:
            BatchError: a freed or foreign sequence, `num_tokens` outside [0, kv_len], or a cut inside a page
                that another sequence shares (prefix cache): cut at a page boundary instead. Nothing changed.
        """
        with self._busy.held("truncate"):
            if self._closed:
                raise self._closed_error()
            if not isinstance(seq, Sequence) or seq.freed or self._live.get(seq.id) is not seq:
                raise BatchError(f"truncate() takes a live Sequence of this executor, got {seq!r}")
            if truncate_sequence(self.kv.allocator, seq, num_tokens, self.page_size) and self.groups is not None:
                self.sent_pages.cut(seq.id)  # the followers' page lists start over at its next step

    def pages_needed(self, seqs: list[Sequence], num_new_tokens: list[int]) -> int:
        """KV pages a step feeding `num_new_tokens[i]` tokens to `seqs[i]` would allocate (compare with
        `kv.allocator.num_free`, which counts evictable cached pages too)."""
        ps = self.page_size
        return sum(max(0, -(-(s.kv_len + n) // ps) - len(s.pages)) for s, n in zip(seqs, num_new_tokens))

    @property
    def num_free_tokens(self) -> int:
        """Tokens the KV pool can still take (whole free pages)."""
        return self.kv.allocator.num_free * self.page_size

    # ---------------------------------------------------------------- the step
    def forward(self, batch: ForwardBatch, *, validate: bool = True) -> torch.Tensor:
        """Run one step.

        `validate=False` skips the checks of the batch (the BatchErrors below): for callers whose
        batches are valid by construction, as the Engine's (prompts checked when added, then only
        sampled in-vocabulary ids, its own live sequences, within the context limit), since the checks
        cost about 1 us per sequence on every step. A bad batch then fails inside the step or writes
        wrong KV.

        Returns:
            float32 logits: [num_seqs, V] for each sequence's last new token, or
            [total new tokens, V] with `batch.return_all_logits` (with a list: every new token's row of
            the sequences it marks, the last one's of the others, in batch order).

        Raises:
            BatchError: invalid batch (token ids that are not integers or lie outside the vocabulary,
                a freed, foreign or repeated sequence, too long); checked before anything changes.
                Whatever fails later (an interrupt included) gives back the pages the step took: the
                pool and every sequence stay as they were.
            OutOfPages: the KV pool lacks the pages the batch needs (`pages_needed`); nothing changed.
            RuntimeError: another thread is inside this executor.
        """
        self._busy.claim("forward")
        try:
            return self._forward(batch, validate)
        finally:
            self._busy.release()

    def _forward(self, batch: ForwardBatch, validate: bool = True) -> torch.Tensor:
        if self._closed:
            raise self._closed_error()
        self.greedy_ids = None
        tokens = self._validate(batch) if validate else batch.tokens
        mode = ForwardMode.classify([len(t) for t in tokens], [s.kv_len for s in batch.seqs])
        if mode is ForwardMode.IDLE:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        new_pages: list[list[int]] = []
        try:
            new_pages = self._reserve_pages(batch.seqs, tokens)
            if self.groups is not None:
                logits = distributed.forward_leader(self, mode, batch.seqs, tokens, batch.return_all_logits)
            else:
                logits = self.run_step(mode, batch.seqs, tokens, batch.return_all_logits)
        except BaseException:
            self._release(batch.seqs, new_pages)
            raise
        caching, ps = self.kv.allocator.prefix_caching, self.page_size
        for seq, toks in zip(batch.seqs, tokens):
            seq.tokens.extend(toks)
            # a placeholder (< 0, the Engine's async steps) is registered once its id is known
            if caching and len(seq.tokens) // ps > len(seq.block_keys) and toks[-1] >= 0:  # a page filled up
                self.register_full_pages(seq)
        return logits

    def register_full_pages(self, seq: Sequence) -> None:
        """Offer the sequence's newly filled pages to the prefix cache (every token of them known)."""
        done = len(seq.block_keys)
        if seq.kv_len // self.page_size <= done:
            return
        parent = seq.block_keys[-1] if done else None
        new = block_keys(seq.tokens, self.page_size, parent, start_page=done)
        for i, key in enumerate(new, start=done):
            self.kv.allocator.register(seq.pages[i], key)
        seq.block_keys.extend(new)

    def run_step(self, mode: ForwardMode, seqs: list[Any], tokens: list[list[int]],
                 all_logits: bool | list[bool]) -> torch.Tensor:
        """The step itself, pages already reserved (every rank of a tensor-parallel run calls it with the
        same arguments): graph mode, kernels, inputs, the model, logits. `seqs` need `pages` and `kv_len`."""
        num_tokens = sum(map(len, tokens))
        graph = self._graph_mode(mode, len(tokens), num_tokens, num_logit_rows(tokens, all_logits))
        if graph is GraphMode.FULL and mode is not ForwardMode.DECODE:
            return self.extend_graphs.run(mode, seqs, tokens, self._prev_ids, all_logits)
        kernels = self.table.step(mode, graph)
        if graph is GraphMode.FULL:
            logits, self.greedy_ids = self.decode_graphs.run(seqs, tokens, kernels)
            self._prev_ids = self.greedy_ids
            return logits
        pad_to = self.piecewise.padded_size(num_tokens) if graph is GraphMode.PIECEWISE else None
        meta, input_ids = self.prepare_step(mode, graph, seqs, tokens, pad_to)
        if self._prev_ids is not None and any(t and t[-1] < 0 for t in tokens):  # the Engine's async steps
            take_previous_ids(input_ids, self._prev_ids)
        hidden = self.run_model(kernels, meta, input_ids)
        rows = logit_rows(tokens, all_logits, self.device)
        return self.model.compute_logits(hidden[rows])

    def feed_ids(self, ids: torch.Tensor) -> None:
        """The ids that the next step's placeholders -(r + 1) read (row r; int64 on the device): the tokens the
        Engine drew on the device from the last step's logits, in place of a decode graph's greedy ids."""
        self._prev_ids = ids
        if self.decode_graphs is not None:
            self.decode_graphs.feed_ids(ids)

    def run_model(self, kernels, meta: StepMetadata, input_ids: torch.Tensor) -> torch.Tensor:
        """The attention backends' plan and the model's forward of a prepared eager or piecewise step
        (`prepare_step`): hidden states [rows, H]."""
        for backend in (kernels.attention, kernels.mla):
            if backend is not None:
                backend.plan(meta)
        with forward_context(ForwardContext(kernels, meta, self.kv)):
            if meta.graph_mode is GraphMode.PIECEWISE:
                return self.piecewise(input_ids, meta.positions)
            return self.model(input_ids, meta.positions)

    def close(self, graceful: bool = True) -> None:
        """Release the model, the KV pool and the CUDA graphs (their device memory is free once this
        returns, unless the caller still holds tensors of them), and stop a tensor-parallel run's
        followers and leave its process group. Idempotent; the executor refuses steps and new sequences
        afterwards. `graceful=False` (after a failed step) kills in-process workers instead of asking
        them to stop. Without close(), an executor's memory outlives it: torch.compile keeps its
        piecewise backend for the life of the process."""
        if self.groups is not None:
            distributed.shutdown(self, graceful)
        if not self._closed:
            self._closed = True
            release_executor(self, str(self._closed_error()))

    @property
    def closed(self) -> bool:
        """Whether close() was called (or a tensor-parallel worker failed): no more steps."""
        return self._closed

    def _closed_error(self) -> RuntimeError:
        why = "a worker failed or close() was called" if self.groups is not None else "close() was called"
        return RuntimeError(f"this executor is closed ({why}); build a new executor")

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _graph_mode(self, mode: ForwardMode, num_seqs: int, num_tokens: int, num_rows: int | None = None) -> GraphMode:
        """Decode within the graph batch sizes -> FULL; extend/mixed within the extend graphs' sizes (`covers`: the
        logits rows wanted, `num_rows` (default: a sequence's last), within those the bucket computes), padded no
        further than piecewise would pad it -> FULL; within piecewise.max_tokens -> PIECEWISE (mixed steps only
        where the kernel table has backends for them there); otherwise EAGER."""
        if mode is ForwardMode.DECODE:
            if self.decode_graphs is not None and self.decode_graphs.covers(num_seqs):
                return GraphMode.FULL
            return GraphMode.EAGER
        pw_size = (self.piecewise.padded_size(num_tokens) if self.piecewise is not None and self.piecewise.covers(
            num_tokens) and self.table.graph_mode_ok(mode, GraphMode.PIECEWISE) else None)
        if self.extend_graphs is not None and self.extend_graphs.takes(num_seqs, num_tokens, pw_size, num_rows):
            return GraphMode.FULL
        return GraphMode.PIECEWISE if pw_size is not None else GraphMode.EAGER

    def prepare_step(self, mode: ForwardMode, graph: GraphMode, seqs: list[Sequence],
                     tokens: list[list[int]], pad_to: int | None = None,
                     table_width: int | None = None) -> tuple[StepMetadata, torch.Tensor]:
        """Host-side inputs of one step as device tensors (pages must already be reserved): its
        `StepMetadata` and token ids (`inputs.step_inputs`; padded tokens up to `pad_to`)."""
        return step_inputs(mode, graph, seqs, tokens, self.page_size, self.kv.reserved_slot, self.device,
                           pad_to, table_width)

    # ---------------------------------------------------------------- validation and pages
    def _validate(self, batch: ForwardBatch) -> list[list[int]]:
        """The batch's new tokens as int lists, or a BatchError; reads the batch, changes nothing."""
        return check_batch(batch, self._live, self.vocab_size, self.max_context)

    def _reserve_pages(self, seqs: list[Sequence], tokens: list[list[int]]) -> list[list[int]]:
        return reserve_pages(self.kv.allocator, self.page_size, seqs, tokens)

    def _release(self, seqs: list[Sequence], new_pages: list[list[int]]) -> None:
        if any(new_pages) and not self._closed:  # a step that failed by closing the executor: its pool is gone
            release_pages(self.kv.allocator, seqs, new_pages)

    # ---------------------------------------------------------------- conveniences
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 32, **kw: Any) -> list[list[int]]:
        """Generate for every prompt with continuous batching under the KV budget; see scheduler.generate."""
        from pieceworks.executor.scheduler import generate

        return generate(self, prompts, max_new_tokens, **kw)

    def score(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Per-position float32 logits [len, V] of each sequence (position i predicts token i+1)."""
        from pieceworks.executor.scheduler import score

        return score(self, sequences)

    @property
    def tokenizer(self):
        """The model directory's Hugging Face tokenizer (needs transformers: pieceworks[demo]).

        Raises:
            CheckpointError: the model has none (random weights, or no tokenizer files in its directory).
            ValueError: transformers is not installed.
        """
        if self._tokenizer is None:
            from pieceworks.models.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_dir, self.vocab_size)
        return self._tokenizer


__all__ = ["Executor", "BatchError", "OutOfPages", "ForwardBatch", "Sequence"]
