"""`pieceworks quantize SRC DST` with neither --calib-text nor --amax calibrates over the bundled text."""

from __future__ import annotations

import errno
import os
import re
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from pieceworks.models.checkpoint import CheckpointReader  # noqa: E402
from pieceworks.cli import main  # noqa: E402
from pieceworks.data import CALIBRATION_TXT, calibration_text  # noqa: E402


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    """A tiny random bf16 Llama with a word-level tokenizer over the calibration text's words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = sorted(set(re.findall(r"\w+", calibration_text())))[:250]
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>"] + words)}
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    d = tmp_path_factory.mktemp("tiny_bf16")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>").save_pretrained(d)
    return d


def _input_scales(d) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(d)
    return {n: reader.get(n) for n in reader.names() if n.endswith(".input_scale")}


def test_quantize_without_an_activation_source_calibrates_on_the_bundled_text(tiny_bf16, tmp_path, capsys,
                                                                             monkeypatch):
    from pieceworks.quant import calibrate

    texts, amaxes = [], []

    def spy(model_dir, text_file, **kw):
        texts.append(text_file)
        amaxes.append(real(model_dir, text_file, **kw))
        return amaxes[-1]

    real = calibrate.calibrate_from_text
    monkeypatch.setattr(calibrate, "calibrate_from_text", spy)
    assert main(["quantize", str(tiny_bf16), str(tmp_path / "q"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"calibrating activation amax over the bundled text {CALIBRATION_TXT}" in out
    assert "wrote NVFP4 checkpoint" in out
    assert texts == [CALIBRATION_TXT]

    got = _input_scales(tmp_path / "q")
    assert len(got) == 14  # q, k, v, o, gate, up, down of 2 layers
    for name, v in got.items():  # input_scale = the calibrated amax / (6 * 448)
        want = torch.tensor(amaxes[0][name.removesuffix(".input_scale")]) / (6 * 448)
        assert torch.equal(v, want), name


def test_quantize_help_names_the_default_text(capsys):
    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    assert "pieceworks/data/calibration.txt" in " ".join(capsys.readouterr().out.split())


def test_fixed_amax_skips_calibration(tiny_bf16, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(tiny_bf16, src)
    (src / "pieceworks-cache.json").write_text('{"format": 1}')  # as a demo model converted by pieceworks holds
    for name in ("pytorch_model.bin", "pytorch_model.bin.index.json", "consolidated.00.pth", "README.md"):
        (src / name).write_bytes(b"the source's own weights, in another format" if "model" in name else b"# card")
    (src / "original").mkdir()
    (src / "original" / "consolidated.00.pth").write_bytes(b"weights")
    assert main(["quantize", str(src), str(tmp_path / "q"), "--amax", "8", "--no-progress"]) == 0
    assert "calibrating" not in capsys.readouterr().out
    for name, v in _input_scales(tmp_path / "q").items():
        assert torch.equal(v, torch.tensor(8.0) / (6 * 448)), name
    # the tokenizer and the model card go along; the record of the source's own conversion, its weights in other
    # formats (the quantized safetensors replace them) and its subdirectories do not
    out = {f.name for f in (tmp_path / "q").iterdir()}
    assert {"tokenizer.json", "README.md", "model.safetensors"} <= out
    assert not out & {"pieceworks-cache.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
                      "consolidated.00.pth", "original"}, out


def test_calibration_shows_its_progress_per_chunk(tiny_bf16, tmp_path, monkeypatch):
    from contextlib import contextmanager

    from pieceworks.quant import calibrate

    bars = []

    @contextmanager
    def bar(enabled, description, total):
        bars.append([enabled, description, total, 0])

        def advance(n=1):
            bars[-1][3] += n

        yield advance

    monkeypatch.setattr(calibrate, "progress_bar", bar)
    calibrate.calibrate_from_text(tiny_bf16, CALIBRATION_TXT, seq_len=64, progress=True)
    assert len(bars) == 1 and bars[0][:2] == [True, "calibrating"] and bars[0][2] > 1 and bars[0][3] == bars[0][2]


def test_calibration_chunks_must_hold_text_after_bos():
    from pieceworks.quant.calibrate import text_batches

    class Tok:
        bos_token_id = 1

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [5, 6, 7]}

    assert [b.tolist() for b in text_batches(Tok(), "x", 3)] == [[[1, 5, 6]], [[1, 7]]]
    with pytest.raises(ValueError, match="max_position_embeddings.*hold no text after the BOS token"):
        text_batches(Tok(), "x", 1)


def test_fp8_kv_scales_follow_the_attention_not_its_k_or_v_projection(tiny_bf16, tmp_path, caplog):
    """--kv-cache fp8: a layer whose k_proj or v_proj alone is excluded keeps its K/V scales (its attention is still
    quantized, as the loader reads the written exclude list); a layer whose attention is excluded whole gets none
    and loads with scales of 1.0. Every output loads and scores."""
    from pieceworks import Executor
    from pieceworks.core.kv import KV_FP8

    for i, (exclude, scaled) in enumerate(((["model.layers.1.self_attn.v_proj"], True),
                                           (["model.layers.1.self_attn.k_proj"], True),
                                           (["model.layers.1.self_attn.*"], False))):
        out = tmp_path / f"q{i}"
        assert main(["quantize", str(tiny_bf16), str(out), "--kv-cache", "fp8", "--exclude", *exclude,
                     "--no-progress"]) == 0
        reader = CheckpointReader(out)
        assert reader.has("model.layers.0.self_attn.k_proj.k_scale"), exclude
        for p in "kv":
            assert reader.has(f"model.layers.1.self_attn.{p}_proj.{p}_scale") == scaled, exclude
        ex = Executor.from_config({"model": {"path": str(out)}, "runtime": {"device": "cpu", "dtype": "float32"},
                                   "kv_cache": {"num_tokens": 64, "page_size": 4}}, progress=False)
        assert ex.kv.dtype == KV_FP8 and (ex.kv.scales[1] == (1.0, 1.0)) != scaled, exclude
        assert torch.isfinite(ex.score([[2, 3, 4, 5]])[0]).all()


@pytest.mark.parametrize("amax", ["1e-40", "1e-36"])
def test_an_amax_whose_input_scale_is_not_a_normal_float32_is_refused(tiny_bf16, tmp_path, capsys, amax):
    """amax / 2688 below float32's smallest normal number: the scale is 0 or subnormal (W4A4 divides by it)."""
    assert main(["quantize", str(tiny_bf16), str(tmp_path / "q"), "--amax", amax, "--no-progress"]) == 2
    assert "--amax must be a number from 3.2e-35" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_linears_whose_input_size_is_not_a_multiple_of_16_are_named(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=40, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    with pytest.warns(UserWarning, match=r"6 linear\(s\) stay in torch.bfloat16 because their input size is not a "
                                         r"multiple of 16 \(e.g. model.layers.0.mlp.gate_proj: K = 40\)"):
        assert main(["quantize", str(tmp_path / "src"), str(tmp_path / "q"), "--amax", "8", "--no-progress"]) == 0
    assert set(_input_scales(tmp_path / "q")) == {"model.layers.0.mlp.down_proj.input_scale"}


def test_max_shard_size_forms():
    """Sizes in the accepted forms; a positive size under one byte is refused by the flag's name, not passed on
    as 0 to the shard writer ("max_shard_bytes must be positive")."""
    from pieceworks.quant.cli import parse_size

    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("1000") == 1000
    with pytest.raises(ValueError, match=r"--max-shard-size '0.0001KB' is less than one byte; give e.g. 500MB"):
        parse_size("0.0001KB")
    for bad in ("0", "-5GB", "lots", "5XB"):
        with pytest.raises(ValueError, match=rf"--max-shard-size {bad!r}: expected a positive size"):
            parse_size(bad)


def test_failed_runs_leave_no_destination(tiny_llama_modelopt, tmp_path):
    """Non-finite weights, a binary calibration text, a destination inside the source: refused with the
    file or tensor named, and no DST directory left behind (a failed run removes what it created)."""
    import shutil

    import pytest
    from safetensors.torch import load_file, save_file

    from pieceworks.quant.quantizer import quantize_checkpoint

    src = tmp_path / "src"
    shutil.copytree(tiny_llama_modelopt.bf16_dir, src)
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][3, 5] = float("nan")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    dst = tmp_path / "out" / "fp4"
    with pytest.raises(ValueError) as e:
        quantize_checkpoint(src, dst, amax=1.0, progress=False)
    assert "model.layers.1.mlp.down_proj" in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()  # both directories the run created are gone
    (tmp_path / "kept").mkdir()  # an empty DST that was there before stays
    with pytest.raises(ValueError):
        quantize_checkpoint(src, tmp_path / "kept", amax=1.0, progress=False)
    assert (tmp_path / "kept").is_dir() and not any((tmp_path / "kept").iterdir())

    good = tiny_llama_modelopt.bf16_dir
    calib = tmp_path / "calib.bin"
    calib.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" * 20)
    with pytest.raises(ValueError, match=rf"{calib}: the calibration text is not UTF-8 \(byte \d+: .*\); it must "
                                         "be UTF-8 plain text"):
        quantize_checkpoint(good, tmp_path / "c", calib_text=calib, progress=False)
    assert not (tmp_path / "c").exists()
    inner = src / "nvfp4"
    with pytest.raises(ValueError, match="the destination lies inside the source"):
        quantize_checkpoint(src, inner, amax=1.0, progress=False)
    assert not inner.exists()


