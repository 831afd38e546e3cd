"""Read NVIDIA ModelOpt NVFP4 checkpoints: the quantization config and per-layer tensors.

What ModelOpt 0.47's `export_hf_checkpoint` writes (checked on exports of Llama and DeepSeek-V3):

- `hf_quant_config.json`: `{"producer": {"name": "modelopt", "version": ...}, "quantization":
  {"quant_algo": "NVFP4", "kv_cache_quant_algo": null, "group_size": 16, "exclude_modules": [...]}}`.
  exclude_modules lists module names kept in the source dtype (`lm_head`, `model.embed_tokens`, MoE
  routers `model.layers.N.mlp.gate`), summarized with prefix wildcards where a whole subtree is
  excluded (`model.layers.61*`).
- `config.json` `quantization_config`, compressed-tensors style: `{"config_groups": {"group_0":
  {"weights": {"num_bits": 4, "type": "float", "group_size": 16, ...}, "input_activations": {...},
  "targets": ["Linear"]}}, "ignore": [...], "quant_algo": "NVFP4", "producer": {...},
  "quant_method": "modelopt"}` (and `kv_cache_scheme` when the KV cache is quantized).
- With `kv_cache_quant_algo: "FP8"` (ModelOpt's FP8_KV_CFG added to the NVFP4 config): per attention layer
  float32 scalars `...self_attn.k_proj.k_scale` and `...self_attn.v_proj.v_scale` (the calibrated amax / 448;
  other exporters write `...self_attn.k_scale` / `v_scale`).
- Per quantized linear `P`: `P.weight` uint8 [N, K/2]; `P.weight_scale` float8_e4m3fn [N, K/16];
  `P.weight_scale_2` and `P.input_scale` float32 0-d tensors. Linears that read the same input (q/k/v;
  gate/up; DeepSeek's q_a_proj + kv_a_proj_with_mqa; each expert's gate/up) share one weight_scale_2
  and one input_scale. Experts are stored one set per expert (`...mlp.experts.{e}.gate_proj.*`), and
  with transformers >= 5 every expert of a layer carries the same input_scale.

This reader accepts both config files (hf_quant_config.json wins) and the older flat
`quantization_config` (`quant_algo`, `group_size`, `exclude_modules` at the top level), plus `ignore`
as an alias of `exclude_modules`, as vLLM and SGLang do.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

import torch

from pieceworks.backends.fp4_gemm.base import Fp4Weight
from pieceworks.backends.moe.base import MoEWeights
from pieceworks.errors import CheckpointError
from pieceworks.quant.nvfp4 import BLOCK, MAX_ABS
from pieceworks.util import load_json_object

log = logging.getLogger(__name__)

HF_QUANT_CONFIG = "hf_quant_config.json"
SUPPORTED_ALGO = "NVFP4"
_NO_KV_QUANT = (None, "", "none", "NONE", "None")
_FP8_KV = ("FP8", "FLOAT8")  # kv_cache_quant_algo, or kv_cache_scheme {"type": "float", "num_bits": 8}
_MODELOPT_METHODS = ("modelopt", "modelopt_fp4")


@dataclass(frozen=True)
class Fp4QuantConfig:
    """A ModelOpt NVFP4 checkpoint's quantization settings.

    Attributes:
        exclude_modules: fnmatch patterns of modules left unquantized (`lm_head`,
            `model.layers.*.mlp.gate`, `model.layers.61*`).
        group_size: elements per block scale along K (always 16 here).
        quant_algo: always "NVFP4" here.
        kv_cache_quant_algo: None (the KV cache stays in the model dtype) or "FP8" (an e4m3 KV cache with the
            per-layer `k_scale` / `v_scale` the export calibrated: `kv_cache_scales`).
        producer: e.g. "modelopt 0.47.0", for messages.
        source: the file the settings came from, for messages.
    """

    exclude_modules: tuple[str, ...] = ()
    group_size: int = BLOCK
    quant_algo: str = SUPPORTED_ALGO
    kv_cache_quant_algo: str | None = None
    producer: str = ""
    source: str = ""

    def is_excluded(self, module_name: str) -> bool:
        """Whether `module_name` (e.g. `model.layers.3.mlp.gate`) is stored unquantized.

        A pattern matches by `fnmatch` (`*` also crosses dots); a pattern also covers the modules
        below it (`model.layers.1.mlp.experts` covers `model.layers.1.mlp.experts.0.up_proj`).
        """
        return covered(module_name, self.exclude_modules)


def covered(module: str, patterns) -> bool:
    """Whether an exclude pattern covers `module` (`Fp4QuantConfig.is_excluded`'s rule, the quantizer's too)."""
    return any(fnmatchcase(module, p) or fnmatchcase(module, p + ".*") for p in patterns)


_MIXTRAL_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_MIXTRAL_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)")


def mixtral_name(name: str) -> str:
    """A module or tensor name as pieceworks' Llama and transformers 5 give it, as Mixtral's checkpoints write it: the
    experts under `block_sparse_moe` (its router `gate`), each expert's gate / up / down projections as w1 / w3 / w2
    (the loader reads, and the calibration names, Mixtral's tensors through it)."""
    if ".mlp." not in name:
        return name
    name = _MIXTRAL_EXPERT.sub(lambda m: f".mlp.experts.{m[1]}.{_MIXTRAL_PROJ[m[2]]}", name)
    return name.replace(".mlp.", ".block_sparse_moe.", 1)


def _group_size_of(qc: dict, where: str) -> object:
    if "group_size" in qc:
        return qc["group_size"]
    sizes = set()
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise CheckpointError(f"{where}.config_groups: {groups!r} must be an object of named groups; fix the file or "
                              "re-export the checkpoint")
    for gname, group in groups.items():
        for part in ("weights", "input_activations"):
            if isinstance(group, dict) and isinstance(group.get(part), dict):
                if "group_size" in group[part]:
                    size, key = group[part]["group_size"], f"{where}.config_groups.{gname}.{part}.group_size"
                    if isinstance(size, (list, dict)):
                        raise CheckpointError(f"{key}: {size!r} must be a number (16 for NVFP4); fix the file or "
                                              "re-export the checkpoint")
                    sizes.add((key, size))
    values = {v for _, v in sizes}
    if len(values) > 1:
        listing = ", ".join(f"{k} = {v}" for k, v in sorted(sizes, key=str))
        raise CheckpointError(f"{where}: config groups disagree on group_size ({listing}); expected 16 everywhere")
    return values.pop() if values else BLOCK


def _kv_algo_of(qc: dict) -> tuple[str, object]:
    if "kv_cache_quant_algo" in qc:
        return "kv_cache_quant_algo", qc["kv_cache_quant_algo"]
    scheme = qc.get("kv_cache_scheme")
    if isinstance(scheme, dict):  # compressed-tensors style, e.g. {"num_bits": 8, "type": "float"}
        return "kv_cache_scheme", f"{scheme.get('type', '?')}{scheme.get('num_bits', '?')}"
    return "kv_cache_scheme", scheme


def _parse(qc: dict, where: str) -> Fp4QuantConfig:
    algo = qc.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() != SUPPORTED_ALGO:
        layers = qc.get("quantized_layers")
        kinds = sorted({str(c.get("quant_algo")) for c in layers.values() if isinstance(c, dict)}) \
            if isinstance(layers, dict) else []
        mixed = f" (its quantized_layers hold {', '.join(kinds)})" if kinds else ""
        raise CheckpointError(
            f"{where}.quant_algo = {algo!r}{mixed}: pieceworks serves ModelOpt NVFP4 checkpoints only "
            f"(quant_algo \"NVFP4\"); re-export the model with ModelOpt's NVFP4 config or `pieceworks quantize`"
        )
    group_size = _group_size_of(qc, where)
    if group_size != BLOCK:
        raise CheckpointError(
            f"{where}.group_size = {group_size!r}: NVFP4 uses one scale per 16 elements; this "
            "checkpoint was made with another block size, which no pieceworks kernel serves"
        )
    kv_key, kv = _kv_algo_of(qc)
    if kv not in _NO_KV_QUANT and str(kv).upper() not in _FP8_KV:
        raise CheckpointError(
            f"{where}.{kv_key} = {kv!r}: pieceworks serves a KV cache in the model dtype or in FP8 (e4m3); "
            f"use a checkpoint exported with kv_cache_quant_algo FP8 or null"
        )
    kv_algo = None if kv in _NO_KV_QUANT else "FP8"
    excl = qc.get("exclude_modules", qc.get("ignore"))
    excl = [] if excl is None else excl
    if not isinstance(excl, list) or not all(isinstance(p, str) for p in excl):
        raise CheckpointError(f"{where}.exclude_modules must be a list of module-name patterns, got {excl!r}")
    return Fp4QuantConfig(exclude_modules=tuple(excl), group_size=BLOCK, kv_cache_quant_algo=kv_algo)


def _producer(d: dict) -> str:
    p = d.get("producer") or {}
    return f"{p.get('name', '')} {p.get('version', '')}".strip() if isinstance(p, dict) else str(p)


def detect_quantization(model_dir: str | Path) -> Fp4QuantConfig | None:
    """The checkpoint's NVFP4 settings, or None for an unquantized checkpoint.

    Reads `hf_quant_config.json` if present, else `config.json`'s `quantization_config`.

    Raises:
        CheckpointError: a quantization config pieceworks cannot serve (another quant_algo or
            quant_method, a group size other than 16, a quantized KV cache), naming the field and
            its value; or an unreadable config file.
    """
    model_dir = Path(model_dir)
    hf = model_dir / HF_QUANT_CONFIG
    if hf.exists():
        data = load_json_object(hf)
        qc = data.get("quantization")
        if not isinstance(qc, dict):
            raise CheckpointError(f"{hf}: has no \"quantization\" object; re-export it with ModelOpt")
        cfg = _parse(qc, f"{hf}: quantization")
        return _with_origin(cfg, _producer(data), str(hf))
    cfg_path = model_dir / "config.json"
    if not cfg_path.exists():
        return None
    qc = load_json_object(cfg_path).get("quantization_config")
    if qc is None:
        return None
    where = f"{cfg_path}: quantization_config"
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where} must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method not in _MODELOPT_METHODS:
        raise CheckpointError(
            f"{where}.quant_method = {method!r}: pieceworks reads ModelOpt NVFP4 checkpoints "
            f"(quant_method \"modelopt\"); convert this model from bf16 with `pieceworks quantize`"
        )
    if "quantization" in qc and isinstance(qc["quantization"], dict):  # hf_quant_config inlined
        return _with_origin(_parse(qc["quantization"], f"{where}.quantization"), _producer(qc), str(cfg_path))
    return _with_origin(_parse(qc, where), _producer(qc), str(cfg_path))


