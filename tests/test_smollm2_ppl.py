"""A real model on a real text: SmolLM2-135M-Instruct perplexity through pieceworks vs transformers.

bf16 weights: the same perplexity as transformers (fp32 compute) within 0.5%. NVFP4 (our quantizer's
export): within 3% of transformers running the same model with its weights replaced by their
dequantized NVFP4 values (w4a16); the w4a4 gap is printed. Text: the first 4000 characters of
pieceworks/data/english.txt (two windows of 512 tokens), scored with the protocol of models/ppl.py.
"""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

from pieceworks import Executor
from pieceworks.data import english_text
from pieceworks.models import ppl

pytestmark = pytest.mark.slow
TEXT = english_text()[:4000]


@pytest.fixture(scope="module")
def bf16_dir():
    smollm2 = pytest.importorskip("pieceworks.models.smollm2")
    try:
        return smollm2.ensure_smollm2(progress=False)
    except smollm2.SmolLM2NotInstalled as exc:
        pytest.skip(str(exc))


@functools.cache  # the bf16 model's values serve two tests each: computed once per session
def pieceworks_ppl(model_dir, kv_dtype: str | None = None, fp4_numerics: str | None = None) -> float:
    quant = {"fp4_numerics": fp4_numerics} if fp4_numerics else {}
    kv_cache = {"dtype": kv_dtype} if kv_dtype else {}
    ex = Executor.from_config({"model": {"path": str(model_dir)}, "quantization": quant,
                               "runtime": {"device": "cpu", "dtype": "float32"}, "kv_cache": kv_cache},
                              progress=False)
    ids = ex.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    chunks = ppl.windows(ids, 512)
    value, scored = ppl.perplexity_from_logits(ex.score(chunks), chunks)
    assert scored == len(ids) - len(chunks)
    return value


@functools.cache
def transformers_ppl(model_dir) -> float:
    return ppl.reference_perplexity_transformers(model_dir, TEXT, window=512).ppl


def test_bf16_perplexity_matches_transformers(bf16_dir):
    ref = transformers_ppl(bf16_dir)
    ours = pieceworks_ppl(bf16_dir)
    print(f"SmolLM2-135M bf16 weights, fp32 compute: pieceworks {ours:.4f}, transformers {ref:.4f}")
    assert 5 < ref < 100, "a sane perplexity for English text"
    assert abs(ours / ref - 1) < 0.005


def _dequantized_copy(fp4_dir, bf16_dir, out_dir):
    """bf16_dir's checkpoint with every NVFP4 linear of fp4_dir replaced by its dequantized values."""
    from safetensors.torch import load_file, save_file

    from pieceworks.models.checkpoint import CheckpointReader
    from pieceworks.quant import nvfp4

    reader = CheckpointReader(fp4_dir)
    weights = {k: v.float() for k, v in load_file(str(bf16_dir / "model.safetensors")).items()}
    replaced = 0
    for name in reader.names():
        if name.endswith(".weight_scale"):
            prefix = name[: -len(".weight_scale")]
            weights[prefix + ".weight"] = nvfp4.dequantize(
                reader.get(prefix + ".weight"), reader.get(name), reader.get(prefix + ".weight_scale_2"))
            replaced += 1
    out_dir.mkdir()
    save_file(weights, str(out_dir / "model.safetensors"))
    for f in bf16_dir.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out_dir / f.name)
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(cfg))
    return replaced


def test_nvfp4_perplexity_matches_dequantized_transformers(bf16_dir, tmp_path):
    from pieceworks.models import smollm2

    fp4_dir = smollm2.ensure_smollm2_fp4(progress=False)
    assert _dequantized_copy(fp4_dir, bf16_dir, tmp_path / "deq") == 30 * 7  # q,k,v,o,gate,up,down
    ref = ppl.reference_perplexity_transformers(tmp_path / "deq", TEXT, window=512).ppl
    bf16 = transformers_ppl(bf16_dir)
    w4a16 = pieceworks_ppl(fp4_dir, fp4_numerics="w4a16")
    w4a4 = pieceworks_ppl(fp4_dir, fp4_numerics="w4a4")
    print(f"SmolLM2-135M NVFP4: transformers bf16 {bf16:.3f}, transformers dequantized-NVFP4 {ref:.3f}, "
          f"pieceworks w4a16 {w4a16:.3f} ({100 * (w4a16 / ref - 1):+.2f}%), "
          f"pieceworks w4a4 {w4a4:.3f} ({100 * (w4a4 / w4a16 - 1):+.2f}% over w4a16)")
    assert abs(w4a16 / ref - 1) < 0.03
    assert w4a16 > bf16 * 1.01, "NVFP4 costs a 135M model real accuracy: equality would mean no quantization"
    assert torch.isfinite(torch.tensor(w4a4)) and w4a4 < 3 * w4a16


def test_fp8_kv_cache_perplexity(bf16_dir, tmp_path):
    """An FP8 KV cache on a real model: `pieceworks quantize --kv-cache fp8`'s calibrated scales, and scales of 1.0
    on the bf16 weights, each against the same weights with K/V in the model dtype (measured +1.5% / +2.2%). The
    calibration reads the bundled text's first 16,000 characters (CI time)."""
    from pieceworks.data import CALIBRATION_TXT
    from pieceworks.quant.quantizer import quantize_checkpoint

    calib = tmp_path / "calib.txt"
    calib.write_text(CALIBRATION_TXT.read_text(encoding="utf-8")[:16000], encoding="utf-8")
    fp4 = quantize_checkpoint(bf16_dir, tmp_path / "q", calib_text=calib, kv_cache="fp8", progress=False)
    full, fp8 = pieceworks_ppl(fp4, "model"), pieceworks_ppl(fp4)
    plain, plain_fp8 = pieceworks_ppl(bf16_dir), pieceworks_ppl(bf16_dir, "fp8")
    print(f"SmolLM2-135M FP8 KV: NVFP4 {full:.3f} -> {fp8:.3f} (calibrated scales), "
          f"bf16 weights {plain:.3f} -> {plain_fp8:.3f} (scales 1.0)")
    assert full < fp8 < full * 1.03 and plain < plain_fp8 < plain * 1.03
