"""Tokenizer: agreement with transformers, special tokens / eos / FIM detection, streaming decode, errors."""

from __future__ import annotations

import json

import pytest
from tiny_models import copy_model, require_reference

from engine.config import ModelError
from engine.tokenizer import StreamDecoder, Tokenizer

TEXTS = [
    "def foo(x):\n    return x + 1\n",
    "  indented\ttabs\r\nand CRLF",
    "unicode: é ß 東京 😀🚀 — ok",
    "",
    "<fim_prefix>a = <fim_suffix>\n<fim_middle>",
]


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return Tokenizer.load(tiny_llama)


def test_matches_transformers(tiny_llama, tok):
    require_reference()
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(tiny_llama))
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text == ref.decode(ids)


def test_special_tokens(tok):
    assert tok.eos_ids == frozenset({tok.token_to_id("<|endoftext|>")})
    assert tok.pad_id == tok.token_to_id("<pad>") and tok.bos_id is None
    assert set(tok.special_tokens) >= {
        "<|endoftext|>",
        "<fim_prefix>",
        "<fim_suffix>",
        "<fim_middle>",
        "<pad>",
        "<file_sep>",
    }
    assert tok.vocab_size == 640
    assert tok.id_to_token(tok.special_tokens["<pad>"]) == "<pad>"
    assert tok.encode("<fim_middle>") == [tok.special_tokens["<fim_middle>"]]
    assert tok.decode(tok.encode("a<|endoftext|>b"), skip_special_tokens=True) == "ab"
    fim = tok.fim
    assert fim.name == "starcoder" and fim.supports_spm
    assert (fim.prefix_id, fim.suffix_id, fim.middle_id) == tuple(
        tok.token_to_id(t) for t in ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
    )
    assert tok.token_to_id("<file_sep>") in fim.stop_ids  # a middle never runs into the next file
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([10_000])


@pytest.mark.parametrize("text", TEXTS + ["ééé東京東京😀😀😀 mixed ascii 😀"])
def test_stream_decoder_reassembles_text(tok, text):
    sd = StreamDecoder(tok)
    ids = tok.encode(text)
    chunks = [sd.push(i) for i in ids]
    assert "".join(chunks) + sd.flush() == text
    assert not any("\ufffd" in c for c in chunks)
    if any(ord(c) > 127 for c in text):
        assert "" in chunks  # multi-byte characters were held back until complete


