"""Broken or unsupported checkpoints fail with errors that name the file, tensor or field."""

from __future__ import annotations

import logging
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pieceworks.errors import CheckpointError
from pieceworks.models import loader as loader_module
from pieceworks.models.checkpoint import CheckpointReader
from pieceworks.quant.modelopt import detect_quantization, read_fp4_linear
from pieceworks.quant.quantizer import quantize_checkpoint

try:  # `python -m pytest` puts the repository root on sys.path, plain `pytest` puts tests/
    from tests.helpers.checkpoint_edits import edit_json as _edit_json, edit_tensors as _edit_tensors
    from tests.helpers.smollm2_files import copy_tokenizer, smollm2_dir
except ImportError:
    from helpers.checkpoint_edits import edit_json as _edit_json, edit_tensors as _edit_tensors
    from helpers.smollm2_files import copy_tokenizer, smollm2_dir

Q = "model.layers.0.self_attn.q_proj"  # [64 out, 64 in] in the tiny Llama


@pytest.fixture
def ckpt(tiny_llama_modelopt, tmp_path):
    """A private copy of ModelOpt's tiny Llama export, free to break."""
    d = tmp_path / "fp4"
    shutil.copytree(tiny_llama_modelopt.fp4_dir, d)
    return d


def _read_q(d):
    return read_fp4_linear(CheckpointReader(d), Q, in_features=64, out_features=64)


# --- files ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [0.5, 0.999, 10])
def test_truncated_safetensors(ckpt, keep):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)] if keep < 1 else data[:keep])
    with pytest.raises(ValueError) as e:
        CheckpointReader(ckpt)
    assert str(path) in str(e.value) and "truncated or corrupt" in str(e.value)
    assert "re-download or re-export" in str(e.value)


def _shard(d, names_per_shard):
    """Split the single file into shards with an index."""
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    weight_map = {}
    for i, names in enumerate(names_per_shard):
        fname = f"model-{i + 1:05d}-of-{len(names_per_shard):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, d / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sorted(tensors)


def test_sharded_checkpoint_reads_like_one_file(ckpt, tiny_llama_modelopt):
    tensors = load_file(ckpt / "model.safetensors")
    all_names = sorted(tensors)
    _shard(ckpt, [all_names[:20], all_names[20:]])
    reader = CheckpointReader(ckpt)
    assert sorted(reader.names()) == all_names and reader.has(f"{Q}.weight") and not reader.has("nope")
    for n in all_names:
        assert reader.get(n).shape == tensors[n].shape and reader.dtype(n) == tensors[n].dtype
    assert len({reader.file_of(n) for n in all_names}) == 2
    with pytest.raises(KeyError, match="nope"):
        reader.get("nope")


def test_index_pointing_to_a_missing_shard(ckpt):
    names = sorted(load_file(ckpt / "model.safetensors"))
    _shard(ckpt, [names[:20], names[20:]])
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError) as e:
        CheckpointReader(ckpt)
    msg = str(e.value)
    assert "model.safetensors.index.json" in msg and "model-00002-of-00002.safetensors" in msg
    assert "re-download" in msg


@pytest.mark.parametrize("value, needle", [
    (5, "is 5, not a shard file name"),
    ("../elsewhere/model.safetensors", "names '../elsewhere/model.safetensors', outside the model directory"),
])
def test_index_entry_that_is_no_shard_name(ckpt, value, needle):
    names = sorted(load_file(ckpt / "model.safetensors"))
    _shard(ckpt, [names[:20], names[20:]])
    _edit_json(ckpt / "model.safetensors.index.json", lambda c: c["weight_map"].update({names[0]: value}))
    with pytest.raises(CheckpointError, match=rf"model.safetensors.index.json: weight_map\[{names[0]!r}\] {needle}"):
        CheckpointReader(ckpt)


def test_truncated_shard_fails_when_the_reader_opens(ckpt):
    names = sorted(load_file(ckpt / "model.safetensors"))
    _shard(ckpt, [names[:20], names[20:]])
    shard = ckpt / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])
    with pytest.raises(ValueError, match=rf"{shard}: not a readable safetensors file, truncated or corrupt"):
        CheckpointReader(ckpt)


def test_index_entry_that_the_shard_lacks(ckpt):
    names = sorted(load_file(ckpt / "model.safetensors"))
    _shard(ckpt, [names[:20], names[20:]])
    ghost = {"ghost.weight": "model-00001-of-00002.safetensors"}
    _edit_json(ckpt / "model.safetensors.index.json", lambda d: d["weight_map"].update(ghost))
    with pytest.raises(ValueError, match=r"model-00001-of-00002.safetensors: lacks 1 tensor.*ghost.weight"):
        CheckpointReader(ckpt)


def test_shard_tensors_the_index_does_not_map_there(ckpt):
    """A shard's tensor that the index lists in another shard (a second copy: pieceworks read the index's,
    transformers the other) is refused, naming both files; one the index does not list is read as the shard's, so
    a tensor the model does not use is refused as a listed one is."""
    names = sorted(load_file(ckpt / "model.safetensors"))
    _shard(ckpt, [names[:20], names[20:]])
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    second = ckpt / "model-00002-of-00002.safetensors"
    tensors = load_file(second)
    save_file({**tensors, names[0]: torch.zeros(3)}, second, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(names[0])} is in both model-00002-of-00002"
                                              r"\.safetensors and model-00001-of-00002\.safetensors"):
        CheckpointReader(ckpt)
    save_file({**tensors, "model.layers.0.self_attn.q_proj.bias": torch.zeros(3)}, second, metadata={"format": "pt"})
    reader = CheckpointReader(ckpt)
    assert reader.file_of("model.layers.0.self_attn.q_proj.bias") == second.name
    assert sorted(reader.names()) == sorted(names + ["model.layers.0.self_attn.q_proj.bias"])
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) the model does not use: model\.layers\.0\.self_attn"
                                              r"\.q_proj\.bias"):
        _load(ckpt)
    assert json.loads((ckpt / "model.safetensors.index.json").read_text()) == index


def test_a_weights_file_that_is_a_dangling_symlink(ckpt, tmp_path):
    """A Hugging Face cache whose blob is gone: the link is named with where it points (it was "no
    model.safetensors")."""
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").symlink_to(tmp_path / "blob")
    with pytest.raises(CheckpointError, match=rf"model.safetensors: a symlink to {tmp_path / 'blob'}, which does not "
                                              "exist; re-download the model"):
        _load(ckpt)


