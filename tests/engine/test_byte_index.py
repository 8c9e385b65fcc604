"""ByteIndex: ``consistent`` against a brute-force scan (random vocabularies with duplicates,
None and empty tokens, zero and 0xff bytes, shared 8-byte heads; the tiny models' tokenizers;
a Qwen-sized synthetic tokenizer when the bench built one), ``token_bytes`` as a sequence, and
storage with no Python object per token."""

from __future__ import annotations

import pickle
import tracemalloc

import numpy as np
import pytest
from engine_helpers import brute_consistent
from hypothesis import given
from hypothesis import strategies as st

from engine.lab.models import bench_root
from engine.tokenizer import ByteIndex, TokenBytes, Tokenizer

#: The edges of the prefix ranges: proper prefixes, 0xff runs, a token spelled twice.
EDGE_VOCAB = [
    None,
    b"a",
    b"ab",
    b"abc",
    b"ab\xff",
    b"ab\xff\xff",
    b"ac",
    b"b",
    b"\xff",
    b"\xff\x00",
    b"a",
]
EDGE_PENDINGS = [
    b"a",
    b"ab",
    b"ab\xff",
    b"abcd",
    b"\xff",
    b"\xff\x00\x01",
    b"b",
    b"c",
    b"ab\xff\xff\xff",
]


def pendings_of(vocab, rng: np.random.Generator, alphabet: bytes, extra: int = 200):
    """Every prefix of every token, each token plus a byte, and random texts of the alphabet."""
    out = set()
    for b in vocab:
        if b:
            out.update(b[:k] for k in range(1, len(b) + 1))
            out.add(b + alphabet[:1])
            out.add(b + alphabet[-1:])
    for _ in range(extra):
        n = int(rng.integers(1, 14))
        out.add(bytes(rng.choice(list(alphabet), n).tolist()))
    return sorted(out)


def random_vocab(rng: np.random.Generator, n: int, alphabet: bytes) -> list[bytes | None]:
    """Short and long tokens of a small alphabet (so heads collide past 8 bytes), some None,
    some b"", some spelled twice."""
    vocab: list[bytes | None] = []
    for _ in range(n):
        r = rng.random()
        if r < 0.05:
            vocab.append(None)
        elif r < 0.07:
            vocab.append(b"")
        elif r < 0.15 and vocab:
            vocab.append(vocab[int(rng.integers(len(vocab)))])  # a duplicate (or None, b"")
        else:
            size = int(rng.choice([1, 2, 3, 4, 7, 8, 9, 12, 20]))
            vocab.append(bytes(rng.choice(list(alphabet), size).tolist()))
    return vocab


def check_against_brute_force(vocab, pendings) -> None:
    ix = ByteIndex(vocab)
    assert len(ix.token_bytes) == len(vocab)
    assert list(ix.token_bytes) == list(vocab)
    for pending in pendings:
        got = ix.consistent(pending)
        assert got.dtype == np.int64
        assert got.tolist() == brute_consistent(vocab, pending), pending


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("alphabet", [b"ab", b"\x00\x01\xfe\xff", b"a\x00\xff"])
def test_random_vocabulary_matches_brute_force(seed, alphabet):
    rng = np.random.default_rng(seed)
    vocab = random_vocab(rng, 300, alphabet)
    check_against_brute_force(vocab, pendings_of(vocab, rng, alphabet))


def test_index_prefix_range_edges():
    ix = ByteIndex(EDGE_VOCAB)
    for pending in EDGE_PENDINGS:
        assert ix.consistent(pending).tolist() == brute_consistent(EDGE_VOCAB, pending), pending
    with pytest.raises(ValueError):
        ix.consistent(b"")


def test_edges_of_the_prefix_ranges():
    vocab = [
        *EDGE_VOCAB,
        b"",
        b"a\x00",  # zero-padded to 8 bytes, these three share a head with b"a"
        b"a\x00\x00",
        b"a\x00\x00\x00\x00\x00\x00\x00\x00",
        b"\xff" * 8,
        b"\xff" * 9,
        b"\xff" * 12 + b"\x00",
        b"\x00",
        b"\x00" * 10,
        b"abcdefgh",
        b"abcdefghi",
        b"abcdefghij",
        b"abcdefghij",
        b"abcdefghik",
        b"abcdefgh\xff\xff",
        b"abcdefgi",
    ]
    pendings = [
        *EDGE_PENDINGS,
        b"a\x00",
        b"a\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00",
        b"\x00",
        b"\x00" * 9,
        b"\x00" * 11,
        *(b"\xff" * k for k in range(1, 16)),
        b"\xff" * 12 + b"\x00\x01",
        b"abcdefgh",
        b"abcdefghi",
        b"abcdefghijklm",
        b"abcdefgh\xff",
        b"abcdefgh\xff\xff\xff",
        b"abcdefgz",
        b"zz",
    ]
    check_against_brute_force(vocab, pendings)
    with pytest.raises(ValueError):
        ByteIndex(vocab).consistent(b"")


@pytest.mark.parametrize("vocab", [[], [None], [None, b""], [b""]])
def test_vocabularies_with_nothing_to_match(vocab):
    ix = ByteIndex(vocab)
    assert list(ix.token_bytes) == vocab
    for pending in (b"a", b"\x00", b"\xff" * 9):
        got = ix.consistent(pending)
        assert got.dtype == np.int64 and got.size == 0


