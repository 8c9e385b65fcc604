"""Text that arrives as JSON, made text every consumer can take.

JSON may escape a lone surrogate (``"\\ud800"``), and a JavaScript string, an editor's document
included, can hold one; Python's ``json`` decodes it into a ``str`` that the tokenizer, Python's
parser and UTF-8 all refuse. Each message reader (the language server's, the engine service's)
replaces such surrogates with U+FFFD, what an editor writes when it saves the text as UTF-8. U+FFFD
is as long as a lone surrogate in UTF-16 code units and in code points, and in UTF-8 as a
surrogate in WTF-8, so LSP positions after it stay where they were. A surrogate pair (an emoji as
``ensure_ascii`` escapes it) decodes to one code point and is untouched.
"""

from __future__ import annotations

import re
from typing import Any

#: a JSON escape of a surrogate, a pair's or a lone one: only a message holding one needs `clean`
_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_ESCAPE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE = re.compile("[\ud800-\udfff]")  # in a decoded str a pair is one code point: lone


def may_hold_surrogates(raw: str | bytes) -> bool:
    """Whether the JSON text `raw` escapes a surrogate (cheap; false for nearly every message)."""
    return (_ESCAPE_BYTES if isinstance(raw, bytes) else _ESCAPE).search(raw) is not None


def clean(value: Any) -> Any:
    """`value` (decoded JSON) with every lone surrogate in its strings, keys included, replaced
    by U+FFFD."""
    if isinstance(value, str):
        return _LONE.sub("\ufffd", value)
    if isinstance(value, list):
        return [clean(v) if isinstance(v, (str, list, dict)) else v for v in value]
    if isinstance(value, dict):
        return {clean(k): clean(v) for k, v in value.items()}
    return value