def test_a_weights_file_that_is_a_fifo(ckpt):
    """Opening a FIFO blocks until a writer comes: refused as no regular file instead."""
    import os

    (ckpt / "model.safetensors").unlink()
    os.mkfifo(ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a regular file; re-download"):
        _load(ckpt)


def test_model_path_that_is_not_a_directory(tmp_path):
    from pieceworks.models.demo import resolve_model_path

    (tmp_path / "model.safetensors").write_bytes(b"")
    for path in (tmp_path / "nowhere", tmp_path / "model.safetensors"):
        with pytest.raises(CheckpointError) as e:
            resolve_model_path(str(path))
        assert str(e.value).startswith(f"model.path={str(path)!r} is not a directory; give a Hugging Face")
        assert "smollm2-135m" in str(e.value)


def test_no_checkpoint_and_bad_config(tmp_path):
    with pytest.raises(ValueError, match="no model.safetensors or model.safetensors.index.json"):
        CheckpointReader(tmp_path)
    save_file({"x": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="config.json: missing"):
        CheckpointReader(tmp_path).config()


# --- tensors -------------------------------------------------------------------------------------


def test_the_intact_copy_reads(ckpt):
    w = _read_q(ckpt)
    assert w.weight.shape == (64, 32) and w.weight_scale_2.shape == () and w.input_scale.shape == ()


def test_missing_weight_scale(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop(f"{Q}.weight_scale"))
    with pytest.raises(CheckpointError) as e:
        _read_q(ckpt)
    assert str(e.value).startswith(f"{Q}.weight_scale: missing from the checkpoint")
    assert "exclude_modules" in str(e.value)


def test_wrong_dtype(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({f"{Q}.weight_scale": t[f"{Q}.weight_scale"].float()}))
    with pytest.raises(CheckpointError) as e:
        _read_q(ckpt)
    assert str(e.value) == f"{Q}.weight_scale: expected float8_e4m3fn [64, 4], got float32 [64, 4]"
    # an MX format's power-of-two scales (F8_E8M0) are read, so that they are named as such
    _edit_tensors(ckpt, lambda t: t.update({f"{Q}.weight_scale": t[f"{Q}.weight_scale"].to(torch.float8_e8m0fnu)}))
    with pytest.raises(CheckpointError, match=rf"{Q}.weight_scale: expected float8_e4m3fn \[64, 4\], got "
                                              r"float8_e8m0fnu \[64, 4\]"):
        _read_q(ckpt)


def test_unquantized_weight_where_fp4_is_expected(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({f"{Q}.weight": torch.zeros(64, 64, dtype=torch.bfloat16)}))
    expected = rf"{Q}.weight: expected uint8 \[64, 32\], got bfloat16 \[64, 64\].*exclude_modules"
    with pytest.raises(CheckpointError, match=expected):
        _read_q(ckpt)


def test_wrong_shape(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({f"{Q}.weight": t[f"{Q}.weight"][:, :16].contiguous()}))
    with pytest.raises(CheckpointError) as e:
        _read_q(ckpt)
    assert str(e.value) == f"{Q}.weight: expected uint8 [64, 32], got uint8 [64, 16]"


def test_global_scale_must_be_a_positive_scalar(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({f"{Q}.weight_scale_2": torch.zeros(2)}))
    expected = rf"{Q}.weight_scale_2: expected float32 scalar \(\[\] or \[1\]\), got float32 \[2\]"
    with pytest.raises(CheckpointError, match=expected):
        _read_q(ckpt)
    _edit_tensors(ckpt, lambda t: t.update({f"{Q}.weight_scale_2": torch.tensor([float("nan")])}))
    with pytest.raises(CheckpointError, match=rf"{Q}.weight_scale_2: must be a positive finite float32 .*, got nan"):
        _read_q(ckpt)
    _edit_tensors(ckpt, lambda t: t.update({f"{Q}.weight_scale_2": torch.tensor([1e30])}))  # dense would refuse it
    with pytest.raises(CheckpointError, match=rf"{Q}.weight_scale_2: 1e\+30 lets its weights reach 2.69e\+33, beyond"):
        _read_q(ckpt)
    _edit_tensors(ckpt, lambda t: t.update({f"{Q}.weight_scale_2": torch.tensor([0.5])}))  # shape [1] is fine
    assert _read_q(ckpt).weight_scale_2.shape == ()
    _edit_tensors(ckpt, lambda t: t.update({f"{Q}.input_scale": torch.tensor(1e-40)}))  # subnormal: W4A4 makes NaN
    with pytest.raises(CheckpointError, match=rf"{Q}.input_scale: must be a positive finite float32 of at least"):
        _read_q(ckpt)
    _edit_tensors(ckpt, lambda t: t.update({f"{Q}.input_scale": torch.tensor(0.01)}))


# --- quantization configs ------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["FP8", "NVFP4_AWQ", "W4A8_AWQ", "W4A16_NVFP4", "MIXED_PRECISION", None])
def test_unknown_quant_algo(ckpt, algo):
    _edit_json(ckpt / "hf_quant_config.json", lambda d: d["quantization"].update({"quant_algo": algo}))
    with pytest.raises(CheckpointError) as e:
        detect_quantization(ckpt)
    assert str(e.value).startswith(f"{ckpt / 'hf_quant_config.json'}: quantization.quant_algo = {algo!r}")


def test_mixed_precision_names_the_formats_of_its_layers(ckpt):
    layers = {"model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"},
              "model.layers.0.mlp.down_proj": {"quant_algo": "NVFP4", "group_size": 16}}
    _edit_json(ckpt / "hf_quant_config.json",
               lambda d: d["quantization"].update({"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}))
    expected = r"quant_algo = 'MIXED_PRECISION' \(its quantized_layers hold FP8, NVFP4\): pieceworks serves ModelOpt"
    with pytest.raises(CheckpointError, match=expected):
        detect_quantization(ckpt)


def test_quant_algo_in_lower_case(ckpt):
    want = detect_quantization(ckpt)
    _edit_json(ckpt / "hf_quant_config.json", lambda d: d["quantization"].update({"quant_algo": "nvfp4"}))
    assert detect_quantization(ckpt) == want


def test_excluded_modules_stored_in_nvfp4_load_dequantized_with_a_warning(ckpt, caplog):
    """exclude_modules naming layer 1's attention whose export is NVFP4 all the same: the model holds those four
    projections as plain weights, dequantized (right numbers, 4x the memory), and says so once."""
    with caplog.at_level(logging.WARNING, logger="pieceworks.loader"):
        _load(ckpt)
    assert "dequantized" not in caplog.text
    _edit_json(ckpt / "hf_quant_config.json",
               lambda d: d["quantization"]["exclude_modules"].append("model.layers.1.self_attn*"))
    with caplog.at_level(logging.WARNING, logger="pieceworks.loader"):
        _load(ckpt, allow_extra=True)  # their input_scales stay unread
    assert "4 module(s) stored in NVFP4 are loaded dequantized" in caplog.text
    assert "model.layers.1.self_attn.q_proj, model.layers.1.self_attn.k_proj, model.layers.1.self_attn.v_proj, ..." \
        in caplog.text


def test_group_size_32(ckpt):
    _edit_json(ckpt / "hf_quant_config.json", lambda d: d["quantization"].update({"group_size": 32}))
    expected = r"hf_quant_config.json: quantization.group_size = 32: NVFP4 uses one scale per 16"
    with pytest.raises(CheckpointError, match=expected):
        detect_quantization(ckpt)


def test_group_size_32_in_config_groups(ckpt):
    (ckpt / "hf_quant_config.json").unlink()
    _edit_json(
        ckpt / "config.json",
        lambda d: d["quantization_config"]["config_groups"]["group_0"]["weights"].update({"group_size": 32}),
    )
    with pytest.raises(CheckpointError, match=r"config groups disagree on group_size.*weights.group_size = 32"):
        detect_quantization(ckpt)


@pytest.mark.parametrize("edit, needle", [
    (lambda q: q.update(config_groups=[{"weights": {"group_size": 16}}]),
     r"quantization_config.config_groups: \[.*\] must be an object of named groups"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=[16]),
     r"config_groups.group_0.weights.group_size: \[16\] must be a number \(16 for NVFP4\)")])
def test_config_groups_of_another_type(ckpt, edit, needle):
    """A list where an object or a number belongs: named (it was an AttributeError / TypeError traceback)."""
    (ckpt / "hf_quant_config.json").unlink()
    _edit_json(ckpt / "config.json", lambda d: edit(d["quantization_config"]))
    with pytest.raises(CheckpointError, match=needle):
        detect_quantization(ckpt)


def test_kv_cache_scheme_other_than_fp8(ckpt):
    """compressed-tensors' kv_cache_scheme (config.json only): float 8-bit is the FP8 cache, int 8-bit is refused."""
    (ckpt / "hf_quant_config.json").unlink()
    scheme = {"kv_cache_scheme": {"num_bits": 8, "type": "float"}}
    _edit_json(ckpt / "config.json", lambda d: d["quantization_config"].update(scheme))
    assert detect_quantization(ckpt).kv_cache_quant_algo == "FP8"
    scheme = {"kv_cache_scheme": {"num_bits": 8, "type": "int"}}
    _edit_json(ckpt / "config.json", lambda d: d["quantization_config"].update(scheme))
    with pytest.raises(CheckpointError, match=r"quantization_config.kv_cache_scheme = 'int8': pieceworks serves"):
        detect_quantization(ckpt)


def test_other_quant_method(ckpt):
    (ckpt / "hf_quant_config.json").unlink()
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    _edit_json(ckpt / "config.json", lambda d: d.update({"quantization_config": fp8}))
    with pytest.raises(CheckpointError, match=r"config.json: quantization_config.quant_method = 'fp8'"):
        detect_quantization(ckpt)


def test_config_json_only_and_legacy_forms(ckpt):
    """Without hf_quant_config.json: config.json's compressed-tensors form, `ignore` or the flat form."""
    (ckpt / "hf_quant_config.json").unlink()
    cfg = detect_quantization(ckpt)
    assert cfg.exclude_modules == ("lm_head", "model.embed_tokens") and cfg.source.endswith("config.json")
    flat = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
            "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}
    _edit_json(ckpt / "config.json", lambda d: d.update({"quantization_config": flat}))
    cfg = detect_quantization(ckpt)
    assert cfg.is_excluded("model.layers.7.mlp.gate") and not cfg.is_excluded("model.layers.7.mlp.gate_proj")
    assert cfg.is_excluded("lm_head")


def test_invalid_json(ckpt):
    (ckpt / "hf_quant_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="hf_quant_config.json: not valid JSON"):
        detect_quantization(ckpt)


# --- quantizer inputs ----------------------------------------------------------------------------


def test_quantizer_refuses_bad_inputs(tiny_llama_modelopt, ckpt, tmp_path, monkeypatch):
    bf16 = tiny_llama_modelopt.bf16_dir
    with pytest.raises(ValueError, match="exactly one activation source"):
        quantize_checkpoint(bf16, tmp_path / "a", progress=False)
    with pytest.raises(ValueError, match="exactly one activation source"):
        quantize_checkpoint(bf16, tmp_path / "a", amax=1.0, calib_text=tmp_path / "t.txt", progress=False)
    with pytest.raises(ValueError, match=r"--amax must be a number from 3.2e-35 .* to 3.4e38, got -1"):
        quantize_checkpoint(bf16, tmp_path / "a", amax=-1.0, progress=False)
    with pytest.raises(ValueError, match=r"to 3.4e38, got 1e\+39"):  # input_scale would be inf
        quantize_checkpoint(bf16, tmp_path / "a", amax=1e39, progress=False)
    for pattern, needle in (("layers.0.*", ""), ("model.layers.1.self_attn.q_proj.weight", "; name the module, without .weight")):
        with pytest.raises(ValueError, match=rf"--exclude {pattern!r} matches no module of .* \(names look like "
                                             rf"model\..*; a pattern is an fnmatch glob, e.g. model.layers.0.\*\){needle}$"):
            quantize_checkpoint(bf16, tmp_path / "a", amax=1.0, exclude=[pattern], progress=False)
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())
    with pytest.raises(ValueError, match="already quantized \\(quant_method 'modelopt'\\)"):
        quantize_checkpoint(ckpt, tmp_path / "a", amax=1.0, progress=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        quantize_checkpoint(bf16, tmp_path / "full", amax=1.0, progress=False)
    with pytest.raises(ValueError, match="x: is a file; DST is the directory the checkpoint goes to"):
        quantize_checkpoint(bf16, tmp_path / "full" / "x", amax=1.0, progress=False)
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(bf16, gpt2)
    config = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"gpt2/config.json: architectures=\['GPT2LMHeadModel'\] .* is not supported"):
        quantize_checkpoint(gpt2, tmp_path / "c", amax=1.0, progress=False)  # before the run, not at the first load
    assert not (tmp_path / "c").exists()
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # import transformers fails
    (tmp_path / "t.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"needs transformers: pip install 'pieceworks\[demo\]'"):
        quantize_checkpoint(bf16, tmp_path / "b", calib_text=tmp_path / "t.txt", progress=False)
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())


# --- whole-model loads: config.json fields, unexpected and non-finite tensors ----------------------
# Each case breaks a private copy of the tiny bf16 (or NVFP4) Llama in one way; loading must fail with a
# CheckpointError that names the file, the field or the tensor. Nothing half-loaded is returned: the
# loader raises before returning a model.


def _load(d, allow_extra=False):
    from pieceworks.config import ModelConfig, QuantizationConfig
    from pieceworks.models.loader import load_model

    return load_model(ModelConfig(path=str(d), allow_extra_tensors=allow_extra), QuantizationConfig(), "cpu",
                      torch.float32, progress=False)


@pytest.fixture
def bf16(tiny_llama_modelopt, tmp_path):
    """A private copy of the tiny bf16 Llama (2 layers, hidden 64, vocab 256), free to break."""
    d = tmp_path / "bf16"
    shutil.copytree(tiny_llama_modelopt.bf16_dir, d)
    return d


def _drop(key):
    return lambda c: c.pop(key)


def _set(**kv):
    return lambda c: c.update(kv)


CONFIG_CASES = {
    "no vocab_size": (_drop("vocab_size"), "vocab_size: missing; a llama config.json needs it"),
    "no hidden_size": (_drop("hidden_size"), "hidden_size: missing"),
    "no num_hidden_layers": (_drop("num_hidden_layers"), "num_hidden_layers: missing"),
    "hidden_size as a string": (_set(hidden_size="64"), "hidden_size: '64' (str) must be an integer"),
    "num_hidden_layers 2.5": (_set(num_hidden_layers=2.5), "num_hidden_layers: 2.5 (float) must be an integer"),
    "max_position_embeddings -5": (_set(max_position_embeddings=-5), "max_position_embeddings: -5 must be >= 1"),
    "max_position_embeddings 0": (_set(max_position_embeddings=0), "max_position_embeddings: 0 must be >= 1"),
    "max_position_embeddings 1e8": (_set(max_position_embeddings=1e8),
                                    "max_position_embeddings: 100000000.0 (float) must be an integer"),
    "max_position_embeddings true": (_set(max_position_embeddings=True),
                                     "max_position_embeddings: True (bool) must be an integer"),
    "llama3 rope pretrained on 0 positions": (
        _set(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 0, "rope_theta": 1e5}),
        "rope_parameters.original_max_position_embeddings: 0 must be an integer >= 1"),
    "yarn rope pretrained on '4096' positions": (
        _set(rope_parameters=None, rope_theta=1e4,
             rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": "4096"}),
        "rope_scaling.original_max_position_embeddings: '4096' must be an integer >= 1"),
    "llama3 rope with high_freq_factor 0": (
        _set(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 0, "rope_theta": 1e5}),
        "rope_parameters.high_freq_factor: 0 must be a finite number > 0"),
    "yarn rope with beta_fast '32'": (
        _set(rope_parameters=None, rope_theta=1e4, rope_scaling={
            "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": "32"}),
        "rope_scaling.beta_fast: '32' must be a finite number > 0"),
    "yarn rope with beta_slow -1": (
        _set(rope_parameters=None, rope_theta=1e4, rope_scaling={
            "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_slow": -1}),
        "rope_scaling.beta_slow: -1 must be a finite number > 0"),
    "yarn rope with mscale_all_dim nan": (
        _set(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                              "original_max_position_embeddings": 256, "mscale": 1, "mscale_all_dim": float("nan")}),
        "rope_parameters.mscale_all_dim: nan must be a finite number >= 0"),
    "rope_theta abc": (_set(rope_parameters={"rope_theta": "abc", "rope_type": "default"}),
                       "rope_parameters.rope_theta: 'abc' must be a finite number > 0"),
    "top-level rope_theta abc": (_set(rope_theta="abc"), "rope_theta: 'abc' (str) must be a number"),
    "llama3 rope without low_freq_factor": (
        _set(rope_parameters={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "rope_theta": 1e5}),
        "rope_parameters.low_freq_factor: missing; llama3 rope needs it"),
    "dynamic rope": (_set(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
                     "rope_parameters.rope_type: 'dynamic' is not supported; pieceworks implements default, linear"),
    "rope_scaling against rope_parameters": (  # which one applies differs between readers
        _set(rope_parameters={"rope_theta": 1e4, "rope_type": "default"}, rope_scaling={"type": "linear", "factor": 4.0}),
        "rope_scaling: {'type': 'linear', 'factor': 4.0} disagrees with rope_parameters"),
    "rms_norm_eps -1": (_set(rms_norm_eps=-1), "rms_norm_eps: -1 must be a finite number > 0"),
    "3 heads": (_set(num_attention_heads=3, head_dim=None), "num_attention_heads: 3 does not divide hidden_size=64"),
    "vocab_size -1": (_set(vocab_size=-1), "vocab_size: -1 must be >= 1"),
    "tie_word_embeddings as a string": (_set(tie_word_embeddings="yes"), "tie_word_embeddings: 'yes' (str) must be true"),
    "architectures as a string": (_set(architectures="LlamaForCausalLM"), "must be a list of class names"),
    "unknown architecture": (_set(architectures=["GPT2LMHeadModel"]), "is not supported; pieceworks supports"),
    "granite logits_scaling 0": (_set(architectures=["GraniteForCausalLM"], model_type="granite", logits_scaling=0),
                                 "logits_scaling: 0 must be a finite number > 0"),
    "no_rope_layers too short": (_set(architectures=["SmolLM3ForCausalLM"], model_type="smollm3", no_rope_layers=[1]),
                                 "no_rope_layers: [1] must list 1 (rope) or 0 (none) for each of the 2 layers"),
    "no_rope_layers of another value": (_set(no_rope_layers=[1, 2]), "no_rope_layers: [1, 2] must list 1 (rope)"),
    "sliding_window as a string": (_set(sliding_window="4k"), "sliding_window: '4k' (str) must be an integer"),
    "EXAONE 4 pattern in letters": (_set(architectures=["Exaone4ForCausalLM"], model_type="exaone4",
                                         sliding_window_pattern="LLLG"),
                                    "sliding_window_pattern: 'LLLG': give layer_types, or an integer >= 1"),
    "OLMo 3 layer types": (_set(architectures=["Olmo3ForCausalLM"], model_type="olmo3", layer_types=["full"]),
                           "layer_types: ['full'] must name sliding_attention or full_attention for each of the 2"),
    "sliding_window 0 in use": (_set(sliding_window=0), "sliding_window: 0 must be >= 1 (or null for full attention)"),
    "sliding_window -1": (_set(sliding_window=-1, use_sliding_window=False), "sliding_window: -1 must be >= 0"),
    "partial rotary 1.5": (_set(rope_parameters={"rope_theta": 1e4, "rope_type": "default",
                                                 "partial_rotary_factor": 1.5}),
                           "rope_parameters.partial_rotary_factor: 1.5 must be a number in (0, 1]"),
    "partial rotary of one dimension": (_set(architectures=["Phi3ForCausalLM"], model_type="phi3",  # head_dim 16
                                             partial_rotary_factor=0.1),
                                        "partial_rotary_factor: 0.1 rotates 1 of each head's dimensions"),
    "longrope factors of the wrong length": (
        _set(rope_parameters={"rope_theta": 1e4, "rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0],
                              "original_max_position_embeddings": 64}),
        "rope_parameters.short_factor: must list 8 finite numbers > 0"),
    "longrope without long factors": (
        _set(rope_parameters={"rope_theta": 1e4, "rope_type": "longrope", "short_factor": [1.0] * 8}),
        "rope_parameters.long_factor: missing; longrope rope needs it"),
    "a sliding layer": (_set(layer_types=["full_attention", "sliding_attention"]),
                        "layer_types: ['full_attention', 'sliding_attention']: pieceworks' Llama runs full attention"),
}


@pytest.mark.parametrize("name", CONFIG_CASES)
def test_bad_config_json_fields(bf16, name):
    edit, needle = CONFIG_CASES[name]
    _edit_json(bf16 / "config.json", edit)
    with pytest.raises(CheckpointError) as e:
        _load(bf16)
    assert needle in str(e.value) and str(bf16 / "config.json") in str(e.value), str(e.value)


@pytest.mark.parametrize("edit", [
    _set(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=256, max_position_embeddings=256),
    # Qwen's configs carry a window that applies only with use_sliding_window
    _set(sliding_window=64, use_sliding_window=False, max_position_embeddings=256,
         layer_types=["full_attention", "full_attention"]),
    _set(sliding_window=0, use_sliding_window=False)])  # as transformers writes Qwen2-MoE's
def test_windows_that_cut_nothing_load(bf16, edit):
    _edit_json(bf16 / "config.json", edit)
    assert _load(bf16).args.num_layers == 2


def test_a_sliding_window_shorter_than_the_context_caps_it(bf16, caplog):
    """A Qwen-style window (`use_sliding_window`, here SmolLM3's config form, whose window transformers applies to
    some layers only), scaled down: the model loads and serves sequences up to its window (full attention equals
    the window's there), model.max_context above the window is a ConfigError that names it, and an unset one takes
    the window with a warning."""
    import logging

    from pieceworks import Executor
    from pieceworks.errors import BatchError, ConfigError

    _edit_json(bf16 / "config.json", _set(architectures=["SmolLM3ForCausalLM"], model_type="smollm3",
                                          use_sliding_window=True, sliding_window=64, max_position_embeddings=256))
    assert _load(bf16).context_cap[0] == 64

    def executor(**model):
        return Executor.from_config({"model": {"path": str(bf16), **model}, "runtime": {"device": "cpu"}},
                                    progress=False)

    with caplog.at_level(logging.WARNING):
        ex = executor()
    assert ex.max_context == 64 and "capped at 64 tokens by the model's sliding window (64 tokens, config.json " \
        "sliding_window)" in caplog.text
    assert len(ex.generate([[1] * 60], max_new_tokens=4)[0]) == 4
    with pytest.raises(BatchError, match="64"):
        ex.generate([[1] * 62], max_new_tokens=4)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert executor(max_context=32).max_context == 32
    assert "sliding window" not in caplog.text
    with pytest.raises(ConfigError, match=r"model.max_context: 128 exceeds 64 tokens, the limit of the model's "
                                          r"sliding window \(64 tokens"):
        executor(max_context=128)


def test_mistral_and_phi3_windows_run_as_windows(bf16):
    """Mistral 7B v0.1's form (a 4,096-token window, 32,768 positions), scaled down: every layer attends through the
    window (`ModelFacts.sliding_windows`; parity with transformers: tests/test_models_parity.py), so the context is
    the model's positions, not the window."""
    from pieceworks import Executor

    _edit_json(bf16 / "config.json", _set(architectures=["MistralForCausalLM"], model_type="mistral",
                                          sliding_window=64, max_position_embeddings=256))
    model = _load(bf16)
    assert model.context_cap is None and model.facts(16).sliding_windows == (64, 64)
    ex = Executor.from_config({"model": {"path": str(bf16)}, "runtime": {"device": "cpu"}}, progress=False)
    assert ex.max_context == 256 and len(ex.generate([[1] * 120], max_new_tokens=4)[0]) == 4


def test_unreadable_config_json(bf16):
    (bf16 / "config.json").write_bytes(b'{"vocab_size": "caf\xe9"}')
    with pytest.raises(CheckpointError, match=r"config.json: not UTF-8 text \(byte 19"):
        _load(bf16)
    (bf16 / "config.json").unlink()
    (bf16 / "config.json").mkdir()
    with pytest.raises(CheckpointError, match=r"config.json: is a directory"):
        _load(bf16)


def test_a_directory_where_the_weights_file_should_be(bf16):
    (bf16 / "model.safetensors").unlink()
    (bf16 / "model.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors file"):
        _load(bf16)


def _poison(name, fn):
    def edit(t):
        t[name] = fn(t[name].clone())
    return edit


def _at(index, value):
    def fn(x):
        x.view(-1)[index] = value
        return x
    return fn


TENSOR_CASES = {
    "one inf weight": (_poison("model.layers.0.self_attn.q_proj.weight", _at(5, float("inf"))),
                       "model.layers.0.self_attn.q_proj.weight: 1 inf of 4096 values"),
    "a -inf embedding": (_poison("model.embed_tokens.weight", _at(70, float("-inf"))),
                         "model.embed_tokens.weight: 1 inf of 16384 values"),
    "a NaN norm": (_poison("model.norm.weight", _at(0, float("nan"))), "model.norm.weight: 1 NaN of 64 values"),
    "weights of 3e38": (_poison("model.layers.1.mlp.down_proj.weight", lambda x: x.float().fill_(3e38)),
                        "model.layers.1.mlp.down_proj.weight: 10240 beyond"),
    "an int weight": (_poison("model.norm.weight", lambda x: x.to(torch.int32)), "model.norm.weight: stored as torch.int32"),
    "a missing tensor": (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
                         "model.layers.1.mlp.up_proj.weight: missing from the checkpoint"),
    "a misshapen tensor": (_poison("model.norm.weight", lambda x: x[:32].clone()),
                           "model.norm.weight: shape mismatch: expected [64] from config.json, got [32]"),
}


@pytest.mark.parametrize("name", TENSOR_CASES)
def test_bad_tensors_are_named(bf16, name):
    edit, needle = TENSOR_CASES[name]
    _edit_tensors(bf16, edit)
    with pytest.raises(CheckpointError) as e:
        _load(bf16)
    assert needle in str(e.value), str(e.value)


def _extra_layer(t):
    for n in [n for n in t if n.startswith("model.layers.1.")]:
        t[n.replace("model.layers.1.", "model.layers.2.")] = t[n].clone()


EXTRA_CASES = {
    "a bias config.json says is absent": (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}),
                                          None, "model.layers.0.self_attn.q_proj.bias"),
    "an extra layer": (_extra_layer, None, "(layers 2..2: config.json says num_hidden_layers=2)"),
    "foo.bar": (lambda t: t.update({"foo.bar": torch.zeros(3)}), None, "1 tensor(s) the model does not use: foo.bar"),
    "num_hidden_layers 1 on 2 layers": (None, _set(num_hidden_layers=1),
                                        "(layers 1..1: config.json says num_hidden_layers=1)"),
    "a tied model with an lm_head": (None, _set(tie_word_embeddings=True),
                                     "tie_word_embeddings=true (the head reuses the embedding) but the checkpoint "
                                     "holds its own lm_head.weight"),
}