def _copy_with(src, dst, **changes):
    """A copy of checkpoint `src` at `dst` with some tensors replaced ({name: tensor})."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors.update(changes)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _quantize(*args) -> int:
    return main(["quantize", *map(str, args), "--no-progress"])


@pytest.mark.parametrize("name, value", [
    ("model.layers.0.self_attn.q_proj.weight", float("nan")),  # a fused group's member: read for the shared scale
    ("model.layers.1.mlp.down_proj.weight", float("inf")),
    ("model.norm.weight", float("nan")),  # copied unquantized: the output would carry the NaN
])
def test_non_finite_weights_are_named_and_leave_no_destination(tiny_bf16, tmp_path, capsys, name, value):
    from safetensors.torch import load_file

    bad = load_file(tiny_bf16 / "model.safetensors")[name]
    bad.view(-1)[5] = value
    src = _copy_with(tiny_bf16, tmp_path / "src", **{name: bad})
    assert _quantize(src, tmp_path / "out" / "fp4", "--amax", "8") == 2
    err = capsys.readouterr().err
    assert f"{name} holds non-finite values" in err and "fix or re-download the checkpoint" in err, err
    assert not (tmp_path / "out").exists()  # both directories the run created are gone

    kept = tmp_path / "kept"  # an empty DST that was there before stays, empty
    kept.mkdir()
    assert _quantize(src, kept, "--amax", "8") == 2
    assert kept.is_dir() and not any(kept.iterdir())


def test_every_tensor_is_checked_once(tiny_bf16, tmp_path, monkeypatch):
    """Each weight's finiteness check is one pass: a fused group's members are checked as their shared scale is
    measured, not again while they are quantized."""
    from collections import Counter

    from safetensors import safe_open

    from pieceworks.quant import quantizer

    seen, check = Counter(), quantizer.check_finite
    monkeypatch.setattr(quantizer, "check_finite", lambda src, name, t: (seen.update([name]), check(src, name, t)))
    assert _quantize(tiny_bf16, tmp_path / "fp4", "--amax", "8") == 0
    with safe_open(str(tiny_bf16 / "model.safetensors"), "pt") as f:
        assert seen == Counter(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in seen  # a fused group's member


@pytest.mark.parametrize("name", ["model.layers.1.mlp.down_proj.weight", "model.norm.weight"])
def test_weights_beyond_the_loaders_bound_are_named(tiny_bf16, tmp_path, capsys, name):
    """A finite weight beyond +-3.2e32 (bf16 holds up to 3.4e38) makes an output the loader refuses: refused here."""
    from safetensors.torch import load_file

    bad = load_file(tiny_bf16 / "model.safetensors")[name]
    bad.view(-1)[5] = 1e34
    src = _copy_with(tiny_bf16, tmp_path / "src", **{name: bad})
    assert _quantize(src, tmp_path / "out" / "fp4", "--amax", "8") == 2
    err = capsys.readouterr().err
    assert f"{name} holds 1 value(s) beyond +-3.2e+32" in err and "fix or re-download the checkpoint" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_an_unusable_calibrated_amax_is_refused_before_writing(tiny_bf16, tmp_path, bad):
    """An activation amax that would make input_scale NaN, inf or negative (which the loader refuses)."""
    from pieceworks.quant.quantizer import quantize_checkpoint

    reader = CheckpointReader(tiny_bf16)
    amax = {n.removesuffix(".weight"): 4.0 for n in reader.names() if n.endswith("_proj.weight")}
    amax["model.layers.1.mlp.up_proj"] = bad
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj: the calibrated activation amax is .*; "
                                         "calibrate over another text, or pass a fixed --amax X"):
        quantize_checkpoint(tiny_bf16, tmp_path / "q", input_amax=amax, progress=False)
    assert not (tmp_path / "q").exists()


def test_non_finite_weights_are_named_before_calibrating(tiny_bf16, tmp_path, capsys, monkeypatch):
    """With --calib-text a bad weight is named once the model is loaded, not after the calibration passes."""
    from safetensors.torch import load_file

    from pieceworks.quant import calibrate

    name = "model.layers.1.mlp.down_proj.weight"
    bad = load_file(tiny_bf16 / "model.safetensors")[name]
    bad.view(-1)[7] = float("nan")
    src = _copy_with(tiny_bf16, tmp_path / "src", **{name: bad})

    def no_calibration(*args, **kw):
        raise AssertionError("the calibration passes ran over a model with a NaN weight")

    monkeypatch.setattr(calibrate, "calibrate_input_amax", no_calibration)
    calib = tmp_path / "calib.txt"
    calib.write_text(calibration_text()[:2000])
    assert _quantize(src, tmp_path / "q", "--calib-text", calib) == 2
    err = capsys.readouterr().err
    assert f"{name} holds non-finite values (1 NaN, 0 inf)" in err and "fix or re-download" in err, err
    assert not (tmp_path / "q").exists()


def test_binary_calibration_text_is_named(tiny_bf16, tmp_path, capsys):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    nul = tmp_path / "blob.bin"  # valid UTF-8, yet binary
    nul.write_bytes(b"weights\x00\x00\x01\x02 and more")
    for calib, problem in ((latin1, "is not UTF-8"), (nul, "holds NUL bytes")):
        assert _quantize(tiny_bf16, tmp_path / "q", "--calib-text", calib) == 2
        err = capsys.readouterr().err
        assert f"{calib}: the calibration text {problem}" in err and "it must be UTF-8 plain text" in err, err
        assert not (tmp_path / "q").exists()


def test_destination_in_source_is_refused_before_writing(tiny_bf16, tmp_path, capsys, monkeypatch):
    src = tmp_path / "src"
    shutil.copytree(tiny_bf16, src)
    before = sorted(p.name for p in src.iterdir())
    (tmp_path / "link").symlink_to(src)
    monkeypatch.chdir(tmp_path)
    for dst, problem in (
        ("src", "the destination is the source"),
        ("link", "the destination is the source"),
        ("src/../src", "the destination is the source"),
        ("src/nvfp4", "the destination lies inside the source"),
        ("link/a/b", "the destination lies inside the source"),
    ):
        assert _quantize("src", dst, "--amax", "8") == 2, dst
        err = capsys.readouterr().err
        assert f"{dst}: {problem}" in err and "outside" in err, err
        assert sorted(p.name for p in src.iterdir()) == before, dst


def test_unusable_destinations_are_named(tiny_bf16, tmp_path, capsys):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "x")
    assert _quantize(tiny_bf16, tmp_path / "dangling", "--amax", "8") == 2
    assert "which does not exist; create that directory or choose another DST" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")
    assert _quantize(tiny_bf16, tmp_path / "a_file" / "q", "--amax", "8") == 2
    err = capsys.readouterr().err
    assert "a_file/q: cannot create the destination directory (Not a directory" in err, err


def test_too_little_free_space_is_refused_before_writing(tiny_bf16, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    assert _quantize(tiny_bf16, tmp_path / "q", "--amax", "8") == 2
    err = capsys.readouterr().err
    assert "q: the NVFP4 checkpoint needs" in err and "free some space or choose a DST on another disk" in err, err
    assert not (tmp_path / "q").exists()


class _FullDisk:
    """A shard file whose writes are buffered and whose close finds the disk full, as on a full disk."""

    def __init__(self, f):
        self.f = f

    def seek(self, offset):
        self.f.seek(offset)

    def write(self, data):
        return len(data)

    def close(self):
        self.f.close()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_writing_shards_leaves_nothing(tiny_bf16, tmp_path, capsys, monkeypatch):
    from pieceworks.quant import shard_writer

    real_open = open
    monkeypatch.setattr(shard_writer, "open", lambda path, mode="r": _FullDisk(real_open(path, mode))
                        if mode == "r+b" else real_open(path, mode), raising=False)
    for max_shard in ("1GB", "20KB"):  # one file; several shards (a full disk while switching files)
        assert _quantize(tiny_bf16, tmp_path / "new" / "q", "--amax", "8", "--max-shard-size", max_shard) == 2
        err = capsys.readouterr().err
        assert "q: the disk is full (No space left on device); the files this run wrote are removed" in err, err
        assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    assert _quantize(tiny_bf16, kept, "--amax", "8") == 2
    assert kept.is_dir() and not any(kept.iterdir())


def test_unsigned_integer_tensors_are_copied(tiny_bf16, tmp_path):
    """safetensors' U16/U32/U64 tensors (which the reader loads) are written as they are."""
    from safetensors.torch import load_file

    ids = torch.tensor([1, 2, 65535], dtype=torch.int32).to(torch.uint16)
    src = _copy_with(tiny_bf16, tmp_path / "src", **{"model.extra_ids": ids})
    assert _quantize(src, tmp_path / "q", "--amax", "8") == 0
    assert torch.equal(load_file(tmp_path / "q" / "model.safetensors")["model.extra_ids"], ids)