def _with_origin(cfg: Fp4QuantConfig, producer: str, source: str) -> Fp4QuantConfig:
    return Fp4QuantConfig(cfg.exclude_modules, cfg.group_size, cfg.quant_algo, cfg.kv_cache_quant_algo, producer,
                          source)


# --- Tensors -------------------------------------------------------------------------------------


def _expect(reader, name: str, dtype: torch.dtype, shape: tuple[int, ...] | None, what: str) -> torch.Tensor:
    """Load `name` and check dtype and shape (shape None = a scalar: [] or [1])."""
    if not reader.has(name):
        raise CheckpointError(
            f"{name}: missing from the checkpoint; a ModelOpt NVFP4 linear carries weight, "
            f"weight_scale, weight_scale_2 and input_scale ({what}). If this layer is meant to stay "
            "unquantized, its module must be listed in exclude_modules"
        )
    got_dtype, got_shape = reader.dtype(name), tuple(reader.shape(name))
    shape_ok = got_shape in ((), (1,)) if shape is None else got_shape == shape
    if got_dtype != dtype or not shape_ok:
        want = "scalar ([] or [1])" if shape is None else list(shape)
        hint = ""
        if name.endswith(".weight") and got_dtype != dtype and got_dtype.is_floating_point:
            hint = " (an unquantized weight: list the module in exclude_modules if that is intended)"
        raise CheckpointError(
            f"{name}: expected {str(dtype).removeprefix('torch.')} {want}, got "
            f"{str(got_dtype).removeprefix('torch.')} {list(got_shape)}{hint}"
        )
    return reader.get(name)


