"""pieceworks against NVIDIA ModelOpt on real exports of tiny Llama and DeepSeek-V3 models.

- Reading: every quantized linear read by `read_fp4_linear` and decoded by `nvfp4.dequantize` equals
  ModelOpt's own dequantization of the same export (`NVFP4QTensor.dequantize`), bit for bit.
- Writing: `quantize_checkpoint` on the same bf16 weights writes the same tensors (names, dtypes,
  shapes, bytes) and the same quantization configs as ModelOpt's export. input_scale depends on the
  activation source: with the activation amax measured on ModelOpt's own calibration batches it is
  bit-identical too; with a fixed amax it is amax / (6 * 448) everywhere.
"""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch

from pieceworks.models.checkpoint import CheckpointReader
from pieceworks.quant import nvfp4
from pieceworks.quant.calibrate import calibrate_input_amax, text_batches
from pieceworks.quant.modelopt import detect_quantization, fuse_fp4, read_fp4_experts, read_fp4_linear
from pieceworks.quant.quantizer import quantize_checkpoint
from pieceworks.version import __version__

MODELOPT = "needs nvidia-modelopt, the reference quantizer: pip install -e '.[test]'"

# Importing modelopt warns about the transformers version and its use of torch.jit: not ours.
pytestmark = [
    pytest.mark.filterwarnings("ignore:transformers .* is not tested:UserWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script:DeprecationWarning"),
]

MODELS = ["tiny_llama_modelopt", "tiny_deepseek_modelopt", "tiny_tied_llama_modelopt"]


@pytest.fixture(params=MODELS)
def export(request):
    return request.getfixturevalue(request.param)


