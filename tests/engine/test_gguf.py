"""GGUF files (engine.gguf): written from the tiny HF models with gguf's writer the way llama.cpp's
converter lays them out (Q/K permutation for llama, Gemma's norm + 1), then loaded by the engine;
tokenizers rebuilt from real llama.cpp vocabularies against the original tokenizers' ids."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import onnx
import pytest
from engine_helpers import graph_cache_dir, greedy, hf_greedy, hf_logits, random_ids
from gguf_files import write_gguf
from onnx import numpy_helper

from engine import Engine, ModelError
from engine.gguf import GGUFModel, default_precision, is_gguf
from engine.linears import make_linear
from engine.tokenizer import Tokenizer

ARCHS = ("llama", "qwen2", "mistral", "qwen3", "starcoder2", "gemma")
STDLIB = ("ast.py", "dataclasses.py", "argparse.py", "inspect.py")  # ~9,000 lines of real Python


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module", params=ARCHS)
def f32_gguf(request, tiny_models, gguf_dir, tmp_path_factory):
    arch = request.param
    path = write_gguf(tiny_models[arch], gguf_dir / f"{arch}-f32.gguf")
    eng = Engine.load(path, wafer=False, cache_dir=graph_cache_dir(tmp_path_factory), slots=2)
    return arch, tiny_models[arch], eng


def test_f32_logits_and_greedy_match_transformers(f32_gguf):
    arch, folder, eng = f32_gguf
    assert eng.config.architecture == ("llama" if arch == "mistral" else arch)
    ids = random_ids(eng, 40, seed=1)
    np.testing.assert_allclose(eng.forward_logits(ids), hf_logits(folder, ids), atol=1e-4, rtol=0)
    assert greedy(eng, ids, 64).tokens == hf_greedy(folder, ids, 64)
    edited = ids[:30] + random_ids(eng, 4, seed=2)
    greedy(eng, ids, 4, slot="doc")
    again = greedy(eng, edited, 64, slot="doc")
    assert again.stats["reused_tokens"] == 30
    assert again.tokens == hf_greedy(folder, edited, 64)


def test_config_and_tokenizer_match_the_folder(f32_gguf):
    _, folder, eng = f32_gguf
    from engine.config import load_config

    ref = load_config(folder)
    got = eng.config
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rope_theta",
        "tie_word_embeddings",
        "norm",
        "mlp_act",
        "qk_norm",
        "attention_bias",
        "embed_scale",
    ):
        assert getattr(got, field) == getattr(ref, field), field
    assert abs(got.rms_norm_eps - ref.rms_norm_eps) < 1e-9
    hf_tok = Tokenizer.load(folder)
    text = _stdlib_text()[:20000]
    assert eng.tokenizer.encode(text) == hf_tok.encode(text)
    assert eng.tokenizer.decode(eng.tokenizer.encode(text)) == text
    assert eng.tokenizer.eos_ids == hf_tok.eos_ids
    assert eng.tokenizer.fim is not None and eng.tokenizer.fim.name == hf_tok.fim.name
    assert eng.tokenizer.special_tokens == hf_tok.special_tokens


@pytest.mark.parametrize("dtype,qtype", [("float16", "F16"), ("bfloat16", "BF16")])
def test_half_precision_files_equal_the_same_folder(
    dtype, qtype, tiny_qwen2, gguf_dir, tmp_path, tmp_path_factory
):
    """F16 / BF16 tensors read as the same numbers as a folder saved in that dtype."""
    from tiny_models import write_variant

    folder = write_variant(tiny_qwen2, tmp_path / dtype, dtype=dtype)
    path = write_gguf(folder, gguf_dir / f"qwen2-{qtype}.gguf", qtype=qtype)
    assert GGUFModel(path).tensor_types()[qtype] > 0
    cache = graph_cache_dir(tmp_path_factory)
    a = Engine.load(path, wafer=False, cache_dir=cache)
    b = Engine.load(folder, wafer=False, cache_dir=cache)
    ids = random_ids(a, 32, seed=4)
    np.testing.assert_allclose(a.forward_logits(ids), b.forward_logits(ids), atol=1e-5, rtol=0)


def _initializers(eng) -> dict[str, np.ndarray]:
    model = onnx.load(str(eng.graph_path))
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_q8_0_blocks_become_matmulnbits_codes_exactly(tiny_llama, gguf_dir, tmp_path_factory):
    """A Q8_0 file runs at int8 with MatMulNBits blocks of 32 whose codes and scales are the file's
    (q + 128, d): no second rounding.  Logits stay close to fp32 transformers."""
    import gguf

    path = write_gguf(tiny_llama, gguf_dir / "llama-q8_0.gguf", qtype="Q8_0")
    model = GGUFModel(path)
    assert default_precision(model) == "int8"
    eng = Engine.load(
        path, wafer=False, cache_dir=graph_cache_dir(tmp_path_factory), precision="auto"
    )
    assert eng.precision == "int8"
    init = _initializers(eng)
    blocks = model.tensor_data("blk.0.ffn_down.weight")  # [rows = out, blocks * 34 bytes]
    rows = blocks.shape[0]
    raw = blocks.reshape(rows, -1, 34)
    d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = raw[..., 2:].copy().view(np.int8)
    np.testing.assert_array_equal(
        init["layers.0.down.q8"], (q.astype(np.int16) + 128).astype(np.uint8)
    )
    np.testing.assert_array_equal(init["layers.0.down.scales"], d)
    assert "layers.0.down.zero_points" not in init
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
    with model.open_weights(eng.config) as weights:
        assert np.abs(ref - weights["model.layers.0.mlp.down_proj.weight"]).max() == 0
    # As accurate as the same quantisation done by us on the fp32 folder (int8 blocks of 32).
    ours = Engine.load(
        tiny_llama,
        cache_dir=graph_cache_dir(tmp_path_factory),
        linear=make_linear("int8", wafer=False, block_size=32, symmetric=True),
    )
    ids = random_ids(eng, 32, seed=5)
    ref = hf_logits(tiny_llama, ids)
    err, our_err = np.abs(eng.forward_logits(ids) - ref), np.abs(ours.forward_logits(ids) - ref)
    assert err.mean() <= 1.2 * our_err.mean(), (err.mean(), our_err.mean())


def test_q4_0_blocks_become_matmulnbits_codes_exactly(tiny_qwen2, gguf_dir, tmp_path_factory):
    """A Q4_0 file runs at int4 with MatMulNBits blocks of 32 holding the file's own 4-bit codes and
    scales (recovered exactly from the dequantised weights, repacked to the op's nibble order)."""
    import gguf

    path = write_gguf(tiny_qwen2, gguf_dir / "qwen2-q4_0.gguf", qtype="Q4_0")
    model = GGUFModel(path)
    assert default_precision(model) == "int4"
    cache = graph_cache_dir(tmp_path_factory)
    q4 = Engine.load(path, wafer=False, cache_dir=cache, precision="auto")
    assert q4.precision == "int4"
    init = _initializers(q4)
    t = model.tensors["blk.1.attn_output.weight"]
    data = model.tensor_data(t.name)
    raw = data.reshape(t.shape[0], -1, 18)  # per block: fp16 scale, 16 bytes of nibbles
    d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = raw[..., 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # llama.cpp: low nibbles hold 0..15
    np.testing.assert_array_equal(init["layers.1.o.q4"], codes[..., 0::2] | (codes[..., 1::2] << 4))
    np.testing.assert_array_equal(init["layers.1.o.scales"], d)
    assert "layers.1.o.zero_points" not in init
    with model.open_weights(q4.config) as weights:
        np.testing.assert_array_equal(
            weights["model.layers.1.self_attn.o_proj.weight"],
            gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q4_0),
        )
    # as accurate as our own int4 quantisation of the fp32 weights
    ours = Engine.load(tiny_qwen2, cache_dir=cache, linear=make_linear("int4", wafer=False))
    ids = random_ids(q4, 32, seed=6)
    ref = hf_logits(tiny_qwen2, ids)
    err = np.abs(q4.forward_logits(ids) - ref).mean()
    our_err = np.abs(ours.forward_logits(ids) - ref).mean()
    assert err <= 1.5 * our_err, (err, our_err)


def test_q4_0_grid_recovery_refuses_other_weights():
    from engine.gguf_quant import q4_0_codes

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 8)).astype(np.float32)
    assert q4_0_codes(w) is None  # not a Q4_0 grid: quantised the usual way instead
    assert q4_0_codes(np.zeros((48, 4), np.float32)) is None  # K not a multiple of 32
    z = q4_0_codes(np.zeros((32, 2), np.float32))
    assert z is not None and (z.packed == 0x88).all() and (z.scales == 0).all()