def test_stream_decoder_flushes_incomplete_utf8(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1
    sd = tok.stream()
    assert "".join(sd.push(i) for i in ids[:-1]) == ""
    assert sd.flush() == "\ufffd"
    assert sd.flush() == ""


def test_stream_decoder_does_not_hold_invalid_bytes_forever(tok):
    """A model emitting bytes that never form UTF-8 (a run of continuation bytes) must stream,
    not make every push re-decode an ever longer window."""
    cont = tok.encode("😀")[-1]  # a token holding only UTF-8 continuation byte(s)
    assert tok.decode([cont]).endswith("\ufffd")
    sd = tok.stream()
    chunks = [sd.push(cont) for _ in range(200)]
    assert sum(1 for c in chunks if c) >= 200 // StreamDecoder.MAX_HELD - 1
    assert len(sd._ids) - sd._prefix <= 2 * StreamDecoder.MAX_HELD  # the window stays short
    assert "".join(chunks) + sd.flush() == tok.decode([cont] * 200)


def test_eos_from_generation_config_and_fallback(tiny_llama, tmp_path):
    folder = copy_model(tiny_llama, tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    assert Tokenizer.load(folder).eos_ids == {0, 5}
    for f in ("generation_config.json", "tokenizer_config.json", "config.json"):
        (folder / f).unlink()
    t = Tokenizer.load(folder)
    assert t.eos_ids == {t.token_to_id("<|endoftext|>")} and t.pad_id is None


def test_other_fim_styles(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers

    vocab = {c: i for i, c in enumerate("abc")}
    for specials, style in (
        (["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|endoftext|>"], "qwen"),
        (["<PRE>", "<SUF>", "<MID>", "<EOT>"], "codellama"),
        (
            ["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", "<｜end▁of▁sentence｜>"],
            "deepseek",
        ),
        (["x"], None),
    ):
        hf = HF(models.WordLevel(vocab, unk_token="a"))
        hf.pre_tokenizer = pre_tokenizers.Whitespace()
        hf.add_special_tokens(specials)
        t = Tokenizer(hf)
        assert (t.fim.name if t.fim else None) == style
        if style:
            assert t.fim.prefix_id == hf.token_to_id(specials[0]) and not t.fim.supports_spm
            assert hf.token_to_id(specials[3]) in t.fim.stop_ids
            if style != "deepseek":  # the eos fallbacks know the others' end tokens
                assert t.eos_ids == {hf.token_to_id(specials[3])}


def test_missing_and_corrupt_files(tiny_llama, tmp_path):
    folder = copy_model(tiny_llama, tmp_path / "m")
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    with pytest.raises(ModelError, match="tokenizer.json: cannot load"):
        Tokenizer.load(folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match="tokenizer.json: file not found"):
        Tokenizer.load(folder)


def test_bad_special_token_config(tiny_llama, tmp_path):
    folder = copy_model(tiny_llama, tmp_path / "m")
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["eos_token"] = "<not-a-token>"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(
        ModelError,
        match=r"tokenizer_config.json: eos_token='<not-a-token>' is not in the vocabulary",
    ):
        Tokenizer.load(folder)
    cfg_path.write_text("{oops")
    with pytest.raises(ModelError, match="tokenizer_config.json: cannot parse"):
        Tokenizer.load(folder)
    cfg_path.unlink()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 99999}))
    with pytest.raises(ModelError, match="generation_config.json: eos_token_id=99999 is outside"):
        Tokenizer.load(folder)


def test_stream_decoder_sentencepiece_style_spaces():
    """Metaspace (SentencePiece-style) decoders drop the leading '▁' only at the start of a text:
    the streaming window must keep the spaces between words."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HF(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    hf.train_from_iterator(
        ["def foo(bar): return bar + 1", "for x in range(10): print(x)"] * 20,
        trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"], show_progress=False),
    )
    t = Tokenizer(hf)
    assert t.eos_ids == {hf.token_to_id("</s>")}
    text = "for bar in range(1): print(foo)"
    ids = t.encode(text)
    sd = t.stream()
    assert "".join(sd.push(i) for i in ids) + sd.flush() == t.decode(ids)
    assert " in range" in t.decode(ids)


def test_the_byte_index_built_in_the_background_is_built_once(tiny_llama, monkeypatch):
    import threading

    t = Tokenizer.load(tiny_llama)
    calls = []
    real = t._spell_tokens
    started = threading.Event()

    def slow_spell():
        calls.append(1)
        started.set()
        threading.Event().wait(0.2)  # still building when the next caller asks
        return real()

    monkeypatch.setattr(t, "_spell_tokens", slow_spell)
    thread = t.build_byte_index_in_background()
    assert started.wait(5)
    index = t.byte_index()  # waits for the background build instead of starting its own
    thread.join(5)
    assert calls == [1] and t.byte_index() is index
    assert index.token_bytes[t.encode("hello")[0]] is not None


def test_the_chat_template_from_the_tokenizer_config_or_its_own_file(tiny_llama, tmp_path):
    """``Tokenizer.chat``: tokenizer_config.json's template and the tokens it is rendered with;
    a folder whose template is in chat_template.jinja (as recent Hugging Face tooling saves it)
    has it from there."""
    folder = copy_model(tiny_llama, tmp_path / "m")
    assert "chat_template" not in Tokenizer.load(folder).chat
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert Tokenizer.load(folder).chat["chat_template"] == "{{ messages[0]['content'] }}"
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ bos_token }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    chat = Tokenizer.load(folder).chat
    assert chat["chat_template"] == "{{ bos_token }}"
    assert chat == {k: cfg[k] for k in ("chat_template", "bos_token", "eos_token") if cfg.get(k)}
    assert "eos_token" in chat
