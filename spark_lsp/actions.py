"""Code actions that edit: what each one asks the model, and what region of the document it replaces.

Listing is free (titles and a little data); the model runs only when an action is resolved or
executed. Every action becomes an `EditPlan`: a FIM prompt (prefix/suffix text), the document region
the result replaces, and how raw output becomes the region's new text. The result is applied as
minimal TextEdits, never a whole-file replacement.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from . import edit_checks, postprocess
from .backends.base import TextPrompt
from .documents import indentation, split_lines
from .edit_checks import COMPLETE, DEF_RE, DOCSTRING, INSTRUCT, REWRITE, TEST

TITLES = {
    REWRITE: "Spark: Rewrite selection",
    COMPLETE: "Spark: Complete this function / block",
    DOCSTRING: "Spark: Add docstring",
    TEST: "Spark: Generate a test for this function",
    INSTRUCT: "Spark: Edit selection with instruction…",
}
KINDS = {
    REWRITE: "refactor.rewrite",
    COMPLETE: "refactor.rewrite",
    DOCSTRING: "refactor.rewrite",
    TEST: "refactor.extract",
    INSTRUCT: "refactor.rewrite",
}
ACTIONS = tuple(TITLES)

#: the second decoding of a result the checks refused: sampled, reproducibly
RETRY_TEMPERATURE, RETRY_SEED = 0.7, 1


class ActionError(ValueError):
    """The action does not apply here (e.g. no function around the cursor)."""

    expected = True  # an answer for the user, not a failure of the server (the scheduler's log)


class EditRefused(ActionError):
    """The action's result would damage the code (`edit_checks`): it is not applied."""

    def __init__(self, title: str, reason: str, stats: dict) -> None:
        super().__init__(f"{title} was not applied: {reason}")
        self.reason, self.stats = reason, stats


@dataclass
class EditPlan:
    action: str
    start: int  # region to replace: document offsets [start, end)
    end: int
    prefix: str  # FIM prefix text (ends where the generated text begins)
    suffix: str  # FIM suffix text
    stop: tuple[str, ...] = ()
    max_tokens: int = 256
    head: str = ""  # fixed text written before the generated text
    tail: str = ""  # fixed text written after it
    finish: Callable[[str], str] = field(default=lambda s: s)  # raw output -> generated body
    multiline_ctx: postprocess.Context | None = None  # cut like a block when set
    prompt_text: str | None = None  # a complete (chat) prompt instead of FIM prefix/suffix
    partial: Callable[[str], str] = field(default=lambda s: s)  # raw output -> body mid-stream
    done: Callable[[str], bool] | None = None  # early stop on raw output
    draft: str | None = None  # text the output probably repeats (speculative decoding)
    retry_lead: str = ""  # output empty: generate once more, made to begin with this
    messages: list[dict] | None = None  # chat messages, for a model that takes them (remote chat)
    check: Callable[[str], str | None] | None = None  # final region text -> why not to apply it

    @property
    def steerable(self) -> bool:
        """The region shows the generated text as it is (head + raw output), so the user's typing
        in it maps back onto the output (a chat answer's code is extracted from it instead)."""
        return self.messages is None and self.prompt_text is None

    def judge(self, raw: str) -> tuple[str, str | None]:
        """The region's final text for `raw`, and why it must not be applied (None: it may)."""
        try:
            region = self.region_text(raw, final=True)
        except ActionError as exc:
            return "", str(exc)
        return region, self.check(region) if self.check is not None else None

    def region_text(self, raw: str, final: bool) -> str:
        body = self.finish(raw) if final else self.partial(raw)
        return self.head + body + (self.tail if final else "")


@dataclass
class Block:
    header_line: int  # line index of the `def` / `class` line
    body_end_line: int  # exclusive
    indent: str
    kind: str
    name: str
    header_end_line: int  # line index where the header ends (the line with the ':')


def enclosing_block(lines: list[str], line: int, kinds=("def", "class")) -> Block | None:
    """The innermost Python def/class whose header or body contains `line`."""
    for i in range(min(line, len(lines) - 1), -1, -1):
        m = DEF_RE.match(lines[i])
        if not m or m.group(2) not in kinds:
            continue
        indent = m.group(1)
        # header may span lines until a line ending with ':'
        h = i
        while h < len(lines) - 1 and not lines[h].split("#")[0].rstrip().endswith(":"):
            h += 1
        end = h + 1
        while end < len(lines):
            ln = lines[end]
            if ln.strip() and len(indentation(ln)) <= len(indent):
                break
            end += 1
        while end - 1 > h and not lines[end - 1].strip():
            end -= 1
        if i <= line < max(end, h + 1):
            return Block(i, end, indent, m.group(2), m.group(3), h)
    return None