@pytest.mark.parametrize("name", EXTRA_CASES)
def test_unexpected_tensors_are_an_error_unless_allowed(bf16, name):
    tensors, config, needle = EXTRA_CASES[name]
    if tensors:
        _edit_tensors(bf16, tensors)
    if config:
        _edit_json(bf16 / "config.json", config)
    with pytest.raises(CheckpointError) as e:
        _load(bf16)
    assert needle in str(e.value) and "model.allow_extra_tensors=true" in str(e.value), str(e.value)
    model = _load(bf16, allow_extra=True)  # the explicit switch loads it, ignoring the extra tensors
    assert torch.isfinite(model.embed_tokens.weight).all()


def test_fewer_layers_than_config_json_says_fail_before_the_build(bf16, monkeypatch):
    _edit_json(bf16 / "config.json", _set(num_hidden_layers=200_000))
    built = []
    monkeypatch.setattr(loader_module, "build", lambda *a, **k: built.append(a))
    with pytest.raises(CheckpointError) as e:
        _load(bf16)
    assert "num_hidden_layers=200000, but the checkpoint holds layers 0..1 (2 layers)" in str(e.value), str(e.value)
    assert not built  # refused before the skeleton of 200,000 layers


def test_deepseek_mtp_layers_are_expected(tiny_deepseek_modelopt, tmp_path):
    """DeepSeek-V3's multi-token-prediction layers (num_nextn_predict_layers after the last layer) are
    not run and not an error; one layer further is."""
    d = tmp_path / "ds"
    shutil.copytree(tiny_deepseek_modelopt.bf16_dir, d)
    n = json.loads((d / "config.json").read_text())["num_hidden_layers"]

    def mtp(t, index):
        t[f"model.layers.{index}.enorm.weight"] = torch.ones(64, dtype=torch.bfloat16)

    _edit_tensors(d, lambda t: mtp(t, n))
    _edit_json(d / "config.json", _set(num_nextn_predict_layers=1))
    assert len(_load(d).layers) == n
    _edit_tensors(d, lambda t: mtp(t, n + 1))
    with pytest.raises(CheckpointError, match=rf"model.layers.{n + 1}.enorm.weight"):
        _load(d)


