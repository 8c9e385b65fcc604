"""The language server's benchmarks: `spark-lsp bench lsp | service | robustness` and the plots.

Each module measures the server from outside, as an editor would (over its pipes, sockets and
the engine service), and exposes ``main(argv) -> int`` for ``spark_lsp.commands.bench``. Nothing
that serves an editor imports this package (pyproject.toml's ``server-runs-no-bench`` contract),
as the engine's core never imports ``engine.lab``.
"""