KV_SCALE_NAMES = (("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"), ("self_attn.k_scale", "self_attn.v_scale"))
"""Where exports keep a layer's FP8 KV scales: ModelOpt's (under the projections), then llm-compressor's."""


def kv_cache_scales(reader, num_layers: int, named=None, quant: Fp4QuantConfig | None = None
                    ) -> list[tuple[float, float]] | None:
    """Each layer's (k_scale, v_scale) of a checkpoint with an FP8 KV cache, or None where it holds none (scales of
    1.0 then, as vLLM takes them). `named` maps pieceworks' tensor names to the checkpoint's (a multimodal
    checkpoint's text model). A layer whose attention `quant` excludes (ModelOpt then calibrates no KV scales for
    it) takes scales of 1.0, with a warning.

    Raises:
        CheckpointError: a layer whose attention is quantized has no scales while others have, or a scale is not a
            positive finite normal float32 scalar.
    """
    named = named or (lambda name: name)
    found, missing, unquantized = [], [], []
    for i in range(num_layers):
        pair = next(((named(f"model.layers.{i}.{k}"), named(f"model.layers.{i}.{v}")) for k, v in KV_SCALE_NAMES
                     if reader.has(named(f"model.layers.{i}.{k}"))), None)
        if pair is None:
            if quant is not None and quant.is_excluded(named(f"model.layers.{i}.self_attn")):
                unquantized.append(i)
                found.append((1.0, 1.0))
            else:
                missing.append(i)
            continue
        if not reader.has(pair[1]):
            raise CheckpointError(f"{pair[0]} is there but {pair[1]} is not: an FP8 KV cache needs both scales of "
                                  "every layer; re-export the checkpoint")
        found.append(tuple(float(_scalar(reader, name, "an FP8 KV cache's scale")) for name in pair))
    if len(unquantized) == len(found):
        return None
    if unquantized:
        log.warning("%s: layer(s) %s keep their attention unquantized (exclude_modules) and have no FP8 KV scales: "
                    "their K/V are stored in FP8 with scales of 1.0", reader.model_dir, unquantized[:8])
    if missing:
        have = len(found) - len(unquantized)
        raise CheckpointError(f"{reader.model_dir}: FP8 KV scales (k_proj.k_scale / v_proj.v_scale) in {have} "
                              f"layers but not in layer(s) {missing[:4]}; the export is incomplete, re-export it")
    return found