def test_broken_files_fail_with_the_file_named(tiny_llama, gguf_dir, tmp_path):
    path = write_gguf(tiny_llama, gguf_dir / "llama-broken-src.gguf")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match="cut.gguf.*truncated"):
        Engine.load(cut, wafer=False)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ModelError, match="bad.gguf: not a readable GGUF file"):
        Engine.load(bad, wafer=False)
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    assert not is_gguf(other)
    with pytest.raises(ModelError, match="neither a model folder nor a GGUF file"):
        Engine.load(other, wafer=False)


# -- tokenizers of real vocabularies ---------------------------------------------------------------


def _stdlib_text() -> str:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return "\n".join((lib / f).read_text(encoding="utf-8") for f in STDLIB)


class _VocabOnly(GGUFModel):
    """A llama.cpp vocabulary file (no tensors, so no model to check)."""

    def __init__(self, path: Path) -> None:
        from engine.gguf import read_gguf

        self.path = path
        self.fields, self.tensors = read_gguf(path)
        self.arch = self.fields["general.architecture"]


VOCABS = ("qwen2", "llama-bpe", "deepseek-coder", "starcoder", "llama-spm")


@pytest.fixture(scope="module", params=VOCABS)
def vocab(request):
    import llama_vocab

    path = llama_vocab.vocab_dir() / f"ggml-vocab-{request.param}.gguf"
    return request.param, path, _VocabOnly(path).tokenizer()


