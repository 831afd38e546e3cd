"""`pieceworks quantize SRC DST` with neither --calib-text nor --amax calibrates over the bundled text."""

from __future__ import annotations

import re

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
    assert main(["quantize", str(tiny_bf16), str(tmp_path / "q"), "--amax", "8", "--no-progress"]) == 0
    assert "calibrating" not in capsys.readouterr().out
    for name, v in _input_scales(tmp_path / "q").items():
        assert torch.equal(v, torch.tensor(8.0) / (6 * 448)), name


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
    with pytest.raises(ValueError, match=rf"{calib}: the calibration text is not UTF-8 \(byte \d+: .*\); give a "
                                         "plain-text file"):
        quantize_checkpoint(good, tmp_path / "c", calib_text=calib, progress=False)
    assert not (tmp_path / "c").exists()
    inner = src / "nvfp4"
    with pytest.raises(ValueError, match="the destination lies inside the source"):
        quantize_checkpoint(src, inner, amax=1.0, progress=False)
    assert not inner.exists()