@pytest.mark.parametrize("key", ["norm_topk_prob", "rope_interleave"])
def test_deepseek_null_for_a_boolean_that_defaults_to_true(tiny_deepseek_modelopt, tmp_path, key):
    """transformers keeps a null and tests it for truth (false); pieceworks' default is true. Neither
    reading is taken silently: null is refused, naming the key; an explicit true or false loads."""
    d = tmp_path / "ds"
    shutil.copytree(tiny_deepseek_modelopt.bf16_dir, d)
    _edit_json(d / "config.json", _set(**{key: None}))
    with pytest.raises(CheckpointError) as e:
        _load(d)
    assert f"{key} is null; transformers reads null as false" in str(e.value), str(e.value)
    assert "write true or false" in str(e.value), str(e.value)
    for value in (False, True):
        _edit_json(d / "config.json", _set(**{key: value}))
        assert getattr(_load(d).args, key) is value


@pytest.mark.parametrize("key", ["n_group", "num_experts_per_tok", "routed_scaling_factor", "first_k_dense_replace"])
def test_deepseek_null_for_a_number_transformers_refuses(tiny_deepseek_modelopt, tmp_path, key):
    """A null here read as absent took pieceworks' own fallback (1 group, 1 expert per token, scaling 1), not
    transformers' default, and computed another model; transformers refuses it: refused, naming the key."""
    d = tmp_path / "ds"
    shutil.copytree(tiny_deepseek_modelopt.bf16_dir, d)
    _edit_json(d / "config.json", _set(**{key: None}))
    with pytest.raises(CheckpointError, match=f"config.json: {key} is null, which transformers refuses too: write a "
                                              "number, or leave the key out"):
        _load(d)


