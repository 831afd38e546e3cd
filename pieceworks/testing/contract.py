"""Step-by-step runs of the attention and mla contracts over one KV pool, as the executor drives them.

A `PoolRun` owns a pool of several layers (pages handed out in shuffled order, every slot no sequence
owns filled with NaN, the reserved page with finite values) and the truth of every layer's cache as
float64 host tensors. Each `step` builds the metadata the runner would (EAGER; PIECEWISE with padded
rows at position 0 and the reserved slot; FULL decode with static page table, slots and positions
refilled in place and graph-batch padding rows at position 1 over the reserved page), calls `plan`
once, then `forward` once per layer with fresh random inputs, a non-default scale and an output
buffer filled with NaN. It then checks, per layer: that forward left its inputs as they were; the real
rows of `out` against a float64 dense reference over the truth; that padded rows of `out` are finite;
that every new token's K/V (latent) sits at its slot of that layer; that the reserved slot holds one of
the padded rows' K/V. The next step reads what this one wrote, so a backend that does not write the
pool, writes another layer's cache, keeps stale plan state or ignores the scale fails with the measured
error and the tolerance.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields, replace

import torch

from pieceworks.core.batch import ForwardMode, GraphMode, StepMetadata, extend_index
from pieceworks.core.kv import KV_FP8, dequantize_kv, quantize_kv
from pieceworks.executor.kv_cache import RESERVED_PAGE, KVPool

from pieceworks.testing.shapes import GqaShape, MlaShape, rel_err  # noqa: F401 (contract's own names)

# relative Frobenius error of the real rows against the float64 reference
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-3, torch.float16: 2e-3}


@dataclass(frozen=True)
class Step:
    """One step: (sequence name, new tokens) per sequence, in batch order."""

    work: tuple[tuple[str, int], ...]
    pad: int = 0  # PIECEWISE: padded rows past the real tokens


class ContractError(AssertionError):
    pass


def changed_inputs(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    """One message per input tensor that forward wrote: `after` (the tensors forward was given, after the
    call) against `before` (copies taken before it)."""
    found = []
    for name, was in before.items():
        now = after[name].detach().cpu()
        if now.shape != was.shape:
            found.append(f"forward changed its input {name} from shape {tuple(was.shape)} to {tuple(now.shape)}; "
                         "a backend must not write its inputs")
        elif not torch.equal(now.nan_to_num(1e30), was.cpu().nan_to_num(1e30)):
            diff = float((now.double() - was.cpu().double()).abs().nan_to_num(float("inf")).max())
            found.append(f"forward changed its input {name} (max |diff| {diff:.3g}); a backend must not write "
                         "its inputs (copy what it needs to change)")
    return found


def raised(exc: BaseException, backend: type, call: str = "forward") -> str:
    """What a suite case says about an exception from `call`: its type and message, or, for a
    NotImplementedError without a message (a stub, or a method left to a base class that raises a bare
    one), which method of the op's base class to define."""
    if not isinstance(exc, NotImplementedError) or str(exc).strip():
        return f"{call} raised {type(exc).__name__}: {exc}"
    return not_implemented(exc, backend)


def not_implemented(exc: NotImplementedError, backend: type) -> str:
    """'forward is not implemented: define forward(self, q, ...) with the signature of <base>.forward',
    the method being the one that raised `exc` and <base> the op's base class (pieceworks.backends.<op>.base)."""
    import inspect

    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    method = tb.tb_frame.f_code.co_name if tb is not None else "forward"
    base = next((c for c in backend.__mro__ if method in vars(c) and c.__module__.startswith("pieceworks.backends.")
                 and c.__module__.endswith(".base")), None)
    if base is None:
        return f"{method} raised NotImplementedError with no message: {method} is not implemented"
    params = ", ".join(inspect.signature(vars(base)[method]).parameters)
    return (f"{method} is not implemented: define {method}({params}) with the signature of "
            f"{base.__name__}.{method} ({base.__module__})")