def _quantized_modules(reader: CheckpointReader) -> list[str]:
    return [n[: -len(".weight_scale")] for n in reader.names() if n.endswith(".weight_scale")]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN-safe, works for float8)."""
    flat = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat(a), flat(b))


def _amax(model_dir, batches, dtype="auto", kv_amax=None) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, experts_implementation="eager")
    return calibrate_input_amax(model, batches, kv_amax)


# --- reading -------------------------------------------------------------------------------------


def test_export_layout_is_what_the_reader_expects(export):
    """The facts modelopt.py is written against, checked on the live export."""
    reader = CheckpointReader(export.fp4_dir)
    modules = _quantized_modules(reader)
    assert modules
    for m in modules:
        assert reader.dtype(f"{m}.weight") == torch.uint8
        assert reader.dtype(f"{m}.weight_scale") == torch.float8_e4m3fn
        assert reader.dtype(f"{m}.weight_scale_2") == torch.float32 and reader.shape(f"{m}.weight_scale_2") == ()
        assert reader.dtype(f"{m}.input_scale") == torch.float32 and reader.shape(f"{m}.input_scale") == ()
    hf = json.loads((export.fp4_dir / "hf_quant_config.json").read_text())["quantization"]
    assert hf["quant_algo"] == "NVFP4" and hf["group_size"] == 16 and hf["kv_cache_quant_algo"] is None
    qc = json.loads((export.fp4_dir / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["ignore"] == hf["exclude_modules"]


def test_reader_reproduces_modelopt_dequantization(export):
    NVFP4QTensor = pytest.importorskip("modelopt.torch.quantization.qtensor", reason=MODELOPT).NVFP4QTensor

    reader = CheckpointReader(export.fp4_dir)
    for m in _quantized_modules(reader):
        n, k2 = reader.shape(f"{m}.weight")
        w = read_fp4_linear(reader, m, in_features=2 * k2, out_features=n)
        ours = nvfp4.dequantize(w.weight, w.weight_scale, w.weight_scale_2)
        qt = NVFP4QTensor(torch.Size([n, 2 * k2]), torch.float32, w.weight)
        ref = qt.dequantize(
            dtype=torch.float32, scale=w.weight_scale, double_scale=w.weight_scale_2, block_sizes={-1: 16}
        )
        # Equal values. Bytes differ only in the sign of zero: code 8 decodes to -0.0 here (E2M1's
        # "-0"), to +0.0 in ModelOpt's table; no product or sum sees the difference.
        assert torch.equal(ours, ref), m
        differs = ours.view(torch.int32) != ref.view(torch.int32)
        assert bool((ours[differs] == 0).all()), m


def test_config_detection(export):
    cfg = detect_quantization(export.fp4_dir)
    hf = json.loads((export.fp4_dir / "hf_quant_config.json").read_text())
    assert cfg.exclude_modules == tuple(hf["quantization"]["exclude_modules"])
    assert cfg.is_excluded("lm_head") and cfg.is_excluded("model.embed_tokens")
    assert not cfg.is_excluded("model.layers.0.self_attn.o_proj")
    assert detect_quantization(export.bf16_dir) is None
    for m in _quantized_modules(CheckpointReader(export.fp4_dir)):
        assert not cfg.is_excluded(m), m


def test_fused_groups_share_scales_and_fuse_exactly(tiny_llama_modelopt):
    reader = CheckpointReader(tiny_llama_modelopt.fp4_dir)
    p = tiny_llama_modelopt.params
    hd = p["head_dim"]
    shapes = {"q_proj": p["num_attention_heads"] * hd, "k_proj": p["num_key_value_heads"] * hd}
    shapes["v_proj"] = shapes["k_proj"]
    mlp = dict.fromkeys(["gate_proj", "up_proj"], p["intermediate_size"])
    for layer in range(p["num_hidden_layers"]):
        for names, k, n_of in (
            (["q_proj", "k_proj", "v_proj"], p["hidden_size"], shapes),
            (["gate_proj", "up_proj"], p["hidden_size"], mlp),
        ):
            kind = "self_attn" if "q_proj" in names else "mlp"
            parts = [read_fp4_linear(reader, f"model.layers.{layer}.{kind}.{x}", k, n_of[x]) for x in names]
            fused = fuse_fp4(parts)
            assert fused is not None  # ModelOpt exports one weight_scale_2 and input_scale per group
            deq = lambda w: nvfp4.dequantize(w.weight, w.weight_scale, w.weight_scale_2)  # noqa: E731
            assert torch.equal(deq(fused), torch.cat([deq(x) for x in parts]))
    # Different global scales: no fusion (the model keeps separate linears).
    q = read_fp4_linear(reader, "model.layers.0.self_attn.q_proj", p["hidden_size"], shapes["q_proj"])
    assert fuse_fp4([q, q._replace(weight_scale_2=q.weight_scale_2 * 2)]) is None
    assert fuse_fp4([q, q._replace(input_scale=q.input_scale * 2)]) is None
    assert fuse_fp4([q, q]) is not None


def test_experts_stack_as_moe_weights(tiny_deepseek_modelopt):
    p = tiny_deepseek_modelopt.params
    reader = CheckpointReader(tiny_deepseek_modelopt.fp4_dir)
    e_count, h, i = p["n_routed_experts"], p["hidden_size"], p["moe_intermediate_size"]
    moe = read_fp4_experts(reader, "model.layers.1.mlp.experts.{e}", e_count, h, i)
    assert moe.is_fp4
    assert moe.w13.shape == (e_count, 2 * i, h // 2) and moe.w13_scale.shape == (e_count, 2 * i, h // 16)
    assert moe.w2.shape == (e_count, h, i // 2) and moe.w2_scale.shape == (e_count, h, i // 16)
    assert moe.w13_scale_2.shape == (e_count, 2) and moe.w13_input_scale.shape == (e_count,)
    assert moe.w2_scale_2.shape == (e_count,) and moe.w2_input_scale.shape == (e_count,)
    for e in range(e_count):
        gate = read_fp4_linear(reader, f"model.layers.1.mlp.experts.{e}.gate_proj", h, i)
        up = read_fp4_linear(reader, f"model.layers.1.mlp.experts.{e}.up_proj", h, i)
        assert torch.equal(moe.w13[e], torch.cat([gate.weight, up.weight]))
        assert torch.equal(moe.w13_scale_2[e], torch.stack([gate.weight_scale_2, up.weight_scale_2]))
        assert torch.equal(moe.w13_input_scale[e], torch.maximum(gate.input_scale, up.input_scale))
        assert torch.equal(gate.weight_scale_2, up.weight_scale_2)  # ModelOpt syncs each expert's gate/up


# --- writing -------------------------------------------------------------------------------------


def _assert_same_checkpoint(ours_dir, ref_dir, skip_suffix: str | None = None):
    ours, ref = CheckpointReader(ours_dir), CheckpointReader(ref_dir)
    assert set(ours.names()) == set(ref.names())
    for name in ref.names():
        if skip_suffix and name.endswith(skip_suffix):
            continue
        assert _same(ours.get(name), ref.get(name)), name


def test_quantizer_matches_modelopt_export_exactly(export, tmp_path):
    amax = _amax(export.bf16_dir, export.calibration_batches())
    out = quantize_checkpoint(export.bf16_dir, tmp_path / "q", input_amax=amax, progress=False)
    _assert_same_checkpoint(out, export.fp4_dir)  # every tensor, input_scale included
    ours = json.loads((out / "hf_quant_config.json").read_text())
    ref = json.loads((export.fp4_dir / "hf_quant_config.json").read_text())
    assert ours["quantization"] == ref["quantization"]
    assert ours["producer"] == {"name": "pieceworks", "version": __version__}
    ours_cfg = json.loads((out / "config.json").read_text())
    ref_cfg = json.loads((export.fp4_dir / "config.json").read_text())
    ours_cfg["quantization_config"].pop("producer")
    ref_cfg["quantization_config"].pop("producer")
    assert ours_cfg == ref_cfg


def test_quantizer_fp8_kv_cache_matches_modelopt_export_exactly(tiny_llama_fp8kv_modelopt, tmp_path):
    """`--kv-cache fp8` against ModelOpt's NVFP4 + FP8_KV_CFG export of the same weights and batches: every tensor
    (k_proj.k_scale / v_proj.v_scale included) and both config files (kv_cache_quant_algo, kv_cache_scheme)."""
    export, kv_amax = tiny_llama_fp8kv_modelopt, {}
    amax = _amax(export.bf16_dir, export.calibration_batches(), kv_amax=kv_amax)
    assert sorted(kv_amax) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert "get_interface" not in vars(ALL_ATTENTION_FUNCTIONS)  # the calibration's spy is gone
    out = quantize_checkpoint(export.bf16_dir, tmp_path / "q", input_amax=amax, kv_cache="fp8", kv_amax=kv_amax,
                              progress=False)
    _assert_same_checkpoint(out, export.fp4_dir)
    ref = json.loads((export.fp4_dir / "hf_quant_config.json").read_text())["quantization"]
    assert json.loads((out / "hf_quant_config.json").read_text())["quantization"] == ref
    ours_cfg, ref_cfg = (json.loads((d / "config.json").read_text())["quantization_config"]
                         for d in (out, export.fp4_dir))
    ours_cfg.pop("producer"), ref_cfg.pop("producer")
    assert ours_cfg == ref_cfg and ref_cfg["kv_cache_scheme"]["num_bits"] == 8
    with pytest.raises(ValueError, match="--kv-cache fp8 needs calibration: .* leave out --amax"):
        quantize_checkpoint(export.bf16_dir, tmp_path / "fixed", amax=12.0, kv_cache="fp8", progress=False)


def test_quantizer_fixed_amax(tiny_deepseek_modelopt, tmp_path):
    out = quantize_checkpoint(tiny_deepseek_modelopt.bf16_dir, tmp_path / "q", amax=12.0, progress=False)
    _assert_same_checkpoint(out, tiny_deepseek_modelopt.fp4_dir, skip_suffix=".input_scale")
    reader = CheckpointReader(out)
    expected = torch.tensor(12.0) / (6 * 448)
    for m in _quantized_modules(reader):
        assert torch.equal(reader.get(f"{m}.input_scale"), expected), m


def _with_word_tokenizer(src, tmp_path):
    """A word-level tokenizer saved into `src`, and a calibration text over its words: (tokenizer, text file)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(200)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "<s>"] + words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>")
    tokenizer.save_pretrained(src)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(words[(7 * i) % 200] for i in range(1500)))
    return tokenizer, text


