"""What the conformance suite's test modules share (`suite`, `suite_fp4`): the device's dtypes and the
tolerances, `for_op` (which ops a test function covers), building a backend for a spec (skipping with its
reasons where it can't serve), and the checks whose messages name the backend, the case, expected and got."""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch

from pieceworks.backends.base import BackendSpec, ModelFacts, bad_check_result, parse_options
from pieceworks.core.batch import ForwardMode, GraphMode
from pieceworks.testing import contract as C
from pieceworks.testing.plugin import SUITE_DTYPES, SUITE_OP
from pieceworks.testing.shapes import rel_err

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GRAPHS = {g.value: g for g in GraphMode}
# the forward modes a graph mode runs (FULL graphs are decode graphs; attention runs eagerly between
# piecewise pieces, which pad extend and mixed steps)
GRAPH_FORWARD_MODES = {GraphMode.EAGER: (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE),
                       GraphMode.PIECEWISE: (ForwardMode.EXTEND, ForwardMode.MIXED),
                       GraphMode.FULL: (ForwardMode.DECODE,)}
SHAPES = {"attention": C.ATTENTION_SHAPES, "mla": C.MLA_SHAPES}
# the contract runs' shapes and page size: small on the CPU; on CUDA the shapes of real models, in pages
# of 32 (a size every built-in GPU attention kernel serves)
CONTRACT = {"cpu": ({"attention": C.GqaShape(8, 2, 64), "mla": C.MlaShape(4, 128, 64)}, 4),
            "cuda": ({"attention": C.GqaShape(8, 2, 128), "mla": C.MlaShape(16, 512, 64)}, 32)}
# the activation dtypes of the fp4_gemm and moe cases per device: bf16 on both (where a backend that
# returns float32 shows), float32 too on the CPU (the tight tolerance)
ACTIVATION_DTYPES = {"cpu": ("float32", "bfloat16"), "cuda": ("bfloat16",)}
GEMM_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
W4A16_HINT = ("; it is within tolerance of the w4a16 reference: if your kernel keeps activations in bf16/fp32 "
              "(w4a16), declare numerics = ('w4a16',)")


def for_op(*ops: str, dtypes: dict[str, tuple[str, ...]] | None = None):
    """Mark a suite test: the plugin parametrizes its `backend` (the selected backends of `ops`) and
    `device`, and with `dtypes` (dtype names per device) `device` and `dtype` together. A
    NotImplementedError without a message fails the case naming the method to define."""
    def mark(fn):
        @functools.wraps(fn)
        def run(**kwargs):
            try:
                return fn(**kwargs)
            except NotImplementedError as exc:
                if str(exc).strip():
                    raise
                backend = kwargs["backend"]
                raise C.ContractError(f"{backend.key()}: {C.not_implemented(exc, backend)}") from exc

        setattr(run, SUITE_OP, ops)
        if dtypes is not None:
            setattr(run, SUITE_DTYPES, dtypes)
        return run
    return mark


def device_dtype(device: str) -> torch.dtype:
    return torch.float32 if device == "cpu" else torch.bfloat16


def spec_for(device: str, facts: ModelFacts, numerics: str = "auto") -> BackendSpec:
    if device == "cuda":
        return BackendSpec.for_device("cuda", model=facts, fp4_numerics=numerics)
    return BackendSpec(device="cpu", model=facts, fp4_numerics=numerics)


def reasons_of(cls, spec: BackendSpec) -> list[str]:
    """`cls.check(spec)`; a check that raises or returns anything but a list of strings fails the case."""
    try:
        reasons = cls.check(spec)
    except Exception as exc:
        pytest.fail(f"{cls.key()}.check() raised {type(exc).__name__}: {exc}; check() returns why the backend can't "
                    "serve a spec (a list of strings, empty: it can) and does not raise")
    bad = bad_check_result(cls, reasons)
    if bad is not None:
        pytest.fail(bad)
    return list(reasons)


def build(cls, spec: BackendSpec, mode=None):
    reasons = reasons_of(cls, spec)
    if mode is not None and mode not in cls.forward_modes:
        reasons.append(f"does not support {mode.value} steps")
    if reasons:
        pytest.skip(f"{cls.key()} can't serve here: {'; '.join(reasons)}")
    return cls(spec, parse_options(cls, {}))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str, hint: str = "") -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.2e} > tolerance {tol:.0e}{hint}"


