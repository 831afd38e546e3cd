"""load_model: random-weight presets, checkpoint formats, and the errors bad checkpoints give."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pieceworks import Executor
from pieceworks.config import ModelConfig, QuantizationConfig
from pieceworks.errors import CheckpointError
from pieceworks.models.base import MergedProj
from pieceworks.models.deepseek_v3 import DeepseekV3
from pieceworks.models.llama import Llama
from pieceworks.models.loader import build, load_model, model_facts
from pieceworks.models.moe import MoE
from pieceworks.models.presets import preset_config
from pieceworks.quant.linear import Fp4Linear

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _load(path, fmt="auto", dtype=torch.float32):
    return load_model(ModelConfig(path=str(path)), QuantizationConfig(format=fmt), "cpu", dtype, progress=False)


# --- random weights ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("fmt", ["none", "nvfp4"])
def test_random_tiny_presets_run(arch, fmt):
    ex = Executor.from_config({"model": {"arch": arch, "preset": "tiny"}, "quantization": {"format": fmt},
                               "runtime": {"device": "cpu", "dtype": "float32"}, "kv_cache": {"num_tokens": 256}},
                              progress=False)
    m = ex.model
    assert m.has_fp4() == (fmt == "nvfp4")
    assert ("fp4_gemm" in m.required_ops()) == (fmt == "nvfp4")
    if arch == "deepseek_v3":
        assert m.required_ops() >= {"mla", "moe"} and m.kv_layout().kind == "mla"
        assert m.facts(16).moe_quant == ("nvfp4" if fmt == "nvfp4" else "none")
    else:
        assert m.required_ops() >= {"attention"} and m.kv_layout().kind == "gqa"
    logits = ex.score([[1, 2, 3, 4, 5, 6, 7]])[0]
    assert logits.shape == (7, m.vocab_size) and logits.isfinite().all()
    assert len(ex.generate([[3, 1, 4]], max_new_tokens=4)[0]) == 4


def _numel(model) -> int:
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    return sum(t.numel() for n, t in tensors if not n.startswith("rotary"))


def test_full_size_presets_have_the_published_sizes():
    """Built on the meta device only: Llama-3.1-8B has 8,030,261,248 parameters, DeepSeek-V3 (without
    its MTP layer) 671.0B."""
    llama = build(Llama, preset_config("llama", "llama-3.1-8b"), torch.bfloat16, lambda n: False)
    assert _numel(llama) == 8_030_261_248
    ds = build(DeepseekV3, preset_config("deepseek_v3", "deepseek-v3"), torch.bfloat16, lambda n: False)
    assert _numel(ds) == 671_026_419_200
    fp4 = build(Llama, preset_config("llama", "llama-3.1-8b"), torch.bfloat16, lambda n: True)
    assert isinstance(fp4.layers[0].self_attn.qkv_proj.proj, Fp4Linear)
    assert fp4.facts(16).fp4 and fp4.kv_layout().num_kv_heads == 8


def test_model_facts_without_loading(tiny_deepseek_modelopt):
    """model_facts (for `pieceworks backends`) agrees with the loaded model, from a preset or a checkpoint."""
    cases = [(ModelConfig(arch="deepseek_v3", preset="tiny"), QuantizationConfig(format="nvfp4")),
             (ModelConfig(path=str(tiny_deepseek_modelopt.fp4_dir)), QuantizationConfig())]
    for model_cfg, quant_cfg in cases:
        facts, ops = model_facts(model_cfg, quant_cfg, 16, dtype=torch.float32)
        loaded = load_model(model_cfg, quant_cfg, "cpu", torch.float32, progress=False)
        assert facts == loaded.facts(16) and ops == loaded.required_ops() == {"mla", "moe", "fp4_gemm"}
        assert facts.moe_quant == "nvfp4"


def test_sizes_override_the_preset():
    cfg = preset_config("deepseek_v3", "deepseek-v3", {"num_hidden_layers": 4})
    m = build(DeepseekV3, cfg, torch.bfloat16, lambda n: False)
    assert len(m.layers) == 4
    assert [isinstance(layer.mlp, MoE) for layer in m.layers] == [False, False, False, True]
    assert m.kv_layout().latent_dim == 512 + 64
    with pytest.raises(ValueError, match="model.preset='huge'.*known: tiny, llama-3.1-8b"):
        preset_config("llama", "huge")


def test_gpu_graph_models_describe_on_cpu():
    """The model configurations of tests/gpu/test_graphs.py resolve here (on the meta device), and a case that names
    a share of each head rotated gets it: a config a change elsewhere refuses, or reads otherwise, fails in CPU CI
    rather than on the next GPU run."""
    import importlib.util
    from pathlib import Path

    from pieceworks.models.hf_config import rotary_dim

    spec = importlib.util.spec_from_file_location("gpu_graphs", Path(__file__).parent / "gpu" / "test_graphs.py")
    gpu_graphs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_graphs)
    for name, (model, fmt) in gpu_graphs.MODELS.items():
        model_cfg = ModelConfig(**{**model, "max_context": 1024})
        model_facts(model_cfg, QuantizationConfig(format=fmt), 16)
        sizes = model.get("sizes", {})
        if "partial_rotary_factor" in sizes and model["arch"] == "llama":
            hf = preset_config(model["arch"], model["preset"], sizes)
            head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
            assert rotary_dim(hf) == int(head_dim * sizes["partial_rotary_factor"]), name


# --- checkpoints ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny transformers Llama saved in bf16, sharded (index + several files)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    d = tmp_path_factory.mktemp("llama_bf16")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d, max_shard_size="20KB")
    return d


@pytest.fixture
def broken(llama_dir, tmp_path):
    """A private copy of the checkpoint, merged into one safetensors file, free to break."""
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(llama_dir / "config.json", d)
    tensors = {}
    for f in llama_dir.glob("*.safetensors"):
        tensors.update(load_file(f))
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return d


def _edit_tensors(d, fn):
    tensors = load_file(d / "model.safetensors")
    fn(tensors)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def _edit_config(d, fn):
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def test_sharded_bf16_checkpoint_loads_as_float32(llama_dir):
    from transformers import AutoModelForCausalLM

    assert (llama_dir / "model.safetensors.index.json").exists()
    model = _load(llama_dir)
    assert model.dtype == torch.float32 and model.embed_tokens.weight.dtype == torch.float32
    assert isinstance(model.layers[0].self_attn.qkv_proj, MergedProj)
    ref = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    torch.testing.assert_close(model.layers[1].mlp.down_proj.weight, ref.model.layers[1].mlp.down_proj.weight,
                               rtol=0, atol=0)
    q, k, v = (getattr(ref.model.layers[0].self_attn, f"{n}_proj").weight for n in "qkv")
    assert torch.equal(model.layers[0].self_attn.qkv_proj.proj.weight, torch.cat([q, k, v]))


def test_a_dense_checkpoint_is_opened_once(llama_dir, tiny_llama_modelopt, monkeypatch):
    """The reader that looked for quantized tensors (a checkpoint without a quantization config) is the
    one the load reads from: each checkpoint's headers are read once."""
    from pieceworks.models import checkpoint

    opened = []
    real = checkpoint.CheckpointReader.__init__

    def init(self, *a, **kw):
        opened.append(a[0] if a else kw)
        real(self, *a, **kw)

    monkeypatch.setattr(checkpoint.CheckpointReader, "__init__", init)
    _load(llama_dir)
    assert len(opened) == 1, opened
    _load(tiny_llama_modelopt.fp4_dir)  # quantized: its config says so, and no reader looks first
    assert len(opened) == 2, opened


