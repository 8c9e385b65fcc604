"""Speculative decoding: output identical to plain greedy decoding (edits and n-gram drafts), the
drafters and the draft-length policy, cancel during speculation, and a consistent prefix cache."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from engine import Engine, GenerationParams
from engine.generate import Generation
from engine.speculative import (
    DraftPolicy,
    EditDrafter,
    PromptLookup,
    SpeculativeGeneration,
    _Tokens,
    generate,
    ngram_matches,
)

PROMPT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for i in range(n):\n        a, b = b, a + b\n    return a\n\n\n"
    "def fib_list(n):\n    out = []\n    for i in range(n):\n        out.append(fibonacci(i))\n    return out\n\n\ndef"
)


@pytest.fixture(scope="module")
def engines(tiny_models, tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "graph_cache"
    return {
        arch: Engine.load(path, cache_dir=cache, threads=1) for arch, path in tiny_models.items()
    }


def plain(eng, prompt, params, slot=None) -> Generation:
    gen = eng.generate(prompt, params, slot=slot)
    gen.result()
    return gen


def mutate(tokens: list[int], edits: int, vocab: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    d = list(tokens)
    for _ in range(edits):
        i = rnd.randrange(len(d))
        op = rnd.choice("sid")
        if op == "s":
            d[i] = rnd.randrange(vocab)
        elif op == "i":
            d.insert(i, rnd.randrange(vocab))
        else:
            del d[i]
    return d


def assert_same(spec: Generation, ref: Generation) -> None:
    assert spec.tokens == ref.tokens
    assert spec.text == ref.text
    assert spec.finish_reason == ref.finish_reason


class UntimedPolicy(DraftPolicy):
    """The draft-length policy on its priors only: what it drafts no longer depends on how busy
    the machine is while the test measures pass costs (a loaded CI box made "exact" flaky)."""

    def prime(self, *args) -> None:
        pass

    def timed(self, *args) -> None:
        pass

    def emitted(self, *args) -> None:
        pass

    def charge(self, *args) -> None:
        pass


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_identical_to_greedy(engines, arch):
    eng = engines[arch]
    params = GenerationParams(max_new_tokens=96, ignore_eos=True)
    ref = plain(eng, PROMPT, params)
    vocab = eng.sample_vocab
    drafts = {
        "ngram": None,
        "exact": ref.tokens,
        "text": PROMPT,
        **{f"mutated{k}": mutate(ref.tokens, 3 + 3 * k, vocab, k) for k in range(3)},
        "garbage": list(np.random.default_rng(0).integers(0, vocab, 200)),
    }
    for name, draft in drafts.items():
        gen = generate(eng, PROMPT, params, draft=draft, policy=UntimedPolicy(alpha=0.9))
        assert isinstance(gen, SpeculativeGeneration)
        chunks = list(gen)
        assert_same(gen, ref)
        assert "".join(c.text for c in chunks) == gen.text, name
        assert [c.token_id for c in chunks] == gen.tokens, name
        s = gen.stats
        assert s["new_tokens"] == len(ref.tokens) and s["model_runs"] >= 1
        if name == "exact":  # the whole output was drafted: many tokens per decoder pass
            assert s["acceptance"] > 0.9 and s["tokens_per_run"] > 4, s


def test_stop_strings_eos_and_lengths(engines):
    eng = engines["llama"]
    ref_long = plain(eng, PROMPT, GenerationParams(max_new_tokens=80, ignore_eos=True))
    text = ref_long.text
    stop = text[30:34] if len(text) > 40 else "\n"
    cases = [GenerationParams(max_new_tokens=n, ignore_eos=True) for n in (1, 2, 3, 7, 17)]
    cases += [
        GenerationParams(max_new_tokens=80, stop=(stop,)),
        GenerationParams(max_new_tokens=80),
        GenerationParams(max_new_tokens=80, stop=("\n\n", stop)),
    ]
    for params in cases:
        ref = plain(eng, PROMPT, params)
        for draft in (ref_long.tokens, None):
            gen = generate(eng, PROMPT, params, draft=draft)
            gen.result()
            assert_same(gen, ref)


def test_context_end(tiny_llama, tmp_path_factory):
    """Drafts never run past the KV buffer: generation to the end of a short context is identical."""
    eng = Engine.load(
        tiny_llama,
        cache_dir=tmp_path_factory.getbasetemp() / "graph_cache",
        max_context=64,
        threads=1,
    )
    params = GenerationParams(max_new_tokens=100, ignore_eos=True)
    ref = plain(eng, PROMPT[:80], params)
    gen = generate(eng, PROMPT[:80], params, draft=ref.tokens + ref.tokens)
    gen.result()
    assert_same(gen, ref)
    assert len(gen.tokens) + len(gen.prompt) == 64


def test_sampling_runs_the_plain_loop(engines):
    eng = engines["llama"]
    params = GenerationParams(max_new_tokens=24, temperature=0.8, seed=3, ignore_eos=True)
    ref = plain(eng, PROMPT, params)
    gen = generate(eng, PROMPT, params, draft=ref.tokens)
    gen.result()
    assert_same(gen, ref)
    assert gen.stats["drafted_tokens"] == 0


def test_prefix_cache_stays_consistent(engines):
    """After speculation (rejected drafts leave KV past the slot's end) reuse gives plain results."""
    eng = engines["qwen2"]
    params = GenerationParams(max_new_tokens=48, ignore_eos=True)
    ref = plain(eng, PROMPT, params)
    gen = generate(
        eng, PROMPT, params, slot="doc", draft=mutate(ref.tokens, 8, eng.sample_vocab, 9)
    )
    gen.result()
    assert_same(gen, ref)
    follow = eng.tokenizer.encode(PROMPT) + gen.tokens[:40]
    again = eng.generate(follow, params, slot="doc")
    again.result()
    assert again.stats["reused_tokens"] >= len(follow) - 1 - 8
    eng.reset()
    fresh = plain(eng, follow, params)
    assert again.tokens == fresh.tokens


def test_cancel_during_speculation(engines):
    eng = engines["llama"]
    params = GenerationParams(max_new_tokens=400, ignore_eos=True)
    ref = plain(eng, PROMPT, params)
    gen = generate(eng, PROMPT, params, slot="c", draft=mutate(ref.tokens, 20, eng.sample_vocab, 1))
    got, stopped = [], []
    started = threading.Event()

    def consume():
        for chunk in gen:
            got.append(chunk.token_id)
            if len(got) >= 10:
                started.set()
        stopped.append(time.perf_counter())
        started.set()

    th = threading.Thread(target=consume, daemon=True)
    th.start()
    assert started.wait(30)
    t0 = time.perf_counter()
    gen.cancel()
    th.join(10)
    assert stopped, "the speculative generation did not stop after cancel()"
    assert gen.finish_reason == "cancelled" and gen.cancelled
    assert len(gen.tokens) < 400 and gen.tokens == ref.tokens[: len(gen.tokens)]
    assert stopped[0] >= t0
    # the slot is usable at once and still gives the plain result
    again = eng.generate(PROMPT, GenerationParams(max_new_tokens=32, ignore_eos=True), slot="c")
    again.result()
    assert again.tokens == ref.tokens[:32]


def test_cancel_before_start(engines):
    gen = generate(engines["llama"], PROMPT, GenerationParams(max_new_tokens=8), draft=PROMPT)
    gen.cancel()
    assert list(gen) == [] and gen.finish_reason == "cancelled"


# -- drafters and policy (no model) --------------------------------------------------------------


def test_ngram_matches():
    hay = np.array([1, 2, 3, 9, 1, 2, 3, 4, 1, 2], np.int64)
    assert ngram_matches(hay, np.array([1, 2])).tolist() == [
        2,
        6,
    ]  # the last [1, 2] has no continuation
    assert ngram_matches(hay, np.array([2, 3])).tolist() == [3, 7]
    assert ngram_matches(hay, np.array([7])).tolist() == []
    assert ngram_matches(hay, np.array([1, 2, 3]), end=7).tolist() == [3]


def test_prompt_lookup_drafts_latest_continuation():
    ctx = _Tokens([5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 7])
    assert PromptLookup(max_ngram=3).propose(ctx, 2) == [9, 2]
    assert PromptLookup().propose(_Tokens([1, 2, 3, 4]), 4) == []


def test_edit_drafter_follows_and_resyncs():
    src = list(range(100, 140))
    d = EditDrafter(src)
    ctx = _Tokens([1, 2, 3])
    d.start(ctx)
    assert d.propose(ctx, 4) == [100, 101, 102, 103]
    ctx.extend([100, 101, 102, 103, 104])
    d.observe([100, 101, 102, 103, 104], 4)  # all accepted + the model's next token matched too
    assert d.propose(ctx, 3) == [105, 106, 107]
    ctx.extend([105, 7])
    d.observe([105, 7], 1)  # one accepted, then the model inserted 7
    assert d.cursor is None
    ctx.extend([106])
    d.observe([106], 0)
    assert d.propose(ctx, 2) == [107, 108]  # re-found "106" right after the old cursor
    # a deletion: the output skips ahead; the n-gram resync finds the later spot
    ctx.extend([120, 121])
    d.observe([120, 121], 0)
    assert d.propose(ctx, 2) == [122, 123]


def _drive(drafter: EditDrafter, prompt: list[int], output: list[int], k: int = 16) -> int:
    """Run ``drafter`` against a known greedy ``output`` as the generation loop does; passes used."""
    ctx = _Tokens(prompt)
    drafter.start(ctx)
    ctx.extend(output[:1])
    drafter.observe(output[:1], 0)
    i, passes = 1, 0
    while i < len(output):
        draft = drafter.propose(ctx, k)[:k]
        a = 0
        while a < len(draft) and i + a < len(output) and draft[a] == output[i + a]:
            a += 1
        decided = output[i : i + a + 1]
        ctx.extend(decided)
        drafter.observe(decided, a)
        i += len(decided)
        passes += 1
    return passes


def test_edit_drafter_learns_renames():
    from engine.models import default_model_dir
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.load(default_model_dir())
    body = (
        "    total = 0\n    for value in values:\n        total += value * self._scale\n"
        "    print(values.count, len(values), self._scale)\n    return total / len(values)\n"
    )
    # the edit renames the parameter `values` and the attribute `_scale` everywhere; `value`
    # (another word that starts the same) stays
    edited = body.replace("values", "samples").replace("._scale", "._factor")
    prompt, src, out = (
        tok.encode("def mean(self, values):\n" + body + "\n\ndef mean(self, samples):\n"),
        tok.encode(body),
        tok.encode(edited),
    )
    learned = EditDrafter(src, tokenizer=tok)
    with_renames, without = _drive(learned, prompt, out), _drive(EditDrafter(src), prompt, out)
    assert learned.renames == {"values": "samples", "._scale": "_factor"}
    assert with_renames < without
    rest = tok.decode(
        learned.source.tolist()
    )  # renamed after the first occurrence, whole words only
    assert "total += value * self._scale" in rest and "len(samples), self._factor" in rest
    # an unchanged output learns nothing; a changed non-identifier (an operator) is not a rename
    same = EditDrafter(src, tokenizer=tok)
    assert _drive(same, prompt, src) == _drive(EditDrafter(src), prompt, src) and not same.renames
    op = EditDrafter(src, tokenizer=tok)
    _drive(op, prompt, tok.encode(body.replace("+=", "-=")))
    assert not op.renames


def test_top2_margin_matches_a_full_sort():
    from engine.speculative import _top2_margin

    rows = np.random.default_rng(0).standard_normal((5, 300)).astype(np.float32)
    rows[3, [7, 9]] = 50.0  # a tie at the top: no margin
    before = rows.copy()
    top, margin = _top2_margin(rows, rows.argmax(-1))
    ref = np.sort(before, axis=1)
    assert np.array_equal(top, ref[:, -1]) and np.array_equal(margin, ref[:, -1] - ref[:, -2])
    assert margin[3] == 0.0 and np.array_equal(rows, before)  # the rows are left as they were


def test_policy_follows_acceptance_and_cost():
    p = DraftPolicy(k_min=2, k_max=12, max_misses=2, backoff=3, alpha=0.7, beta=0.15)
    k0 = p.size()
    assert 2 <= k0 <= 12
    for _ in range(20):  # everything accepted: alpha -> 1, drafts grow to the cap
        p.update(p.size() or 2, p.k)
    assert p.size() == 12 and p.acceptance > 0.95
    p.update(12, 0)
    p.update(2, 0)  # two misses in a row: off for 3 plain steps, the last of which probes k_min
    assert [p.size() for _ in range(3)] == [0, 0, 2]
    p.update(2, 0)
    p.update(2, 0)
    assert [p.size() for _ in range(6)] == [0, 0, 0, 0, 0, 2]  # back-off doubled
    # a pass that costs as much as its tokens: drafting never pays, steps stay plain
    q = DraftPolicy(alpha=0.5)
    q.timed(1, 0.001)
    q.timed(9, 0.009)
    assert q.cost_per_token == pytest.approx(1.0)
    assert q.best()[1] < 1.0 and q.size() == 0
    assert DraftPolicy.expected_tokens(0.5, 3) == pytest.approx(1.875)
    # a drafter with nothing to offer pauses drafting for a couple of steps, alpha untouched
    e = DraftPolicy(k_min=2, empty_pause=2)
    alpha, k = e.acceptance, e.size()
    assert k > 0
    e.empty()
    assert [e.size() for _ in range(3)] == [0, 2, k] and e.acceptance == alpha
    assert PromptLookup.pause_when_empty and not EditDrafter.pause_when_empty
    # measured: drafting passes emit tokens more slowly than plain steps -> back off, whatever alpha says
    r = DraftPolicy(alpha=0.9)
    for _ in range(10):
        r.emitted("draft", 2, 0.004)
        r.emitted("plain", 1, 0.001)
    assert r.losing() and r.size() == 0
    r2 = DraftPolicy(alpha=0.9)
    for _ in range(10):
        r2.emitted("draft", 6, 0.002)
        r2.emitted("plain", 1, 0.001)
    assert not r2.losing() and r2.size() > 0
    # slow start: drafts begin at k_min, double while accepted whole, fall back after a miss
    sl = DraftPolicy(alpha=0.95, k_min=2, k_max=24)
    sizes = []
    for _ in range(5):
        k = sl.size()
        sizes.append(k)
        sl.update(k, k)
    assert sizes == [2, 4, 8, 16, 24]
    sl.update(24, 3)
    assert sl.size() == 4  # just past the accepted run
    # lookups that found nothing cost time too: charged to drafting, they can make it lose
    for _ in range(10):
        r2.charge(0.004)
    assert r2.losing() and r2.size() == 0
    # primed with this engine's costs: a 9-token pass as dear as 9 steps never pays
    q2 = DraftPolicy(alpha=0.6)
    q2.prime(0.001, 0.009, 9)
    assert q2.cost_per_token == pytest.approx(1.0) and q2.size() == 0
    q3 = DraftPolicy(alpha=0.6)
    q3.prime(0.001, 0.0015, 9)
    assert q3.size() > 0
    with pytest.raises(ValueError):
        DraftPolicy(k_min=0)
    with pytest.raises(ValueError):
        DraftPolicy(alpha=1.0)


@pytest.mark.slow
def test_identical_on_bundled_model(tmp_path_factory):
    """The bundled model (when installed): edits and completions, token for token."""
    from engine.config import ModelError

    try:
        eng = Engine.load(None, cache_dir=tmp_path_factory.getbasetemp() / "graph_cache")
    except ModelError as e:
        pytest.skip(f"no bundled model: {e}")
    from engine.lab.bench_edits import TASKS

    for task in TASKS:
        ids, healed = task.prompt(eng)
        params = GenerationParams(
            max_new_tokens=task.max_new_tokens(eng), ignore_eos=True, healed_prefix=healed
        )
        ref = plain(eng, ids, params)
        gen = generate(eng, ids, params, draft=task.draft)
        gen.result()
        assert_same(gen, ref)
