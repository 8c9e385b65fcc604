"""Remote backends behind the server's `Model` seam (`spark_lsp.model_host`): llama.cpp's
server, Ollama and OpenAI-compatible servers (see `base` for what they promise).

`make_remote(settings)` builds the backend the `backend` setting names; `local` is the in-process
engine, `model_host.LocalModel`.
"""

from __future__ import annotations

from . import templates
from .base import BackendError, BackendUnavailable, Chunk, FileChunk, Request, TextPrompt
from .http import RemoteBackend, read_api_key
from .llamacpp import LlamaCppBackend
from .ollama import OllamaBackend
from .openai import OpenAIBackend

REMOTE = {"llamacpp": LlamaCppBackend, "ollama": OllamaBackend, "openai": OpenAIBackend}

__all__ = [
    "BackendError",
    "BackendUnavailable",
    "Chunk",
    "FileChunk",
    "Request",
    "TextPrompt",
    "RemoteBackend",
    "REMOTE",
    "make_remote",
]


def make_remote(settings) -> RemoteBackend:
    """The remote backend of `settings.backend` (raises BackendError for a bad API key source)."""
    cls = REMOTE.get(settings.backend)
    if cls is None:
        raise BackendError(
            f"unknown backend {settings.backend!r}; expected local or one of {', '.join(REMOTE)}"
        )
    url = settings.backend_url
    if url is not None and not url.startswith(("http://", "https://")):
        raise BackendError(f"setting 'backendUrl' must be an http:// or https:// URL, got {url!r}")
    try:
        templates.resolve(settings.fim_template, settings.backend_model, settings.fim_format)
    except ValueError as exc:
        raise BackendError(f"setting 'fimTemplate': {exc}") from None
    key = read_api_key(settings.backend_api_key_env, settings.backend_api_key_file)
    return cls(
        settings.backend_url,
        settings.backend_model,
        api_key=key,
        timeout_s=settings.backend_timeout_s,
        fim_template=settings.fim_template,
        fim_format=settings.fim_format,
    )