@pytest.mark.parametrize("edit, needle", [
    (_set(topk_method="noaux_tc"), "topk_method='noaux_tc': DeepSeek-V2 routes greedy or group_limited_greedy"),
    (_set(norm_topk_prob=True), "norm_topk_prob=true with DeepSeek-V2's routing is not supported"),
    (_set(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", scoring_func="softmax"),
     "implements DeepSeek-V3 routing (sigmoid scores, noaux_tc grouped top-k) and DeepSeek-V2's"),
], ids=["v2 noaux_tc", "v2 norm_topk_prob", "v3 softmax"])
def test_deepseek_routings_pieceworks_does_not_run_are_refused(tiny_deepseek_modelopt, tmp_path, edit, needle):
    d = tmp_path / "ds"
    shutil.copytree(tiny_deepseek_modelopt.bf16_dir, d)
    _edit_json(d / "config.json", _set(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                                       topk_method="greedy", norm_topk_prob=False))
    assert _load(d, allow_extra=True).args.scoring_func == "softmax"  # read as DeepSeek-V2 (its bias unused)
    _edit_json(d / "config.json", edit)
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        _load(d, allow_extra=True)


def _scale(fn):
    return _poison(f"{Q}.weight_scale", lambda s: fn(s.float()).to(torch.float8_e4m3fn))


@pytest.mark.parametrize("name, edit, needle", [
    ("a NaN e4m3 block scale", _scale(lambda s: s.view(-1).index_fill_(0, torch.tensor([3]), float("nan")).view(s.shape)),
     f"{Q}.weight_scale: 1 of 256 NVFP4 block scales are negative or NaN (e.g. nan)"),
    ("negative FP4 scales", _scale(lambda s: -s - 1), f"{Q}.weight_scale: 256 of 256 NVFP4 block scales are negative"),
])
def test_bad_nvfp4_scales_are_named(ckpt, name, edit, needle):
    _edit_tensors(ckpt, edit)
    with pytest.raises(CheckpointError) as e:
        _load(ckpt)
    assert needle in str(e.value), str(e.value)


def test_the_intact_copies_load(bf16, ckpt):
    assert len(_load(bf16).layers) == 2 and len(_load(ckpt).layers) == 2


@pytest.mark.parametrize("text, needle", [
    ('{"eos_token_id": "2"}', "eos_token_id '2' must be a token id (an int >= 0) or a list of them"),
    ('{"eos_token_id": [2, -1]}', "eos_token_id [2, -1] must be a token id"),
    ('{"eos_token_id": ', "not valid JSON"),
    ('[2]', "expected a JSON object at the top level, got list"),
])
def test_bad_generation_config_is_named(tmp_path, text, needle):
    """An EOS id that is no int would never match a sampled token: the request would run to its length."""
    from pieceworks.engine.detokenize import eos_token_ids

    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(CheckpointError, match="generation_config.json: ") as err:
        eos_token_ids(tmp_path)
    assert needle in str(err.value)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 7]}')
    assert eos_token_ids(tmp_path) == {2, 7}