def test_token_bytes_is_a_sequence_like_the_tuple_it_replaces():
    vocab = [b"ab", None, b"", b"\xff\x00", b"ab"]
    tb = ByteIndex(vocab).token_bytes
    assert isinstance(tb, TokenBytes) and len(tb) == 5
    assert [tb[i] for i in range(5)] == vocab and list(tb) == vocab
    assert tb[-1] == b"ab" and tb[-4] is None and tb[np.int64(3)] == b"\xff\x00"
    assert type(tb[0]) is bytes and tb[2] == b""
    assert tb[1:4] == (None, b"", b"\xff\x00") and tb[::-2] == (b"ab", b"", b"ab")
    assert b"\xff\x00" in tb and None in tb and b"zz" not in tb
    for bad in (5, -6, 10**6):
        with pytest.raises(IndexError):
            tb[bad]
    with pytest.raises(TypeError):
        tb["0"]


def test_an_index_pickles():
    vocab = [b"ab", None, b"", b"a", b"abc"]
    ix = pickle.loads(pickle.dumps(ByteIndex(vocab)))
    assert list(ix.token_bytes) == vocab
    assert ix.consistent(b"ab").tolist() == [0, 3, 4]


def test_construction_takes_any_sequence():
    vocab = [b"b", None, b"a", b"ab"]
    for seq in (vocab, tuple(vocab), iter(vocab), ByteIndex(vocab).token_bytes):
        ix = ByteIndex(seq)
        assert list(ix.token_bytes) == vocab and ix.consistent(b"a").tolist() == [2, 3]


# -- storage ----------------------------------------------------------------------------------------
def test_storage_is_a_blob_and_arrays_with_no_object_per_token():
    rng = np.random.default_rng(7)
    n = 50_000
    vocab = [
        None if i % 997 == 0 else bytes(rng.integers(0, 256, int(rng.integers(1, 12))).tolist())
        for i in range(n)
    ]
    blob_size = sum(len(b) for b in vocab if b)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ix = ByteIndex(vocab)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    per_token = 17  # offsets (int32), None mask, order (int32), keys (uint64)
    assert ix.nbytes <= blob_size + per_token * (n + 1)
    assert held <= blob_size + per_token * n + 64 * 1024, held  # and nothing else of size n
    containers = (list, tuple, dict, set)

    def walk(obj) -> None:
        for name in getattr(obj, "__slots__", ()) or vars(obj):
            value = getattr(obj, name)
            assert not isinstance(value, containers), name
            if isinstance(value, np.ndarray):
                assert value.dtype != object, name
            elif isinstance(value, TokenBytes):
                walk(value)

    walk(ix)


# -- real tokenizers ---------------------------------------------------------------------------------
def test_the_tiny_models_tokenizers(tiny_models):
    rng = np.random.default_rng(0)
    for arch, folder in sorted(tiny_models.items()):
        tok = Tokenizer.load(folder)
        spelled = tok._spell_tokens()
        ix = tok.byte_index()
        assert list(ix.token_bytes) == spelled, arch
        assert all(tok.token_bytes(i) == spelled[i] for i in range(0, tok.vocab_size, 7))
        assert tok.token_bytes(tok.vocab_size) is None and tok.token_bytes(-1) is None
        pendings = pendings_of(spelled, rng, b" \n\xc3\xa9def(", extra=50)
        if len(pendings) > 1500:
            pendings = [pendings[int(i)] for i in rng.choice(len(pendings), 1500, replace=False)]
        for pending in pendings:
            assert ix.consistent(pending).tolist() == brute_consistent(spelled, pending), (
                arch,
                pending,
            )


def _bench_tokenizer_folder():
    folders = sorted(bench_root().glob("synthetic-qwen2.5-coder-*/tokenizer.json"))
    return folders[0].parent if folders else None


@pytest.mark.skipif(_bench_tokenizer_folder() is None, reason="no Qwen-sized bench tokenizer")
def test_a_qwen_sized_vocabulary():
    tok = Tokenizer.load(_bench_tokenizer_folder())
    spelled = tok._spell_tokens()
    ix = ByteIndex(spelled)
    assert list(ix.token_bytes) == spelled
    assert ix.nbytes < 6 * 2**20  # a tuple/list/dict index of it held tens of MB
    arr = np.array([b if b else b"" for b in spelled], dtype=object)
    lens = np.fromiter((len(b) for b in arr), np.int64, len(arr))

    def brute(pending: bytes) -> list[int]:
        starts = np.fromiter((b.startswith(pending) for b in arr), bool, len(arr))
        prefix = np.fromiter((pending.startswith(b) for b in arr), bool, len(arr))
        return np.flatnonzero((lens > 0) & (starts | prefix)).tolist()

    rng = np.random.default_rng(1)
    samples = [spelled[int(i)] for i in rng.choice(len(spelled), 12) if spelled[int(i)]]
    for pending in (
        b" re",
        b"\n    ",
        b"de",
        b"(self",
        b"\xe4\xb8",
        b"self.assertEqual(response.status_code",
        b" filler1234",
        b"\xff",
        *samples,
        *(s[:-1] for s in samples if len(s) > 1),
    ):
        assert ix.consistent(pending).tolist() == brute(pending), pending


# -- property --------------------------------------------------------------------------------------
_ALPHABET = st.sampled_from([0, 1, 0x61, 0x62, 0xFE, 0xFF])
_BYTES = st.lists(_ALPHABET, max_size=12).map(bytes)


@given(
    st.lists(st.one_of(st.none(), _BYTES), max_size=40),
    st.lists(st.lists(_ALPHABET, min_size=1, max_size=13).map(bytes), max_size=10),
)
def test_consistent_matches_brute_force(vocab, pendings):
    tokens = [b for b in vocab if b]
    pendings = pendings + [b[:k] for b in tokens[:5] for k in range(1, len(b) + 1)]
    check_against_brute_force(vocab, pendings)
