"""Where text is generated: the in-process engine or a remote server (see `base` for the contract).

`make_remote(settings)` builds the remote backend the settings name; the local one is built by
the server once its engine has loaded (`local.LocalBackend`).
"""

from __future__ import annotations

from .base import Backend, BackendError, BackendUnavailable, Chunk, FileChunk, Request, Stream
from .http import RemoteBackend, read_api_key
from .llamacpp import LlamaCppBackend
from .ollama import OllamaBackend
from .openai import OpenAIBackend

REMOTE = {"llamacpp": LlamaCppBackend, "ollama": OllamaBackend, "openai": OpenAIBackend}

__all__ = ["Backend", "BackendError", "BackendUnavailable", "Chunk", "FileChunk", "Request", "Stream",
           "RemoteBackend", "REMOTE", "make_remote"]


def make_remote(settings) -> RemoteBackend:
    """The remote backend of `settings.backend` (raises BackendError for a bad API key source)."""
    cls = REMOTE.get(settings.backend)
    if cls is None:
        raise BackendError(f"unknown backend {settings.backend!r}; expected local or one of {', '.join(REMOTE)}")
    key = read_api_key(settings.backend_api_key_env, settings.backend_api_key_file)
    return cls(settings.backend_url, settings.backend_model, api_key=key, timeout_s=settings.backend_timeout_s,
               fim_template=settings.fim_template)
