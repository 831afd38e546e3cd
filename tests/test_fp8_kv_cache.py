"""FP8 KV caches: `kv_cache.dtype`, ModelOpt checkpoints that ask for one (kv_cache_quant_algo FP8, per-layer
k_scale / v_scale), the pool's bytes, and the executor's steps over it (the attention backends' numerics are the
conformance suite's `test_attention_fp8_kv`)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file

from pieceworks import Executor
from pieceworks.core.batch import ForwardBatch
from pieceworks.core.kv import KV_FP8, dequantize_kv, quantize_kv
from pieceworks.errors import CheckpointError, ConfigError
from pieceworks.quant.modelopt import detect_quantization

try:  # `python -m pytest` puts the repository root on sys.path, plain `pytest` puts tests/
    from tests.helpers.checkpoint_edits import edit_json, edit_tensors
except ImportError:
    from helpers.checkpoint_edits import edit_json, edit_tensors

MODELOPT = "needs nvidia-modelopt, the reference quantizer: pip install -e '.[test]'"

CPU = {"runtime": {"device": "cpu", "dtype": "float32"}}


@pytest.fixture
def ckpt(tiny_llama_modelopt, tmp_path):
    """ModelOpt's tiny Llama export asking for an FP8 KV cache, with k_scale / v_scale in every layer (ModelOpt's
    names), distinct per layer."""
    d = tmp_path / "fp4"
    shutil.copytree(tiny_llama_modelopt.fp4_dir, d)
    edit_json(d / "hf_quant_config.json", lambda q: q["quantization"].update({"kv_cache_quant_algo": "FP8"}))
    edit_tensors(d, lambda t: t.update({name: torch.tensor(s * (i + 1)) for i in range(_num_layers(d))
                                        for name, s in ((f"model.layers.{i}.self_attn.k_proj.k_scale", 0.02),
                                                        (f"model.layers.{i}.self_attn.v_proj.v_scale", 0.03))}))
    return d


def _num_layers(d) -> int:
    return json.loads((d / "config.json").read_text())["num_hidden_layers"]


def _executor(path, **kv_cache) -> Executor:
    return Executor.from_config({"model": {"path": str(path)}, **CPU,
                                 "kv_cache": {"num_tokens": 256, "page_size": 4, **kv_cache}}, progress=False)


def test_quantize_kv_saturates_and_rounds_to_e4m3():
    x = torch.tensor([1.0, -1000.0, 1000.0, 0.3, 0.0])
    q = quantize_kv(x, 0.5)
    assert q.dtype == KV_FP8
    assert dequantize_kv(q, 0.5).tolist() == [1.0, -224.0, 224.0, 0.3125, 0.0]  # 2.0, -448, 448, 0.625 (e4m3), 0


def test_quantize_kv_equals_modelopt_e4m3_fake_quantization():
    """What a pool stores and reads back equals ModelOpt's FP8 KV quantizer (num_bits (4, 3), per tensor) with
    amax = 448 x scale, the calibration its exported k_scale / v_scale come from: values past amax saturate."""
    config = pytest.importorskip("modelopt.torch.quantization.config", reason=MODELOPT)
    from modelopt.torch.quantization.nn import TensorQuantizer

    QuantizerAttributeConfig = config.QuantizerAttributeConfig

    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 3
    quantizer = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3), axis=None))
    quantizer.amax = torch.tensor(5.0)
    assert (x.abs() > 5.0).any()
    scale = 5.0 / 448
    assert torch.equal(dequantize_kv(quantize_kv(x, scale), scale), quantizer(x))


def test_modelopt_fp8_kv_checkpoint_serves_from_an_fp8_pool_with_its_scales(ckpt):
    assert detect_quantization(ckpt).kv_cache_quant_algo == "FP8"
    ex = _executor(ckpt)
    n = _num_layers(ckpt)
    assert ex.kv.dtype == KV_FP8 and ex.kv.buffer.dtype == KV_FP8
    assert ex.kv.scales == [(pytest.approx(0.02 * (i + 1)), pytest.approx(0.03 * (i + 1))) for i in range(n)]
    same = _executor(ckpt, dtype="model")  # the checkpoint's ask overridden: the model dtype, and twice the bytes
    assert same.kv.dtype == torch.float32 and same.kv.buffer.element_size() == 4 * ex.kv.buffer.element_size()
    prompt = torch.randint(0, 128, (19,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = ex.score([prompt])[0]
    seq = ex.new_sequence()  # chunks and decodes read back what earlier steps stored
    parts = [ex.forward(ForwardBatch([seq], [prompt[:7]], return_all_logits=True)),
             ex.forward(ForwardBatch([seq], [prompt[7:15]], return_all_logits=True))]
    parts += [ex.forward(ForwardBatch([seq], [[t]])) for t in prompt[15:]]
    torch.testing.assert_close(torch.cat([parts[0], parts[1], *[p.view(1, -1) for p in parts[2:]]]), whole,
                               rtol=1e-5, atol=1e-5)
    # the stored keys are the quantized ones: different from the model-dtype pool's by the e4m3 rounding only
    diff = (same.score([prompt])[0] - whole).abs().max()
    assert 0 < diff < 0.1 * whole.abs().max()


def test_modelopt_own_fp8_kv_export_loads_its_scales(tiny_llama_fp8kv_modelopt):
    """ModelOpt's export with its FP8 KV cache (hf_quant_config kv_cache_quant_algo FP8, config.json kv_cache_scheme
    float 8-bit, calibrated k_proj.k_scale / v_proj.v_scale per layer): the pool is e4m3 with exactly those scales,
    every tensor is read (no unused one), and chunked steps agree with one prefill."""
    d = tiny_llama_fp8kv_modelopt.fp4_dir
    tensors = load_file(d / "model.safetensors")
    want = [(float(tensors[f"model.layers.{i}.self_attn.k_proj.k_scale"]),
             float(tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"])) for i in range(_num_layers(d))]
    assert all(0 < k < 1 and 0 < v < 1 and (k, v) != (1.0, 1.0) for k, v in want)  # calibrated amax / 448
    ex = _executor(d)
    assert ex.kv.dtype == KV_FP8 and ex.kv.scales == want
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    seq = ex.new_sequence()
    first = ex.forward(ForwardBatch([seq], [prompt[:5]], return_all_logits=True))
    rest = ex.forward(ForwardBatch([seq], [prompt[5:]], return_all_logits=True))
    torch.testing.assert_close(torch.cat([first, rest]), ex.score([prompt])[0], rtol=1e-5, atol=1e-5)


def test_fp8_kv_checkpoint_without_scales_runs_at_scale_one_and_says_so(ckpt, caplog):
    _edit_tensors_drop(ckpt, ("k_scale", "v_scale"))
    with caplog.at_level(logging.WARNING, logger="pieceworks.executor"):
        ex = _executor(ckpt)
    assert ex.kv.dtype == KV_FP8 and ex.kv.scales == [(1.0, 1.0)] * _num_layers(ckpt)
    assert "holds no k_scale / v_scale: scales of 1.0" in caplog.text


def _edit_tensors_drop(d, endings, layers=None):
    def drop(tensors):
        for name in [n for n in tensors if n.endswith(endings)]:
            if layers is None or int(name.split(".")[2]) in layers:
                del tensors[name]

    edit_tensors(d, drop)


def test_fp8_kv_scales_missing_in_one_layer_are_refused(ckpt):
    _edit_tensors_drop(ckpt, ("k_scale", "v_scale"), layers={1})
    with pytest.raises(CheckpointError, match=r"FP8 KV scales .* in 1 layers but not in layer\(s\) \[1\]"):
        _executor(ckpt)


def test_fp8_kv_scales_of_a_layer_whose_attention_is_excluded_are_one(ckpt, caplog):
    """ModelOpt calibrates no KV scales for a layer whose attention it leaves unquantized (exclude_modules): that
    layer takes scales of 1.0 with a warning; the other layers keep theirs."""
    want = _executor(ckpt).kv.scales
    _edit_tensors_drop(ckpt, ("k_scale", "v_scale"), layers={1})
    edit_json(ckpt / "hf_quant_config.json",
              lambda q: q["quantization"]["exclude_modules"].append("model.layers.1.self_attn*"))
    with caplog.at_level(logging.WARNING, logger="pieceworks.quant.modelopt"):
        # layer 1's input_scales stay unread: its attention loads dense (its NVFP4 weights dequantized)
        ex = Executor.from_config({"model": {"path": str(ckpt), "allow_extra_tensors": True}, **CPU,
                                   "kv_cache": {"num_tokens": 256, "page_size": 4}}, progress=False)
    assert ex.kv.scales == [want[0], (1.0, 1.0), *want[2:]] and want[1] != (1.0, 1.0)
    assert "layer(s) [1] keep their attention unquantized (exclude_modules) and have no FP8 KV scales" in caplog.text


def test_fp8_kv_layer_with_a_k_scale_but_no_v_scale_is_refused(ckpt):
    _edit_tensors_drop(ckpt, ("v_scale",), layers={0})
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.k_proj.k_scale is there but "
                                              r"model.layers.0.self_attn.v_proj.v_scale is not"):
        _executor(ckpt)


@pytest.mark.parametrize("bad", [0.0, -0.5, float("inf")])
def test_fp8_kv_scale_that_is_not_positive_and_finite_is_refused(ckpt, bad):
    edit_tensors(ckpt, lambda t: t.update({"model.layers.0.self_attn.v_proj.v_scale": torch.tensor(bad)}))
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.v_proj.v_scale: must be a positive finite"):
        _executor(ckpt)


def test_other_kv_cache_quantization_is_refused_by_name(ckpt):
    edit_json(ckpt / "hf_quant_config.json", lambda q: q["quantization"].update({"kv_cache_quant_algo": "INT8"}))
    with pytest.raises(CheckpointError, match=r"kv_cache_quant_algo = 'INT8': pieceworks serves a KV cache in the "
                                              r"model dtype or in FP8"):
        detect_quantization(ckpt)


def test_kv_cache_dtype_fp8_on_random_weights_and_a_bad_value():
    tiny = {"model": {"arch": "llama", "preset": "tiny"}, **CPU}
    ex = Executor.from_config({**tiny, "kv_cache": {"num_tokens": 64, "page_size": 4, "dtype": "fp8"}}, progress=False)
    assert ex.kv.dtype == KV_FP8 and ex.kv.scales == [(1.0, 1.0)] * len(ex.model.layers)
    auto = Executor.from_config({**tiny, "kv_cache": {"num_tokens": 64, "page_size": 4}}, progress=False)
    assert auto.kv.dtype == torch.float32  # no checkpoint asks: the model dtype
    with pytest.raises(ConfigError, match=r"kv_cache.dtype: 'int8'.*auto, model, fp8"):
        Executor.from_config({**tiny, "kv_cache": {"dtype": "int8"}}, progress=False)


def test_mla_keeps_its_latents_in_the_model_dtype_under_auto_and_refuses_fp8(tiny_deepseek_modelopt, tmp_path,
                                                                             caplog):
    d = tmp_path / "ds"
    shutil.copytree(tiny_deepseek_modelopt.fp4_dir, d)
    edit_json(d / "hf_quant_config.json", lambda q: q["quantization"].update({"kv_cache_quant_algo": "FP8"}))
    with caplog.at_level(logging.WARNING, logger="pieceworks.executor"):
        ex = _executor(d)
    assert ex.kv.dtype == torch.float32 and "no MLA backend reads FP8 latents" in caplog.text
    with pytest.raises(Exception, match=r"no FP8 KV cache \(MLA latents stay in the model dtype"):
        _executor(d, dtype="fp8")


def test_backends_report_sees_the_pool_the_run_would_build(ckpt, tiny_deepseek_modelopt):
    """`pieceworks backends` judges the backends against the KV dtype the executor would pick, without loading."""
    from pieceworks.config import load_config
    from pieceworks.report import _model_facts

    def facts(path, dtype):
        return _model_facts(load_config({"model": {"path": str(path)}, **CPU, "kv_cache": {"dtype": dtype}}))[0]

    assert facts(ckpt, "auto").kv_fp8 and not facts(ckpt, "model").kv_fp8
    mla = tiny_deepseek_modelopt.fp4_dir
    assert not facts(mla, "auto").kv_fp8 and facts(mla, "fp8").kv_fp8
