"""Parse and validate a Hugging Face ``config.json`` into a :class:`ModelConfig`.

Everything the graph builder needs is checked here, once, so a bad model folder fails at load time
with a message that names the file and the field rather than deep inside ONNX Runtime.
Supported: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM (RMSNorm, RoPE, SwiGLU, GQA),
Qwen3ForCausalLM (+ per-head RMSNorm on q and k), Starcoder2ForCausalLM (LayerNorm with bias,
GELU-tanh MLP, biases everywhere) and GemmaForCausalLM (RMSNorm scaled by weight + 1, GeGLU,
embeddings scaled by sqrt(hidden)).  The family differences are fields of :class:`ModelConfig`
(``norm``, ``mlp_act``, ``mlp_gated``, ``qk_norm``, ``embed_scale`` …), so the graph builder
reads what to emit rather than branching on architecture names.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Qwen3ForCausalLM": "qwen3",
    "Starcoder2ForCausalLM": "starcoder2",
    "GemmaForCausalLM": "gemma",
}
#: transformers' per-architecture defaults for fields a saved config.json may omit.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rope_theta": 10_000.0, "tie_word_embeddings": False, "rms_norm_eps": 1e-6},
    "mistral": {"rope_theta": 10_000.0, "tie_word_embeddings": False, "rms_norm_eps": 1e-6},
    "qwen2": {"rope_theta": 1_000_000.0, "tie_word_embeddings": False, "rms_norm_eps": 1e-6},
    "qwen3": {"rope_theta": 10_000.0, "tie_word_embeddings": False, "rms_norm_eps": 1e-6},
    "starcoder2": {"rope_theta": 10_000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-5},
    "gemma": {"rope_theta": 10_000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-6},
}
#: hidden_act values by the activation the graph emits ('gelu_tanh': the tanh approximation).
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_DTYPES = {"float32", "float16", "bfloat16"}


class ModelError(Exception):
    """A model folder is missing, corrupt or unsupported; the message names the file and the field."""


@dataclass(frozen=True)
class ModelConfig:
    """The validated architecture of a decoder-only model.

    ``max_position_embeddings`` is the usable context: for sliding-window models whose window is
    shorter than the declared context it is clamped to the window (full attention over at most
    ``sliding_window`` tokens is then exactly sliding-window attention).
    ``rope_scaling`` is ``None`` or a sorted tuple of ``(key, value)`` pairs (hashable);
    use :meth:`rope_inv_freq` rather than interpreting it yourself.
    """

    architecture: str  # 'llama' | 'qwen2' | 'mistral' | 'qwen3' | 'starcoder2' | 'gemma'
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float  # epsilon of every norm (LayerNorm's too: Starcoder2's norm_epsilon)
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # biases on q/k/v projections (Qwen2: always; Llama: `attention_bias`)
    attention_out_bias: bool  # bias on o_proj (Llama with attention_bias=true only)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str  # storage dtype declared by the folder: float32 | float16 | bfloat16
    sliding_window: int | None
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    norm: str = (
        "rms"  # 'rms' | 'rms_offset' (Gemma: scaled by 1 + weight) | 'layer' (LayerNorm + bias)
    )
    mlp_act: str = "silu"  # 'silu' | 'gelu_tanh' | 'gelu' (erf)
    mlp_gated: bool = True  # act(gate) * up -> down; False: act(c_fc) -> c_proj (Starcoder2)
    mlp_bias: bool = False  # biases on the MLP's linears
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    embed_scale: float = 1.0  # embeddings multiplied by this (Gemma: sqrt(hidden_size))

    @property
    def num_kv_groups(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (stable key order), e.g. for graph-cache keys and reports."""
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return d

    def rope_inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies (float64, shape ``[head_dim // 2]``), with rope scaling applied.

        Matches transformers' ``ROPE_INIT_FUNCTIONS`` for the 'default', 'linear' and 'llama3' types.
        """
        dim = self.head_dim
        inv = 1.0 / (
            self.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim)
        )
        if not self.rope_scaling:
            return inv
        rs = dict(self.rope_scaling)
        kind = rs.get("rope_type", "default")
        if kind == "linear":
            return inv / float(rs["factor"])
        if kind == "llama3":
            factor = float(rs["factor"])
            low = float(rs.get("low_freq_factor", 1.0))
            high = float(rs.get("high_freq_factor", 4.0))
            old_ctx = float(rs["original_max_position_embeddings"])
            low_wavelen = old_ctx / low
            high_wavelen = old_ctx / high
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_ctx / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return np.where(medium, smoothed, scaled)
        return inv


def read_json(path: Path, *, required: bool = True) -> dict[str, Any] | None:
    """Read a JSON object; ModelError naming the file (and line) when missing or corrupt."""
    if not path.is_file():
        if required:
            raise ModelError(f"{path}: file not found")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelError(
            f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: cannot read: {e}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def model_path(model_dir: str | Path) -> Path:
    """The model folder as a Path; ModelError when it does not exist or is not a folder."""
    p = Path(model_dir).expanduser()
    if not p.exists():
        raise ModelError(f"{p}: model folder not found")
    if not p.is_dir():
        raise ModelError(
            f"{p}: not a folder (expected a Hugging Face model folder with config.json)"
        )
    return p


def model_name(path: str | Path) -> str:
    """The name a model is shown and chosen by (``spark/status``, an engine service's models): a
    GGUF file's stem, a folder's name, and for a folder in the Hugging Face cache
    (``models--ORG--REPO/snapshots/COMMIT``, where ``hf:`` and catalogue names resolve to) the
    repository's name, as a clone of it would be named, not the commit hash."""
    p = Path(path)
    if p.suffix == ".gguf":
        return p.stem
    repo = p.parent.parent.name
    if p.parent.name == "snapshots" and repo.startswith("models--") and repo.count("--") >= 2:
        return repo.rsplit("--", 1)[1]  # Hub names never hold "--"
    return p.name


def _int_ids(value: Any, where: str) -> list[int]:
    """An eos/bos id field: int, list of ints or null."""
    if value is None:
        return []
    vals = value if isinstance(value, list) else [value]
    out = []
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ModelError(f"{where}={value!r} must be a non-negative integer or a list of them")
        out.append(v)
    return out


def load_config(model_dir: str | Path) -> ModelConfig:
    """Load ``config.json`` (plus eos ids from ``generation_config.json``) and validate it."""
    folder = model_path(model_dir)
    path = folder / "config.json"
    raw = read_json(path)
    assert raw is not None
    gen = read_json(folder / "generation_config.json", required=False)
    return parse_config(raw, path=path, generation=gen)


def parse_config(
    raw: dict[str, Any],
    *,
    path: Path | str = "config.json",
    generation: dict[str, Any] | None = None,
    name: str = "config.json",
) -> ModelConfig:
    """Validate a Hugging Face config (as a dict) into a :class:`ModelConfig`.

    ``generation``: the ``generation_config.json`` object, whose eos ids are added.  ``name``
    prefixes every error (a GGUF file passes its own name: its metadata is mapped to this form).
    """

    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ModelError(
            f"{name}: field 'architectures' is missing; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch_name = archs[0]
    if arch_name not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"{name}: architectures={arch_name!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = SUPPORTED_ARCHITECTURES[arch_name]

    def field(key: str, default: Any = ..., *, kind: type | tuple = int) -> Any:
        if key not in raw or raw[key] is None:
            if default is ...:
                raise ModelError(f"{name}: required field '{key}' is missing")
            return default
        v = raw[key]
        ok = isinstance(v, kind) and not (isinstance(v, bool) and kind is not bool)
        if kind is float and isinstance(v, int) and not isinstance(v, bool):
            ok, v = True, float(v)
        if not ok:
            want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise ModelError(f"{name}: {key}={v!r} must be of type {want}")
        return v

    def positive(key: str, default: Any = ...) -> int:
        v = field(key, default)
        if v <= 0:
            raise ModelError(f"{name}: {key}={v} must be a positive integer")
        return v

    vocab = positive("vocab_size")
    hidden = positive("hidden_size")
    inter = positive("intermediate_size")
    layers = positive("num_hidden_layers")
    heads = positive("num_attention_heads")
    kv_heads = positive("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ModelError(
            f"{name}: num_key_value_heads={kv_heads} must divide num_attention_heads={heads}"
        )
    if "head_dim" in raw and raw["head_dim"] is not None:
        head_dim = positive("head_dim")
    else:
        if hidden % heads:
            raise ModelError(
                f"{name}: num_attention_heads={heads} must divide hidden_size={hidden}"
            )
        head_dim = hidden // heads
    if head_dim % 2:
        raise ModelError(
            f"{name}: head_dim={head_dim} must be even (rotary embeddings rotate pairs)"
        )

    defaults = _ARCH_DEFAULTS[arch]
    eps_key = "norm_epsilon" if arch == "starcoder2" else "rms_norm_eps"
    eps = field(eps_key, defaults["rms_norm_eps"], kind=float)
    if not eps > 0:
        raise ModelError(f"{name}: {eps_key}={eps} must be positive")
    default_act = {"starcoder2": "gelu_pytorch_tanh", "gemma": "gelu_pytorch_tanh"}.get(
        arch, "silu"
    )
    act_key = (
        "hidden_activation" if arch == "gemma" and raw.get("hidden_activation") else "hidden_act"
    )
    act = field(act_key, default_act, kind=str)
    if arch == "gemma" and act == "gelu":
        act = "gelu_pytorch_tanh"  # transformers reads Gemma's legacy 'gelu' as the tanh approximation
    if act not in _ACTIVATIONS:
        raise ModelError(
            f"{name}: {act_key}={act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}"
        )
    use_bias = field("use_bias", True, kind=bool) if arch == "starcoder2" else False
    mlp_bias = use_bias or field("mlp_bias", False, kind=bool)

    # RoPE: transformers >= 5 writes `rope_parameters`; older folders `rope_theta` + `rope_scaling`.
    rope_params = raw.get("rope_parameters")
    if rope_params is not None and not isinstance(rope_params, dict):
        raise ModelError(f"{name}: rope_parameters={rope_params!r} must be an object")
    rope_params = dict(rope_params or {})
    theta_default = defaults["rope_theta"]
    theta = rope_params.get("rope_theta", raw.get("rope_theta", theta_default))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ModelError(f"{name}: rope_theta={theta!r} must be a positive number")
    theta = float(theta)
    scaling = raw.get("rope_scaling")
    if scaling is None and rope_params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    rope_scaling = _validate_rope_scaling(scaling, name)

    max_pos = positive("max_position_embeddings", 2048)
    sliding = raw.get("sliding_window")
    if arch in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        sliding = None
    if sliding is not None:
        if isinstance(sliding, bool) or not isinstance(sliding, int) or sliding <= 0:
            raise ModelError(
                f"{name}: sliding_window={sliding!r} must be a positive integer or null"
            )
        if sliding < max_pos:
            warnings.warn(
                f"{path}: sliding_window={sliding} < max_position_embeddings={max_pos}; "
                f"the context is limited to {sliding} tokens (full attention within the window)",
                stacklevel=2,
            )
            max_pos = sliding

    tie = field("tie_word_embeddings", defaults["tie_word_embeddings"], kind=bool)
    attn_bias_flag = field("attention_bias", False, kind=bool)
    attention_bias = {"qwen2": True, "starcoder2": use_bias}.get(arch, attn_bias_flag)
    attention_out_bias = (arch in ("llama", "qwen3") and attn_bias_flag) or use_bias

    dtype = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if dtype not in _DTYPES:
        raise ModelError(
            f"{name}: dtype={dtype!r} is not supported; supported: {', '.join(sorted(_DTYPES))}"
        )

    eos = _int_ids(raw.get("eos_token_id"), f"{name}: eos_token_id")
    if generation:
        eos += _int_ids(generation.get("eos_token_id"), "generation_config.json: eos_token_id")
    eos = [e for e in dict.fromkeys(eos)]
    for e in eos:
        if e >= vocab:
            raise ModelError(f"{name}: eos_token_id={e} is outside vocab_size={vocab}")
    bos_ids = _int_ids(raw.get("bos_token_id"), f"{name}: bos_token_id")
    bos = bos_ids[0] if bos_ids else None

    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=eps,
        rope_theta=theta,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tie,
        attention_bias=attention_bias,
        attention_out_bias=attention_out_bias,
        eos_token_ids=tuple(eos),
        bos_token_id=bos,
        torch_dtype=dtype,
        sliding_window=sliding,
        rope_scaling=rope_scaling,
        norm={"gemma": "rms_offset", "starcoder2": "layer"}.get(arch, "rms"),
        mlp_act=_ACTIVATIONS[act],
        mlp_gated=arch != "starcoder2",
        mlp_bias=mlp_bias,
        qk_norm=arch == "qwen3",
        embed_scale=float(np.float32(hidden**0.5)) if arch == "gemma" else 1.0,
    )


def _validate_rope_scaling(scaling: Any, name: str) -> tuple[tuple[str, Any], ...] | None:
    """Accept no scaling, 'linear' and 'llama3'; refuse other types by name."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ModelError(f"{name}: rope_scaling={scaling!r} must be an object or null")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelError(
            f"{name}: rope_scaling type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if kind == "default":
        return None
    factor = scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ModelError(f"{name}: rope_scaling.factor={factor!r} must be a positive number")
    out: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    if kind == "llama3":
        for key, default in (("low_freq_factor", 1.0), ("high_freq_factor", 4.0)):
            v = scaling.get(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ModelError(f"{name}: rope_scaling.{key}={v!r} must be a positive number")
            out[key] = float(v)
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise ModelError(f"{name}: rope_scaling.high_freq_factor must exceed low_freq_factor")
        omp = scaling.get("original_max_position_embeddings")
        if isinstance(omp, bool) or not isinstance(omp, int) or omp <= 0:
            raise ModelError(
                f"{name}: rope_scaling.original_max_position_embeddings={omp!r} must be a positive integer"
            )
        out["original_max_position_embeddings"] = omp
    return tuple(sorted(out.items()))
