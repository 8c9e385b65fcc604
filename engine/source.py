"""A model on disk, a Hugging Face folder or a GGUF file: its configuration, its tokenizer, and
where its weights are read from.

What :meth:`engine.Engine.load` starts from, and all a language server whose engine is a daemon
needs of the model (it builds prompts with the tokenizer): nothing here imports the graph builder
or ONNX Runtime.
"""

from __future__ import annotations

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
