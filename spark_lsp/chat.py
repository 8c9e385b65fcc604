"""Chat-template prompts for instruction edits on chat / instruct models.

A base code model is steered by putting the instruction in a comment and regenerating the
selection by FIM; a chat model follows instructions better when asked in its own template (from
`tokenizer_config.json`, rendered with Jinja2 like Hugging Face does). Jinja2 is optional: without
it, instruction edits use the FIM path.
"""

from __future__ import annotations

import logging
import re
from typing import Any

log = logging.getLogger(__name__)

SYSTEM = "You edit code. Reply with only the edited code in one fenced code block, no explanations."
_FENCE_OPEN = re.compile(r"^\s*```[\w+-]*[ \t]*\n?")


class ChatTemplate:
    def __init__(self, source: str, bos: str | None, eos: str | None):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(source)
        self.bos, self.eos = bos or "", eos or ""

    def render(self, messages: list[dict]) -> str:
        return self._template.render(
            messages=messages, add_generation_prompt=True, bos_token=self.bos, eos_token=self.eos
        )


def _token(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def load_chat_template(
    chat: dict[str, Any] | None, name: str, has_fim: bool
) -> ChatTemplate | None:
    """The model's chat template if it is a chat model: it has a template and either no FIM tokens
    or 'instruct' / 'chat' in its name (base code models often ship a template they were not
    trained on). None otherwise, or when Jinja2 is not installed.  ``chat``: the tokenizer's
    chat settings (``engine.tokenizer.Tokenizer.chat``: a folder's ``tokenizer_config.json``, a
    GGUF file's header)."""
    cfg = chat or {}
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": "..."}, ...]
        tpl = next(
            (t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"),
            None,
        )
    if not isinstance(tpl, str) or not tpl.strip():
        return None
    lowered = name.lower()
    if has_fim and "instruct" not in lowered and "chat" not in lowered:
        return None
    try:
        return ChatTemplate(tpl, _token(cfg.get("bos_token")), _token(cfg.get("eos_token")))
    except ImportError:
        log.info(
            "%s has a chat template but Jinja2 is not installed; instruction edits use FIM", name
        )
    except Exception as exc:
        log.warning("%s: cannot parse the chat template: %s", name, exc)
    return None


def instruction_messages(
    instruction: str, selected: str, before: str, after: str, language: str = "python"
) -> list[dict]:
    ctx_before = before[-1500:]
    ctx_after = after[:800]
    user = (
        f"Context before the code:\n```{language}\n{ctx_before}\n```\n"
        f"Context after the code:\n```{language}\n{ctx_after}\n```\n"
        f"Code to edit:\n```{language}\n{selected}```\n"
        f"Instruction: {instruction.strip()}\n"
        "Reply with the edited code only."
    )
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def extract_code(reply: str, final: bool) -> str:
    """The code inside the reply's first fenced block (or the whole reply without fences).
    Mid-stream, an opening fence is hidden and nothing after a closing fence is shown."""
    m = _FENCE_OPEN.match(reply)
    if m:
        body = reply[m.end() :]
        close = body.find("```")
        if close >= 0:
            return body[:close]
        if not final:
            # hold back a partial closing fence
            k = len(body) - len(body.rstrip("`"))
            return body[: len(body) - k] if k else body
        return body
    if not final and reply.lstrip().startswith("`"):
        return ""  # an opening fence still arriving
    return reply
