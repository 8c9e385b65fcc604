"""engine.train.data: FIM splits, document encoding and packing (the training stream)."""

from __future__ import annotations

import itertools
import random

import pytest

pytest.importorskip("tokenizers")
from engine.train.data import (  # noqa: E402
    DocumentEncoder,
    EditConfig,
    FimConfig,
    code_blocks,
    copy_document,
    edit_block,
    edit_document,
    fim_split,
    packed_sequences,
    split_segments,
)
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
        assert "\n" not in m  # rest of one line
        assert s == "" or s.startswith("\n")  # the line's newline stays in the suffix
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
    assert enc.fim_ids("ab", "c", "d", spm=False) == [
        enc.pre,
        *e("ab"),
        enc.suf,
        *e("d"),
        enc.mid,
        *e("c"),
        enc.eos,
    ]
    assert enc.fim_ids("ab", "c", "d", spm=True) == [
        enc.suf,
        *e("d"),
        enc.pre,
        *e("ab"),
        enc.mid,
        *e("c"),
        enc.eos,
    ]
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


EDIT_SRC = """import os


class Cache:
    def get(self, key, default):
        value = self._items.get(key, default)
        return value

    def put(self, key, value):
        self._items[key] = value


def join_all(root, names):
    out = []
    for name in names:
        out.append(os.path.join(root, name))
    return out
"""


def test_code_blocks_find_whole_def_and_class_blocks():
    spans = [EDIT_SRC[s:e] for s, e in code_blocks(EDIT_SRC)]
    assert spans[0].startswith("class Cache:") and spans[0].rstrip().endswith(
        "self._items[key] = value"
    )
    assert "    def get(self, key, default):\n        value" in spans[1]
    assert spans[-1].startswith("def join_all(root, names):") and spans[-1].endswith("return out\n")
    assert all(len(b.splitlines()) >= 3 for b in spans)  # "def put" has 2 lines: skipped


def test_edit_block_keeps_the_body_and_changes_the_header():
    block = EDIT_SRC[EDIT_SRC.index("def join_all") :]
    head0, body0 = block.split("\n", 1)
    seen = set()
    for seed in range(80):
        new = edit_block(block, random.Random(seed), ["prefix", "entries"])
        if new is None:
            continue
        head, body = new.split("\n", 1)
        assert head != head0 and head.startswith("def ") and head.endswith(":")
        compile(new, "<edit>", "exec")  # still valid Python
        if not head.startswith("def join_all("):
            seen.add("rename")
            assert body == body0
        elif "->" in head:
            seen.add("hints")
            assert body == body0 and head.count(": ") == 2
        elif head.count(",") == 2:
            seen.add("add_param")
            assert body == body0 and head.startswith("def join_all(root, names, ")
        else:  # a parameter renamed everywhere
            seen.add("rename_param")
            old = "root" if "root" not in head else "names"
            assert old not in new and body != body0
            assert body.count("root" if old == "names" else "names") == body0.count(
                "root" if old == "names" else "names"
            )
    assert seen == {"rename", "rename_param", "hints", "add_param"}


def test_edit_document_is_context_original_then_copy(files, tok):
    doc = edit_document(EDIT_SRC, random.Random(1), EditConfig(rate=1.0, context_chars=20))
    assert doc is not None
    originals = [EDIT_SRC[s:e] for s, e in code_blocks(EDIT_SRC)]
    original = next(b for b in originals if b in doc)
    before, after = doc.split(original, 1)
    assert EDIT_SRC.find(before + original) >= 0  # the file's own text up to the block
    assert after.lstrip("\n") != original and after.startswith("\n")
    # rate 0 leaves the training stream exactly as it was; rate 1 adds edit documents
    plain = list(itertools.islice(packed_sequences(files, tok, 64, 0), 30))
    again = list(
        itertools.islice(packed_sequences(files, tok, 64, 0, edit=EditConfig(rate=0.0)), 30)
    )
    more = sum(1 for _ in packed_sequences(files, tok, 64, 0, epochs=1, edit=EditConfig(rate=1.0)))
    assert plain == again
    assert more > sum(1 for _ in packed_sequences(files, tok, 64, 0, epochs=1))
    assert (
        sum(1 for _ in packed_sequences(files, tok, 64, 0, epochs=1, edit=EditConfig(rate=2.5)))
        > more
    )


def test_copy_document_repeats_a_shuffled_window_of_the_file():
    pool = list(range(1000, 1300))
    for seed in range(20):
        ids = copy_document(pool, random.Random(seed))
        n = next(
            k for k in range(16, 97) if ids[:k] * (len(ids) // k) == ids and len(ids) // k in (2, 3)
        )
        window = ids[:n]
        assert sorted(window) == list(
            range(min(window), min(window) + n)
        )  # a slice of the file's tokens
        assert window != sorted(window)  # shuffled
    assert copy_document(list(range(10)), random.Random(0)) is None  # too short a file


def test_copy_rate_adds_copy_documents(tok):
    text = EDIT_SRC * 4
    plain = DocumentEncoder(tok).encode_file(text, random.Random(3))
    more = DocumentEncoder(tok, edit=EditConfig(copy_rate=2.0)).encode_file(text, random.Random(3))
    assert more[: len(plain)] == plain and len(more) > len(plain) + 2 * 16
