"""spark-lsp: a language server for AI inline completions and live code-action edits."""

__version__ = "0.1.0"
