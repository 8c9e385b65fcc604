"""engine.train.data: FIM splits, document encoding and packing (the training stream)."""

from __future__ import annotations

import itertools
import random

import pytest

pytest.importorskip("tokenizers")
from engine.train.data import DocumentEncoder, FimConfig, fim_split, packed_sequences, split_segments  # noqa: E402
from engine.train.tokenizer import build_tokenizer, list_stdlib_files, split_files  # noqa: E402

SRC = "import os\n\n\ndef f(x):\n    if x:\n        return os.path.join(x, 'a')\n    return None\n"


@pytest.fixture(scope="module")
def files():
    return list_stdlib_files()[:12]


@pytest.fixture(scope="module")
def tok(files):
    return build_tokenizer(files, vocab_size=600)


def test_fim_split_reassembles_and_line_middles():
    rng = random.Random(0)
    line_cfg = FimConfig(line_rate=1.0, lines_rate=0.0)
    for _ in range(300):
        p, m, s = fim_split(SRC, rng, line_cfg)
        assert p + m + s == SRC
        assert "\n" not in m                       # rest of one line
        assert s == "" or s.startswith("\n")       # the line's newline stays in the suffix
        assert p.rsplit("\n", 1)[-1].strip() or m.strip()  # cursor inside a non-blank line
    for _ in range(300):
        p, m, s = fim_split(SRC, rng)
        assert p + m + s == SRC


def test_split_segments():
    text = "".join(f"line {i}\n" for i in range(1000))
    segs = split_segments(text, 300)
    assert "".join(segs) == text
    assert all(len(s) <= 300 and s.endswith("\n") for s in segs)


def test_document_encoding_layouts(tok):
    enc = DocumentEncoder(tok, FimConfig(rate=1.0, spm_rate=0.5))
    e = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    assert enc.fim_ids("ab", "c", "d", spm=False) == [enc.pre, *e("ab"), enc.suf, *e("d"), enc.mid, *e("c"), enc.eos]
    assert enc.fim_ids("ab", "c", "d", spm=True) == [enc.suf, *e("d"), enc.pre, *e("ab"), enc.mid, *e("c"), enc.eos]
    rng = random.Random(1)
    orders = set()
    for _ in range(40):
        ids = enc.encode_file(SRC, rng)
        assert ids[-1] == enc.eos and ids.count(enc.mid) == 1
        orders.add(ids[0])
    assert orders == {enc.pre, enc.suf}  # both PSM and SPM occur
    plain = DocumentEncoder(tok, FimConfig(rate=0.0)).encode_file(SRC, rng)
    assert plain == e(SRC) + [enc.eos]


def test_packed_stream_is_deterministic(files, tok):
    a = list(itertools.islice(packed_sequences(files, tok, 128, seed=3), 20))
    b = list(itertools.islice(packed_sequences(files, tok, 128, seed=3), 20))
    c = list(itertools.islice(packed_sequences(files, tok, 128, seed=4), 20))
    assert a == b and a != c
    assert all(len(s) == 128 for s in a)
    assert any(tok.token_to_id("<fim_middle>") in s for s in a)


def test_split_is_by_file_and_fixed(files):
    tr, va = split_files(files, seed=1)
    assert not set(tr) & set(va) and len(tr) + len(va) == len(files)
    assert split_files(files, seed=1) == (tr, va)


def test_shuffle_buffer_mixes_deterministically():
    from engine.train.data import shuffle_buffer

    a = list(shuffle_buffer(iter(range(200)), 16, seed=1))
    assert a == list(shuffle_buffer(iter(range(200)), 16, seed=1))
    assert sorted(a) == list(range(200)) and a != list(range(200))
    assert list(shuffle_buffer(iter(range(5)), 1, seed=1)) == list(range(5))