def test_tokenizer_ids_equal_the_original_tokenizers(vocab):
    """llama.cpp's test texts (unicode, whitespace runs, digits, code) with the ids the original
    Hugging Face tokenizer gave them."""
    import llama_vocab

    name, _, tok = vocab
    cases = llama_vocab.cases(name)
    assert len(cases) > 40
    bad = [(text, tok.encode(text), ids) for text, ids in cases if tok.encode(text) != ids]
    assert not bad, f"{name}: {len(bad)} texts differ, first {bad[0]!r}"


def test_tokenizer_ids_equal_llama_cpp_on_python_source(vocab):
    """~9,000 lines of CPython's library: the same ids as llama.cpp's own tokenizer, and a round trip."""
    llama_cpp = pytest.importorskip("llama_cpp")
    _, path, tok = vocab
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    text = _stdlib_text()
    assert text.count("\n") > 8000
    for chunk in text.split("\n\n\n"):
        want = ref.tokenize(chunk.encode("utf-8"), add_bos=False, special=False)
        assert tok.encode(chunk) == want, chunk[:200]
    assert tok.decode(tok.encode(text)) == text


def test_sentencepiece_without_dummy_prefix():
    """Gemma-style vocabularies (tokenizer.ggml.add_space_prefix false) get no leading "▁"."""
    import llama_vocab

    path = llama_vocab.vocab_dir() / "ggml-vocab-llama-spm.gguf"
    with_prefix = _VocabOnly(path)
    without = _VocabOnly(path)
    without.fields = {**without.fields, "tokenizer.ggml.add_space_prefix": False}
    a, b = with_prefix.tokenizer(), without.tokenizer()
    assert b.encode(" def f(x):\n    return x") == a.encode("def f(x):\n    return x")
    assert b.encode("def") != a.encode("def")
    text = "def f(x):\n    return x"
    assert b.decode(b.encode(text)) == text


