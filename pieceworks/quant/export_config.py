"""The quantization config files of a ModelOpt-format NVFP4 checkpoint, as ModelOpt 0.47 writes them.

`hf_quant_config.json` is ModelOpt's own file; `config.json` carries the same facts as a
compressed-tensors style `quantization_config` with `quant_method: "modelopt"`, which is what vLLM,
SGLang and TensorRT-LLM look for. The exclude list is summarized with prefix wildcards exactly as
ModelOpt's `_prefix_wildcard_summarize_exclude_modules` does, so a quantizer run and a ModelOpt export
of the same model list the same patterns.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

from pieceworks.quant.nvfp4 import BLOCK


def summarize_exclude(unquantized: Iterable[str], quantized: Iterable[str]) -> list[str]:
    """Shortest prefix wildcards (cut at dots) that cover `unquantized` and no quantized module.

    For each unquantized module, in order: try `a*`, then the pair (`a`, `a.*`), for each dotted
    prefix `a`, shortest first, then the name itself; skip candidates that match a prefix wildcard of
    a quantized module; stop early when an earlier pick already covers it. A pair is written as
    `a.*` alone. Returns the sorted patterns.
    """
    negative: set[str] = set()
    for q in quantized:
        negative.add(q)
        negative.update(q[:i] + "*" for i in range(len(q) + 1))
    summary: set[str] = set()
    for name in unquantized:
        candidates = []
        for i, ch in enumerate(name):
            if ch == ".":
                candidates.append([name[:i] + "*"])
                candidates.append([name[:i], name[:i] + ".*"])
        candidates.append([name])
        pick: list[str] = []
        for wildcards in candidates:
            if any(w in negative for w in wildcards):
                continue
            if all(w in summary for w in wildcards):
                pick = []
                break
            pick = wildcards
            break
        if len(pick) == 2 and pick[1] == pick[0] + ".*":
            summary.add(pick[1])
        else:
            summary.update(pick)
    return sorted(summary)


def hf_quant_config(exclude_modules: list[str], producer: dict, kv_cache_quant_algo: str | None = None) -> dict:
    """The `hf_quant_config.json` object for an NVFP4 checkpoint (with an FP8 KV cache: `kv_cache_quant_algo`
    "FP8")."""
    return {
        "producer": producer,
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": kv_cache_quant_algo,
            "group_size": BLOCK,
            "exclude_modules": list(exclude_modules),
        },
    }


def quantization_config(hf: dict) -> dict:
    """config.json's `quantization_config` for an `hf_quant_config` (ModelOpt's conversion)."""
    q = hf["quantization"]
    gs = q["group_size"]
    kv = {"kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}} if q["kv_cache_quant_algo"] else {}
    return {
        "config_groups": {
            "group_0": {
                "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": gs},
                "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": gs},
                "targets": ["Linear"],
            }
        },
        "ignore": list(q["exclude_modules"]),
        "quant_algo": q["quant_algo"],
        **kv,
        "producer": hf["producer"],
        "quant_method": "modelopt",
    }


def write_configs(dst: Path, config: dict, unquantized: list[str], quantized: list[str], copied: list[Path],
                   kv_cache_quant_algo: str | None = None) -> None:
    """Write the two config files of a checkpoint of the `quantized` modules (`unquantized` listed as excluded) into
    dst, config.json being `config` with its `quantization_config`, and copy the `copied` files there."""
    from pieceworks.version import __version__ as version

    hf = hf_quant_config(summarize_exclude(unquantized, quantized), {"name": "pieceworks", "version": version},
                         kv_cache_quant_algo)
    config = dict(config)
    config["quantization_config"] = quantization_config(hf)
    for name, obj in (("hf_quant_config.json", hf), ("config.json", config)):
        (dst / name).write_text(json.dumps(obj, indent=4))
    for f in copied:
        shutil.copy2(f, dst / f.name)
