"""The errors a service raises for the editor to see, free of any LSP library.

Services (inline completions, edits, settings) raise these; `spark_lsp.protocol` maps each to its
JSON-RPC error code in one place, so no service imports pygls and every handler stays a few lines.
A stopped generation is `Cancelled` (see docs/ARCHITECTURE.md, "Cancellation").
"""

from __future__ import annotations


class SparkError(Exception):
    """An error answered to the request that caused it; `code` is its JSON-RPC error code."""

    code = -32603


class InvalidParams(SparkError):
    """The request's parameters are wrong (unknown document, bad position, malformed data)."""

    code = -32602


class ContentModified(SparkError):
    """The document changed while the answer was computed; the answer would be stale."""

    code = -32801


class RequestCancelled(SparkError):
    """The request's work was stopped (superseded, cancelled, the user typed)."""

    code = -32800


class ServerError(SparkError):
    """A server-side failure the client should show (model not loaded, an edit already running)."""

    code = -32001