def test_an_eos_id_outside_the_vocabulary_is_named(bf16):
    """It could never end a request (each would run to its length): refused when the Engine is built."""
    from pieceworks import Engine

    vocab = json.loads((bf16 / "config.json").read_text())["vocab_size"]
    (bf16 / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, vocab]}))
    with pytest.raises(CheckpointError, match=rf"generation_config.json: eos_token_id {vocab} is outside the model's "
                                              rf"vocabulary \[0, {vocab}\) \(config.json vocab_size\)"):
        Engine.from_config({"model": {"path": str(bf16)}, "runtime": {"device": "cpu"}}, progress=False)


def test_tokenizer_files_that_do_not_load_are_not_taken_for_no_tokenizer(tmp_path):
    """A corrupt tokenizer.json is an error naming it; only a directory without tokenizer files has none
    (which makes the Engine and `pieceworks run` fall back to token ids)."""
    pytest.importorskip("transformers", reason="tokenizers load through transformers")
    from pieceworks.errors import TokenizerError
    from pieceworks.models.tokenizer import load_tokenizer

    with pytest.raises(CheckpointError, match="has no tokenizer that transformers can load") as err:
        load_tokenizer(tmp_path)
    assert not isinstance(err.value, TokenizerError)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    with pytest.raises(TokenizerError, match=r"its tokenizer files \(tokenizer.json, tokenizer_config.json\) "
                                             r"don't load \(.*\); fix or re-download them"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()  # the config alone: the missing file is named, with the whole reason
    with pytest.raises(TokenizerError, match=r": tokenizer.json is missing and its tokenizer files "
                                             r"\(tokenizer_config.json\) don't load \(\w+: .{40,}\); fix") as err:
        load_tokenizer(tmp_path)
    assert "\n" not in str(err.value)


def test_a_tokenizer_side_file_that_does_not_load_is_named_too(tmp_path, caplog):
    """special_tokens_map.json is read with the tokenizer: broken, it is among the files the error names. A
    tokenizer of more tokens than the model's vocabulary is a warning."""
    pytest.importorskip("transformers", reason="tokenizers load through transformers")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from pieceworks.errors import TokenizerError
    from pieceworks.models.tokenizer import load_tokenizer

    vocab = {"<unk>": 0, "a": 1, "b": 2}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                  unk_token="<unk>")
    tok.save_pretrained(tmp_path)
    load_tokenizer(tmp_path)
    load_tokenizer(tmp_path, vocab_size=3)
    with caplog.at_level(logging.WARNING, logger="pieceworks.models.tokenizer"):
        load_tokenizer(tmp_path, vocab_size=2)  # another model's tokenizer: its ids past the model are named
    assert "the tokenizer holds 3 tokens, the model's vocabulary 2 (config.json vocab_size): prompts with ids " \
           "from 2 up are refused" in caplog.text
    (tmp_path / "special_tokens_map.json").write_text('{"unk_token": ')
    with pytest.raises(TokenizerError, match=r"its tokenizer files \(tokenizer.json, tokenizer_config.json, "
                                             r"special_tokens_map.json\) don't load"):
        load_tokenizer(tmp_path)


