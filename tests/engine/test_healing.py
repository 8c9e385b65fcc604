"""Token healing: the byte table and its prefix index, the constrained sampler, prompt healing
(engine.fim.heal) and generations whose output must begin with a healed text."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from engine_helpers import brute_consistent, load_engine

from engine import GenerationParams
from engine.fim import FimFormat, heal
from engine.generate import _Emitter
from engine.sampling import Healing, Sampler
from engine.speculative import SpeculativeGeneration
from engine.speculative import generate as spec_generate
from engine.tokenizer import ByteIndex

CODE = (
    "def add(a, b):\n    return a + b\n\n\ndef scale(values, factor):\n    out = []\n"
    "    for v in values:\n        out.append(v * factor)\n    return out\n\n\n"
)


@pytest.fixture(scope="module")
def eng(tiny_llama, tmp_path_factory):
    return load_engine(tiny_llama, tmp_path_factory)


@pytest.fixture(scope="module")
def tok(eng):
    return eng.tokenizer


# -- byte table and index ---------------------------------------------------------------------------
def test_token_bytes_spell_what_decode_gives(tok):
    tb = tok.byte_index().token_bytes
    assert len(tb) == tok.vocab_size
    assert all(tb[i] is None for i in tok.special_tokens.values())
    checked = 0
    for i, b in enumerate(tb):
        if b is None:
            continue
        text = tok.decode([i])
        if "\ufffd" not in text:  # whole characters: the bytes are exactly the text
            assert b.decode("utf-8") == text, i
            checked += 1
    assert checked > len(tb) // 2  # all but the lone non-ASCII bytes
    assert sum(len(b) == 1 for b in tb if b) == 256  # byte-level BPE: every byte is a token
    assert tok.byte_index() is tok.byte_index()  # built once per tokenizer


@pytest.mark.parametrize(
    "pending",
    [
        "s",
        "re",
        " fo",
        "return",
        "x = ",
        "é".encode()[:1],
        "é",
        "日本",
        b"\xff",
        "zzzzzzzzqqq",
        " (",
        ")",
    ],
)
def test_index_matches_brute_force(tok, pending):
    pending = pending.encode() if isinstance(pending, str) else pending
    ix = tok.byte_index()
    got = ix.consistent(pending).tolist()
    assert got == brute_consistent(ix.token_bytes, pending)
    assert got == sorted(got) and got  # every byte is a token: never empty


# -- the constraint -------------------------------------------------------------------------------
def test_healing_greedy_picks_the_best_consistent_token(tok):
    ix = tok.byte_index()
    rng = np.random.default_rng(0)
    logits = rng.normal(size=tok.vocab_size).astype(np.float32)
    h = Healing(ix, "return")
    allowed = ix.consistent(b"return")
    t = h.pick(logits, Sampler())
    assert t == int(allowed[np.argmax(logits[allowed])])
    spelled = ix.token_bytes[t]
    assert h.pending == (b"" if spelled.startswith(b"return") else b"return"[len(spelled) :])


def test_healing_spells_a_text_longer_than_one_token_then_lets_go(tok):
    ix = tok.byte_index()
    text = "naïve_日本 = "  # multi-byte characters, several tokens
    for seed in range(5):
        h = Healing(ix, text)
        s = Sampler(temperature=1.0, seed=seed)
        rng = np.random.default_rng(seed)
        out = b""
        for _ in range(64):
            if not h.active:
                break
            out += ix.token_bytes[h.pick(rng.normal(size=tok.vocab_size).astype(np.float32), s)]
        assert not h.active and not h.abandoned
        assert out.startswith(text.encode())
        assert h.allowed(tok.vocab_size) is None


def test_healing_abandons_gracefully_when_nothing_is_consistent():
    ix = ByteIndex([None, b"a", b"b"])
    h = Healing(ix, "z")
    logits = np.array([0.0, 1.0, 2.0], np.float32)
    assert h.pick(logits, Sampler()) == 2 and h.abandoned and not h.active


# -- prompt healing ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prefix",
    [
        "def scale(values, fac",
        "    out.app",
        "x = ",
        "return foo(bar(x)",
        "s = 'naï",
        "print(",
        "a_very_long_identifier_that_goes_on",
    ],
)
def test_heal_backs_off_the_partial_word(tok, prefix):
    ids = tok.encode(prefix)
    kept, healed = heal(tok, prefix, ids)
    assert healed and prefix.endswith(healed)
    assert kept == ids[: len(kept)] and 1 <= len(ids) - len(kept) <= 4
    assert tok.decode(kept) + healed == prefix


def test_heal_covers_the_whole_partial_word(tok):
    kept, healed = heal(tok, "x = values.app")
    assert healed.endswith("app") and "\n" not in healed


@pytest.mark.parametrize("prefix", ["", "def f():\n", "x\r\n", "x = 1\n\n"])
def test_heal_leaves_line_starts_alone(tok, prefix):
    ids = tok.encode(prefix) if prefix else []
    assert heal(tok, prefix, ids) == (ids, "")


def test_heal_never_backs_off_a_line_break(tok):
    kept, healed = heal(tok, "def f():\n    ")  # GPT-2 style: the indent is its own token, healed
    assert healed.strip(" ") == "" and tok.decode(kept).endswith("\n")


@pytest.mark.parametrize(
    "prefix", ["def f():\n", "x = 1\n\n", "class A:\n    def f(self):\n", "x\r\n"]
)
def test_heal_newline_backs_off_a_final_line_break(tok, prefix):
    ids = tok.encode(prefix)
    kept, healed = heal(tok, prefix, ids, newline=True)
    assert healed and healed.strip("\r\n") == "" and prefix.endswith(healed)
    assert kept == ids[:-1] and tok.decode(kept) + healed == prefix
    assert heal(tok, prefix, ids, newline=True, keep=len(ids)) == (ids, "")


def test_heal_newline_leaves_other_endings_to_the_word_rule(tok):
    for prefix in ("x = values.app", "def f():\n    "):
        assert heal(tok, prefix, newline=True) == heal(tok, prefix)
    ids = tok.encode("x = values.app")
    assert heal(tok, "x = values.app", ids, run=None) == (ids, "")  # run=None: no partial words


def test_heal_keeps_tokens_and_needs_a_byte_table(tok):
    assert heal(tok, "x", keep=1) == (tok.encode("x"), "")
    kept, healed = heal(tok, "x", keep=0)
    assert kept == [] and healed == "x"

    class Plain:  # a tokenizer without a byte table: no healing, no error
        def encode(self, text):
            return tok.encode(text)

    assert heal(Plain(), "x = fo") == (tok.encode("x = fo"), "")


def test_build_healed_is_build_without_the_partial_word(tok):
    fim = FimFormat.detect(tok)
    for spm in (True, False):
        ids, healed = fim.build_healed("x = values.app", "\nprint(x)\n", spm=spm)
        assert ids == fim.build("x = values.app"[: -len(healed)], "\nprint(x)\n", spm=spm)
        assert fim.build_healed("x = 1\n", "y\n", spm=spm) == (
            fim.build("x = 1\n", "y\n", spm=spm),
            "",
        )


# -- generations -------------------------------------------------------------------------------------
def clean_greedy(eng, tok, n=24):
    """(prompt ids, reference generation) for a prompt whose greedy output starts with three
    tokens of whole characters (the random tiny model also writes lone non-ASCII bytes)."""
    tb = tok.byte_index().token_bytes
    for cut in range(len(CODE), 0, -7):
        prompt = tok.encode(CODE[:cut])
        ref = eng.generate(prompt, GenerationParams(max_new_tokens=n, ignore_eos=True))
        ref.result()
        try:
            b"".join(tb[t] for t in ref.tokens[:3]).decode("utf-8")
            return prompt, ref
        except UnicodeDecodeError:
            continue
    raise AssertionError("no prompt with a clean greedy start")


def test_healed_generation_emits_only_the_text_after_the_healed_part(eng, tok):
    prompt, ref = clean_greedy(eng, tok)
    full = tok.decode(ref.tokens)
    n = len(tok.decode(ref.tokens[:2])) + 1  # spans more than one token and ends mid-token
    assert 0 < n < len(full)
    gen = eng.generate(
        prompt, GenerationParams(max_new_tokens=24, ignore_eos=True, healed_prefix=full[:n])
    )
    chunks = list(gen)
    # the greedy path already spelled the healed text: the constraint changes no choice
    assert gen.tokens == ref.tokens
    assert gen.text == full[n:] == "".join(c.text for c in chunks)


def test_healing_forces_the_text_the_model_would_not_write(eng, tok):
    prompt = tok.encode(CODE)
    healed = "zq日"
    for params in (
        GenerationParams(max_new_tokens=16, ignore_eos=True, healed_prefix=healed),
        GenerationParams(
            max_new_tokens=16, ignore_eos=True, healed_prefix=healed, temperature=1.0, seed=3
        ),
    ):
        gen = eng.generate(prompt, params)
        gen.result()
        full = tok.decode(gen.tokens)
        assert full.startswith(healed) and gen.text == full[len(healed) :]


def test_stop_strings_see_only_the_emitted_text(eng, tok):
    prompt = tok.encode(CODE)
    gen = eng.generate(
        prompt,
        GenerationParams(max_new_tokens=12, ignore_eos=True, healed_prefix="a\nb", stop=("\n",)),
    )
    gen.result()
    full = tok.decode(gen.tokens)
    assert full.startswith("a\nb")
    rest = full[3:]
    assert gen.text == rest.split("\n", 1)[0]
    assert gen.finish_reason == ("stop" if "\n" in rest else "length")


def test_unhealed_greedy_is_unchanged(eng, tok):
    fim = FimFormat.detect(tok)
    prefix, suffix = CODE + "def main():\n", "\n"
    ids, healed = fim.build_healed(prefix, suffix, spm=True)
    assert healed == "" and ids == fim.build(prefix, suffix, spm=True)
    a = eng.generate(ids, GenerationParams(max_new_tokens=16, ignore_eos=True))
    b = eng.generate(ids, GenerationParams(max_new_tokens=16, ignore_eos=True, healed_prefix=""))
    assert a.result() == b.result() and a.tokens == b.tokens


@pytest.mark.parametrize("cut", ["    out.app", "def sca", "    return a +", "for v in val"])
def test_speculative_equals_plain_under_healing(eng, tok, cut):
    fim = FimFormat.detect(tok)
    src = CODE * 3
    at = src.rindex(cut) + len(cut)
    ids, healed = fim.build_healed(src[:at], src[at:], spm=True)
    assert healed
    params = GenerationParams(max_new_tokens=40, ignore_eos=True, healed_prefix=healed)
    ref = eng.generate(ids, params)
    ref.result()
    spec = spec_generate(eng, ids, params)
    assert isinstance(spec, SpeculativeGeneration)
    chunks = list(spec)
    assert spec.tokens == ref.tokens and spec.text == ref.text == "".join(c.text for c in chunks)
    assert tok.decode(ref.tokens).startswith(healed)


def test_speculative_edit_under_a_healed_line_break(eng, tok):
    """A code action's prompt ends at a line start: the line break is healed and the draft (the
    region's original text) is encoded after it, so it lines up with the output token for token."""
    body = "    out = []\n    for v in values:\n        out.append(v * factor)\n    return out\n"
    prefix = CODE + "def scale2(values, factor):\n"
    ids, healed = heal(tok, prefix, tok.encode(prefix), keep=1, newline=True)
    assert healed == "\n"
    params = GenerationParams(max_new_tokens=30, ignore_eos=True, healed_prefix=healed)
    ref = eng.generate(ids, params)
    ref.result()
    spec = spec_generate(eng, ids, params, draft=body)
    spec.result()
    assert spec.tokens == ref.tokens and spec.text == ref.text
    assert tok.decode(ref.tokens).startswith("\n")


def test_bad_healed_prefix():
    with pytest.raises(ValueError, match="healed_prefix"):
        GenerationParams(healed_prefix=b"x")
    assert GenerationParams(healed_prefix=None).healed_prefix == ""


def test_cut_survives_a_decoder_that_drops_the_first_leading_space():
    class Stream:  # SentencePiece-like: "▁foo" at the start of a stream decodes as "foo"
        parts = {1: "foo", 2: "bar", 3: " baz"}

        def push(self, t):
            return self.parts[t]

        def flush(self):
            return ""

    gen = SimpleNamespace(
        params=GenerationParams(max_new_tokens=8, healed_prefix=" foob"),
        tokens=[],
        text="",
        _t0=0.0,
        _engine=SimpleNamespace(eos_ids=frozenset(), tokenizer=SimpleNamespace(stream=Stream)),
    )
    em = _Emitter(gen)
    out = [em.emit(t, 0.0)[0].text for t in (1, 2, 3)]
    assert out == ["", "ar", " baz"] and gen.text == "ar baz"
