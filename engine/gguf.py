"""Read llama.cpp's GGUF files: architecture, tokenizer and weights, with the ``gguf`` package.

A GGUF file holds what a Hugging Face folder spreads over ``config.json``, ``tokenizer.json``
and safetensors.  This module maps each part onto the engine's own forms, so the rest of the
engine never knows where a model came from:

* metadata (``general.architecture`` and ``{arch}.*`` keys) -> a Hugging Face style config
  object -> :func:`engine.config.parse_config` (one validation path for both sources);
* ``tokenizer.ggml.*`` -> a ``tokenizers`` tokenizer: byte-level BPE split the way the
  vocabulary's merges were learnt (``tokenizer.ggml.pre``: the regexes of the original
  ``tokenizer.json``), or SentencePiece-style BPE with byte fallback for ``llama``
  vocabularies; control tokens become special tokens, so FIM detection works unchanged;
* tensors -> float32 arrays under Hugging Face names: F32 stays a view of the memory-mapped
  file, F16 / BF16 / Q8_0 / Q4_0 / K-quants are dequantised by ``gguf.quants`` one tensor at a
  time.  llama.cpp's converter permutes the Q/K rows of ``llama`` files for its rotary layout
  and adds 1 to Gemma's norm weights; both are undone here.

Quantised files keep their precision through the engine's own quantiser
(:func:`default_precision`): Q8_0 blocks (32 weights, one scale) requantise exactly to
MatMulNBits' symmetric 8-bit blocks of 32; 4-bit and K-quant files are requantised to 4 bits
(the emitter that keeps Q8_0 and Q4_0 blocks as they are is :mod:`engine.gguf_quant`'s, apart so
that reading a file imports no graph builder).
"""

from __future__ import annotations

import re
import struct
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .config import ModelConfig, ModelError, parse_config
from .tokenizer import Tokenizer
from .weights import expected_shapes

MAGIC = b"GGUF"

#: general.architecture -> the transformers class the engine knows.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "gemma": "GemmaForCausalLM",
}

#: tokenizer.ggml.pre -> the split regexes of the original tokenizer.json, applied in order
#: (llama.cpp's llama-vocab.cpp lists the same families).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "gpt2": (_GPT2,),
    "gpt-2": (_GPT2,),
    "default": (_GPT2,),
    "starcoder": (r"\p{N}", _GPT2),
    "refact": (r"\p{N}", _GPT2),
    "smollm": (r"\p{N}", _GPT2),
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
    "smaug-bpe": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
}
#: Pre-tokenizers whose tokenizer.json had ``ignore_merges`` (a whole word in the vocabulary wins).
_IGNORE_MERGES = {"llama-bpe", "llama3", "smaug-bpe"}
#: ... and an NFC normalizer.
_NFC = {"qwen2"}

_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4

