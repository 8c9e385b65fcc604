"""Train the byte-level BPE tokenizer of the bundled model on the CPython standard library.

Only the standard library is training data (code of other packages stays unseen, for
evaluation), so the corpus is every ``.py`` under this interpreter's ``Lib/`` (tests
included, ``site-packages`` excluded).  5% of the files are held out *by file* with a
fixed seed; the split is written to the run directory so evaluation uses exactly the
files the model never saw.

The pre-tokenizer keeps a newline together with the indentation that follows it
("\\n        " is one pre-token), so BPE learns single tokens for Python's most common
whitespace, and a completion that starts at the beginning of an indented line tokenises
the same way as in training.

Usage::

    python -m engine.train.tokenizer --out runs/spark-code-mini [--vocab-size 8192]
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
from pathlib import Path

EOS = "<|endoftext|>"
FIM_PREFIX = "<fim_prefix>"
FIM_SUFFIX = "<fim_suffix>"
FIM_MIDDLE = "<fim_middle>"
PAD = "<pad>"
FILE_SEP = "<file_sep>"
SPECIAL_TOKENS = [EOS, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, PAD, FILE_SEP]

# Newline(s) plus the following indentation form one pre-token; otherwise GPT-2 style
# words with an optional leading space, digit groups, punctuation runs, and space runs.
SPLIT_PATTERN = (
    r"(?:[ \t]*\r?\n)+[ \t]*|^[ \t]+"
    r"|'(?:[sdmt]|ll|ve|re)"
    r"| ?\p{L}+"
    r"| ?\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+"
    r"|[ \t]+(?![^ \t\r\n])"
    r"|[ \t]+"
    r"|\s+"
)

SPLIT_SEED = 1234
HOLDOUT_FRACTION = 0.05


def stdlib_dir() -> Path:
    """The ``Lib/`` directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_files(root: Path | None = None) -> list[Path]:
    """All UTF-8 decodable ``.py`` files under the stdlib, sorted, without site-packages."""
    root = root or stdlib_dir()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if "site-packages" in rel or "dist-packages" in rel or not p.is_file():
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append(p)
    return out


def split_files(
    files: list[Path], seed: int = SPLIT_SEED, holdout: float = HOLDOUT_FRACTION
) -> tuple[list[Path], list[Path]]:
    """Deterministic by-file train/validation split."""
    order = sorted(files)
    random.Random(seed).shuffle(order)
    n_val = max(1, round(len(order) * holdout))
    return sorted(order[n_val:]), sorted(order[:n_val])


def write_split(run_dir: Path, train: list[Path], val: list[Path]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "train_files.txt").write_text("".join(f"{p}\n" for p in train))
    (run_dir / "val_files.txt").write_text("".join(f"{p}\n" for p in val))


def read_file_list(path: Path) -> list[Path]:
    return [Path(line) for line in path.read_text().splitlines() if line.strip()]


def build_tokenizer(files: list[Path], vocab_size: int = 8192):
    """Train a byte-level BPE tokenizer (``tokenizers.Tokenizer``) on ``files``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        for p in files:
            yield p.read_text(encoding="utf-8")

    tok.train_from_iterator(texts(), trainer=trainer, length=len(files))
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    """``tokenizer_config.json`` so transformers' AutoTokenizer loads the same tokenizer."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, FILE_SEP],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="run directory")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=SPLIT_SEED, help="seed of the file split")
    ap.add_argument("--stdlib", type=Path, default=None, help="default: this Python's Lib/")
    args = ap.parse_args(argv)
    if not 256 < args.vocab_size <= 65536:
        ap.error(f"--vocab-size must be in (256, 65536], got {args.vocab_size}")

    files = list_stdlib_files(args.stdlib)
    train, val = split_files(files, seed=args.seed)
    write_split(args.out, train, val)
    tok = build_tokenizer(train, args.vocab_size)
    tok.save(str(args.out / "tokenizer.json"))
    chars = sum(len(p.read_text(encoding="utf-8")) for p in val[:40])
    ntok = sum(len(tok.encode(p.read_text(encoding="utf-8")).ids) for p in val[:40])
    info = {
        "files": len(files),
        "train_files": len(train),
        "val_files": len(val),
        "vocab_size": tok.get_vocab_size(),
        "val_chars_per_token": round(chars / max(ntok, 1), 3),
    }
    (args.out / "tokenizer_info.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info))


if __name__ == "__main__":
    main()