def test_tokenizer_file_the_os_will_not_read_is_named(tmp_path, monkeypatch):
    """transformers raises PermissionError for a tokenizer file it can't open (the real exception,
    simulated: root reads chmod-000 files): named as unreadable, not as broken."""
    transformers = pytest.importorskip("transformers", reason="tokenizers load through transformers")
    from pieceworks.errors import TokenizerError
    from pieceworks.models.tokenizer import load_tokenizer

    (tmp_path / "tokenizer.json").write_text("{}")

    def from_pretrained(path, *a, **kw):
        raise PermissionError(13, "Permission denied", str(tmp_path / "tokenizer.json"))

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(tmp_path)
    assert str(e.value) == (f"{tmp_path / 'tokenizer.json'}: can't be read (Permission denied); give the user "
                            "running pieceworks read access to it")


def test_huge_max_position_embeddings_needs_max_context(bf16):
    """A checkpoint declaring 2**31 positions: its rope tables would take 128 GiB (head_dim 16). Without model.max_context
    the loader refuses by name before allocating; with it the tables cover only max_context positions,
    with the values of the full table, and the executor runs."""
    from pieceworks import Executor
    from pieceworks.config import ModelConfig, QuantizationConfig
    from pieceworks.errors import ConfigError
    from pieceworks.models.loader import load_model

    full = _load(bf16).rotary
    _edit_json(bf16 / "config.json", _set(max_position_embeddings=2**31))
    with pytest.raises(ConfigError, match=r"max_position_embeddings \(2147483648\) needs rope tables of 128.0 GiB; "
                                          r"set model.max_context"):
        _load(bf16)
    model = load_model(ModelConfig(path=str(bf16), max_context=96), QuantizationConfig(), "cpu", torch.float32,
                       progress=False)
    assert model.rotary.cos.shape == (96, full.cos.shape[1])
    if full.params["rope_type"] == "default":  # the frequencies do not depend on max_position_embeddings
        assert torch.equal(model.rotary.cos, full.cos[:96]) and torch.equal(model.rotary.sin, full.sin[:96])
    cfg = {"model": {"path": str(bf16), "max_context": 96}, "runtime": {"device": "cpu", "dtype": "float32"},
           "kv_cache": {"num_tokens": 256}}
    with Executor.from_config(cfg, progress=False) as ex:
        assert ex.max_context == 96
        assert len(ex.generate([[1, 2, 3]], max_new_tokens=4)[0]) == 4


def test_rope_tables_are_only_built_for_the_positions_served(bf16):
    """max_position_embeddings beyond what a tensor can index (2**70) loads with model.max_context: no table
    of the declared size is built, not even on the meta device. A max_context above max_position_embeddings
    is refused before anything is allocated; a null max_position_embeddings is transformers' default."""
    from pieceworks.config import ModelConfig, QuantizationConfig
    from pieceworks.errors import ConfigError
    from pieceworks.models.loader import load_model

    def load(**kw):
        return load_model(ModelConfig(path=str(bf16), **kw), QuantizationConfig(), "cpu", torch.float32,
                          progress=False)

    full = load().rotary
    with pytest.raises(ConfigError, match=r"model.max_context: 200 exceeds the model's max_position_embeddings "
                                          r"\(128\); use at most that"):
        load(max_context=200)
    _edit_json(bf16 / "config.json", _set(max_position_embeddings=2**70))
    model = load(max_context=96)
    assert model.max_position_embeddings == 2**70 and model.rotary.cos.shape == (96, full.cos.shape[1])
    assert torch.equal(model.rotary.cos, full.cos[:96]) and torch.equal(model.rotary.sin, full.sin[:96])
    _edit_json(bf16 / "config.json", _set(max_position_embeddings=None))
    assert load().rotary.cos.shape[0] == 2048


def test_chat_template_that_is_no_jinja_is_named(tmp_path):
    """A chat template with a Jinja syntax error, or one that is no text, is refused when the tokenizer
    loads, naming the file it came from and the line (transformers compiles it only when a chat is
    rendered: a traceback in `pieceworks run`)."""
    from pieceworks.errors import TokenizerError
    from pieceworks.models.tokenizer import load_tokenizer

    copy_tokenizer(smollm2_dir(), tmp_path)
    assert load_tokenizer(tmp_path).chat_template  # the intact copy loads
    good = (tmp_path / "chat_template.jinja").read_text()
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    with pytest.raises(TokenizerError, match=r"chat_template.jinja: the chat template is not valid Jinja "
                                             r"\(line 2: unexpected '}'\); fix the template"):
        load_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(good)
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools")
    with pytest.raises(TokenizerError, match=r"additional_chat_templates/tool_use.jinja: the chat template 'tool_use' "
                                             r"is not valid Jinja \(line 1: unexpected end of template"):
        load_tokenizer(tmp_path)
    shutil.rmtree(tmp_path / "additional_chat_templates")
    (tmp_path / "chat_template.jinja").unlink()
    _edit_json(tmp_path / "tokenizer_config.json", lambda c: c.update(chat_template=5))
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: the chat template is 5 \(int\), not Jinja "
                                             r"text; fix the template"):
        load_tokenizer(tmp_path)


