"""One module per CLI subcommand; each exposes ``register(subparsers)`` and keeps heavy imports inside its run function."""