def test_not_a_directory(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        _load(tmp_path / "nowhere")


def test_missing_config_json(broken):
    (broken / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config\.json: missing"):
        _load(broken)


def test_unknown_architecture(broken):
    _edit_config(broken, lambda c: c.update(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    with pytest.raises(ValueError) as e:
        _load(broken)
    from pieceworks.models.architectures import ARCHITECTURES

    assert "GPT2LMHeadModel" in str(e.value) and str(e.value).endswith(f"pieceworks supports {', '.join(ARCHITECTURES)}")
    assert {"LlamaForCausalLM", "DeepseekV3ForCausalLM", "Gemma3ForCausalLM"} <= set(ARCHITECTURES)


def test_missing_tensor(broken):
    _edit_tensors(broken, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight: missing from the checkpoint"):
        _load(broken)
    assert torch.get_default_dtype() == torch.float32  # the meta build's default dtype was restored


def test_shape_mismatch(broken):
    _edit_config(broken, lambda c: c.update(intermediate_size=64))
    with pytest.raises(ValueError) as e:
        _load(broken)
    msg = str(e.value)
    assert "model.layers.0.mlp.gate_proj.weight" in msg and "expected [64, 32]" in msg and "got [48, 32]" in msg


def test_unsupported_llama_variant(broken):
    _edit_config(broken, lambda c: c.update(attention_bias=True))
    with pytest.raises(ValueError, match="attention_bias=true is not supported"):
        _load(broken)
    # Seed-OSS's attention_bias is q/k/v's (read); its attention_out_bias, o_proj's, is not
    _edit_config(broken, lambda c: c.update(architectures=["SeedOssForCausalLM"], model_type="seed_oss",
                                            attention_out_bias=True))
    with pytest.raises(ValueError, match="attention_out_bias=true is not supported"):
        _load(broken)


def test_nan_weight_is_named(broken):
    def poison(t):
        t["model.layers.1.post_attention_layernorm.weight"][3] = float("nan")

    _edit_tensors(broken, poison)
    with pytest.raises(CheckpointError, match=r"model.layers.1.post_attention_layernorm.weight: 1 NaN of 32 values"):
        _load(broken)


def test_format_must_match_the_checkpoint(broken, tiny_llama_modelopt):
    with pytest.raises(ValueError, match="quantization.format=nvfp4, but .* is not an NVFP4 checkpoint"):
        _load(broken, fmt="nvfp4")
    with pytest.raises(ValueError, match="quantization.format=none, but .* is a ModelOpt NVFP4 checkpoint"):
        _load(tiny_llama_modelopt.fp4_dir, fmt="none")


def test_nvfp4_tensor_errors_propagate(tiny_llama_modelopt, tmp_path):
    d = tmp_path / "fp4"
    shutil.copytree(tiny_llama_modelopt.fp4_dir, d)
    _edit_tensors(d, lambda t: t.pop("model.layers.1.self_attn.o_proj.input_scale"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.o_proj\.input_scale: missing"):
        _load(d)


def test_mixtral_checkpoint_errors_name_the_checkpoints_tensors(tmp_path):
    """Mixtral's experts load through the model's names; a missing or misshapen one is named as the file has it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    cfg = {"model": {"path": str(tmp_path)}, "runtime": {"device": "cpu"}}
    Executor.from_config(cfg, progress=False).close()  # every tensor read under its Mixtral name
    for edit, needle in ((lambda t: t.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight"),
                          "model.layers.1.block_sparse_moe.experts.2.w3.weight: missing"),
                         (lambda t: t.update({"model.layers.0.block_sparse_moe.experts.1.w2.weight":
                                              torch.zeros(32, 5)}),
                          "model.layers.0.block_sparse_moe.experts.1.w2.weight: shape mismatch")):
        broken = dict(tensors)
        edit(broken)
        save_file(broken, tmp_path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=needle.replace(".", r"\.")):
            Executor.from_config(cfg, progress=False)



@pytest.mark.parametrize("arch, preset, billions, rel", [
    ("llama", "llama-3.1-8b", 8.03, 0.005), ("llama", "mixtral-8x7b", 46.7, 0.005),
    ("llama", "qwen3-30b-a3b", 30.5, 0.005), ("llama", "glm-4.5-air", 106, 0.01), ("llama", "gemma-3-1b", 1.0, 0.005),
    ("llama", "gemma-2-2b", 2.61, 0.005),
    ("deepseek_v3", "deepseek-v3", 671.0, 0.005), ("deepseek_v3", "deepseek-v2-lite", 15.7, 0.005),
    ("deepseek_v3", "glm-4.7-flash", 30, 0.005)])
def test_presets_have_the_published_models_parameter_counts(arch, preset, billions, rel):
    """The random-weight presets are the published models' shapes: built on the meta device, their weights
    (rope tables aside) count the parameters their model cards give (DeepSeek-V3 and the GLMs without their MTP
    layers; GLM-4.5-Air's card gives a whole "106 billion", against 106.85 counted: the wider bound; GLM-4.7-Flash
    is "30B-A3B")."""
    from pieceworks.models.architectures import architecture
    from pieceworks.models.loader import build
    from pieceworks.models.presets import preset_config

    hf = preset_config(arch, preset)
    with torch.device("meta"):
        model = build(architecture(hf, preset), hf, torch.bfloat16, lambda name: False)
    weights = [t for n, t in [*model.named_parameters(), *model.named_buffers()]
               if t.is_floating_point() and "rotary" not in n]
    assert sum(t.numel() for t in weights) / 1e9 == pytest.approx(billions, rel=rel)


def test_phi3_checkpoint_errors_name_the_fused_tensors(tmp_path):
    """Phi-3's q / k / v are read as rows of its qkv_proj: a missing one is named as the file has it, and so is one
    whose rows are not the sum of config.json's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=None, eos_token_id=2)).save_pretrained(tmp_path)
    cfg = {"model": {"path": str(tmp_path)}, "runtime": {"device": "cpu"}}
    Executor.from_config(cfg, progress=False).close()
    # the fused tensors' rows against config.json's sizes (other rows would be read as k / v, or up, silently)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 2}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight has 64 rows, "
                                              r"config\.json's sizes give 96 \(q 32 \+ k 32 \+ v 32\)"):
        Executor.from_config(cfg, progress=False)
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = load_file(tmp_path / "model.safetensors")
    gate_up = tensors["model.layers.1.mlp.gate_up_proj.weight"]
    save_file({**tensors, "model.layers.1.mlp.gate_up_proj.weight": gate_up[:-1].contiguous()},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"gate_up_proj\.weight has 95 rows, config\.json's sizes give 96 "
                                              r"\(gate 48 \+ up 48\)"):
        Executor.from_config(cfg, progress=False)
    tensors.pop("model.layers.1.self_attn.qkv_proj.weight")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight: missing"):
        Executor.from_config(cfg, progress=False)
