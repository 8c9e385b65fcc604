"""engine.fim: detection of the three FIM token styles and prompt layout (PSM / SPM)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.fim import FimFormat

TEXT = "def add(a, b):\n    return a + b\n\nclass Foo:\n    pass\n" * 20

STYLES = {
    "starcoder": [
        "<|endoftext|>",
        "<fim_prefix>",
        "<fim_suffix>",
        "<fim_middle>",
        "<pad>",
        "<file_sep>",
    ],
    "qwen": [
        "<|endoftext|>",
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        "<|fim_pad|>",
        "<|file_sep|>",
    ],
    "codellama": ["</s>", "▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"],
    "codellama_plain": ["</s>", "<PRE>", "<SUF>", "<MID>", "<EOT>"],
    "deepseek": [
        "<｜end▁of▁sentence｜>",
        "<｜fim▁begin｜>",
        "<｜fim▁hole｜>",
        "<｜fim▁end｜>",
        "<|EOT|>",
    ],
    "codegemma": [
        "<eos>",
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        "<|file_separator|>",
    ],
    "codestral": ["</s>", "[PREFIX]", "[SUFFIX]", "[INST]"],
    "none": ["<|endoftext|>", "<pad>"],
}


def tiny_tokenizer(specials: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [TEXT],
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return tok


@pytest.fixture(scope="module")
def toks() -> dict[str, Tokenizer]:
    return {k: tiny_tokenizer(v) for k, v in STYLES.items()}


def enc(tok: Tokenizer, s: str) -> list[int]:
    return tok.encode(s, add_special_tokens=False).ids


@pytest.mark.parametrize(
    "style,name",
    [
        ("starcoder", "starcoder"),
        ("qwen", "qwen"),
        ("codellama", "codellama"),
        ("codellama_plain", "codellama"),
        ("deepseek", "deepseek"),
        ("codegemma", "codegemma"),
    ],
)
def test_detect(toks, style, name):
    tok = toks[style]
    fim = FimFormat.detect(tok)
    assert fim is not None and fim.name == name
    assert [fim.prefix_id, fim.suffix_id, fim.middle_id] == [
        tok.token_to_id(t) for t in STYLES[style][1:4]
    ]


def test_codestral_is_suffix_first_with_no_middle_token(toks):
    tok = toks["codestral"]
    fim = FimFormat.detect(tok)
    assert fim.name == "codestral" and fim.middle_id is None
    p, s = "def f(x):\n    return ", "\n\nprint(f(2))\n"
    want = [tok.token_to_id("[SUFFIX]"), *enc(tok, s), tok.token_to_id("[PREFIX]"), *enc(tok, p)]
    assert fim.build(p, s) == want and fim.build(p, s, spm=True) == want
    assert tok.token_to_id("</s>") in fim.stop_ids


def test_codegemma_stops_at_its_file_separator(toks):
    fim = FimFormat.detect(toks["codegemma"])
    assert toks["codegemma"].token_to_id("<|file_separator|>") in fim.stop_ids


def test_override_forces_a_family_or_says_why_not(toks):
    # a Qwen-style vocabulary read as CodeGemma's is refused (no <|file_separator|>) ...
    with pytest.raises(ValueError, match="no codegemma FIM tokens"):
        FimFormat.detect(toks["qwen"], "codegemma")
    with pytest.raises(ValueError, match="unknown FIM format 'gpt'"):
        FimFormat.detect(toks["qwen"], "gpt")
    # ... while CodeGemma's vocabulary can be driven as plain Qwen-style FIM
    assert FimFormat.detect(toks["codegemma"], "qwen").name == "qwen"


@pytest.mark.parametrize("style", [k for k in STYLES if k not in ("none", "codellama_plain")])
def test_text_template_tokenizes_to_the_token_layout(toks, style):
    """A prompt rendered as text (for remote backends) encodes to the ids build() lays out."""
    tok = toks[style]
    fim = FimFormat.detect(tok)
    p, s = "class Foo:\n    def bar(self):\n        ", "\n\nfoo = Foo()\n"
    text = fim.style.render(p, s)
    assert enc(tok, text) == fim.build(p, s)


def test_repository_level_text():
    from engine.fim import STYLES as FS

    files = [("pkg/util.py", "def helper():\n    return 1\n")]
    qwen = FS["qwen"].render("x = ", "\n", files=files, repo="myrepo", path="pkg/main.py")
    assert qwen == (
        "<|repo_name|>myrepo\n<|file_sep|>pkg/util.py\ndef helper():\n    return 1\n"
        "<|file_sep|>pkg/main.py\n<|fim_prefix|>x = <|fim_suffix|>\n<|fim_middle|>"
    )
    sc = FS["starcoder"].render("x = ", "\n", files=files, repo="myrepo", path="pkg/main.py")
    assert sc.startswith("<repo_name>myrepo<file_sep>pkg/util.py\ndef helper()") and sc.endswith(
        "<file_sep>pkg/main.py\n<fim_prefix>x = <fim_suffix>\n<fim_middle>"
    )
    gemma = FS["codegemma"].render("x = ", "\n", files=files)
    assert gemma.startswith(
        "pkg/util.py\ndef helper():\n    return 1\n<|file_separator|><|fim_prefix|>x = "
    )
    ds = FS["deepseek"].render("x = ", "\n", files=files)
    assert ds.startswith(
        "<｜fim▁begin｜>#pkg/util.py\ndef helper():\n    return 1\nx = <｜fim▁hole｜>"
    )
    assert FS["codestral"].render("x = ", "\n") == "[SUFFIX]\n[PREFIX]x = "
    with pytest.raises(ValueError, match="suffix-first only"):
        FS["codestral"].render("x = ", "\n", spm=False)


def test_detect_none(toks):
    assert FimFormat.detect(toks["none"]) is None


def test_stop_ids(toks):
    sc = FimFormat.detect(toks["starcoder"])
    assert {
        toks["starcoder"].token_to_id(t) for t in ("<|endoftext|>", "<file_sep>")
    } <= sc.stop_ids
    assert toks["starcoder"].token_to_id("<pad>") not in sc.stop_ids
    cl = FimFormat.detect(toks["codellama"])
    assert toks["codellama"].token_to_id("▁<EOT>") in cl.stop_ids
    qw = FimFormat.detect(toks["qwen"])
    assert {
        toks["qwen"].token_to_id(t) for t in ("<|endoftext|>", "<|file_sep|>", "<|fim_pad|>")
    } <= qw.stop_ids


@pytest.mark.parametrize("style", ["starcoder", "qwen", "codellama"])
def test_psm_layout(toks, style):
    tok = toks[style]
    fim = FimFormat.detect(tok)
    p, s = "def add(a, b):\n    ret", "\n\nclass Foo:\n"
    assert fim.build(p, s) == [
        fim.prefix_id,
        *enc(tok, p),
        fim.suffix_id,
        *enc(tok, s),
        fim.middle_id,
    ]


def test_spm_layout_grows_at_the_end(toks):
    tok = toks["starcoder"]
    fim = FimFormat.detect(tok)
    assert fim.supports_spm
    s = "\n    pass\n"
    before = fim.build("class Foo:\n    def", s, spm=True)
    assert before == [
        fim.suffix_id,
        *enc(tok, s),
        fim.prefix_id,
        *enc(tok, "class Foo:\n    def"),
        fim.middle_id,
    ]
    after = fim.build("class Foo:\n    def add", s, spm=True)
    # typing only appends: everything up to the old prefix tokens is a prompt prefix (KV reuse)
    assert after[: len(before) - 2] == before[:-2]


def test_parts_are_encoded_separately(toks):
    tok = toks["starcoder"]
    fim = FimFormat.detect(tok)
    ids = fim.build("", "", spm=False)
    assert ids == [fim.prefix_id, fim.suffix_id, fim.middle_id]
    # a suffix change never changes the prefix tokens
    a, b = fim.build("x = 1", "\nfoo", spm=False), fim.build("x = 1", "\nbar baz", spm=False)
    assert a[: a.index(fim.suffix_id)] == b[: b.index(fim.suffix_id)]


@pytest.mark.parametrize("style", ["qwen", "codellama"])
def test_spm_refused_where_untrained(toks, style):
    fim = FimFormat.detect(toks[style])
    assert not fim.supports_spm
    with pytest.raises(ValueError, match="SPM"):
        fim.build("a", "b", spm=True)


def test_bad_input(toks):
    fim = FimFormat.detect(toks["starcoder"])
    with pytest.raises(TypeError):
        fim.build(None, "x")


def test_engine_tokenizer(tiny_llama):
    from engine.tokenizer import Tokenizer as EngineTokenizer

    tok = EngineTokenizer.load(tiny_llama)
    fim = FimFormat.detect(tok)
    assert fim.name == "starcoder"
    assert tok.eos_ids <= fim.stop_ids
    ids = fim.build("import os\n", "\n", spm=True)
    assert ids[0] == fim.suffix_id and ids[-1] == fim.middle_id
    assert ids[ids.index(fim.prefix_id) + 1 : -1] == tok.encode("import os\n")
