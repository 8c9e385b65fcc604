"""Real tokenizer vocabularies for tests: the ``ggml-vocab-*.gguf`` files llama.cpp ships for its own
tokenizer tests, each with ``.inp`` texts and ``.out`` token ids written by the original Hugging Face
tokenizer.  They come from the llama-cpp-python source distribution (cached under
``~/.cache/spark-lsp/sdist``, downloaded from PyPI when missing) and are extracted once."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

SDIST_VERSION = "0.3.36"
CACHE = Path(os.environ.get("SPARK_LSP_CACHE", Path.home() / ".cache" / "spark-lsp"))
NAMES = ("qwen2", "llama-bpe", "deepseek-coder", "starcoder", "llama-spm")


def _sdist() -> Path:
    sdist_dir = CACHE / "sdist"
    found = sorted(sdist_dir.glob(f"llama_cpp_python-{SDIST_VERSION}.tar.gz"))
    if found:
        return found[0]
    sdist_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(sdist_dir),
            f"llama-cpp-python=={SDIST_VERSION}",
        ],
        check=True,
    )
    return sdist_dir / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"


def vocab_dir() -> Path:
    """The folder holding ggml-vocab-{name}.gguf(.inp/.out) for every name in NAMES."""
    out = CACHE / "llama-vocab" / SDIST_VERSION
    if all((out / f"ggml-vocab-{n}.gguf.out").is_file() for n in NAMES):
        return out
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(_sdist()) as tar:
        for m in tar.getmembers():
            base = m.name.rsplit("/", 1)[-1]
            if "/vendor/llama.cpp/models/" in m.name and any(
                base.startswith(f"ggml-vocab-{n}.gguf") for n in NAMES
            ):
                src = tar.extractfile(m)
                if src is not None:
                    (out / base).write_bytes(src.read())
    return out


def cases(name: str) -> list[tuple[str, list[int]]]:
    """(text, Hugging Face token ids) pairs of one vocabulary's test file."""
    d = vocab_dir()
    texts = (
        (d / f"ggml-vocab-{name}.gguf.inp")
        .read_text(encoding="utf-8")
        .split("\n__ggml_vocab_test__\n")
    )
    ids = (d / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, ids)]