def test_fim_tokens_of_real_vocabularies(vocab):
    name, _, tok = vocab
    # ggml-vocab-qwen2 is Qwen2's (FIM tokens came with Qwen2.5-Coder); Llama's have none.
    expected = {"deepseek-coder": "deepseek", "starcoder": "starcoder"}.get(name)
    assert (tok.fim.name if tok.fim else None) == expected


# -- llama.cpp as the second reader --------------------------------------------------------------

_LLAMA_CPP_LOGITS = """
import sys, numpy as np, llama_cpp
path, out, ids = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
m = llama_cpp.Llama(model_path=path, logits_all=True, verbose=False, n_ctx=128, n_threads=1)
m.eval(ids)
np.save(out, np.array(m.scores[:len(ids)]))
"""

_LLAMA_CPP_QUANTIZE = """
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
params.nthread = 1
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


def _run(script: str, *args: str) -> None:
    import subprocess
    import sys

    # llama.cpp runs in its own process: it and ONNX Runtime do not share one safely
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_reads_the_written_files_as_transformers_computes(
    arch, tiny_models, gguf_dir, tmp_path
):
    """The test files are laid out as llama.cpp expects (tensor names, Q/K permutation, Gemma's
    norm + 1, metadata, tokenizer): llama.cpp's own logits from them match transformers'."""
    pytest.importorskip("llama_cpp")
    path = write_gguf(tiny_models[arch], gguf_dir / f"{arch}-for-llama-cpp.gguf")
    ids = list(range(10, 40))
    _run(_LLAMA_CPP_LOGITS, str(path), str(tmp_path / "ref.npy"), ",".join(map(str, ids)))
    ref = hf_logits(tiny_models[arch], ids)
    got = np.load(tmp_path / "ref.npy")
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.fixture(scope="module")
def k_quant_files(tmp_path_factory):
    """A Llama with rows of 256 (K-quant super-blocks), written in F32 and quantised by llama.cpp."""
    pytest.importorskip("llama_cpp")
    import tiny_models as tm
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    d = tmp_path_factory.mktemp("kquant")
    tok = tm.build_tokenizer()
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        eos_token_id=0,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d / "hf")
    tm.save_tokenizer(tok, d / "hf")
    f32 = write_gguf(d / "hf", d / "f32.gguf")
    out = {"F32": f32}
    for ftype in ("Q4_K_M", "Q5_K_M", "Q6_K"):
        out[ftype] = d / f"{ftype}.gguf"
        _run(_LLAMA_CPP_QUANTIZE, str(f32), str(out[ftype]), ftype)
    return out


@pytest.mark.parametrize(
    "ftype,kind,tolerance",
    [("Q4_K_M", "Q4_K", 0.12), ("Q5_K_M", "Q5_K", 0.06), ("Q6_K", "Q6_K", 0.03)],
)
def test_k_quant_files_from_llama_cpp(k_quant_files, ftype, kind, tolerance, tmp_path_factory):
    """Files llama.cpp quantised itself: every K-quant tensor reads back as the float weights it was
    made from, up to that type's rounding (a wrong block layout would be noise, not a small error),
    and the model runs at int4 by default."""
    ref, model = GGUFModel(k_quant_files["F32"]), GGUFModel(k_quant_files[ftype])
    assert model.tensor_types()[kind] > 0
    cfg = model.config()
    with ref.open_weights(cfg) as exact, model.open_weights(cfg) as quant:
        for name in exact:
            a, b = exact[name], quant[name]
            err = np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(a**2))
            assert err < tolerance, (name, err)
    cache = graph_cache_dir(tmp_path_factory)
    eng = Engine.load(k_quant_files[ftype], wafer=False, cache_dir=cache, precision="auto")
    assert eng.precision == "int4"
    dense = Engine.load(k_quant_files["F32"], wafer=False, cache_dir=cache)
    ids = random_ids(eng, 32, seed=7)
    assert (eng.forward_logits(ids).argmax(-1) == dense.forward_logits(ids).argmax(-1)).mean() > 0.5