def test_float8_tensors_are_checked_and_copied(tiny_bf16, tmp_path, capsys):
    """torch has no isfinite for float8_e4m3fn: the value check still runs on such a tensor (no traceback)."""
    from safetensors.torch import load_file

    scale = torch.tensor([0.5, 1.0, 448.0]).to(torch.float8_e4m3fn)
    src = _copy_with(tiny_bf16, tmp_path / "src", **{"model.extra_scale": scale})
    assert _quantize(src, tmp_path / "q", "--amax", "8") == 0
    assert torch.equal(load_file(tmp_path / "q" / "model.safetensors")["model.extra_scale"].float(), scale.float())
    bad = _copy_with(tiny_bf16, tmp_path / "bad", **{"model.extra_scale": torch.tensor([1.0, float("inf")]).to(
        torch.float8_e5m2)})
    assert _quantize(bad, tmp_path / "q2", "--amax", "8") == 2
    assert "model.extra_scale holds non-finite values (0 NaN, 1 inf)" in capsys.readouterr().err
    assert not (tmp_path / "q2").exists()


# --- the staging directory: DST appears complete, or not at all ---------------------------------------------
# quantize writes into `.DSTNAME.quantize-HOST-PID.tmp` beside DST and renames it to DST when every file is
# complete; a failed run removes it, a killed run's is removed by the next run into the same DST.

