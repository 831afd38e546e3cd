"""The activation and K/V-cache scales of a `pieceworks quantize` run: each linear's input amax (fixed, calibrated,
or ModelOpt's substitute for a linear the calibration never reached; one per group of linears that read the same
input), the attention layers that get FP8 KV scales, and those scales."""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from pieceworks.quant import nvfp4
from pieceworks.quant.export_config import summarize_exclude
from pieceworks.quant.modelopt import covered

UNCALIBRATED_AMAX = 6.0  # ModelOpt's substitute (the quantizer's maxbound) for a zero/missing amax
MIN_AMAX = torch.finfo(torch.float32).tiny * nvfp4.E2M1_MAX * nvfp4.E4M3_MAX
"""The smallest amax whose input_scale (amax / (6 * 448)) is a normal float32: below it the scale is 0 or subnormal,
and the W4A4 path, which divides by it, computes inf and NaN (the loader refuses such scales). K/V amax are held to
it too (their scale, amax / 448, would stay normal down to a bound 6 times lower)."""


def usable_amax(v) -> bool:
    """Whether an activation or K/V amax gives a usable scale: from MIN_AMAX to float32's largest value."""
    return MIN_AMAX <= float(v) <= torch.finfo(torch.float32).max


def input_amaxes(modules: list[str], groups, amax, calibrated: Mapping[str, float] | None) -> dict[str, float]:
    """Each quantized module's input amax: `amax` for all, or the `calibrated` one (UNCALIBRATED_AMAX, with a
    warning, where there is none); a group of `groups` takes its members' max, as ModelOpt's export does."""
    if calibrated is None:
        return {m: float(amax) for m in modules}
    out, missing = {}, []
    for m in modules:
        v = calibrated.get(m)
        if v is None or v == 0.0:
            missing.append(m)
            v = UNCALIBRATED_AMAX
        if not usable_amax(v):  # its input_scale would be NaN, inf, negative, zero or subnormal
            raise ValueError(f"{m}: the calibrated activation amax is {float(v)} (the activations overflowed, or "
                             "the calibration is broken); calibrate over another text, or pass a fixed --amax X")
        out[m] = float(v)
    if missing:
        warnings.warn(
            f"{len(missing)} linear(s) got no calibration data (e.g. {missing[0]}); their input_scale "
            f"uses amax {UNCALIBRATED_AMAX} as ModelOpt does; use more calibration text",
            stacklevel=3,
        )
    for group in groups:  # one input_scale per group: the max, as ModelOpt's export does
        top = max(out[m] for m in group)
        out.update({m: top for m in group})
    return out


def kv_layers(quantized: list[str], unquantized: list[str]) -> list[str]:
    """The attention modules an FP8 KV cache's scales go to: every module with a k_proj and a v_proj, quantized or
    not, but those the written exclude list covers whole (`summarize_exclude`), for which the loader, as ModelOpt's
    export, expects none (their scales are 1.0); excluding a k_proj or v_proj alone leaves the KV cache quantized."""
    modules = set(quantized) | set(unquantized)
    excluded = summarize_exclude(unquantized, quantized)
    layers = {m.rsplit(".", 1)[0] for m in modules
              if m.endswith(".k_proj") and m.rsplit(".", 1)[0] + ".v_proj" in modules}
    return sorted(a for a in layers if not covered(a, excluded))


def kv_scales(layers: list[str], kv_amax: Mapping[str, tuple[float, float]]) -> dict[str, torch.Tensor]:
    """Each layer's k_scale / v_scale: the calibrated amax / 448 (ModelOpt's FP8 KV export), float32 scalars."""
    out, missing = {}, [a for a in layers if a not in kv_amax]
    if missing or not layers:
        raise ValueError(f"--kv-cache fp8: no key / value amax was calibrated for {missing[:3] or 'any layer'} (its "
                         "attention did not run through transformers' attention functions); leave --kv-cache out")
    for a in layers:
        for p, v in zip("kv", kv_amax[a]):
            if not usable_amax(v):
                raise ValueError(f"{a}: the calibrated {p} amax is {float(v)}; calibrate over another text")
            out[f"{a}.{p}_proj.{p}_scale"] = torch.tensor(float(v), dtype=torch.float32) / nvfp4.E4M3_MAX
    return out
