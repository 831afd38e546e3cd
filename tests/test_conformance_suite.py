"""The conformance suite, run the documented way (`pytest --pyargs pieceworks.testing.suite
--pieceworks-backend OP.NAME`) in a subprocess on out-of-tree plugins installed by entry point: it passes
docs/plugins.md's example backend, a correct tiled copy of it and a correct fp4 GEMM, fails each broken
backend (the copies in tests/helpers/suite_variants.py and the backends below) with a message naming the
mistake, fails a run whose backend under test skipped every case, and fails a run of every backend where
an installed plugin is broken.

This module is a plugin too (entry point `wrong` in the test site): `pieceworks_register_backends` below
registers its backends, each of which makes one mistake a plugin author made."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from pieceworks import hookimpl
from pieceworks.backends.attention.base import AttentionBackend
from pieceworks.backends.attention.torch import TorchAttentionBackend, attend
from pieceworks.backends.fp4_gemm.base import Fp4GemmBackend
from pieceworks.backends.mla.torch import TorchMLABackend, attend_latent
from pieceworks.backends.moe.torch import TorchMoEBackend
from pieceworks.core.batch import ForwardMode, GraphMode
from pieceworks.quant import nvfp4

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
BROKEN = {  # backend -> what the suite must say about it (one of its failures)
    "attention.anyheaddim": "shapes that check() accepts fail",
    "attention.nokvwrite": "new tokens' K/V are not at their slots",
    "attention.ignoreslayer": "new tokens' K/V are not at their slots",
    "attention.ignoresscale": "relative error",
    "attention.staleplan": "step 2",  # its first step is right; the next one reads the first one's plan
    "attention.nanpadded": "padded rows",
    "attention.nopaddedkv": "the reserved slot does not hold a padded row's K/V",
    "attention.syncs": "syncs with the host or reads tensor values on the host: item",
    "attention.fp32error": "> tolerance 1e-05",
    "attention.bf16error": "> tolerance 5e-03",
    # this module's backends
    "attention.writesq": "forward changed its input q (max |diff|",
    "attention.strided": "(float32, q, k, v strided views of one fused qkv projection): relative error",
    "attention.window": "long_context (float32, q, k, v separate tensors): relative error",
    "attention.stub": "forward is not implemented: define forward(self, q, k, v, out, layer_id, scale, kv) with "
                      "the signature of AttentionBackend.forward",
    "attention.indexedoffbyone": "full extend step 1 (full, a+5, b+7)",
    "fp4_gemm.inplace": "forward changed its input x (max |diff|",
    "fp4_gemm.reusesout": "forward's result changed when forward ran again: return a new tensor each call",
    "fp4_gemm.float32out": "forward returned float32 for bfloat16 x; return x's dtype",
    "fp4_gemm.transposed": "forward returned shape (96, 7), expected [M, N] = (7, 96)",
    "fp4_gemm.undeclared": "if your kernel keeps activations in bf16/fp32 (w4a16), declare numerics = ('w4a16',)",
    "fp4_gemm.noresidual": "forward_add, against residual + forward: not the same bits",
    "attention.checkstr": "attention.checkstr.check() returned 'needs an H100'; return a list of reason strings",
    "attention.checkraises": "attention.checkraises.check() raised KeyError: 'head_dim'; check() returns why",
    "fp4_gemm.syncs": "fp4_gemm.syncs.forward is not traceable as one graph",
    "attention.bf16window": "long_context (bfloat16, q, k, v separate tensors): relative error",
    "mla.bf16window": "mla.bf16window long_context (bfloat16): relative error",
    "attention.counts": "attention.counts.forward traces to another graph for a later step",
    "attention.pastend": "reads no cache slot but its sequences' tokens",
    "attention.zeroesslots": "plan or forward changed meta.slot_mapping: the step's metadata is the runner's",
    # kernels right at small sizes only: the suite's large cases
    "attention.firstblock": "long_extend (float32, q, k, v separate tensors): relative error",
    "fp4_gemm.rows64": "w4a16 float32 m=200 k=1024 n=64: relative error",
    "fp4_gemm.splitk": "w4a16 float32 m=200 k=1024 n=64: relative error",
    "moe.experts16": "nvfp4 w4a16 (float32), 160 tokens over 64 experts: relative error",
}
HINTS = {  # backend -> what each of its failures must say
    "attention.strided": "contiguous copies of the same q, k, v pass: read q, k and v through their strides",
    "fp4_gemm.transposed": "forward returned shape",  # not a reshape error in the fused tests
}


# ---------------------------------------------------------------------------- this plugin's backends
class GoodGemm(Fp4GemmBackend):
    """Correct: a w4a16 NVFP4 GEMM in plain torch."""

    name = "good"
    numerics = ("w4a16",)

    def forward(self, x, weight, weight_scale, weight_scale_2, input_scale, out_features):
        return x @ nvfp4.dequantize(weight, weight_scale, weight_scale_2, dtype=x.dtype).t()


class InPlaceGemm(GoodGemm):
    name = "inplace"

    def forward(self, x, *args):
        x.clamp_(-1.0, 1.0)  # "saturates" the activations in its input
        return super().forward(x, *args)


class ReusesOutGemm(GoodGemm):
    """Returns one buffer per shape, overwritten by the next call (a later GEMM overwrites a result still in use)."""

    name = "reusesout"

    def forward(self, x, *args):
        y = super().forward(x, *args)
        buf = self.__dict__.setdefault("bufs", {}).setdefault((y.shape, y.dtype), torch.empty_like(y))
        return buf.copy_(y)


class Float32Gemm(GoodGemm):
    name = "float32out"

    def forward(self, x, *args):
        return super().forward(x.float(), *args)


class TransposedGemm(GoodGemm):
    name = "transposed"

    def forward(self, *args):
        return super().forward(*args).t()


class UndeclaredW4A16Gemm(GoodGemm):
    """Correct w4a16 numerics, but it does not declare them: the w4a4 cases run and fail."""

    name = "undeclared"
    numerics = ()


class NoResidualGemm(GoodGemm):
    name = "noresidual"

    def forward_add(self, x, weight, weight_scale, weight_scale_2, input_scale, out_features, residual):
        return self.forward(x, weight, weight_scale, weight_scale_2, input_scale, out_features)


class WritesQ(TorchAttentionBackend):
    """Right output, but it scales q in place."""

    name = "writesq"

    def forward(self, q, k, v, out, layer_id, scale, kv):
        super().forward(q.mul_(scale), k, v, out, layer_id, 1.0, kv)


class IgnoresStrides(TorchAttentionBackend):
    """Reads v as if it were contiguous (a kernel taking v.data_ptr() without v.stride())."""

    name = "strided"

    def forward(self, q, k, v, out, layer_id, scale, kv):
        v = v.as_strided(v.shape, (v.shape[1] * v.shape[2], v.shape[2], 1))
        super().forward(q, k, v, out, layer_id, scale, kv)


WINDOW = 1024


class KeepsStep(TorchAttentionBackend):
    """The torch backend keeping the planned step as `self.step`, for the variants below to read."""

    name = "keepsstep"

    def plan(self, meta):
        super().plan(meta)
        self.step = meta


class ReadsPastTheEnd(KeepsStep):
    """Extend steps read each sequence's pages whole, the slots past its length too (as a kernel that loads
    whole pages and masks only the scores: 0 x NaN is NaN)."""

    name = "pastend"

    def forward(self, q, k, v, out, layer_id, scale, kv):
        super().forward(q, k, v, out, layer_id, scale, kv)
        if self.step.mode is not ForwardMode.DECODE:
            vc = kv.v_cache(layer_id)
            for _, seq_len, pages, rows in self._seqs:
                out[rows] += 0 * vc[pages].flatten(0, 1)[seq_len:].float().sum().to(out.dtype)


class Window(KeepsStep):
    """Decode attends to the last 1024 keys only (a split-KV kernel that drops the earlier splits)."""

    name = "window"

    def forward(self, q, k, v, out, layer_id, scale, kv):
        super().forward(q, k, v, out, layer_id, scale, kv)
        meta = self.step
        if meta.mode is not ForwardMode.DECODE:
            return
        for i, seq_len in enumerate(meta.seq_lens):
            if seq_len > WINDOW:
                pages = meta.page_table[i, : -(-seq_len // meta.page_size)].long()
                keys, vals = (c[pages].flatten(0, 1)[seq_len - WINDOW : seq_len]
                              for c in (kv.k_cache(layer_id), kv.v_cache(layer_id)))
                out[i] = attend(q[i : i + 1], keys, vals, scale, WINDOW - 1)[0].to(out.dtype)


class Bf16Window(Window):
    """Window's split bug in a backend serving bf16 only: the CPU runs of the scenarios in bf16 find it."""

    name = "bf16window"

    @classmethod
    def check(cls, spec):
        return super().check(spec) + ([] if spec.model.dtype == torch.bfloat16 else ["serves bf16 only"])


