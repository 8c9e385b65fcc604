"""A model on disk, a Hugging Face folder or a GGUF file: its configuration, its tokenizer, and
where its weights are read from.

What :meth:`engine.Engine.load` starts from, and all a language server whose engine is a daemon
needs of the model (it builds prompts with the tokenizer): nothing here imports the graph builder
or ONNX Runtime.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .config import ModelConfig, ModelError, load_config, model_path
from .gguf import GGUFModel, is_gguf
from .tokenizer import Tokenizer
from .weights import file_digest, open_weights, weights_digest


@dataclass
class ModelSource:
    """What is read from a model, whether a Hugging Face folder or a GGUF file."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    gguf: GGUFModel | None = None

    def digest(self) -> str:
        return file_digest(self.path) if self.gguf is not None else weights_digest(self.path)

    def open_weights(self):
        """The decoder's tensors, read on access (a context manager)."""
        if self.gguf is not None:
            return self.gguf.open_weights(self.config)
        return open_weights(self.path, self.config)


def model_config(model_dir: str | Path) -> ModelConfig:
    """A model folder's or a ``.gguf`` file's configuration alone (a GGUF's from its header):
    :func:`open_model`'s without the tokenizer, for a caller that holds that already."""
    path = Path(model_dir).expanduser()
    return GGUFModel(path).config() if is_gguf(path) else load_config(path)


def open_model(model_dir: str | Path) -> ModelSource:
    """A model folder or a ``.gguf`` file, its config and tokenizer read and validated."""
    path = Path(model_dir).expanduser()
    if is_gguf(path):
        gg = GGUFModel(path)
        return ModelSource(path, gg.config(), gg.tokenizer(), gg)
    if path.is_file():
        raise ModelError(f"{path}: neither a model folder nor a GGUF file")
    folder = model_path(path)
    return ModelSource(folder, load_config(folder), Tokenizer.load(folder))


#: The files of a model folder a tokenizer, a configuration and a chat template are read from
#: (``Tokenizer.load``, ``load_config``): all that a client of an engine
#: service elsewhere needs of its model (``prompt_files``).
PROMPT_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def prompt_files(model_dir: str | Path, tokenizer: Tokenizer | None = None) -> dict[str, str]:
    """The ``PROMPT_FILES`` of a model folder, or of a GGUF file as a folder would hold them (its
    header's configuration, its tokenizer in ``tokenizers`` JSON, its special tokens and chat
    template in ``tokenizer_config.json``): a folder of these files loads the same tokenizer and
    configuration as the model itself (``open_model``, ``model_config``).  Text by file name.
    ``tokenizer``: a GGUF's, when loaded already (made from the file's vocabulary otherwise)."""
    path = Path(model_dir).expanduser()
    if is_gguf(path):
        gg = GGUFModel(path)
        tok = tokenizer if tokenizer is not None else gg.tokenizer()
        special = {
            key: tok.id_to_token(i)
            for key, i in (("bos_token", tok.bos_id), ("pad_token", tok.pad_id))
            if i is not None and tok.id_to_token(i) is not None
        }
        special.update(tok.chat)  # its chat template, and the tokens it is rendered with
        return {
            "config.json": json.dumps(gg.hf_config(), indent=1),
            "tokenizer.json": tok.serialized(),
            "tokenizer_config.json": json.dumps(special, indent=1, ensure_ascii=False),
        }
    folder = model_path(path)
    out = {}
    for name in PROMPT_FILES:
        f = folder / name
        if f.is_file():
            try:
                with f.open(encoding="utf-8", newline="") as fh:  # as stored: no newline edits
                    out[name] = fh.read()
            except (OSError, UnicodeDecodeError) as e:
                raise ModelError(f"{f}: cannot read: {e}") from None
    return out