def available(text: str, start: int, end: int, cursor_line: int) -> list[str]:
    """Actions that make sense for this selection / cursor (cheap: no model)."""
    lines = split_lines(text)
    block = enclosing_block(lines, cursor_line)
    out = []
    if end > start:
        out.append(REWRITE)
    out.append(COMPLETE)
    if block is not None and not _has_docstring(lines, block):
        out.append(DOCSTRING)
    fn = enclosing_block(lines, cursor_line, kinds=("def",))
    if fn is not None and not fn.name.startswith("test"):
        out.append(TEST)
    out.append(INSTRUCT)
    return out


def _has_docstring(lines: list[str], block: Block) -> bool:
    nxt = next(
        (ln for ln in lines[block.header_end_line + 1 : block.body_end_line] if ln.strip()), ""
    )
    return nxt.strip().startswith(('"""', "'''", 'r"""', "r'''"))


def _ends_newline(s: str) -> str:
    return s if s.endswith("\n") or not s else s + "\n"


def plan(
    action: str,
    text: str,
    start: int,
    end: int,
    cursor_line: int,
    max_tokens: int,
    instruction: str | None = None,
    count_tokens: Callable[[str], int] | None = None,
    chat: Any = None,
    python: bool | None = None,
    chat_messages: bool = False,
) -> EditPlan:
    """The EditPlan of `action` for the selection [start, end) (a cursor when start == end);
    an instruction edit asks a chat model when there is one: `chat`, the engine's chat template,
    or `chat_messages`, a remote model that takes chat messages;
    `python`: the document is Python (None: guessed from the text). Its result is checked by
    `edit_checks` before it is applied."""
    p = _plan(
        action,
        text,
        start,
        end,
        cursor_line,
        max_tokens,
        instruction,
        count_tokens,
        chat,
        chat_messages,
    )
    if python is None:
        python = looks_like_python(text)
    lines = split_lines(text)
    block = fn_name = None
    if action == COMPLETE:
        b = enclosing_block(lines, text.count("\n", 0, p.start))
        block = (b.name, len(b.indent)) if b is not None else None
    if action == TEST:
        f = enclosing_block(lines, cursor_line, kinds=("def",))
        fn_name = f.name if f is not None else None

    def check(region: str) -> str | None:
        return edit_checks.check(
            edit_checks.Edit(
                action,
                text,
                p.start,
                p.end,
                region,
                python,
                instruction=instruction,
                function=fn_name,
                block=block,
            )
        )

    p.check = check
    return p


_PY_DEF = re.compile(
    r"^[ \t]*(?:async[ \t]+)?def[ \t]+\w+[ \t]*\(.*\)[ \t]*(?:->.*)?:[ \t]*(?:#.*)?$", re.MULTILINE
)


def looks_like_python(text: str) -> bool:
    """A guess when the client did not say: the text parses as Python or has a Python def line."""
    return edit_checks.parse(text) is not None or bool(_PY_DEF.search(text))


