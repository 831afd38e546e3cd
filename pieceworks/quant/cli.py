"""`pieceworks quantize SRC DST`: the quantizer's subcommand (registered by `pieceworks.cli`)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '2GiB' / '1000000' -> bytes (raises ValueError with the accepted forms)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"--max-shard-size {text!r}: expected a positive size such as 5GB, 500MB or 2GiB")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size < 1:  # 0.0001KB: positive, yet no whole byte
        raise ValueError(f"--max-shard-size {text!r} is less than one byte; give e.g. 500MB")
    return size


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `quantize` subcommand to `subparsers`; its `func(args) -> int` runs it."""
    p = subparsers.add_parser(
        "quantize",
        help="turn a bf16 Hugging Face checkpoint into a ModelOpt-format NVFP4 checkpoint",
        description=(
            "Quantize the linear weights of a bf16/fp16/fp32 Hugging Face checkpoint (Llama or "
            "DeepSeek-V3 family) to NVFP4, writing ModelOpt's checkpoint format (tensor names, "
            "hf_quant_config.json). Streams tensor by tensor. input_scale comes from a calibration "
            "text (max |activation| per linear, runs the model with transformers and the tokenizer "
            "files in SRC): by default the bundled English text pieceworks/data/calibration.txt; or "
            "from a fixed amax."
        ),
    )
    p.add_argument("src", type=Path, metavar="SRC", help="source checkpoint directory")
    p.add_argument("dst", type=Path, metavar="DST", help="new or empty output directory")
    # --exclude's patterns run on to the words after them: `--exclude P SRC DST` leaves SRC and DST missing
    p.missing_hint = ("given after --exclude, SRC and DST are read as its patterns: give them first (pieceworks "
                      "quantize SRC DST --exclude PATTERN ...) or end the patterns with --")
    act = p.add_mutually_exclusive_group()
    act.add_argument(
        "--calib-text",
        type=Path,
        metavar="FILE",
        help="text to calibrate activation amax over (needs transformers; default: the bundled "
        "pieceworks/data/calibration.txt, 23 KB of English)",
    )
    act.add_argument(
        "--amax", type=float, metavar="X", help="fixed activation amax for every linear (no calibration)"
    )
    p.add_argument(
        "--exclude",
        nargs="+",
        action="extend",
        default=[],
        metavar="PATTERN",
        help="module-name patterns (fnmatch) to keep unquantized, besides lm_head, embeddings and MoE routers",
    )
    p.add_argument("--kv-cache", choices=("fp8",), help="also calibrate an FP8 KV cache: each attention layer's "
                   "k_scale / v_scale from the keys' and values' amax over the calibration text, as ModelOpt's "
                   "FP8_KV_CFG exports them (kv_cache.dtype: auto then serves e4m3 K/V)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE", help="shard size cap (default 5GB)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run `quantize` from parsed arguments; user errors are raised as ValueError."""
    from pieceworks.data import CALIBRATION_TXT
    from pieceworks.quant.quantizer import quantize_checkpoint

    calib_text = args.calib_text
    if calib_text is None and args.amax is None:
        calib_text = CALIBRATION_TXT
        print(f"calibrating activation amax over the bundled text {CALIBRATION_TXT} "
              "(--calib-text FILE for another text, --amax X for a fixed amax)")
    elif calib_text is not None:
        print(f"calibrating activation amax over {calib_text}")
    out = quantize_checkpoint(
        args.src,
        args.dst,
        calib_text=calib_text,
        amax=args.amax,
        exclude=args.exclude,
        progress=not args.no_progress,
        max_shard_bytes=parse_size(args.max_shard_size),
        kv_cache=args.kv_cache,
    )
    print(f"wrote NVFP4 checkpoint to {out}")
    return 0