#: GGUF tensor name (after ``blk.N.``) -> Hugging Face name (after ``model.layers.N.``).
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_STARCODER2_MLP = {"ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def is_gguf(path: str | Path) -> bool:
    """True for an existing file that starts with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == MAGIC


# GGUF value types (gguf.GGUFValueType) -> struct format of a scalar.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: type, numpy-order ``shape`` ([rows, columns]) and where its
    bytes are (``offset`` from the file's start; -1 for a header read without the data)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int = -1
    n_bytes: int = 0

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def view(self, mm: np.ndarray) -> np.ndarray:
        """The tensor's data in a memory map of its file (F32/F16 typed, others raw block bytes)."""
        import gguf

        raw = mm[self.offset : self.offset + self.n_bytes]
        np_type = {"F32": np.float32, "F16": np.float16}.get(self.tensor_type.name)
        if np_type is not None:
            return raw.view(np_type).reshape(self.shape)
        return raw.reshape(gguf.quants.quant_shape_to_byte_shape(self.shape, self.tensor_type))


class HeaderIncomplete(ValueError):
    """The bytes given end inside the GGUF header (read more of the file)."""


def parse_header(buf, *, complete: bool = True) -> tuple[dict[str, Any], list[tuple], int]:
    """Metadata (key -> value, arrays as lists), tensor infos ``(name, type, numpy shape, offset)``
    and the data section's start, from the first bytes of a GGUF file (or all of it).

    Parsed here rather than with ``gguf.GGUFReader``, which builds a numpy array per string and
    takes seconds on a 150k-token vocabulary, and needs the whole file; ``gguf`` still supplies
    the types, block sizes and dequantisers.  ``complete=False``: running out of bytes raises
    :class:`HeaderIncomplete` (the caller fetches more)."""
    import gguf

    buf = memoryview(buf)
    pos = 0

    def need(n: int) -> None:
        if pos + n > len(buf):
            raise (
                HeaderIncomplete("GGUF header ends past the bytes read")
                if not complete
                else ValueError("file ends inside the GGUF header (truncated?)")
            )

    def take(fmt: str) -> Any:
        nonlocal pos
        size = struct.calcsize("<" + fmt)
        need(size)
        v = struct.unpack_from("<" + fmt, buf, pos)
        pos += size
        return v[0]

    def string() -> str:
        nonlocal pos
        n = take("Q")
        need(n)
        s = bytes(buf[pos : pos + n]).decode("utf-8", errors="replace")
        pos += n
        return s

    def value(kind: int) -> Any:
        nonlocal pos
        if kind in _SCALARS:
            return take(_SCALARS[kind])
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            sub, n = take("I"), take("Q")
            if sub == _STRING:
                return [string() for _ in range(n)]
            if sub in _SCALARS:
                dt = np.dtype("<" + _SCALARS[sub])
                need(dt.itemsize * n)
                arr = np.frombuffer(buf, dtype=dt, count=n, offset=pos)
                pos += arr.nbytes
                return arr.tolist()
            return [value(sub) for _ in range(n)]
        raise ValueError(f"unknown metadata value type {kind}")

    need(4)
    if bytes(buf[:4]) != MAGIC:
        raise ValueError("no GGUF magic")
    pos = 4
    version = take("I")
    if version not in (2, 3):
        raise ValueError(f"version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = take("Q"), take("Q")
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        fields[key] = value(take("I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        infos.append((name, gguf.GGMLQuantizationType(take("I")), tuple(reversed(dims)), take("Q")))
    align = int(fields.get("general.alignment", 32))
    return fields, infos, -(-pos // align) * align


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """Metadata and tensor infos of a GGUF file (the header is read through a memory map that
    is closed again: tensor data is mapped only while it is read, see ``GGUFModel.open_weights``)."""
    import gguf

    try:
        mm = np.memmap(path, mode="r")
        size = len(mm)
        fields, infos, start = parse_header(mm)
        del mm
        tensors: dict[str, TensorInfo] = {}
        for name, kind, shape, offset in infos:
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
            n_bytes = int(np.prod(shape, dtype=np.int64)) * type_size // block
            if start + offset + n_bytes > size:
                raise ValueError(
                    f"tensor {name} runs past the end of the file (truncated download?)"
                )
            tensors[name] = TensorInfo(name, kind, shape, start + offset, n_bytes)
    except (ValueError, struct.error, KeyError, UnicodeDecodeError) as e:
        raise ModelError(f"{path.name}: not a readable GGUF file: {e}") from None
    return fields, tensors


class GGUFModel:
    """One GGUF file: ``config()``, ``tokenizer()`` and ``weights(config)`` in the engine's forms."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ModelError(f"{self.path}: GGUF file not found")
        self.fields, self.tensors = read_gguf(self.path)
        self._check_arch()

    @classmethod
    def from_header(cls, path: Path, fields: dict[str, Any], infos: list[tuple]) -> GGUFModel:
        """A model known from its header alone (metadata and tensor shapes, no data): enough for
        ``config()``, ``tokenizer()`` and ``tensor_types()``, e.g. of a file not downloaded yet."""
        self = cls.__new__(cls)
        self.path, self.fields = Path(path), fields
        self.tensors = {n: TensorInfo(n, kind, shape) for n, kind, shape, _ in infos}
        self._check_arch()
        return self

    def _check_arch(self) -> None:
        self.arch = self.value("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ModelError(
                f"{self.path.name}: general.architecture={self.arch!r} is not supported; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )

    # -- metadata ------------------------------------------------------------------------------
    def value(self, key: str, default: Any = ...) -> Any:
        """A metadata value (arrays as lists); ModelError naming the key when it is required."""
        if key not in self.fields:
            if default is ...:
                raise ModelError(f"{self.path.name}: metadata key {key!r} is missing")
            return default
        return self.fields[key]

    def arch_value(self, key: str, default: Any = ...) -> Any:
        return self.value(f"{self.arch}.{key}", default)

    def hf_config(self) -> dict[str, Any]:
        """The metadata as a Hugging Face ``config.json`` object (what parse_config reads)."""
        embd = self.tensors.get("token_embd.weight")
        if embd is None:
            raise ModelError(f"{self.path.name}: tensor token_embd.weight is missing")
        vocab, hidden = embd.shape
        kv = self.arch_value("attention.head_count_kv", None)
        if isinstance(kv, list):  # per-layer counts: the engine needs one for every layer
            if len(set(kv)) != 1:
                raise ModelError(
                    f"{self.path.name}: per-layer attention.head_count_kv={kv} is not supported"
                )
            kv = kv[0]
        raw: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.arch]],
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": self.arch_value("feed_forward_length"),
            "num_hidden_layers": self.arch_value("block_count"),
            "num_attention_heads": self.arch_value("attention.head_count"),
            "num_key_value_heads": kv,
            "max_position_embeddings": self.arch_value("context_length", 2048),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "dtype": "float32",
        }
        if (head_dim := self.arch_value("attention.key_length", None)) is not None:
            raw["head_dim"] = head_dim
        if (theta := self.arch_value("rope.freq_base", None)) is not None:
            raw["rope_theta"] = theta
        eps_key = "norm_epsilon" if self.arch == "starcoder2" else "rms_norm_eps"
        eps = self.arch_value("attention.layer_norm_rms_epsilon", None)
        if eps is None:
            eps = self.arch_value("attention.layer_norm_epsilon", None)
        if eps is not None:
            raw[eps_key] = eps
        if (window := self.arch_value("attention.sliding_window", None)) is not None:
            raw["sliding_window"] = window
            raw["use_sliding_window"] = True
        scaling = self.arch_value("rope.scaling.type", None)
        if scaling not in (None, "none"):
            raw["rope_scaling"] = {
                "rope_type": scaling,
                "factor": self.arch_value("rope.scaling.factor", None),
            }
        if "rope_freqs.weight" in self.tensors:
            raise ModelError(
                f"{self.path.name}: per-dimension RoPE factors (rope_freqs, Llama 3.1 style) "
                "are not supported"
            )
        has_bias = "blk.0.attn_q.bias" in self.tensors
        if self.arch == "starcoder2":
            raw["use_bias"] = has_bias
        else:
            raw["attention_bias"] = has_bias
            raw["mlp_bias"] = "blk.0.ffn_up.bias" in self.tensors
        eos = [
            self.value(k)
            for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
            if k in self.fields
        ]
        raw["eos_token_id"] = list(dict.fromkeys(eos)) or None
        raw["bos_token_id"] = self.value("tokenizer.ggml.bos_token_id", None)
        return raw

    def config(self) -> ModelConfig:
        return parse_config(self.hf_config(), path=self.path, name=self.path.name)

    def tensor_data(self, name: str) -> np.ndarray:
        """One tensor's stored data (raw blocks for quantised types), from a fresh memory map."""
        return self.tensors[name].view(np.memmap(self.path, mode="r"))

    def tensor_types(self) -> Counter:
        """How many tensors of each GGML type ('F32', 'Q8_0', 'Q4_K', ...) the file holds."""
        return Counter(t.tensor_type.name for t in self.tensors.values())

    def parameter_count(self) -> int:
        return sum(t.n_elements for t in self.tensors.values())

    # -- weights -------------------------------------------------------------------------------
    def hf_name(self, name: str) -> str | None:
        """The Hugging Face tensor name of a GGUF tensor (None for tensors the engine ignores)."""
        m = _BLOCK.fullmatch(name)
        if m:
            layer, part, kind = m.groups()
            table = (
                {**_LAYER_TENSORS, **_STARCODER2_MLP}
                if self.arch == "starcoder2"
                else _LAYER_TENSORS
            )
            if part not in table:
                return None
            return f"model.layers.{layer}.{table[part]}.{kind}"
        base, _, kind = name.rpartition(".")
        return f"{_GLOBAL_TENSORS[base]}.{kind}" if base in _GLOBAL_TENSORS else None

    def open_weights(self, config: ModelConfig) -> GGUFWeights:
        """Every tensor the decoder reads, under Hugging Face names, dequantised on access (one
        tensor in RAM at a time); names and shapes are checked here, like a folder's."""
        shapes = expected_shapes(config)
        names: dict[str, str] = {}
        for name, t in self.tensors.items():
            hf = self.hf_name(name)
            if hf is None or hf not in shapes:
                continue
            if tuple(t.shape) != shapes[hf]:
                raise ModelError(
                    f"{self.path.name}: tensor {name} has shape {list(t.shape)}, expected "
                    f"{list(shapes[hf])} from its metadata"
                )
            names[hf] = name
        if config.tie_word_embeddings:
            names.setdefault("lm_head.weight", "token_embd.weight")
        missing = [n for n in shapes if n not in names]
        if missing:
            raise ModelError(
                f"{self.path.name}: tensor for {missing[0]} is missing "
                f"({len(missing)} of {len(shapes)} missing)"
            )
        return GGUFWeights(self, config, names)

    def _undo_converter(self, hf: str, arr: np.ndarray, config: ModelConfig) -> np.ndarray:
        if self.arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            heads = config.num_attention_heads if ".q_proj." in hf else config.num_key_value_heads
            return unpermute_rotary(arr, heads)
        if self.arch == "gemma" and hf.endswith("norm.weight"):
            return arr - np.float32(1.0)  # exact: the converter's +1 put the weights in [0.5, 2]
        return arr

    # -- tokenizer -----------------------------------------------------------------------------
    def tokenizer(self):
        """The file's tokenizer as the engine's :class:`~engine.tokenizer.Tokenizer`."""
        tok = build_tokenizer(self)
        eos = [
            self.value(k)
            for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
            if k in self.fields
        ]
        bos = self.value("tokenizer.ggml.bos_token_id", None)
        template = self.value("tokenizer.chat_template", None)
        chat = {
            "chat_template": template if isinstance(template, str) and template.strip() else None,
            "bos_token": tok.id_to_token(bos) if bos is not None else None,
            "eos_token": tok.id_to_token(eos[0]) if eos else None,
        }
        return Tokenizer(
            tok,
            eos_ids=eos,
            bos_id=bos,
            pad_id=self.value("tokenizer.ggml.padding_token_id", None),
            name=self.path.stem,
            chat={k: v for k, v in chat.items() if v is not None},
        )


class GGUFWeights(Mapping[str, np.ndarray]):
    """The decoder's tensors of a GGUF file by Hugging Face name, float32, made on access.

    F32 tensors are views of the memory-mapped file; other types are dequantised per access, so
    a graph builder that takes one tensor at a time never holds the whole model in float32."""

    def __init__(self, model: GGUFModel, config: ModelConfig, names: dict[str, str]) -> None:
        self._model, self._config, self._names = model, config, names
        self._mm: np.ndarray | None = np.memmap(model.path, mode="r")

    def __getitem__(self, name: str) -> np.ndarray:
        if self._mm is None:
            raise ModelError(f"{self._model.path.name}: weights read after the file was closed")
        t = self._model.tensors[self._names[name]]
        arr = self._model._undo_converter(
            name, _to_float32(t, t.view(self._mm), self._model.path.name), self._config
        )
        if not np.isfinite(arr).all():
            raise ModelError(
                f"{self._model.path.name}: tensor {t.name} contains NaN or infinite values"
            )
        return arr

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def close(self) -> None:
        """Unmap the file (F32 arrays handed out keep their own reference to the map)."""
        self._mm = None

    def __enter__(self) -> GGUFWeights:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs back to rotate-half)."""
    rows = w.shape[0]
    return np.ascontiguousarray(
        w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (rotate-half rows to interleaved pairs); for writing files."""
    rows = w.shape[0]
    return np.ascontiguousarray(
        w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _to_float32(t: TensorInfo, data: np.ndarray, where: str) -> np.ndarray:
    """One tensor as float32 (F32: a view of the memory-mapped file; others dequantised)."""
    import gguf

    kind = t.tensor_type
    if kind == gguf.GGMLQuantizationType.F32:
        return data
    if kind == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float32)
    try:
        return gguf.quants.dequantize(data, kind).astype(np.float32, copy=False)
    except NotImplementedError:
        raise ModelError(
            f"{where}: tensor {t.name} has type {kind.name}, which cannot be dequantised"
        ) from None


# -- tokenizer ---------------------------------------------------------------------------------


def build_tokenizer(model: GGUFModel):
    """A ``tokenizers.Tokenizer`` equivalent to the one the GGUF was converted from."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    kind = model.value("tokenizer.ggml.model")
    tokens: list[str] = model.value("tokenizer.ggml.tokens")
    types: list[int] = model.value("tokenizer.ggml.token_type", None) or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    name = model.path.name
    if kind == "gpt2":
        pre = model.value("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise ModelError(
                f"{name}: tokenizer.ggml.pre={pre!r} is not supported; "
                f"supported: {', '.join(sorted(PRE_TOKENIZERS))}"
            )
        merges = [tuple(m.split(" ", 1)) for m in model.value("tokenizer.ggml.merges")]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES))
        if pre in _NFC:
            tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tok.decoder = decoders.ByteLevel()
    elif kind == "llama":
        scores = model.value("tokenizer.ggml.scores", None)
        skip = {t for t, ty in zip(tokens, types) if ty in (_TOKEN_CONTROL, 6)}
        merges = sentencepiece_merges(vocab, dict(zip(tokens, scores)) if scores else None, skip)
        unk = model.value("tokenizer.ggml.unknown_token_id", None)
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                byte_fallback=True,
                fuse_unk=True,
                unk_token=tokens[unk] if unk is not None else None,
            )
        )
        # As SentencePiece: one "▁" before the text (even one starting with a space; not for
        # vocabularies without the dummy prefix, e.g. Gemma's), spaces as "▁".
        prefix = bool(model.value("tokenizer.ggml.add_space_prefix", True))
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁")] * prefix + [normalizers.Replace(" ", "▁")]
        )
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            + [decoders.Strip(content=" ", left=1, right=0)] * prefix
        )
    else:
        raise ModelError(
            f"{name}: tokenizer.ggml.model={kind!r} is not supported (expected 'gpt2' or 'llama')"
        )
    added = [
        AddedToken(t, special=ty == _TOKEN_CONTROL, normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    tok.add_tokens([a for a in added if not a.special])
    tok.add_special_tokens([a for a in added if a.special])
    return tok


def sentencepiece_merges(
    vocab: dict[str, int], scores: dict[str, float] | None, skip: set[str]
) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    ranked by the merged token's score (or id), as transformers' converters derive them."""
    reverse = scores is not None
    ranked = scores if scores is not None else vocab
    merges = []
    for merge, score in ranked.items():
        if merge in skip:
            continue
        local = [
            (merge[:i], merge[i:], score)
            for i in range(1, len(merge))
            if merge[:i] in vocab
            and merge[i:] in vocab
            and merge[:i] not in skip
            and merge[i:] not in skip
        ]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=reverse)
    return [(a, b) for a, b, _ in merges]


# -- precision ---------------------------------------------------------------------------------


def default_precision(model: GGUFModel) -> str:
    """The engine precision that keeps a file's own precision: 'fp32' for float files, 'int8'
    for Q8_0, 'int4' for 4-bit and K-quant files (by the type most linear weights have)."""
    counts = Counter(
        t.tensor_type.name
        for n, t in model.tensors.items()
        if n.startswith("blk.") and n.endswith(".weight") and len(t.shape) == 2
    )
    if not counts:
        return "fp32"
    kind = counts.most_common(1)[0][0]
    if kind in ("F32", "F16", "BF16"):
        return "fp32"
    if kind == "Q8_0":
        return "int8"
    return "int4"