class PoolRun:
    """Drive one backend instance through steps over one pool (see the module docstring).

    Args:
        shape: a GqaShape or MlaShape.
        impl: the backend instance (built for `shape.facts(dtype, page_size)`).
        graph: the graph mode of every step (FULL: decode steps, or with `full_extend` extend and mixed steps).
        full_extend: FULL steps are extend / mixed steps laid out as full extend graphs lay them out
            (executor/extend_graph.py): FULL_EXTEND_TOKENS rows, GRAPH_BATCH sequences, `extend_index`.
        scale_factor: the scale passed to forward is this times the shape's default scale.
    """

    GRAPH_BATCH = 8  # FULL: the padded batch of the graph being replayed
    TABLE_WIDTH = 16  # FULL: pages per sequence in the static page table
    FULL_EXTEND_TOKENS = 32  # FULL with full_extend: the token rows of the graph being replayed

    def __init__(self, shape, impl, dtype: torch.dtype, device: str, page_size: int, graph: GraphMode,
                 num_layers: int = 2, num_tokens: int = 128, seed: int = 0, scale_factor: float = 1.37,
                 name: str = "", kv_scales: list[tuple[float, float]] | None = None, full_extend: bool = False) -> None:
        self.shape, self.impl, self.dtype, self.graph = shape, impl, dtype, graph
        self.full_extend = full_extend
        self.device = torch.device(device)
        self.page_size, self.num_layers, self.name = page_size, num_layers, name
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        # room for `num_tokens` tokens of sequences that each waste up to a page, plus the reserved page
        num_pages = 1 + -(-num_tokens // page_size) + 8
        # kv_scales: an FP8 pool with these (k_scale, v_scale) per layer (GqaShape): the truth is what it stores
        self.pool = KVPool(shape.layout(num_layers), num_pages, page_size, dtype if kv_scales is None else KV_FP8,
                           self.device, scales=kv_scales)
        self.pool.buffer.fill_(float("nan"))  # slots no sequence owns may hold anything: never read them
        reserved = torch.arange(RESERVED_PAGE * page_size, (RESERVED_PAGE + 1) * page_size, device=self.device)
        for layer in range(num_layers):  # ... except the reserved page, which holds finite values
            shape.write(self.pool, layer, reserved, torch.zeros(page_size, shape.width(), dtype=dtype))
        self.free = list(range(1, num_pages))
        self.rng.shuffle(self.free)
        self.scale = scale_factor * shape.default_scale()
        self.pages: dict[str, list[int]] = {}
        self.truth: dict[str, list[torch.Tensor]] = {}  # per sequence: [layer] -> [len, W] float64
        self.tol = TOLERANCE[dtype]
        self.steps_run = 0
        if graph is GraphMode.FULL:
            b, w = self.GRAPH_BATCH, self.TABLE_WIDTH
            rows = self.FULL_EXTEND_TOKENS if full_extend else b
            self.static_table = torch.zeros(b, w, dtype=torch.int32, device=self.device)
            self.static_slots = torch.zeros(rows, dtype=torch.int64, device=self.device)
            self.static_pos = torch.zeros(rows, dtype=torch.int64, device=self.device)
            self.static_index = torch.zeros(2 * b + 1, dtype=torch.int32, device=self.device)

    # ------------------------------------------------------------------ sequences
    def add(self, name: str, prefix: int) -> None:
        """A sequence whose first `prefix` tokens' K/V are written straight into the pool (not by the
        backend: its reads are checked independently of its writes)."""
        self.pages[name], self.truth[name] = [], []
        self._grow(name, prefix)
        slots = self._slots(name, 0, prefix)
        for layer in range(self.num_layers):
            _, entries = self.shape.inputs(prefix, self.gen, self.dtype)
            if prefix:
                self.shape.write(self.pool, layer, slots, entries)
            self.truth[name].append(self.stored(layer, entries))

    def _grow(self, name: str, length: int) -> None:
        need = -(-length // self.page_size) - len(self.pages[name])
        if need > len(self.free):
            raise ContractError(f"{self.name}: the test pool is too small ({need} pages needed)")
        self.pages[name] += [self.free.pop() for _ in range(max(0, need))]

    def _slots(self, name: str, start: int, n: int) -> torch.Tensor:
        ps, pages = self.page_size, self.pages[name]
        return torch.tensor([pages[p // ps] * ps + p % ps for p in range(start, start + n)], dtype=torch.int64,
                            device=self.device)

    def length(self, name: str) -> int:
        return self.truth[name][0].shape[0]

    # ------------------------------------------------------------------ one step
    def meta(self, step: Step) -> StepMetadata:
        names = [s for s, _ in step.work]
        extend = [n for _, n in step.work]
        prefix = [self.length(s) for s in names]
        for s, n in step.work:
            self._grow(s, self.length(s) + n)
        mode = ForwardMode.classify(extend, prefix)
        slots = torch.cat([self._slots(s, p, n) for (s, n), p in zip(step.work, prefix)])
        positions = torch.cat([torch.arange(p, p + n) for (_, n), p in zip(step.work, prefix)]).to(self.device)
        pages = [list(self.pages[s]) for s in names]
        if self.graph is GraphMode.FULL:
            assert (mode is ForwardMode.DECODE) != self.full_extend, "FULL graphs run decode steps (full_extend: others)"
            b, pad = self.GRAPH_BATCH, self.GRAPH_BATCH - len(names)
            table = torch.full((b, self.TABLE_WIDTH), RESERVED_PAGE, dtype=torch.int32)
            for i, p in enumerate(pages):
                table[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
            # refilled in place: the graph being replayed reads these addresses
            self.static_table.copy_(table)
            if self.full_extend:
                return self._full_extend_meta(mode, extend, prefix, slots, positions, pages)
            self.static_slots.fill_(self.pool.reserved_slot)[: len(names)].copy_(slots)
            self.static_pos.fill_(1)[: len(names)].copy_(positions)
            return StepMetadata(mode=mode, graph_mode=GraphMode.FULL, extend_lens=extend, prefix_lens=prefix,
                                page_size=self.page_size, page_table=self.static_table, slot_mapping=self.static_slots,
                                positions=self.static_pos, graph_batch_size=b,
                                page_lists=pages + [[RESERVED_PAGE]] * pad)
        width = max(1, max(len(p) for p in pages))
        table = torch.zeros(len(pages), width, dtype=torch.int32)
        for i, p in enumerate(pages):
            table[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
        # padded rows as the runner pads them: position 0, the reserved slot
        pad_slots = torch.full((step.pad,), self.pool.reserved_slot, dtype=torch.int64, device=self.device)
        pad_pos = torch.zeros(step.pad, dtype=torch.int64, device=self.device)
        return StepMetadata(mode=mode, graph_mode=self.graph, extend_lens=extend, prefix_lens=prefix,
                            page_size=self.page_size, page_table=table.to(self.device),
                            slot_mapping=torch.cat([slots, pad_slots]), positions=torch.cat([positions, pad_pos]),
                            page_lists=pages)

    def _full_extend_meta(self, mode, extend, prefix, slots, positions, pages) -> StepMetadata:
        """A full extend graph's step (executor/extend_graph.py): FULL_EXTEND_TOKENS rows (padding ones at position 0
        over the reserved slot), GRAPH_BATCH sequences (padding ones empty), each sequence's query offsets and KV
        lengths in `extend_index`; every tensor at its fixed address."""
        b, n = self.GRAPH_BATCH, sum(extend)
        assert len(extend) <= b and n <= self.FULL_EXTEND_TOKENS, "the step is larger than the graph"
        self.static_slots.fill_(self.pool.reserved_slot)[:n].copy_(slots)
        self.static_pos.fill_(0)[:n].copy_(positions)
        pad = b - len(extend)
        self.static_index.copy_(extend_index(extend, [p + e for p, e in zip(prefix, extend)], b))
        return StepMetadata(mode=mode, graph_mode=GraphMode.FULL, extend_lens=extend, prefix_lens=prefix,
                            page_size=self.page_size, page_table=self.static_table, slot_mapping=self.static_slots,
                            positions=self.static_pos, graph_batch_size=b, extend_index=self.static_index,
                            page_lists=pages + [[RESERVED_PAGE]] * pad)

    def step(self, step: Step) -> None:
        """Run one step over every layer and check it; raises ContractError naming what is wrong."""
        where = f"{self.name} step {self.steps_run + 1} ({self.graph.value}, {describe(step)})"
        meta = self.meta(step)
        real = meta.num_tokens
        rows = meta.slot_mapping.shape[0]
        held = {f.name: v.clone() for f in fields(meta) if isinstance(v := getattr(meta, f.name), torch.Tensor)}
        self.impl.plan(meta)
        inputs = [self.shape.inputs(rows, self.gen, self.dtype) for _ in range(self.num_layers)]
        # forward gets copies: the references below read the inputs as they were before the call
        given = [{k: v.to(self.device, copy=True) for k, v in x.items()} for x, _ in inputs]
        try:
            outs = [out.cpu() for out in self.forward_all(given)]
        except ContractError as exc:
            raise ContractError(f"{where}: {exc}") from exc
        except Exception as exc:  # a kernel that crashes on a step it accepted fails the contract too
            raise ContractError(f"{where}: {raised(exc, type(self.impl))}") from exc
        errors = [f"plan or forward changed meta.{name}: the step's metadata is the runner's, read-only (copy what "
                  "the kernels need into the backend's own buffers in plan)"
                  for name, before in held.items() if not torch.equal(getattr(meta, name), before)]
        meta = replace(meta, **held)  # the checks below read the step as the runner made it
        indptr = meta.qo_indptr()
        for layer, ((x, entries), out) in enumerate(zip(inputs, outs)):
            errors += [f"layer {layer}: {msg}" for msg in changed_inputs(x, given[layer])]
            ref = []
            for i, (s, n) in enumerate(step.work):
                keys = torch.cat([self.truth[s][layer], self.stored(layer, entries[indptr[i] : indptr[i + 1]])])
                ref.append(self.shape.reference(x, slice(indptr[i], indptr[i + 1]), keys, meta.prefix_lens[i],
                                                self.scale))
            ref = torch.cat(ref)
            got = out[:real]
            if not torch.isfinite(got).all():
                errors.append(f"layer {layer}: non-finite values in the real rows of out (forward writes every row "
                              "and reads no cache slot but its sequences' tokens: the suite fills the others, past a "
                              "sequence's length too, with NaN)")
            else:
                err = rel_err(got, ref)
                if not err <= self.tol:
                    errors.append(f"layer {layer}: relative error {err:.2e} > tolerance {self.tol:.0e} "
                                  f"({self.dtype}, scale {self.scale:.4g})")
            if rows > real and not torch.isfinite(out[real:]).all():
                errors.append(f"layer {layer}: padded rows {real}..{rows - 1} of out are not finite (the next "
                              "piece computes on them: write finite values, e.g. zero)")
            want = self.as_pool(layer, entries[:real])
            have = self.shape.pool_rows(self.pool, layer, meta.slot_mapping[:real])
            if not same_rows(have, want):
                bad = int((have != want).any(1).sum())
                errors.append(f"layer {layer}: {bad} of {real} new tokens' K/V are not at their slots in this "
                              "layer's cache (forward writes every row at meta.slot_mapping[row] of "
                              "kv's layer_id buffers)")
            if rows > real:
                # Several padded rows write the one reserved slot in one kernel; on a GPU their writes race
                # element by element, so each element must come from some padded row, not all from one.
                reserved = self.shape.pool_rows(self.pool, layer, meta.slot_mapping[real:real + 1])[0]
                padded = self.as_pool(layer, entries[real:])
                if self.pool.fp8:
                    padded, reserved = padded.view(torch.uint8), reserved.view(torch.uint8)
                if not (padded == reserved).any(0).all():
                    errors.append(f"layer {layer}: the reserved slot does not hold a padded row's K/V (padded "
                                  "rows are written too, at their slot_mapping entry: the reserved slot)")
        if errors:
            raise ContractError(f"{where}:\n  " + "\n  ".join(errors))
        for i, (s, n) in enumerate(step.work):
            for layer, (_, entries) in enumerate(inputs):
                self.truth[s][layer] = torch.cat([self.truth[s][layer],
                                                  self.stored(layer, entries[indptr[i] : indptr[i + 1]])])
        self.steps_run += 1

    def as_pool(self, layer: int, entries: torch.Tensor) -> torch.Tensor:
        """Cache entries [n, W] as this run's pool holds them for `layer`: in the test dtype, or (an FP8 pool) K and
        V halves quantized with the layer's scales (`core.kv.quantize_kv`)."""
        if not self.pool.fp8:
            return entries.to(self.dtype)
        half = entries.shape[1] // 2
        return torch.cat([quantize_kv(entries[:, :half].to(self.dtype), self.pool.k_scale(layer)),
                          quantize_kv(entries[:, half:].to(self.dtype), self.pool.v_scale(layer))], 1)

    def stored(self, layer: int, entries: torch.Tensor) -> torch.Tensor:
        """float64 values a backend reads back of `entries` [n, W] written to `layer` (what the reference sees)."""
        held = self.as_pool(layer, entries)
        if not self.pool.fp8:
            return held.double()
        half = held.shape[1] // 2
        return torch.cat([dequantize_kv(held[:, :half], self.pool.k_scale(layer)),
                          dequantize_kv(held[:, half:], self.pool.v_scale(layer))], 1).double()

    def forward_all(self, xs: list[dict]) -> list[torch.Tensor]:
        """Every layer's forward on the planned step, eagerly (`call` may be a traced wrapper); `xs` are
        the layers' inputs on the device, and afterwards the tensors forward was given (its inputs are
        checked against what they were)."""
        outs = []
        for layer, x in enumerate(xs):
            out = torch.full(self.shape.out_shape(x[next(iter(x))].shape[0]), float("nan"),
                             dtype=self.dtype, device=self.device)
            self.call(self.impl, x, out, layer, self.scale, self.pool)
            outs.append(out)
        return outs

    def call(self, impl, x: dict, out: torch.Tensor, layer: int, scale: float, pool: KVPool) -> None:
        self.shape.call(impl, x, out, layer, scale, pool)


def same_rows(have: torch.Tensor, want: torch.Tensor) -> bool:
    """Cache rows equal to the bit (float8 ones compared as bytes; NaN equal to NaN)."""
    if have.dtype == KV_FP8 or want.dtype == KV_FP8:
        return have.dtype == want.dtype and torch.equal(have.view(torch.uint8), want.view(torch.uint8))
    return torch.equal(have.nan_to_num(1e30), want.nan_to_num(1e30))


def describe(step: Step) -> str:
    body = ", ".join(f"{s}+{n}" for s, n in step.work)
    return body + (f", {step.pad} padded rows" if step.pad else "")


# ---------------------------------------------------------------------------- the step chains
# (sequence, cached prefix written straight into the pool) and the steps over them: every step re-plans
# with new lengths and reads what the steps before it wrote.
CHAINS: dict[ForwardMode, tuple[dict[str, int], tuple[Step, ...]]] = {
    ForwardMode.EXTEND: ({"a": 6, "b": 0, "c": 13},
                         (Step((("a", 5), ("b", 7))), Step((("b", 3), ("c", 9), ("a", 2))))),
    ForwardMode.MIXED: ({"a": 9, "b": 0, "c": 4, "d": 20},
                        (Step((("a", 1), ("b", 6), ("c", 3), ("d", 1))), Step((("b", 1), ("a", 3), ("d", 1))))),
    ForwardMode.DECODE: ({"a": 5, "b": 17, "c": 1, "d": 33},
                         (Step((("a", 1), ("b", 1), ("c", 1), ("d", 1))), Step((("d", 1), ("a", 1))),
                          Step((("c", 1), ("a", 1), ("b", 1))))),
}


def chain(mode: ForwardMode, pad: int = 0) -> tuple[dict[str, int], tuple[Step, ...]]:
    """The step chain of `mode`; PIECEWISE runs pass `pad` > 0 (each step gets pad + its index rows)."""
    seqs, steps = CHAINS[mode]
    if pad:
        steps = tuple(replace(s, pad=pad + i) for i, s in enumerate(steps))
    return seqs, steps


def run_chain(run: PoolRun, mode: ForwardMode, pad: int = 0) -> None:
    seqs, steps = chain(mode, pad)
    for name, prefix in seqs.items():
        run.add(name, prefix)
    for step in steps:
        run.step(step)


# ---------------------------------------------------------------------------- shape sweeps
ATTENTION_SHAPES = (GqaShape(4, 4, 64), GqaShape(8, 2, 128), GqaShape(8, 1, 64), GqaShape(6, 3, 96),
                    GqaShape(4, 2, 256), GqaShape(16, 2, 80))
MLA_SHAPES = (MlaShape(4, 512, 64), MlaShape(16, 128, 64), MlaShape(8, 192, 64), MlaShape(2, 64, 64),
              MlaShape(128, 512, 64))
PAGE_SIZES = (1, 16, 64)
# the sweep's step per shape: an empty-cache 1-token sequence, a 1-token prefix (a decode row), a longer
# prefix over pages; as one mixed step, or as the step kinds the backend serves
SWEEP_SEQS = {"one": 0, "short": 1, "long": 40}
SWEEP_STEPS = {
    ForwardMode.MIXED: (Step((("one", 1), ("short", 1), ("long", 3))),),
    ForwardMode.EXTEND: (Step((("one", 1), ("short", 2), ("long", 5))),),
    ForwardMode.DECODE: (Step((("long", 1), ("short", 1))),),
}


def sweep_steps(forward_modes) -> tuple[Step, ...]:
    if ForwardMode.MIXED in forward_modes:
        return SWEEP_STEPS[ForwardMode.MIXED]
    return tuple(s for m in (ForwardMode.EXTEND, ForwardMode.DECODE) if m in forward_modes for s in SWEEP_STEPS[m])
