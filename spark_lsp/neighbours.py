"""Context from the user's other files: a ring buffer of chunks, after llama.vim's.

Completion models trained at repository level (Qwen2.5-Coder, StarCoder2, CodeGemma) predict
better when the prompt also holds code from the files around the one being edited. The server
keeps chunks of the documents the user opens and edits (`observe`: the lines around an edit or
the cursor, a file's head when it opens); a chunk nearly equal to a newer one is evicted (line
similarity, as llama.vim's), and the oldest go first when the buffer is full.

`select(uri, budget, count)` gives the chunks of the *other* documents that fit a token budget,
oldest first: while the user types in one document the selection does not change, so the
prompt's start (where the engine puts these chunks, before the FIM part) stays the same tokens
and the prefix cache keeps hitting on every keystroke. No LSP library here; the server feeds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: Lines per chunk (llama.vim's ring_chunk_size) and chunks kept (its ring_n_chunks).
CHUNK_LINES = 64
MAX_CHUNKS = 16
#: Chunks kept per document, so one long editing session does not push out every other file.
PER_DOCUMENT = 3
#: Two chunks this similar (share of equal lines) are the same context: the older is dropped.
SIMILAR = 0.9
#: A document's chunk is re-taken when the activity moved at least this many lines away.
MOVE_LINES = CHUNK_LINES // 2
#: Chunks with fewer non-blank lines say too little to be worth their tokens.
MIN_LINES = 4


@dataclass
class Chunk:
    uri: str
    path: str  # as the prompt names the file (relative to the workspace where known)
    line: int  # first line of the chunk in its document
    text: str


def similarity(a: str, b: str) -> float:
    """Share of lines two chunks have in common (2 * common / (len a + len b)), as llama.vim's."""
    la, lb = a.splitlines(), b.splitlines()
    if not la and not lb:
        return 1.0
    pool: dict[str, int] = {}
    for line in la:
        pool[line] = pool.get(line, 0) + 1
    common = 0
    for line in lb:
        if pool.get(line, 0) > 0:
            pool[line] -= 1
            common += 1
    return 2 * common / (len(la) + len(lb))


class Neighbours:
    """The chunk ring buffer (see the module docstring)."""

    def __init__(
        self,
        max_chunks: int = MAX_CHUNKS,
        chunk_lines: int = CHUNK_LINES,
        per_document: int = PER_DOCUMENT,
    ) -> None:
        self.max_chunks = max_chunks
        self.chunk_lines = chunk_lines
        self.per_document = per_document
        self.chunks: list[Chunk] = []  # oldest first
        self._last: dict[str, int] = {}  # uri -> line of the last chunk taken

    def observe(self, uri: str, path: str, text: str, line: int) -> bool:
        """Note activity at ``line`` of a document (an edit, the cursor, an open at line 0): take
        the chunk around it unless one near it was taken already.  True when the buffer changed."""
        last = self._last.get(uri)
        if (
            last is not None
            and abs(line - last) < MOVE_LINES
            and any(c.uri == uri for c in self.chunks)
        ):
            return False
        lines = text.splitlines(keepends=True)
        start = max(0, min(line - self.chunk_lines // 2, len(lines) - self.chunk_lines))
        body = "".join(lines[start : start + self.chunk_lines])
        self._last[uri] = line
        if sum(1 for ln in body.splitlines() if ln.strip()) < MIN_LINES:
            return False
        self.chunks = [c for c in self.chunks if similarity(c.text, body) < SIMILAR]
        self.chunks.append(Chunk(uri, path, start, body))
        mine = [c for c in self.chunks if c.uri == uri]
        for old in mine[: -self.per_document] if len(mine) > self.per_document else []:
            self.chunks.remove(old)
        del self.chunks[: -self.max_chunks]
        return True

    def forget(self, uri: str) -> None:
        """Drop a document's chunks (it was deleted; a closed file's chunks stay useful)."""
        self.chunks = [c for c in self.chunks if c.uri != uri]
        self._last.pop(uri, None)

    def select(self, uri: str, budget: int, count: Callable[[str], int]) -> list[tuple[str, str]]:
        """(path, text) of other documents' chunks within ``budget`` tokens, the newest chosen
        first but listed oldest first (a stable prompt start)."""
        if budget <= 0:
            return []
        picked: list[tuple[str, str]] = []
        used = 0
        for c in reversed(self.chunks):
            if c.uri == uri:
                continue
            room = budget - used - 8  # the path and separators
            text = c.text
            if count(text) > room:  # the chunk's first lines that fit, if they say something
                lines, kept, n = text.splitlines(keepends=True), [], 0
                for line in lines:
                    n += count(line)
                    if n > room:
                        break
                    kept.append(line)
                if sum(1 for ln in kept if ln.strip()) < MIN_LINES:
                    break
                text = "".join(kept)
            picked.append((c.path, text))
            used += count(text) + 8
        return picked[::-1]