def _cli(*argv) -> int:
    from pieceworks.quant import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["quantize", *map(str, argv)])
    return args.func(args)


def test_quantizer_calibrates_over_text_and_cli_writes_shards(tiny_llama_modelopt, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_llama_modelopt.bf16_dir, src)
    tokenizer, text = _with_word_tokenizer(src, tmp_path)
    assert _cli(src, tmp_path / "q", "--calib-text", text, "--max-shard-size", "40KB", "--no-progress") == 0
    out = tmp_path / "q"
    assert (out / "model.safetensors.index.json").exists() and not (out / "model.safetensors").exists()
    assert (out / "tokenizer.json").exists()
    _assert_same_checkpoint(out, tiny_llama_modelopt.fp4_dir, skip_suffix=".input_scale")
    seq_len = tiny_llama_modelopt.params["max_position_embeddings"]  # calibration caps chunks at it
    # calibrate_from_text runs float32 on a CPU (bf16 on CUDA)
    dtype = "auto" if torch.cuda.is_available() else torch.float32
    amax = _amax(src, text_batches(tokenizer, text.read_text(), seq_len), dtype)
    reader = CheckpointReader(out)
    for m in _quantized_modules(reader):
        assert torch.equal(reader.get(f"{m}.input_scale"), torch.tensor(amax[m]) / (6 * 448)), m