def _scalar(reader, name: str, what: str) -> torch.Tensor:
    t = _expect(reader, name, torch.float32, None, what).reshape(())
    v = float(t)
    if not (torch.finfo(torch.float32).tiny <= v < float("inf")):  # 0, subnormal: a W4A4 step divides by it
        raise CheckpointError(f"{name}: must be a positive finite float32 of at least 1.2e-38 (a normal number), got "
                              f"{v}; the export is broken")
    return t


def read_fp4_linear(reader, prefix: str, in_features: int, out_features: int) -> Fp4Weight:
    """Read and validate one ModelOpt NVFP4 linear.

    Args:
        reader: a `pieceworks.models.checkpoint.CheckpointReader` (anything with has/dtype/shape/get).
        prefix: the module name, e.g. `model.layers.3.self_attn.q_proj`.
        in_features: K (a multiple of 16).
        out_features: N.

    Returns:
        Fp4Weight(weight uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_scale_2 float32
        [], input_scale float32 []).

    Raises:
        CheckpointError: a tensor is missing or has the wrong dtype/shape, or a global scale is not a
            positive finite number; the message names the tensor (`{prefix}.weight_scale: expected
            float8_e4m3fn [4096, 256], got ...`). Nothing is returned half-read.
    """
    if in_features % BLOCK:
        raise CheckpointError(
            f"{prefix}: in_features = {in_features} is not a multiple of {BLOCK}; NVFP4 cannot hold it"
        )
    what = f"layer {prefix}: in {in_features}, out {out_features}"
    weight = _expect(reader, f"{prefix}.weight", torch.uint8, (out_features, in_features // 2), what)
    scale = _expect(
        reader, f"{prefix}.weight_scale", torch.float8_e4m3fn, (out_features, in_features // BLOCK), what
    )
    ws2 = _scalar(reader, f"{prefix}.weight_scale_2", what)
    if 6.0 * 448.0 * float(ws2) > MAX_ABS:  # the largest weight it can encode: e2m1 6 x e4m3 448 x it
        raise CheckpointError(f"{prefix}.weight_scale_2: {float(ws2):.3g} lets its weights reach "
                              f"{6 * 448 * float(ws2):.3g}, beyond +-{MAX_ABS:.2g} (as dense weights are held to); "
                              "the export is broken")
    inp = _scalar(reader, f"{prefix}.input_scale", what)
    return Fp4Weight(weight, scale, ws2, inp)


def fuse_fp4(parts: list[Fp4Weight]) -> Fp4Weight | None:
    """Concatenate linears along N (q/k/v, gate/up) when that is exact, else None.

    Fusion is exact only when every part has the same `weight_scale_2` and `input_scale` (what
    ModelOpt exports for linears that read one input): the block scales and codes then mean the same
    thing in the fused weight. Otherwise this returns None and the model keeps the parts as separate
    linears, which is exact too; re-quantizing block scales to a shared global scale would change
    weights by one more e4m3 rounding, so pieceworks never does it.

    Args:
        parts: Fp4Weight each, all with the same K.

    Returns:
        Fp4Weight with weight [sum N, K/2], weight_scale [sum N, K/16] and the shared scalars, or
        None when the scalars differ.
    """
    if not parts:
        raise ValueError("fuse_fp4: no parts given")
    k = {p.weight.shape[-1] for p in parts}
    if len(k) != 1:
        raise ValueError(f"fuse_fp4: parts have different K/2 ({sorted(k)}); only linears on one input fuse")
    first = parts[0]
    for p in parts[1:]:
        same_ws2 = torch.equal(p.weight_scale_2, first.weight_scale_2)
        if not (same_ws2 and torch.equal(p.input_scale, first.input_scale)):
            return None
    return Fp4Weight(
        torch.cat([p.weight for p in parts]),
        torch.cat([p.weight_scale for p in parts]),
        first.weight_scale_2,
        first.input_scale,
    )


def read_fp4_experts(reader, prefix_fmt: str, num_experts: int, hidden: int, intermediate: int,
                     first: int = 0) -> MoEWeights:
    """Read per-expert NVFP4 tensors and stack them into `MoEWeights`.

    Args:
        reader: a CheckpointReader.
        prefix_fmt: expert module name with `{e}`, e.g. `model.layers.3.mlp.experts.{e}`; under it
            `gate_proj`, `up_proj` ([I, H]) and `down_proj` ([H, I]).
        num_experts: E. hidden: H. intermediate: I (the expert's).
        first: the checkpoint index of the first expert read (experts first .. first + E - 1; an
            expert-parallel rank reads its own).

    Returns:
        MoEWeights: w13 uint8 [E, 2I, H/2] (gate rows then up rows), w13_scale e4m3 [E, 2I, H/16],
        w13_scale_2 float32 [E, 2] (gate, up), w13_input_scale float32 [E] = max(gate, up) input
        scale, w2 uint8 [E, H, I/2], w2_scale e4m3 [E, H, I/16], w2_scale_2 [E], w2_input_scale [E].
        Taking the max of gate's and up's input_scale changes nothing for ModelOpt exports (they are
        equal, both read one input); for other producers it is the choice that never clips.

    Raises:
        CheckpointError: as `read_fp4_linear`, naming the expert's tensor.
    """
    w13, s13, g13, i13, w2, s2, g2, i2 = ([] for _ in range(8))
    for e in range(first, first + num_experts):
        p = prefix_fmt.format(e=e)
        gate = read_fp4_linear(reader, f"{p}.gate_proj", hidden, intermediate)
        up = read_fp4_linear(reader, f"{p}.up_proj", hidden, intermediate)
        down = read_fp4_linear(reader, f"{p}.down_proj", intermediate, hidden)
        w13.append(torch.cat([gate.weight, up.weight]))
        s13.append(torch.cat([gate.weight_scale, up.weight_scale]))
        g13.append(torch.stack([gate.weight_scale_2, up.weight_scale_2]))
        i13.append(torch.maximum(gate.input_scale, up.input_scale))
        w2.append(down.weight)
        s2.append(down.weight_scale)
        g2.append(down.weight_scale_2)
        i2.append(down.input_scale)
    st = torch.stack
    return MoEWeights(st(w13), st(s13), st(g13), st(i13), st(w2), st(s2), st(g2), st(i2))