def test_files_the_os_will_not_read_are_named(bf16, monkeypatch):
    """Permission denied on config.json, on a safetensors file or on the model directory: a CheckpointError
    naming it and the cause. safetensors reports an unreadable file as SafetensorError "No such file or
    directory", which read as "truncated or corrupt". Simulated here (chmod 000 does not stop root, who
    runs the tests in CI); `test_unreadable_files_for_real` drops root's access where it can."""
    import pathlib

    from safetensors import SafetensorError

    import pieceworks.models.checkpoint as checkpoint

    def denied(path):
        return PermissionError(13, "Permission denied", str(path))

    read_text, open_, stat = pathlib.Path.read_text, pathlib.Path.open, pathlib.Path.stat

    def read_config_denied(self, *a, **kw):
        if self.name == "config.json":
            raise denied(self)
        return read_text(self, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "read_text", read_config_denied)
        with pytest.raises(CheckpointError, match=r"config.json: can't be read \(Permission denied\); give the "
                                                  r"user running pieceworks read access to it"):
            _load(bf16)

    def safe_open(path, *a, **kw):  # what safetensors raises for a file the OS won't open
        raise SafetensorError(f"No such file or directory: {path}")

    def open_weights_denied(self, *a, **kw):
        if self.suffix == ".safetensors":
            raise denied(self)
        return open_(self, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(checkpoint, "safe_open", safe_open)
        m.setattr(pathlib.Path, "open", open_weights_denied)
        with pytest.raises(CheckpointError) as e:
            _load(bf16)
    assert str(e.value) == (f"{bf16 / 'model.safetensors'}: can't be read (Permission denied); give the user "
                            "running pieceworks read access to it")

    def stat_in_dir_denied(self, *a, **kw):  # a directory without search (x) permission
        if self.parent == bf16:
            raise denied(self)
        return stat(self, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "stat", stat_in_dir_denied)
        for load in (_load, CheckpointReader):
            with pytest.raises(CheckpointError) as e:
                load(bf16)
            assert str(e.value).startswith(f"{bf16}: can't be read (Permission denied)"), str(e.value)


def _without_file_access() -> list[str] | None:
    """A command prefix that runs without permission to read other users' files: none needed for a
    user other than root; for root, setpriv dropping CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH. None
    where that can't be done."""
    import os
    import subprocess

    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    cmd = [setpriv, "--bounding-set", "-dac_override,-dac_read_search"]
    ok = subprocess.run([*cmd, "true"], capture_output=True).returncode == 0
    return cmd if ok else None


def test_unreadable_files_for_real(bf16, tmp_path):
    """chmod 000 on a safetensors file and on a model directory, loaded by a process the OS refuses."""
    import subprocess
    import sys

    prefix = _without_file_access()
    if prefix is None:
        pytest.skip("can't drop root's permission to read any file (no setpriv, or not allowed)")
    weights, folder = tmp_path / "weights", tmp_path / "folder"
    shutil.copytree(bf16, weights)
    shutil.copytree(bf16, folder)
    (weights / "model.safetensors").chmod(0)
    folder.chmod(0)
    script = ("import sys, torch\n"
              "from pieceworks.config import ModelConfig, QuantizationConfig\n"
              "from pieceworks.models.loader import load_model\n"
              "for d in sys.argv[1:]:\n"
              "    try:\n"
              "        load_model(ModelConfig(path=d), QuantizationConfig(), 'cpu', torch.float32,\n"
              "                   progress=False)\n"
              "    except Exception as e:\n"
              "        print(type(e).__name__, e)\n")
    try:
        out = subprocess.run([*prefix, sys.executable, "-c", script, str(weights), str(folder)],
                             capture_output=True, text=True, timeout=300)
    finally:
        folder.chmod(0o755)
    denied = "can't be read (Permission denied); give the user running pieceworks read access to it"
    assert out.stdout.splitlines() == [f"CheckpointError {weights / 'model.safetensors'}: {denied}",
                                       f"CheckpointError {folder}: {denied}"], out.stdout + out.stderr


def test_nvfp4_tensors_without_a_quantization_config(ckpt):
    """ModelOpt's export without its hf_quant_config.json (nor quantization_config in config.json) loaded
    as a dense model of dequantized weights, silently, or (scales missing too) failed as a shape mismatch;
    it is refused by name whatever quantization.format says, and by `model_facts` before any weight loads."""
    from pieceworks.config import ModelConfig, QuantizationConfig
    from pieceworks.models.loader import load_model, model_facts

    (ckpt / "hf_quant_config.json").unlink(missing_ok=True)
    _edit_json(ckpt / "config.json", lambda c: c.pop("quantization_config", None))
    looked = (rf"but no quantization config: looked for {ckpt / 'hf_quant_config.json'} and a quantization_config "
              rf"in {ckpt / 'config.json'}; restore the one ModelOpt exported")
    for fmt in ("auto", "nvfp4", "none"):
        with pytest.raises(CheckpointError, match=r"holds NVFP4 tensors \(model\.layers\..*\.weight_scale, \.\.\.\) "
                                                  + looked):
            load_model(ModelConfig(path=str(ckpt)), QuantizationConfig(format=fmt), "cpu", torch.float32,
                       progress=False)
    with pytest.raises(CheckpointError, match=looked):
        model_facts(ModelConfig(path=str(ckpt)), QuantizationConfig(), page_size=16)
    _edit_tensors(ckpt, lambda t: [t.pop(n) for n in list(t) if n.endswith(("_scale", "_scale_2"))])
    with pytest.raises(CheckpointError, match=r"holds NVFP4 tensors \(model\.layers\..*\.weight, \.\.\.\) " + looked):
        _load(ckpt)


def test_model_facts_of_a_directory_with_config_json_only(bf16, tmp_path):
    """`model_facts` (pieceworks backends, the tensor-parallel layout check) reads config.json alone: a
    directory without weight files still describes its model; loading it fails by name."""
    from pieceworks.config import ModelConfig, QuantizationConfig
    from pieceworks.models.loader import model_facts

    only = tmp_path / "config-only"
    only.mkdir()
    shutil.copy(bf16 / "config.json", only / "config.json")
    facts, ops = model_facts(ModelConfig(path=str(only)), QuantizationConfig(), page_size=16)
    assert "attention" in ops and facts is not None
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        _load(only)
