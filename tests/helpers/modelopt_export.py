"""Tiny random Llama / DeepSeek-V3 checkpoints, quantized to NVFP4 by NVIDIA ModelOpt itself.

Each builder makes a small random `transformers` model, saves it in bf16 with `save_pretrained`
(`bf16_dir`), then quantizes it with `mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop)`
(max calibration over a few random token batches, on CPU) and writes ModelOpt's own export with
`export_hf_checkpoint` (`fp4_dir`). These are the ground truth the parity tests hold pieceworks to.

The quantized model is never run forward: ModelOpt's fake-quant kernels for NVFP4 need CUDA.

Exports are cached on disk under `<cache_root>/<key>`, where the key hashes the versions of torch,
transformers and modelopt, the builder's name and parameters, and `FIXTURE_VERSION` (bump it when a
builder changes). A finished export holds a `DONE` marker; a half-written one is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

FIXTURE_VERSION = 1
DEFAULT_CACHE_ROOT = Path.home() / ".cache" / "pieceworks" / "test-fixtures"

LLAMA_PARAMS = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)

DEEPSEEK_PARAMS = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class ExportedModel:
    """A bf16 checkpoint and ModelOpt's NVFP4 export of the same weights."""

    bf16_dir: Path
    fp4_dir: Path
    params: dict
    seed: int

    def calibration_batches(self) -> list[torch.Tensor]:
        """The token batches ModelOpt calibrated on (int64 [2, 32] each)."""
        return calibration_batches(self.params["vocab_size"], self.seed)


def _versions() -> dict[str, str]:
    # Package metadata, not imports: importing modelopt takes seconds, and a cache hit needs none.
    from importlib.metadata import version

    return {
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "modelopt": version("nvidia-modelopt"),
    }


def cache_key(builder: str, params: dict, seed: int) -> str:
    """Hex digest that names one export in the cache."""
    blob = json.dumps(
        {"v": FIXTURE_VERSION, "builder": builder, "params": params, "seed": seed, **_versions()},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def calibration_batches(vocab_size: int, seed: int) -> list[torch.Tensor]:
    """A few random token batches: enough to route tokens to every expert of the tiny MoE."""
    gen = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(0, vocab_size, (2, 32), generator=gen) for _ in range(4)]


def _calibrate(model: torch.nn.Module, vocab_size: int, seed: int) -> None:
    """ModelOpt's forward loop for max calibration (the model is still unquantized here)."""
    with torch.no_grad():
        for ids in calibration_batches(vocab_size, seed):
            model(input_ids=ids)


def _build(builder: str, make_model, vocab_size: int, params: dict, seed: int, cache_root: Path,
           kv_fp8: bool = False):
    key = cache_key(builder, params, seed)
    out = Path(cache_root) / f"{builder}-{key}"
    result = ExportedModel(out / "bf16", out / "fp4", dict(params), seed)
    if (out / "DONE").exists():
        return result

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    Path(cache_root).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{builder}-", dir=cache_root))
    try:
        torch.manual_seed(seed)
        model = make_model()
        model.eval()
        model.save_pretrained(tmp / "bf16")

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = mtq.NVFP4_DEFAULT_CFG
            if kv_fp8:  # ModelOpt's FP8 KV cache on top: K/V quantizers calibrated in the attention, exported
                cfg = {**cfg, "quant_cfg": list(cfg["quant_cfg"]) + list(mtq.FP8_KV_CFG["quant_cfg"])}
            mtq.quantize(model, cfg, lambda m: _calibrate(m, vocab_size, seed))
            with torch.no_grad():
                # dtype given explicitly: ModelOpt 0.47 reads `config.torch_dtype`, which
                # transformers 5 may hold as the string "bfloat16" (then `.to(dtype)` fails).
                export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=tmp / "fp4")
        (tmp / "DONE").write_text(json.dumps({"params": params, "seed": seed, **_versions()}))
        if out.exists():  # a half-written export from an interrupted run
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return result


def build_tiny_llama(cache_root: Path = DEFAULT_CACHE_ROOT, seed: int = 0, kv_fp8: bool = False,
                     **overrides) -> ExportedModel:
    """A random `LlamaForCausalLM` (bf16) and its ModelOpt NVFP4 export (`kv_fp8`: with ModelOpt's FP8 KV cache,
    `kv_cache_quant_algo: FP8` and each layer's calibrated `k_proj.k_scale` / `v_proj.v_scale`)."""
    params = {**LLAMA_PARAMS, **overrides}

    def make():
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(**params)
        config.architectures = ["LlamaForCausalLM"]
        return LlamaForCausalLM(config).to(torch.bfloat16)

    return _build("llama-fp8kv" if kv_fp8 else "llama", make, params["vocab_size"], params, seed, cache_root, kv_fp8)


def build_tiny_deepseek(
    cache_root: Path = DEFAULT_CACHE_ROOT, seed: int = 0, **overrides
) -> ExportedModel:
    """A random `DeepseekV3ForCausalLM` (bf16, router weights fp32) and its ModelOpt NVFP4 export.

    Layer 0 is dense (first_k_dense_replace=1); the others are MoE with grouped routing (n_group=2,
    2 experts per group) and one shared expert. `transformers` >= 5 holds the experts as fused 3-D
    parameters; ModelOpt calibrates them through one shared input quantizer per projection and
    exports them per expert under the checkpoint names (`mlp.experts.{e}.gate_proj...`).
    """
    params = {**DEEPSEEK_PARAMS, **overrides}

    def make():
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        config = DeepseekV3Config(**params)
        config.architectures = ["DeepseekV3ForCausalLM"]
        model = DeepseekV3ForCausalLM(config)
        # The router stays fp32, as transformers creates it (and pieceworks' model keeps it).
        for name, module in model.named_modules():
            if type(module).__name__ == "DeepseekV3TopkRouter":
                continue
            for pname, p in module.named_parameters(recurse=False):
                p.data = p.data.to(torch.bfloat16)
        return model

    return _build("deepseek_v3", make, params["vocab_size"], params, seed, cache_root)