_RUN = "import sys; from pieceworks.cli import main; sys.exit(main(sys.argv[1:]))"


def _staging(parent, name="q") -> list:
    return sorted(p for p in parent.iterdir() if p.name.startswith(f".{name}.quantize-"))


def _python(code: str, *args, **kw):
    """Run `code` in a fresh interpreter with this checkout importable."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env, capture_output=True, text=True,
                          **kw)


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", ""])
    p.wait()
    return p.pid


def _listing(d) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _on_close(monkeypatch, hook):
    """Call hook(writer) right after the shard writer's close: every file is complete, DST not yet renamed."""
    from pieceworks.quant import shard_writer

    real_close = shard_writer.ShardedWriter.close

    def close(self):
        names = real_close(self)
        hook(self)
        return names

    monkeypatch.setattr(shard_writer.ShardedWriter, "close", close)


def test_the_run_writes_beside_dst_and_renames_it_when_complete(tiny_bf16, tmp_path, monkeypatch):
    seen, where = [], {}

    def look(writer):  # every file complete, not yet renamed
        dst = where["dst"]
        seen.append((dst.exists() and any(dst.iterdir()), writer.out_dir, _staging(dst.parent, dst.name),
                     sorted(p.name for p in writer.out_dir.iterdir())))

    _on_close(monkeypatch, look)
    dst = where["dst"] = tmp_path / "new" / "q"
    assert _quantize(tiny_bf16, dst, "--amax", "8") == 0
    dst_had_files, staging, listed, files = seen[0]
    assert not dst_had_files and listed == [staging]  # DST absent while the files are written
    assert re.fullmatch(rf"\.q\.quantize-.+-{os.getpid()}\.tmp", staging.name), staging.name
    assert {"config.json", "hf_quant_config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert sorted(p.name for p in dst.iterdir()) == files  # the same files, now under DST
    assert _staging(dst.parent) == [] and sorted(p.name for p in (tmp_path / "new").iterdir()) == ["q"]
    assert len(_input_scales(dst)) == 14

    kept = where["dst"] = tmp_path / "kept"  # an existing empty DST: replaced by the finished directory, its mode kept
    kept.mkdir()
    kept.chmod(0o750)
    assert _quantize(tiny_bf16, kept, "--amax", "8") == 0
    assert seen[1][0] is False and seen[1][1].parent == tmp_path
    assert sorted(p.name for p in kept.iterdir()) == files and (kept.stat().st_mode & 0o777) == 0o750
    assert _staging(tmp_path, "kept") == []
    (tmp_path / "link").symlink_to(tmp_path / "target")  # a symlink to an empty directory: filled where it points
    (tmp_path / "target").mkdir()
    where["dst"] = tmp_path / "target"
    assert _quantize(tiny_bf16, tmp_path / "link", "--amax", "8") == 0
    assert (tmp_path / "link").is_symlink() and sorted(p.name for p in (tmp_path / "target").iterdir()) == files


def test_an_interrupt_before_the_rename_leaves_nothing(tiny_bf16, tmp_path, monkeypatch):
    from pieceworks.quant.quantizer import quantize_checkpoint

    def interrupt(writer):
        raise KeyboardInterrupt

    _on_close(monkeypatch, interrupt)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(tiny_bf16, tmp_path / "new" / "q", amax=8.0, progress=False)
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    assert _quantize(tiny_bf16, tmp_path / "kept", "--amax", "8") == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and not any((tmp_path / "kept").iterdir())


_KILLED = """
import os, signal, sys
from pieceworks.quant import shard_writer
real_close = shard_writer.ShardedWriter.close
def close(self):
    real_close(self)
    os.kill(os.getpid(), signal.SIGKILL)  # every file written, not yet renamed to DST
shard_writer.ShardedWriter.close = close
from pieceworks.cli import main
main(sys.argv[1:])
"""


def test_a_killed_run_leaves_no_destination_and_does_not_block_the_next(tiny_bf16, tmp_path):
    """SIGKILL (the OOM killer, a power loss) after every file was written: DST does not exist; the files are in the
    hidden staging directory, which the next run removes (its process is gone) before writing its own."""
    dst = tmp_path / "q"
    killed = _python(_KILLED, "quantize", tiny_bf16, dst, "--amax", "8", "--no-progress", timeout=300)
    assert killed.returncode == -9, killed.stderr
    assert not dst.exists()
    [stale] = _staging(tmp_path)
    assert {"config.json", "model.safetensors"} <= {p.name for p in stale.iterdir()}
    assert _quantize(tiny_bf16, dst, "--amax", "8") == 0
    assert _staging(tmp_path) == [] and len(_input_scales(dst)) == 14


def test_stale_staging_directories_are_removed_when_their_process_is_gone(tiny_bf16, tmp_path, capsys,
                                                                          monkeypatch):
    from pieceworks.quant.output_dir import _host

    host, dead = _host(), _dead_pid()
    stale = [f".q.quantize-{host}-{dead}.tmp",  # this host, process gone
             f".q.quantize-{host}-{os.getpid()}.tmp"]  # an earlier process that had this pid
    kept = [f".q.quantize-{host}-{os.getppid()}.tmp",  # a run still going
            f".q.quantize-otherhost-{dead}.tmp",  # another host's (a shared disk): its pid means nothing here
            f".r.quantize-{host}-{dead}.tmp",  # another DST's
            f".q.quantize-{host}-x{dead}.tmp"]  # not a name quantize makes
    for name in stale + kept:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"partial")
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    assert _quantize(tiny_bf16, tmp_path / "q", "--amax", "8") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "is left by another quantize run into the same DST, still running or on another host: remove it if it " \
           "is not); free some space" in err, err
    assert not any((tmp_path / n).exists() for n in stale)  # removed before the free space was counted
    monkeypatch.setattr(shutil, "disk_usage", real_usage)
    assert _quantize(tiny_bf16, tmp_path / "q", "--amax", "8") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + ["q"])
    assert all((tmp_path / n / "model.safetensors").read_bytes() == b"partial" for n in kept)