def _plan(
    action: str,
    text: str,
    start: int,
    end: int,
    cursor_line: int,
    max_tokens: int,
    instruction: str | None,
    count_tokens: Callable[[str], int] | None,
    chat: Any,
    chat_messages: bool = False,
) -> EditPlan:
    lines = split_lines(text)
    line_starts = [0]
    for ln in lines:
        line_starts.append(line_starts[-1] + len(ln))

    if action in (REWRITE, INSTRUCT):
        if start == end:  # a cursor: act on its whole line
            s_line = cursor_line
            start, end = line_starts[s_line], line_starts[s_line + 1]
        selected = text[start:end]
        if not selected.strip():
            raise ActionError("the selection is empty; select the code to rewrite")
        budget = max(
            32, int((count_tokens(selected) if count_tokens else len(selected) // 3) * 1.5) + 32
        )
        prefix, suffix = text[:start], text[end:]
        if action == INSTRUCT:
            if not instruction or not instruction.strip():
                raise ActionError(
                    "an instruction is required (third argument of spark.editWithInstruction)"
                )
            first = selected.split("\n", 1)[0]
            at_line_start = start == 0 or text[start - 1] == "\n"
            ind = indentation(first) if at_line_start else ""
            comment = "".join(f"{ind}# {ln.strip()}\n" for ln in instruction.strip().splitlines())
            if at_line_start:
                prefix = prefix + comment
        keep_nl = selected.endswith("\n")

        def finish(raw: str, keep_nl=keep_nl) -> str:
            out = postprocess.cut_loops(raw).rstrip()
            if out != raw.rstrip():  # a rewrite cut short by a loop is not the whole rewrite
                loop = raw[len(out) :].strip().split("\n", 1)[0]
                raise ActionError(f"the model's rewrite went into a loop (repeating {loop[:40]!r})")
            return out + "\n" if keep_nl and out else out

        if action == INSTRUCT and (chat is not None or chat_messages):
            from . import chat as chatmod

            messages = chatmod.instruction_messages(instruction, selected, text[:start], text[end:])
            prompt = chat.render(messages) if chat is not None else None

            def chat_finish(raw: str, keep_nl=keep_nl) -> str:
                code = chatmod.extract_code(raw, final=True).rstrip()
                if not code.strip():
                    raise ActionError("the model's reply held no code")
                return code + "\n" if keep_nl else code

            return EditPlan(
                action,
                start,
                end,
                "",
                "",
                stop=(),
                max_tokens=min(budget * 2, max_tokens),
                finish=chat_finish,
                prompt_text=prompt,
                messages=None if chat is not None else messages,
                partial=lambda raw: chatmod.extract_code(raw, final=False),
                done=lambda raw: raw.lstrip().startswith("```") and raw.count("```") >= 2,
                draft=selected,
            )
        return EditPlan(
            action,
            start,
            end,
            prefix,
            suffix,
            stop=(),
            max_tokens=min(budget, max_tokens),
            finish=finish,
            draft=selected,
        )

    if action == COMPLETE:
        at = end
        cursor_line = text.count("\n", 0, at)
        ctx_line = text[line_starts[cursor_line] : at] if cursor_line < len(lines) else ""
        nxt = tuple(ln.rstrip("\r\n") for ln in lines[cursor_line + 1 : cursor_line + 7])
        prv = tuple(ln.rstrip("\r\n") for ln in lines[max(0, cursor_line - 6) : cursor_line])
        after = (
            lines[cursor_line][len(ctx_line) :].rstrip("\r\n") if cursor_line < len(lines) else ""
        )
        ctx = postprocess.Context(
            ctx_line, after, nxt, prv, python=True
        )  # the actions find Python blocks
        fn = enclosing_block(lines, cursor_line, kinds=("def",))
        if fn is not None and edit_checks.block_is_complete(text, fn.header_line, fn.body_end_line):
            raise ActionError(
                f"function {fn.name!r} is already complete (it ends with a return); "
                "there is nothing to add"
            )

        def finish(raw: str, ctx=ctx) -> str:
            return postprocess.clean(raw, ctx, multiline=True, max_lines=200)

        return EditPlan(
            action,
            at,
            at,
            text[:at],
            text[at:],
            stop=("\n\n\n",),
            max_tokens=max_tokens,
            finish=finish,
            multiline_ctx=ctx,
        )

    if action == DOCSTRING:
        block = enclosing_block(lines, cursor_line)
        if block is None:
            raise ActionError("no function or class around the cursor to document")
        if _has_docstring(lines, block):
            raise ActionError(f"{block.kind} {block.name!r} already has a docstring")
        body_line = block.header_end_line + 1
        nxt_body = next((ln for ln in lines[body_line : block.body_end_line] if ln.strip()), None)
        ind = indentation(nxt_body) if nxt_body is not None else block.indent + "    "
        at = line_starts[body_line] if body_line < len(lines) else len(text)
        prefix = _ends_newline(text[:at]) + ind + '"""'
        head = ("" if text[:at].endswith("\n") or not text[:at] else "\n") + ind + '"""'

        def finish(raw: str, ind=ind) -> str:
            body = postprocess.cut_loops(raw.split('"""', 1)[0]).rstrip()
            if not body.strip():
                raise ActionError("the model produced an empty docstring")
            return body + ("\n" + ind if "\n" in body else "")

        # A model may close the quotes at once (an empty docstring); it is then asked again with
        # its text made to start on the next line, a summary it rarely declines (run_plan_steps).
        return EditPlan(
            action,
            at,
            at,
            prefix,
            text[at:],
            stop=('"""',),
            max_tokens=min(max_tokens, 160),
            head=head,
            tail='"""\n',
            finish=finish,
            retry_lead="\n" + ind,
        )

    if action == TEST:
        fn = enclosing_block(lines, cursor_line, kinds=("def",))
        if fn is None:
            raise ActionError("no function around the cursor to test")
        name = fn.name.lstrip("_") or fn.name
        at = len(text)
        head = ("" if text.endswith("\n") or not text else "\n") + f"\n\ndef test_{name}():\n    "
        prefix = text + head
        ctx = postprocess.Context("    ", "", (), (f"def test_{name}():",), python=True)

        def finish(raw: str, ctx=ctx) -> str:
            body = postprocess.clean(raw, ctx, multiline=True, max_lines=60)
            if not body.strip():
                raise ActionError("the model produced an empty test")
            return body + "\n"

        return EditPlan(
            action,
            at,
            at,
            prefix,
            "",
            stop=("\n\n\n",),
            max_tokens=max_tokens,
            head=head,
            finish=finish,
            multiline_ctx=ctx,
        )

    raise ActionError(f"unknown action {action!r}; known: {', '.join(ACTIONS)}")


def generated_is_done(p: EditPlan, raw: str) -> bool:
    """Early stop once the output is complete: the block is, or the output started to loop
    (nothing after a loop is kept)."""
    if p.multiline_ctx is not None and p.done is None:
        return postprocess.block_done(raw, p.multiline_ctx, 200)  # (it checks for loops itself)
    return postprocess.ends_in_loop(raw) or (p.done is not None and p.done(raw))


def run_plan(*args: Any, **kw: Any) -> tuple[str, dict]:
    """run_plan_steps run to its end."""
    from .completions import drive

    return drive(run_plan_steps(*args, **kw))


def run_plan_steps(
    model: Any,
    builder: Any,
    job: Any,
    p: EditPlan,
    params_cls: Any,
    context_tokens: int,
    on_text: Callable[[str], None] | None = None,
    speculative: bool = False,
    lead: str = "",
):
    """Generate the region's final text for plan `p` (engine thread, a step generator returning
    (region text, stats)). `lead`: the output starts with this text (the user's, typed after an
    earlier generation of the edit ended), and the model continues after it."""
    from .completions import control_ids, generate_steps

    healed = ""
    if p.messages is not None:  # a remote chat model: the messages go as they are
        ids, text = [], TextPrompt(messages=tuple(p.messages))
    elif p.prompt_text is not None:
        ids = list(builder.tokenizer.encode(p.prompt_text))
        if len(ids) > context_tokens + 512:
            raise ActionError(f"the chat prompt has {len(ids)} tokens; select less code")
        text = TextPrompt(p.prompt_text)
    else:  # the region usually starts a line: its line break is healed (see build_parts_healed)
        ids, healed = builder.build_parts_healed(p.prefix, p.suffix, context_tokens)
        prefix, suffix = builder.fit_parts(p.prefix, p.suffix, context_tokens)  # the same texts
        text = TextPrompt(prefix, suffix if getattr(builder, "fim", None) is not None else None)
    # FIM control tokens end a chat answer too: a chat prompt must not let "<fim_suffix>" through
    stop = p.stop + tuple(builder.stop_strings)

    steering = getattr(job, "steering", None)

    def steered() -> bool:
        """The user typed into the output: their text is part of the result, never redone."""
        return steering is not None and bool(steering.typed)

    def attempt(lead: str, sampled: bool = False):
        decoding = (
            {"temperature": RETRY_TEMPERATURE, "top_p": 0.95, "seed": RETRY_SEED}
            if sampled
            else {"temperature": 0.0}
        )
        while True:
            params = params_cls(
                max_new_tokens=p.max_tokens,
                stop=stop,
                stop_ids=control_ids(builder),
                healed_prefix=healed + lead,
                **decoding,
            )  # generated, not emitted: put back below
            raw, stats, finish = yield from generate_steps(
                model,
                job,
                ids,
                params,
                done=(lambda s, lead=lead: generated_is_done(p, lead + s)),
                on_text=(lambda s, lead=lead: on_text(lead + s))
                if on_text is not None and lead
                else on_text,
                speculative=speculative,
                draft=p.draft,
                text_prompt=replace(text, prefix=text.prefix + lead)
                if lead and text.messages is None
                else text,
                **({"steering": steering.starting(lead)} if steering is not None else {}),
            )
            # the user changed text they typed, or typed after the generation ended and not what
            # it wrote: a successor continues after their text (their output as they left it)
            late = steering is not None and steering.take_late()
            if late and not (lead + raw).startswith(steering.typed):
                lead = steering.typed
                continue
            return lead + raw, {**stats, "finish_reason": finish}

    raw, stats = yield from attempt(lead)
    if p.retry_lead and not raw.strip() and not steered():  # e.g. a docstring closed at once
        raw, stats = yield from attempt(p.retry_lead)
        region, reason = p.judge(raw)
    else:
        region, reason = p.judge(raw)
        if reason is not None and not steered():  # would damage the code: once more, sampled
            raw, stats = yield from attempt(p.retry_lead, sampled=True)
            region, reason = p.judge(raw)
    if reason is not None:
        raise EditRefused(TITLES[p.action], reason, stats)
    return region, stats
