"""Fill-in-the-middle prompts within a token budget, laid out so the engine's prefix cache hits.

Why the layout matters: the engine reuses the KV cache for the longest common token prefix with the
previous prompt of the same document. With suffix-prefix-middle (SPM) order the prompt reads
`<suffix-token> suffix <prefix-token> prefix <middle-token>`: while the user types, the suffix and
the head of the prefix stay identical, so each keystroke only prefills the few new tokens. The
windows are anchored: the prefix keeps starting at the same line until it outgrows its budget (then
it jumps forward by a quarter of the budget, not one line per keystroke), and the suffix is cut at
a line count that depends only on the suffix text.

Token healing: the partial word at the cursor is backed off the prompt (`Prompt.healed`, see
`engine.fim.heal`) and the engine generates it as the constrained start of the answer without
emitting it, so the model completes `assertEq` as the `assertEqual` it learnt instead of from an
odd token boundary. A cursor at column 0 heals the line break before it the same way, so the
model writes the line's indentation as the merged newline+indent token it learnt. The healed
prompt only loses tokens at its end: the prefix cache still hits.

Prefix-suffix-middle (PSM) formats, the only ones Qwen2.5-Coder, CodeLlama and DeepSeek-Coder were
trained on, put the suffix after the prefix, so a prompt rebuilt at every keystroke would
re-prefill the whole suffix each time. There the prompt is anchored at the cursor instead: while
the user types at it (nothing before the anchor or after the cursor changes), the text typed
since goes after the middle token, as if the model had written it, and the prompt only grows at
its end (`_Middle`). In training the middle is any span, so a middle that begins with what the
user typed is what the model learnt to continue.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.fim import Context, FimFormat
from engine.fim import heal as heal_ids

from .documents import split_lines


@dataclass
class Prompt:
    ids: list[int]
    prefix: str  # the prefix text actually in the prompt
    suffix: str  # the suffix text actually in the prompt
    prefix_start: int  # document offset where the prefix text begins
    fim: bool  # False: no FIM tokens in this tokenizer, plain left-to-right prompt
    healed: str = ""  # end of `prefix` left out of `ids`: the answer must begin with it (not shown)
    context_tokens: int = 0  # ids of other files' chunks at the start (spark_lsp.neighbours)


@dataclass
class _Middle:
    """A PSM prompt's fixed part while the user types at its cursor (`PromptBuilder.build`)."""

    begin: int  # document offset of the prompt's prefix text
    anchor: int  # document offset where that prefix ends and the middle begins
    prefix: str  # text[begin:anchor]
    suffix: str  # the text after the cursor in the prompt
    ids: list[int]  # the prompt up to and including the middle token
    context: Context | None
    n_context: int


class TokenCounter:
    """Token counts per line, memoised: lines rarely change between keystrokes."""

    def __init__(self, encode: Callable[[str], list[int]], capacity: int = 20000):
        self._encode = encode
        self._memo: OrderedDict[str, int] = OrderedDict()
        self._capacity = capacity

    def line(self, text: str) -> int:
        n = self._memo.get(text)
        if n is None:
            n = len(self._encode(text)) if text else 0
            self._memo[text] = n
            if len(self._memo) > self._capacity:
                self._memo.popitem(last=False)
        return n


