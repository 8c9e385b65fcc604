"""Context from the other files (spark_lsp.neighbours and PromptBuilder's context): chunks taken
around activity, near-duplicates evicted, other documents only, within the budget, and placed at
the start of the prompt so typing in one document keeps the prompt's head (and the engine's
prefix cache) intact."""

from __future__ import annotations

from engine.fim import FimFormat
from spark_lsp.neighbours import Neighbours, similarity
from spark_lsp.prompt import PromptBuilder
from spark_lsp.state import document_path


def doc(name: str, n: int = 200) -> str:
    return "".join(f"def {name}_{i}(x):\n    return x + {i}\n" for i in range(n // 2))


def words(text: str) -> int:
    return len(text.split())


def test_chunks_around_activity_and_only_when_it_moves():
    ring = Neighbours(chunk_lines=16)
    a = doc("a")
    assert ring.observe("file:///a.py", "a.py", a, 100)
    chunk = ring.chunks[-1]
    assert chunk.line == 92 and chunk.text == "".join(a.splitlines(keepends=True)[92:108])
    assert not ring.observe("file:///a.py", "a.py", a, 104)  # the same neighbourhood: nothing new
    assert ring.observe("file:///a.py", "a.py", a, 150)
    assert [c.line for c in ring.chunks] == [92, 142]
    assert not ring.observe("file:///b.py", "b.py", "x = 1\n\n\n", 0)  # too little to be worth it


def test_similar_chunks_are_replaced_and_the_buffer_is_bounded():
    ring = Neighbours(max_chunks=3, chunk_lines=16, per_document=2)
    a = doc("a")
    ring.observe("file:///a.py", "a.py", a, 0)
    edited = a.replace("return x + 3\n", "return x + 33\n", 1)
    ring.observe("file:///a2.py", "a2.py", edited, 0)  # nearly the same lines: the older goes
    assert [c.uri for c in ring.chunks] == ["file:///a2.py"]
    assert similarity(a.splitlines()[0], a.splitlines()[0]) == 1.0
    for name in "bcde":
        ring.observe(f"file:///{name}.py", f"{name}.py", doc(name), 0)
    assert [c.path for c in ring.chunks] == ["c.py", "d.py", "e.py"]  # oldest evicted first
    for line in (0, 40, 80, 120):
        ring.observe("file:///e.py", "e.py", doc("e"), line)
    assert sum(c.uri == "file:///e.py" for c in ring.chunks) == 2  # one document cannot fill it


def test_select_other_documents_within_budget_oldest_first():
    ring = Neighbours(chunk_lines=8)
    for name in "abc":
        ring.observe(f"file:///{name}.py", f"{name}.py", doc(name), 0)
    per_chunk = words(ring.chunks[0].text) + 8
    assert [p for p, _ in ring.select("file:///c.py", 10_000, words)] == ["a.py", "b.py"]
    assert [p for p, _ in ring.select("file:///x.py", 2 * per_chunk, words)] == ["b.py", "c.py"]
    assert ring.select("file:///a.py", 0, words) == []
    # activity in the current document does not change what it gets
    before = ring.select("file:///c.py", 10_000, words)
    ring.observe("file:///c.py", "c.py", doc("c"), 60)
    assert ring.select("file:///c.py", 10_000, words) == before


def test_document_path():
    assert document_path("file:///home/u/proj/pkg/util.py", "/home/u/proj") == "pkg/util.py"
    assert document_path("file:///home/u/other/pkg/util.py", "/home/u/proj") == "pkg/util.py"
    assert document_path("untitled:Untitled-1", None) == "untitled:Untitled-1"


def test_context_goes_first_and_stays_while_typing(tiny_llama):
    """With the bundled-style (StarCoder) tokens: <repo_name>…<file_sep>path\\ncode… then the FIM
    part; two keystrokes later the prompt still starts with the same tokens."""
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.load(tiny_llama)
    builder = PromptBuilder(tok)
    files = [("pkg/util.py", "def helper(x):\n    return x * 2\n")]
    ctx = builder.context(files)
    assert ctx is builder.context(list(files))  # encoded once per selection
    assert tok.decode(ctx.head).startswith("<repo_name>repo<file_sep>pkg/util.py\ndef helper(x)")
    text = "import os\n\ndef main():\n    value = hel"
    p1 = builder.build(text, len(text), 200, key="doc", context=ctx)
    text2 = text + "pe"
    p2 = builder.build(text2, len(text2), 200, key="doc", context=ctx)
    assert p1.ids[: len(ctx.head)] == ctx.head == p2.ids[: len(ctx.head)]
    assert p1.context_tokens == len(ctx.head) and p1.ids[len(ctx.head)] == builder.fim.suffix_id
    plain = builder.build(text, len(text), 200, key="other")
    assert plain.ids == p1.ids[len(ctx.head) :]


def test_families_without_repository_tokens_put_files_in_the_prefix():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(
        [doc("a", 40)],
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=[
                "<｜end▁of▁sentence｜>",
                "<｜fim▁begin｜>",
                "<｜fim▁hole｜>",
                "<｜fim▁end｜>",
            ],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    fim = FimFormat.detect(t)
    assert fim.name == "deepseek"
    ctx = fim.context_ids([("util.py", "x = 1\n")])
    assert ctx.head == [] and t.decode(ctx.lead) == "#util.py\nx = 1\n"
    ids = fim.build("a = ", "\n", context=ctx)
    assert ids[: 1 + len(ctx.lead)] == [fim.prefix_id, *ctx.lead]


async def test_server_puts_other_files_first_and_the_prefix_cache_still_hits(tiny_llama):
    import asyncio

    from conftest import SAMPLE, start_editor
    from lsprotocol import types as T

    client, ed = await start_editor(
        tiny_llama, options={"neighbourTokens": 96, "contextTokens": 160}
    )
    try:
        main, util = "file:///proj/main.py", "file:///proj/util.py"
        text = "def run(values):\n    total = scale(values, 2)\n    return "
        ed.open(main, text)

        async def complete(typed: str) -> dict:
            ed.type(
                main, len(ed.text(main)), typed
            )  # a new prompt (not the suggestion typed along)
            n = len(ed.status)
            await ed.inline(main, len(ed.text(main)), T.InlineCompletionTriggerKind.Invoked)
            for _ in range(100):
                if len(ed.status) > n:
                    break
                await asyncio.sleep(0.05)
            assert len(ed.status) > n, "no generation ran"
            return ed.status[-1]

        alone = await complete("(")
        ed.open(util, SAMPLE)  # another file joins the context
        with_util = await complete("[")
        assert with_util["promptTokens"] > alone["promptTokens"] + 20
        typed = await complete("{")
        # the other file's chunk and the document's start are reused: only the end is new
        assert typed["reusedPromptTokens"] >= with_util["promptTokens"] - 12
    finally:
        await client.shutdown_session()
        await client.stop()