class Bf16MLAWindow(TorchMLABackend):
    """A bf16-only MLA backend whose decode attends to the last 1024 entries only (Window's split bug): the CPU runs
    of the MLA scenarios in bf16 find it."""

    name = "bf16window"

    @classmethod
    def check(cls, spec):
        return super().check(spec) + ([] if spec.model.dtype == torch.bfloat16 else ["serves bf16 only"])

    def forward(self, q_nope, q_pe, c_kv, k_pe, out, layer_id, scale, kv):
        super().forward(q_nope, q_pe, c_kv, k_pe, out, layer_id, scale, kv)
        meta = self._meta
        if meta.mode is not ForwardMode.DECODE:
            return
        cache = kv.latent_cache(layer_id)
        for i, seq_len in enumerate(meta.seq_lens):
            if seq_len > WINDOW:
                pages = meta.page_table[i, : -(-seq_len // meta.page_size)].long()
                entries = cache[pages].flatten(0, 1)[seq_len - WINDOW : seq_len]
                out[i] = attend_latent(q_nope[i : i + 1], q_pe[i : i + 1], entries, scale, WINDOW - 1)[0].to(out.dtype)


class IndexedAttention(TorchAttentionBackend):
    """Correct: declares full_extend and takes a full extend graph's layout from `extend_index` (each sequence's
    query offsets, then KV lengths; padding sequences empty), as a device-planned kernel reads it."""

    name = "indexed"
    full_extend = True
    shift = 0

    def plan(self, meta):
        if meta.extend_index is not None:
            b, idx = meta.graph_batch_size, meta.extend_index.tolist()
            qo, lens = idx[: b + 1], idx[b + 1:]
            extend = [e for e in (qo[i + 1] - qo[i] for i in range(b)) if e]
            meta = dataclasses.replace(meta, extend_lens=extend,
                                       prefix_lens=[n - e - self.shift for n, e in zip(lens, extend)])
        super().plan(meta)


class IndexedOffByOne(IndexedAttention):
    """Reads the KV lengths of `extend_index` as one short (takes them for the cached lengths before the step's
    last token)."""

    name = "indexedoffbyone"
    shift = 1


class StubForward(AttentionBackend):
    """forward left a stub."""

    name = "stub"

    def forward(self, q, k, v, out, layer_id, scale, kv):
        raise NotImplementedError


class FirstBlockOnly(KeepsStep):
    """Rows past a sequence's first 16 new tokens stay zero (a kernel that runs one 16-query block per sequence)."""

    name = "firstblock"

    def forward(self, q, k, v, out, layer_id, scale, kv):
        super().forward(q, k, v, out, layer_id, scale, kv)
        lo = 0
        for n in self.step.extend_lens:
            out[lo + 16 : lo + n] = 0
            lo += n


class ZeroesSlots(KeepsStep):
    """Right output and K/V, then it clears the step's slot mapping (scratch use of the runner's buffer)."""

    name = "zeroesslots"

    def forward(self, q, k, v, out, layer_id, scale, kv):
        super().forward(q, k, v, out, layer_id, scale, kv)
        self.step.slot_mapping.zero_()


class CountsInForward(TorchAttentionBackend):
    """Declares FULL graphs but scales the step's real rows by a count taken in plan: a captured graph would
    replay the first step's count (here harmless, a scale of 1)."""

    name = "counts"

    def plan(self, meta):
        super().plan(meta)
        self.count = meta.num_tokens

    def forward(self, q, k, v, out, layer_id, scale, kv):
        super().forward(q, k, v, out, layer_id, scale, kv)
        out[: self.count] *= 1.0


class Rows64Gemm(GoodGemm):
    """Rows past the first 64 stay zero (one 64-row tile)."""

    name = "rows64"

    def forward(self, x, *args):
        y = super().forward(x, *args)
        y[64:] = 0
        return y


class SplitKGemm(GoodGemm):
    """Reads K up to 512 only (a split-K kernel that drops its second split)."""

    name = "splitk"

    def forward(self, x, *args):
        return super().forward(torch.nn.functional.pad(x[:, :512], (0, max(0, x.shape[1] - 512))), *args)


class SyncingGemm(GoodGemm):
    """Declares every graph mode but reads a value on the host in forward (an input-range check)."""

    name = "syncs"
    graph_modes = frozenset(GraphMode)

    def forward(self, x, *args):
        if float(x.abs().max()) > 1e4:
            raise ValueError("activations out of range")
        return super().forward(x, *args)


class Experts16MoE(TorchMoEBackend):
    """Right for at most 16 experts only (a kernel with a 16-expert table); zeros beyond."""

    name = "experts16"

    def forward(self, x, router_logits, correction_bias, weights, *args):
        y = super().forward(x, router_logits, correction_bias, weights, *args)
        return y if router_logits.shape[1] <= 16 else torch.zeros_like(y)


class Hangs(TorchAttentionBackend):
    """Its forward never returns, as a kernel that hangs."""

    name = "hangs"

    def forward(self, q, k, v, out, layer_id, scale, kv):
        while True:
            time.sleep(0.05)


class CheckStr(TorchAttentionBackend):
    """check() returns one reason as a bare string."""

    name = "checkstr"

    @classmethod
    def check(cls, spec):
        return "needs an H100"


class CheckRaises(TorchAttentionBackend):
    name = "checkraises"

    @classmethod
    def check(cls, spec):
        raise KeyError("head_dim")


WRONG = (CheckStr, CheckRaises, InPlaceGemm, Float32Gemm, TransposedGemm, UndeclaredW4A16Gemm, NoResidualGemm,
         WritesQ, IgnoresStrides, Window, Bf16Window, StubForward, IndexedOffByOne, FirstBlockOnly, ZeroesSlots,
         CountsInForward, Rows64Gemm, SplitKGemm, SyncingGemm, Experts16MoE, Hangs,
         ReadsPastTheEnd, Bf16MLAWindow, ReusesOutGemm)


@hookimpl
def pieceworks_register_backends():
    return [GoodGemm, IndexedAttention, *WRONG]


# ---------------------------------------------------------------------------- the tests


def docs_example() -> str:
    """The complete backend of docs/plugins.md (its first Python block)."""
    text = (ROOT / "docs" / "plugins.md").read_text()
    block = re.search(r"```python\n(# mykernels/plugin\.py\n.*?)```", text, re.S)
    assert block, "docs/plugins.md lost its example backend (a ```python block starting '# mykernels/plugin.py')"
    return block.group(1)


def dist(site: Path, name: str, eps: str) -> None:
    info = site / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(eps)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A site directory with docs/plugins.md's `mykernels` package and the variants, each installed by
    entry point of group pieceworks as a plugin author's pyproject.toml would declare it."""
    site = tmp_path_factory.mktemp("site")
    (site / "mykernels").mkdir()
    (site / "mykernels" / "__init__.py").write_text("")
    (site / "mykernels" / "plugin.py").write_text(docs_example())
    (site / "suite_variants.py").write_text((ROOT / "tests" / "helpers" / "suite_variants.py").read_text())
    dist(site, "mykernels", "[pieceworks]\nmykernels = mykernels.plugin\n")
    dist(site, "suite_variants", "[pieceworks]\nvariants = suite_variants\n")
    dist(site, "wrong_backends", "[pieceworks]\nwrong = test_conformance_suite\n")
    return site


def suite(site: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "pieceworks.testing.suite", "-q", "-p", "no:cacheprovider",
           "--pieceworks-device", "cpu", *args]
    if not any(ep.name == "pieceworks.testing.plugin" for ep in importlib.metadata.entry_points(group="pytest11")):
        cmd += ["-p", "pieceworks.testing.plugin"]  # this checkout is not installed: name the plugin
    # one thread: the tensors are tiny, and CI machines are small
    path = [str(site), str(ROOT), str(ROOT / "tests")]  # tests/: this module, plugin `wrong`
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=site, env=env, capture_output=True, text=True, timeout=timeout)


def failures(xml: Path) -> dict[str, list[tuple[str, str]]]:
    """backend key -> (message, message and traceback) of each failed case, from a JUnit report."""
    out: dict[str, list[tuple[str, str]]] = {}
    for case in ET.parse(xml).iter("testcase"):
        key = re.search(r"(attention|mla|fp4_gemm|moe)\.\w+", case.get("name", ""))
        for bad in [*case.iter("failure"), *case.iter("error")]:
            message = bad.get("message") or ""
            out.setdefault(key.group(0) if key else "?", []).append((message, message + (bad.text or "")))
    return out


def test_suite_passes_the_docs_example_and_correct_plugins(site):
    correct = ("attention.mine", "attention.tiled", "fp4_gemm.good", "attention.indexed")
    res = suite(site, *[a for key in correct for a in ("--pieceworks-backend", key)])
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    for key in correct:
        assert re.search(rf"{key} \(under test\): \d+ passed, 0 failed", res.stdout), res.stdout[-3000:]


def test_suite_fails_each_broken_backend_and_a_backend_whose_every_case_skips(site, tmp_path):
    xml = tmp_path / "report.xml"
    args = [a for key in [*BROKEN, "attention.notimportable"] for a in ("--pieceworks-backend", key)]
    # --tb=line: the report's messages are what is checked, and formatting 100+ tracebacks takes seconds
    res = suite(site, *args, f"--junitxml={xml}", "--tb=line")
    assert res.returncode == 1, res.stdout[-6000:] + res.stderr[-3000:]
    found = failures(xml)
    for key, says in BROKEN.items():
        messages = found.get(key, [])
        assert messages, f"the suite passed {key}:\n{res.stdout[-4000:]}"
        assert any(says in full for _, full in messages), (key, says, [full[:600] for _, full in messages])
        # every failure names the backend and says what is wrong (no bare AssertionError)
        for message, full in messages:
            assert key in message and HINTS.get(key, "") in full, (key, message[:600])
    # a host sync is named in the failure's message itself (torch 2.13 keeps it as the compile error's
    # inner_exception, not as __cause__), not only somewhere in a chained traceback
    assert any(BROKEN["attention.syncs"] in message for message, _ in found["attention.syncs"])
    # check() wrongly says "not importable": every case skips, which fails the run and is named
    assert "attention.notimportable" not in found
    assert "NOT TESTED: attention.notimportable: every case skipped: attention.notimportable can't serve here: " \
           "module 'mykernels_ext' is not importable (pip install mykernels)" in res.stdout, res.stdout[-4000:]
    assert "a skip is not a pass" in res.stdout


def test_a_plugin_can_be_left_out_of_a_run(tmp_path):
    """Two plugins registering one name: neither serves, so naming the backend is a usage error, until
    --pieceworks-disable leaves one out (as plugins.disabled does for the executor)."""
    code = ("from pieceworks import hookimpl\nfrom pieceworks.backends.attention.torch import TorchAttentionBackend\n"
            "class Dup(TorchAttentionBackend):\n    name = 'dup'\n"
            "@hookimpl\ndef pieceworks_register_backends():\n    return [Dup]\n")
    for name in ("dupa", "dupb"):
        (tmp_path / f"{name}.py").write_text(code)
        dist(tmp_path, name, f"[pieceworks]\n{name} = {name}\n")
    res = suite(tmp_path, "--pieceworks-backend", "attention.dup", "-k", "test_attention and small_decode")
    assert res.returncode == 4 and "no backend attention.dup is registered" in res.stderr, res.stderr[-2000:]
    res = suite(tmp_path, "--pieceworks-backend", "attention.dup", "--pieceworks-disable", "dupb",
                "-k", "test_attention and small_decode")
    assert res.returncode == 0 and re.search(r"attention.dup \(under test\): [1-9]\d* passed", res.stdout), \
        res.stdout[-3000:]


def test_allow_skip_accepts_an_untested_backend(site):
    res = suite(site, "--pieceworks-backend", "attention.notimportable", "--pieceworks-allow-skip")
    assert res.returncode == 0, res.stdout[-4000:]
    assert "NOT TESTED: attention.notimportable" in res.stdout and "--pieceworks-allow-skip: the backends above" in res.stdout


def test_a_broken_plugin_fails_a_run_of_every_backend(tmp_path):
    """Without --pieceworks-backend every plugin is under test: one the registry leaves out (here its hook
    has the wrong signature) fails the run, named with the reason."""
    (tmp_path / "badhook.py").write_text("from pieceworks import hookimpl\n\n\n@hookimpl\n"
                                         "def pieceworks_register_backends(spec):\n    return []\n")
    dist(tmp_path, "badhook", "[pieceworks]\nbadhook = badhook\n")
    res = suite(tmp_path, "-k", "test_attention and small_decode")
    assert res.returncode == 1, res.stdout[-4000:] + res.stderr[-2000:]
    assert "BROKEN PLUGIN: plugin 'badhook'" in res.stdout and "{'spec'}" in res.stdout, res.stdout[-4000:]
    assert "the run fails: an installed plugin is broken" in res.stdout, res.stdout[-4000:]


def test_a_case_that_hangs_stops_the_run_naming_it(site):
    res = suite(site, "--pieceworks-backend", "attention.hangs", "--pieceworks-timeout", "2", "-k",
                "test_attention and small_decode", timeout=120)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    said = re.search(r"pieceworks conformance suite: \S*test_attention\[[^\]]*attention\.hangs[^\]]*\] ran past 2 s "
                     r"\(--pieceworks-timeout\)", res.stderr)
    assert said and "in forward" in res.stderr[said.end():], res.stderr[-3000:]


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_timeout_that_is_no_number_of_seconds_is_a_usage_error(site, value):
    res = suite(site, "--pieceworks-backend", "attention.hangs", "--pieceworks-timeout", value, timeout=120)
    assert res.returncode == 4 and f"--pieceworks-timeout {value}: give seconds" in res.stderr, res.stderr[-2000:]


def test_unknown_backend_is_a_usage_error(site):
    res = suite(site, "--pieceworks-backend", "attention.nosuch")
    assert res.returncode == 4 and "no backend attention.nosuch is registered" in res.stderr, res.stderr[-2000:]