class PromptBuilder:
    """Builds FIM prompts for one model; keeps one prefix anchor per document."""

    def __init__(self, tokenizer: Any, fim: Any | None = None, heal: bool = True):
        self.tokenizer = tokenizer
        self.heal = (
            heal  # token-heal prompts: a partial word (`build`), a final line break (code actions)
        )
        self.fim: FimFormat | None = fim if fim is not None else FimFormat.detect(tokenizer)
        # suffix-first only where the model was trained on it (engine.fim: the bundled model's style)
        self.spm = self.fim is not None and self.fim.supports_spm
        # special tokens that end a middle (e.g. <file_sep>) decode as text: stop on them too
        stop_ids = self.fim.stop_ids if self.fim is not None else ()
        eos = set(getattr(tokenizer, "eos_ids", ()) or ())
        names = (
            (tokenizer.id_to_token(i) for i in sorted(stop_ids) if i not in eos)
            if hasattr(tokenizer, "id_to_token")
            else ()
        )
        self.stop_strings: tuple[str, ...] = tuple(t for t in names if t)
        self.counter = TokenCounter(tokenizer.encode)
        self._anchors: dict[str, int] = {}
        # PSM prompts keep their suffix while the user types (see the module docstring)
        self.anchor_middle = (
            self.fim is not None and not self.spm and self.fim.middle_id is not None
        )
        if self.anchor_middle and self.fim.style is not None and self.fim.style.spm_only:
            self.anchor_middle = False
        self._middles: dict[str, _Middle] = {}
        self._context_key: tuple = ()
        self._context: Context | None = None

    def forget(self, key: str) -> None:
        self._anchors.pop(key, None)
        self._middles.pop(key, None)

    def count_tokens(self, text: str) -> int:
        """Tokens of a text, line by line (memoised): budgets, not exact prompt lengths."""
        return sum(self.counter.line(line) for line in split_lines(text))

    def context(self, files: list[tuple[str, str]]) -> Context | None:
        """Other files' chunks ((path, text) pairs, `spark_lsp.neighbours`) as prompt ids in the
        model's repository format, encoded once per distinct selection; None without FIM."""
        if not files or self.fim is None:
            return None
        key = tuple(files)
        if key != self._context_key:
            self._context_key, self._context = key, self.fim.context_ids(files)
        return self._context

    def encode_fim(self, prefix: str, suffix: str, context: Context | None = None) -> list[int]:
        if self.fim is None:
            return list(self.tokenizer.encode(prefix))
        return self.fim.build(prefix, suffix, spm=self.spm, context=context)

    def encode_healed(
        self, prefix: str, suffix: str, *, line_break: bool = False, context: Context | None = None
    ) -> tuple[list[int], str]:
        """`encode_fim` with the prefix token-healed: (ids, healed text). A left-to-right prompt
        keeps at least one token (the engine needs something to start from). A final line break
        is always healed (a cursor at column 0: tokenizers that merge a newline with the next
        line's indentation never saw a bare one before indented code); `line_break`: only that,
        never a partial word (code actions, see `build_parts_healed`)."""
        if not self.heal:
            return self.encode_fim(prefix, suffix, context), ""
        rule = {"run": None, "newline": True} if line_break else {"newline": True}
        ids, healed = heal_ids(
            self.tokenizer, prefix, keep=0 if self.fim is not None else 1, **rule
        )
        if self.fim is None:
            return ids, healed
        suffix_ids = list(self.tokenizer.encode(suffix)) if suffix else []
        return self.fim.layout(ids, suffix_ids, self.spm, context=context), healed

    def build(
        self,
        text: str,
        offset: int,
        budget: int,
        key: str | None = None,
        suffix_share: float | None = None,
        context: Context | None = None,
    ) -> Prompt:
        """Prompt for the cursor at string offset `offset` of `text`, at most about `budget` tokens
        of document text (a few FIM tokens come on top).  `context`: other files' ids
        (`context()`), first in the prompt, on top of `budget`.  With a `key` (the document) a PSM
        prompt stays anchored while the user types at its cursor (`_Middle`)."""
        if key is None or not self.anchor_middle:
            return self._build_window(text, offset, budget, key, suffix_share, context)
        m = self._middles.get(key)
        if m is not None:
            p = self._extend_middle(m, text, offset, budget, context)
            if p is not None:
                return p
        p = self._build_window(text, offset, budget, key, suffix_share, context)
        anchor = offset - len(p.healed)
        kept = p.prefix[: len(p.prefix) - len(p.healed)]
        if text[p.prefix_start : anchor] == kept and p.ids and p.ids[-1] == self.fim.middle_id:
            self._middles[key] = _Middle(
                p.prefix_start, anchor, kept, p.suffix, p.ids, context, p.context_tokens
            )
        else:  # a cut line (minified code): no anchor
            self._middles.pop(key, None)
        return p

    def _extend_middle(
        self, m: _Middle, text: str, offset: int, budget: int, context: Context | None
    ) -> Prompt | None:
        """The anchored prompt with the text typed since as the start of the middle, or None when
        the user did anything else (or it outgrew `budget`)."""
        if (
            offset < m.anchor
            or context is not m.context
            or text[offset : offset + len(m.suffix)] != m.suffix
            or text[m.begin : m.anchor] != m.prefix
        ):
            return None
        typed = text[m.anchor : offset]
        if len(m.ids) - m.n_context + self.count_tokens(typed) > budget + 8:
            return None
        if self.heal:
            ids, healed = heal_ids(self.tokenizer, typed, keep=0, newline=True)
        else:
            ids, healed = list(self.tokenizer.encode(typed)) if typed else [], ""
        return Prompt(
            [*m.ids, *ids], m.prefix + typed, m.suffix, m.begin, True, healed, m.n_context
        )

    def _build_window(
        self,
        text: str,
        offset: int,
        budget: int,
        key: str | None,
        suffix_share: float | None,
        context: Context | None,
    ) -> Prompt:
        """A fresh prompt: the prefix window anchored at a line, the suffix cut by lines."""
        # Work on a window around the cursor (a token is rarely over 12 characters): splitting a
        # whole large file into lines on every keystroke would cost more than the model's prefill.
        reach = max(budget, 64) * 12
        ws = text.rfind("\n", 0, max(0, offset - reach)) + 1 if offset > reach else 0
        we = text.find("\n", min(len(text), offset + reach))
        we = len(text) if we < 0 or offset + reach >= len(text) else we + 1
        lines = split_lines(text[ws:we])
        starts = [ws]
        for ln in lines:
            starts.append(starts[-1] + len(ln))
        # locate the cursor line
        line_no = max(0, bisect.bisect_right(starts, offset) - 1)
        line_no = min(line_no, len(lines) - 1)
        line_start = starts[line_no]
        # the cursor line before and after the cursor; of a very long line (minified code, a
        # 1 MB line) only the part near the cursor, so the work stays bounded by the budget
        head = text[max(line_start, offset - reach) : offset]
        tail = lines[line_no][offset - line_start :][:reach]

        if suffix_share is None:
            # PSM prompts re-prefill the whole suffix on every keystroke: keep it short there
            suffix_share = 0.25 if self.spm else 0.1
        suffix_budget = int(budget * suffix_share) if self.fim is not None else 0
        # suffix: rest of the cursor line, then whole lines while they fit
        if suffix_budget:
            tail = self._cut(tail, suffix_budget, keep_end=False)
        used = self.counter.line(tail) if suffix_budget else 0
        end = line_no + 1
        while suffix_budget and end < len(lines):
            n = self.counter.line(lines[end])
            if used + n > suffix_budget:
                break
            used += n
            end += 1
        suffix = (tail + "".join(lines[line_no + 1 : end])) if suffix_budget else ""
        prefix_budget = max(budget - used, 8)

        # prefix: anchored start line (kept as a document offset)
        head = self._cut(head, prefix_budget, keep_end=True)
        head_n = self.counter.line(head)
        anchor = self._anchors.get(key) if key is not None else None
        start = None
        if anchor is not None:
            i = bisect.bisect_left(starts, anchor)
            if i <= line_no and starts[i] == anchor:
                total = head_n + sum(self.counter.line(lines[j]) for j in range(i, line_no))
                if total <= prefix_budget:
                    start = i
        if start is None:
            target = prefix_budget * 0.75 if key is not None else prefix_budget
            total, start = head_n, line_no
            while start > 0:
                n = self.counter.line(lines[start - 1])
                if total + n > target:
                    break
                total += n
                start -= 1
        if key is not None:
            self._anchors[key] = starts[start]
        prefix = "".join(lines[start:line_no]) + head
        ids, healed = self.encode_healed(prefix, suffix, context=context)
        n_context = len(context.head) + len(context.lead) if context is not None else 0
        begin = starts[start] if start < line_no else offset - len(head)
        return Prompt(ids, prefix, suffix, begin, self.fim is not None, healed, n_context)

    def _cut(self, s: str, budget: int, keep_end: bool) -> str:
        """`s` (one line, or part of one) cut to about `budget` tokens: its end or its start."""
        for _ in range(8):
            n = self.counter.line(s)
            if n <= budget or not s:
                return s
            k = max(1, int(len(s) * budget / n * 0.9))
            s = s[-k:] if keep_end else s[:k]
        return s

    def build_parts(self, prefix: str, suffix: str, budget: int) -> list[int]:
        """FIM prompt ids for explicit prefix/suffix texts (code actions), keeping the lines nearest
        the middle: the prefix is cut at its start, the suffix at its end, whole lines at a time."""
        return self.encode_fim(*self.fit_parts(prefix, suffix, budget))

    def build_parts_healed(self, prefix: str, suffix: str, budget: int) -> tuple[list[int], str]:
        """`build_parts` with a final line break healed (`engine.fim.heal(newline=True)`): a code
        action's prompt ends where its region starts, usually a line start, and a bare newline
        before indented code is out of distribution for tokenizers that merge it with the
        indentation. Returns (ids, healed text for `GenerationParams.healed_prefix`)."""
        return self.encode_healed(*self.fit_parts(prefix, suffix, budget), line_break=True)

    def fit_parts(self, prefix: str, suffix: str, budget: int) -> tuple[str, str]:
        """The ends of `prefix` and `suffix` that fit `budget` tokens (suffix at most 30%)."""
        suffix_budget = int(budget * 0.3) if self.fim is not None and suffix else 0
        s_lines = split_lines(suffix) if suffix_budget else []
        used, k = 0, 0
        while k < len(s_lines):
            n = self.counter.line(s_lines[k])
            if used + n > suffix_budget:
                break
            used += n
            k += 1
        suffix = "".join(s_lines[:k])
        p_lines = split_lines(prefix)
        total, j = 0, len(p_lines)
        while j > 0:
            n = self.counter.line(p_lines[j - 1])
            if total + n > budget - used and j < len(p_lines):
                break
            total += n
            j -= 1
        return "".join(p_lines[j:]), suffix