@pytest.mark.parametrize("existed, appears", [
    (False, "a directory with a file"),
    (True, "a file in the empty DST"),
    (False, "a file"),
])
def test_a_destination_created_during_the_run_is_left_alone(tiny_bf16, tmp_path, capsys, monkeypatch, existed,
                                                           appears):
    dst = tmp_path / "q"
    if existed:
        dst.mkdir()

    def someone_else(writer):
        if appears == "a file":
            dst.write_text("theirs")
        else:
            dst.mkdir(exist_ok=True)
            (dst / "theirs.txt").write_text("theirs")

    _on_close(monkeypatch, someone_else)
    assert _quantize(tiny_bf16, dst, "--amax", "8") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{dst}: was created or filled by someone else (another quantize run into the same DST?) while this " \
           "run was writing; it is left as it is and this run's output is removed" in err, err
    assert (dst.read_text() if appears == "a file" else _listing(dst)) in ("theirs", {"theirs.txt": b"theirs"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # no staging directory left


def test_two_runs_into_one_new_destination(tiny_bf16, tmp_path, capsys, monkeypatch):
    """Both pass the checks on a new DST; the one that finishes first gets DST, the other fails and leaves it."""
    dst = tmp_path / "q"
    other = []

    def run_another(writer):  # while this run is about to rename, another process quantizes into the same DST
        other.append(_python(_RUN, "quantize", tiny_bf16, dst, "--amax", "8", "--no-progress", timeout=300))
        other.append(_listing(dst))

    _on_close(monkeypatch, run_another)
    assert _quantize(tiny_bf16, dst, "--amax", "8") == 2
    assert other[0].returncode == 0, other[0].stderr  # it left this run's staging directory alone (pid alive)
    assert "was created or filled by someone else" in capsys.readouterr().err
    assert _listing(dst) == other[1] and "model.safetensors" in other[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_an_empty_mount_point_is_refused(tiny_bf16, tmp_path, capsys, monkeypatch):
    """The staging directory lives beside DST: a DST that is a file system of its own cannot receive it by rename."""
    from pieceworks.quant import output_dir

    monkeypatch.setattr(output_dir, "is_mount_point", lambda real: real == tmp_path / "mnt")
    (tmp_path / "mnt").mkdir()
    assert _quantize(tiny_bf16, tmp_path / "mnt", "--amax", "8") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "mnt: an empty file system of its own (a mount point)" in err and f"e.g. {tmp_path}/mnt/nvfp4" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnt"]


def test_a_failed_rename_puts_the_empty_destination_back(tiny_bf16, tmp_path, capsys, monkeypatch):
    """The empty DST is removed right before the rename; when the rename fails for another reason, it is made
    again (with its mode) and the run's output removed."""
    real_rename = os.rename

    def rename(a, b, **kw):
        if str(a).endswith(".tmp"):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(a))
        return real_rename(a, b, **kw)

    monkeypatch.setattr(os, "rename", rename)
    kept = tmp_path / "kept"
    kept.mkdir()
    kept.chmod(0o751)
    assert _quantize(tiny_bf16, kept, "--amax", "8") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "kept: cannot move the finished checkpoint from .kept.quantize-" in err and "(Permission denied)" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and not any(kept.iterdir())
    assert kept.stat().st_mode & 0o777 == 0o751


def test_a_second_run_in_the_same_process_does_not_take_a_running_ones_staging_directory(tmp_path):
    """Two threads of one process (one pid, so one staging name) quantizing into one DST: the second is refused,
    and does not remove the first one's directory as stale."""
    from pieceworks.quant.output_dir import Staging

    first, second = Staging(tmp_path / "q"), Staging(tmp_path / "q")
    first.create()
    try:
        assert second.clear_stale() == [first.path] and first.path.is_dir()
        with pytest.raises(ValueError, match="q: another quantize run in this process is writing it"):
            second.create()
        assert first.path.is_dir()
    finally:
        first.discard()
    assert list(tmp_path.iterdir()) == []
    second.create()  # free again
    second.discard()


def test_mixtral_experts_are_calibrated_under_their_checkpoint_names(tmp_path, recwarn):
    """transformers 5 calls Mixtral's block_sparse_moe `mlp` and its w1 / w3 / w2 gate / up / down: calibration
    reports the checkpoint's names, so every expert gets its measured input_scale (not the 6.0 fallback)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=4, experts_implementation="eager"))
    amax, reader = _calibrate_and_quantize(model, tmp_path, recwarn, "model.layers.1.block_sparse_moe.experts.3.w2")
    assert not [k for k in amax if ".mlp." in k]


def _calibrate_and_quantize(model, tmp_path, recwarn, expert: str):
    """Calibrate `model` on random tokens and quantize its checkpoint with that amax: no linear falls back for want
    of data, and `expert`'s input_scale is its amax / (6 * 448). Returns (amax, the export's reader)."""
    import warnings

    from pieceworks.quant.calibrate import calibrate_input_amax
    from pieceworks.quant.quantizer import quantize_checkpoint

    model.save_pretrained(tmp_path / "bf16")
    amax = calibrate_input_amax(model, [torch.randint(0, 128, (1, 32))])
    assert expert in amax
    warnings.simplefilter("always")
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "fp4", input_amax=amax, progress=False)
    assert not [w for w in recwarn if "got no calibration data" in str(w.message)]
    reader = CheckpointReader(tmp_path / "fp4")
    assert float(reader.get(f"{expert}.input_scale")) == pytest.approx(amax[expert] / (6 * 448), rel=1e-6)
    return amax, reader


def test_glm4_moe_experts_and_shared_experts_are_calibrated(tmp_path, recwarn):
    """GLM-4.5's routed experts (transformers 5 stacks them), its shared experts and its dense first layer each get a
    measured input_scale; its router and correction bias stay unquantized."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, n_routed_experts=4, num_experts_per_tok=4, moe_intermediate_size=32,
        first_k_dense_replace=1, attention_bias=True, pad_token_id=None, experts_implementation="eager"))
    amax, reader = _calibrate_and_quantize(model, tmp_path, recwarn, "model.layers.1.mlp.experts.3.down_proj")
    for name in ("model.layers.1.mlp.shared_experts.up_proj", "model.layers.0.mlp.gate_proj",
                 "model.layers.1.self_attn.q_proj"):
        assert amax.get(name, 0) > 0, name
    assert not reader.has("model.layers.1.mlp.gate.weight_scale")
    assert reader.get("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32


def test_gemma3_multimodal_text_model_is_calibrated_under_its_checkpoint_names(tmp_path, recwarn):
    """transformers 5 runs Gemma 3's text model as `model.language_model`; its checkpoint says
    `language_model.model`: every text linear gets its measured input_scale, the vision model none."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=127, boi_token_index=125, eoi_token_index=126)).eval()
    amax, reader = _calibrate_and_quantize(model, tmp_path, recwarn, "language_model.model.layers.1.mlp.down_proj")
    assert not [k for k in amax if k.startswith("model.")]
    assert not [n for n in reader.names() if "vision_tower" in n and n.endswith("weight_scale")]


def test_exclude_patterns_that_take_src_and_dst_are_explained(tiny_bf16, tmp_path, capsys):
    """`--exclude` takes one or more patterns, so SRC DST after it become patterns: the error says so and how to
    write it; `--` ends the patterns; flags may stand between SRC and DST."""
    out = tmp_path / "q"
    with pytest.raises(SystemExit) as exit_:
        main(["quantize", "--exclude", "model.layers.0.*", str(tiny_bf16), str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "the following arguments are required: SRC, DST (given after --exclude, SRC " \
        "and DST are read as its patterns: give them first" in err and "end the patterns with --" in err, err
    assert not out.exists()
    assert main(["quantize", "--amax", "8", "--no-progress", "--exclude", "model.layers.0.*", "--", str(tiny_bf16),
                 str(out)]) == 0
    assert (out / "hf_quant_config.json").exists()
    # flags between SRC and DST
    assert main(["quantize", str(tiny_bf16), "--amax", "8", "--no-progress", str(tmp_path / "q2")]) == 0


@pytest.mark.parametrize("flags", [["--no-progress"], []])
def test_no_progress_hides_transformers_loading_bar_too(tiny_bf16, tmp_path, capfd, flags):
    """Calibration loads the model with transformers, which draws a bar of its own: --no-progress hides it too, and
    transformers' setting is as it was afterwards."""
    from transformers.utils import logging as hf_logging

    assert main(["quantize", str(tiny_bf16), str(tmp_path / "q"), *flags]) == 0
    err = capfd.readouterr().err
    assert ("Loading weights" in err) == (not flags), err[-500:]
    assert hf_logging.is_progress_bar_enabled()


def test_a_staging_directory_whose_flock_is_held_is_not_stale(tmp_path):
    """A run holds an flock on its staging directory while it writes: one whose pid looks gone from here (a run in
    another PID namespace of this host) but whose lock is held is kept; once the lock is free it is removed."""
    import fcntl

    from pieceworks.quant.output_dir import Staging, _host, _locked_elsewhere

    running = Staging(tmp_path / "q")
    running.create()
    assert _locked_elsewhere(running.path)
    running.discard()
    assert list(tmp_path.iterdir()) == []
    other = tmp_path / f".q.quantize-{_host()}-{_dead_pid()}.tmp"
    other.mkdir()
    fd = os.open(other, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert Staging(tmp_path / "q").clear_stale() == [other] and other.is_dir()
    finally:
        os.close(fd)
    assert Staging(tmp_path / "q").clear_stale() == [] and not other.exists()