def test_quantize_cli_kv_cache_fp8_calibrates_kv_scales_over_text(tiny_llama_modelopt, tiny_deepseek_modelopt,
                                                                   tmp_path):
    """`pieceworks quantize --kv-cache fp8`: each layer's k_scale / v_scale is the keys' / values' amax over the
    text / 448, and pieceworks serves the result from an e4m3 pool with them; MLA models are refused."""
    from pieceworks import Executor

    src = tmp_path / "src"
    shutil.copytree(tiny_llama_modelopt.bf16_dir, src)
    tokenizer, text = _with_word_tokenizer(src, tmp_path)
    assert _cli(src, tmp_path / "q", "--calib-text", text, "--kv-cache", "fp8", "--no-progress") == 0
    kv_amax = {}
    dtype = "auto" if torch.cuda.is_available() else torch.float32
    _amax(src, text_batches(tokenizer, text.read_text(), tiny_llama_modelopt.params["max_position_embeddings"]),
          dtype, kv_amax)
    reader = CheckpointReader(tmp_path / "q")
    want = []
    for layer, (k, v) in sorted(kv_amax.items()):
        for name, a in ((f"{layer}.k_proj.k_scale", k), (f"{layer}.v_proj.v_scale", v)):
            assert torch.equal(reader.get(name), torch.tensor(a) / 448), name
        want.append((float(torch.tensor(k) / 448), float(torch.tensor(v) / 448)))
    ex = Executor.from_config({"model": {"path": str(tmp_path / "q")}, "runtime": {"device": "cpu"},
                               "kv_cache": {"num_tokens": 64}}, progress=False)
    assert ex.kv.dtype == torch.float8_e4m3fn and ex.kv.scales == want
    with pytest.raises(ValueError, match="MLA attention"):
        _cli(tiny_deepseek_modelopt.bf16_dir, tmp_path / "ds", "--calib-text", text, "--kv-cache", "fp8")


def test_exclude_list_is_summarized_as_modelopt_does():
    quant_utils = pytest.importorskip("modelopt.torch.export.quant_utils", reason=MODELOPT)
    _prefix_wildcard_summarize_exclude_modules = quant_utils._prefix_wildcard_summarize_exclude_modules

    from pieceworks.quant.export_config import summarize_exclude

    layers = [f"model.layers.{i}" for i in range(12)]
    linears = ["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj", "mlp.gate"]
    names = lambda lays, xs: {f"{lay}.{x}" for lay in lays for x in xs}  # noqa: E731
    cases = [  # (quantized, unquantized)
        (names(layers, linears[:4]), {"lm_head", "model.embed_tokens"}),  # a dense model
        (names(layers[2:], linears), names(layers[:2], linears)),  # whole layers excluded
        (names(layers[:11], linears[:4]), names(layers[11:], linears) | {"lm_head"}),  # an MTP-like last layer
        (names(layers, linears[:3]), names(layers, linears[3:])),  # some linears in every layer
    ]
    for quantized, unquantized in cases:
        ours = summarize_exclude(sorted(unquantized), sorted(quantized))
        assert ours == sorted(_prefix_wildcard_summarize_exclude_modules(sorted(unquantized), sorted(quantized)))


def test_exclude_patterns_and_mtp_layers(tiny_deepseek_modelopt, tmp_path):
    """Excluded modules stay in the source dtype and the written exclude list says exactly which."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(tiny_deepseek_modelopt.bf16_dir, src)
    tensors = load_file(src / "model.safetensors")
    n_layers = tiny_deepseek_modelopt.params["num_hidden_layers"]
    mtp = f"model.layers.{n_layers}"  # a DeepSeek MTP layer: in the checkpoint, beyond num_hidden_layers
    tensors[f"{mtp}.eh_proj.weight"] = torch.randn(64, 128).to(torch.bfloat16)
    tensors[f"{mtp}.enorm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})

    out = quantize_checkpoint(
        src, tmp_path / "q", amax=4.0, exclude=["model.layers.1.self_attn.*"], progress=False
    )
    cfg = detect_quantization(out)
    assert f"{mtp}*" in cfg.exclude_modules and "model.layers.1.self_attn*" in cfg.exclude_modules  # summarized
    reader = CheckpointReader(out)
    for name in reader.names():
        if name.endswith(".weight") and len(reader.shape(name)) == 2:
            module = name[: -len(".weight")]
            stored_fp4 = reader.dtype(name) == torch.uint8
            assert stored_fp4 != cfg.is_excluded(module), module
            if not stored_fp4:
                assert torch.equal(reader.get(name), tensors[name]), name  # passed through unchanged
    assert reader.dtype("model.layers.1.self_attn.q_a_proj.weight") == torch.bfloat16
    assert reader.dtype("model.layers.2.self_attn.q_a_proj.weight") == torch.uint8