def assert_same_bits(got, ref: torch.Tensor, what: str) -> None:
    """`got` is `ref`, bit for bit (a fused entry point against the unfused ops it stands for)."""
    assert isinstance(got, torch.Tensor), f"{what}: returned {type(got).__name__}, expected a tensor"
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    assert got.dtype == ref.dtype, f"{what}: dtype {dtype_name(got.dtype)}, expected {dtype_name(ref.dtype)}"
    assert torch.equal(got, ref), (
        f"{what}: not the same bits (max |diff| {float((got.double() - ref.double()).abs().max()):.3g}, "
        f"relative error {rel_err(got, ref):.2e}; tolerance: identical bits)")


def decisive_argmax_flips(got: torch.Tensor, ref: torch.Tensor, ulps: int = 4) -> list[tuple[int, float]]:
    """Rows of logits [rows, vocab] whose argmax differs between `got` and `ref` although ref's top two lie more
    than `ulps` bf16 steps apart at its largest logit: (row, ref's top-1 - top-2 margin) each. Another kernel path
    (a padded GEMM, a graph) changes logits in their last bits, which may flip a near tie and nothing else;
    random weights give flat logits with many (the GPU's graph tests saw flips at margins of 0 and 1 step)."""
    top = ref.float().topk(2, dim=-1).values
    margin = top[:, 0] - top[:, 1]
    step = torch.exp2(torch.floor(torch.log2(top[:, 0].abs().clamp_min(2.0**-126))) - 7)  # bf16: 8 mantissa bits
    bad = (got.argmax(-1) != ref.argmax(-1)) & (margin > ulps * step)
    return [(i, float(margin[i])) for i in bad.nonzero().flatten().tolist()]


def assert_output(y, shape: tuple[int, ...], dims: str, x: torch.Tensor, what: str) -> None:
    """forward's result: a tensor of `shape` (`dims`, e.g. "[M, N]") in x's dtype on x's device."""
    assert isinstance(y, torch.Tensor), f"{what}: forward returned {type(y).__name__}, expected a tensor {dims}"
    got, dtype, device = tuple(y.shape), y.dtype, y.device  # (pytest's report then shows no tensor values)
    assert got == shape, f"{what}: forward returned shape {got}, expected {dims} = {shape}"
    assert dtype == x.dtype, f"{what}: forward returned {dtype_name(dtype)} for {dtype_name(x.dtype)} x; return x's dtype"
    assert device == x.device, f"{what}: forward returned a tensor on {device} for x on {x.device}"


def assert_kept(y: torch.Tensor, again: Callable[[], Any], what: str) -> None:
    """forward's result stays the caller's: `again()` (forward on other inputs) must not change it."""
    kept = y.clone()
    again()
    changed = not torch.equal(y.nan_to_num(1e30), kept.nan_to_num(1e30))
    assert not changed, (f"{what}: forward's result changed when forward ran again: return a new tensor each call "
                         "(the model keeps a result while it calls the op again, e.g. DeepSeek-V3's kv_a_proj "
                         "output while q_b_proj runs)")


def assert_unchanged(before: dict[str, torch.Tensor], given: dict[str, torch.Tensor], what: str) -> None:
    changed = C.changed_inputs(before, given)
    assert not changed, f"{what}: " + "; ".join(changed)


def assert_written(out: torch.Tensor, what: str) -> None:
    bad = int((~torch.isfinite(out)).flatten(1).any(1).sum())
    assert not bad, (f"{what}: {bad} of {out.shape[0]} rows of out are not finite after forward: forward writes every "
                     "row of out, in place (the suite fills out with NaN), and reads no cache slot but its sequences' "
                     "tokens (the suite fills the others, past a sequence's length too, with NaN)")


def snapshot(**tensors: torch.Tensor) -> tuple[dict, dict]:
    """The tensors forward is given, and copies of them to check afterwards that it left them alone."""
    return tensors, {n: t.clone() for n, t in tensors.items()}
