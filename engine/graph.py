"""Write the ONNX decoder for a Llama / Qwen2 / Mistral / Qwen3 / Starcoder2 / Gemma model straight
from its numpy weights.

The family differences are read from the config, not from the architecture's name: the norm
(RMSNorm, RMSNorm scaled by 1 + weight, LayerNorm with bias), the MLP (gated SwiGLU / GeGLU or a
plain GELU MLP, with or without biases), per-head q/k RMSNorm and an embedding scale.

The graph is built for ONNX Runtime on CPU with batch size 1:

* inputs  ``input_ids`` int64 [1, S] or, in a graph with an external data file whose embedding
  table only a Gather would read, ``inputs_embeds`` [1, S, hidden] in the table's element type
  (the rows the runtime reads for those tokens, :mod:`engine.embedding`; metadata
  ``spark_lsp.embedding`` says where the table lies in the data file), ``seqlens_k`` int32 [1]
  (= total length - 1),
  ``total_sequence_length`` int32 scalar, ``logits_from`` int64 [1] (first position that gets
  logits: S - number of trailing logits wanted), and per layer ``past.{i}.key`` /
  ``past.{i}.value`` [1, kv_heads, max_len, head_dim], float32, or float16 where the graph was
  built with ``kv_dtype="float16"`` and its emitter's attention op reads such a cache (metadata
  ``spark_lsp.kv_dtype`` says which; :data:`KV_DTYPES`);
* outputs ``logits`` float32 [1, S - logits_from, vocab] and ``present.{i}.key`` / ``present.{i}.value``.

Only positions from ``logits_from`` go on after the last layer's attention (its O-proj, MLP, the
final norm and the LM head): a prefill that wants one row of logits skips about 1/L of its
matmuls, while every position's KV is still written.

``head_dim`` in the KV buffers is the model's head size rounded up to a multiple of 16 (the op's
requirement); the padding is zero rows in the q/k/v/o weights, so the results are unchanged.

Attention is ``com.microsoft.GroupQueryAttention`` with a packed Q|K|V input, rotary embedding
inside the op and a KV buffer shared between past and present (bind the same OrtValue to both):
the cache is preallocated once and rewinding a sequence only means passing a smaller
``seqlens_k``.  Activations between layers are 2-D [S, hidden] as the emitter contract says, or
3-D [1, S, hidden] when the emitter declares ``accepts_3d = True`` (then no reshapes are needed
around the attention op: fewer kernels per decode step).

Every weight matmul goes through a *linear emitter* (``DenseLinear`` by default) so the wafer
package can replace it with a partitioned version without touching the rest of the graph.  An
emitter may take over more than the matmul: ``emit_gated`` (a gated MLP's act(gate) * up),
``emit_tied`` (an LM head read from the embedding table) and, with ``fuses_norm``, the RMSNorm
before a linear (``norm=NormInput(...)``; the residual add of the skip norm with it): each
spares a decode step ONNX Runtime's per-node cost (dispatch, allocation, a thread-pool hand-off),
which on a small model is a real share of the step.  The weight reaches the emitter as
``[K, N]``, usually a transposed view of the checkpoint's ``[N, K]``: each emitter copies it once,
into the layout it stores (a quantiser reads it back column-major).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: Bump when the emitted graph changes, so cached graphs from older builders are not reused.
GRAPH_VERSION = 11

#: The KV cache element types a graph can hold (``build_decoder(kv_dtype=...)``).
KV_DTYPES = ("float32", "float16")

OPSET = 17
MS_DOMAIN = "com.microsoft"
INT64_MAX = np.iinfo(np.int64).max


class GraphBuilder:
    """Accumulates nodes, initializers, inputs and outputs; hands out unique value names."""

    #: External tensors start at multiples of this (the page size), so ONNX Runtime can map them.
    ALIGN = 4096

    def __init__(self, external_data: str | Path | None = None, threshold: int = 1024) -> None:
        """``external_data``: a file to stream the initializers of ``threshold`` bytes or more into
        as they are added (ONNX external data; the model must be saved next to it).  The graph then
        holds no weight bytes in memory, so building a model takes about one tensor of RAM."""
        self._data = open(external_data, "wb") if external_data is not None else None
        self._data_name = Path(external_data).name if external_data is not None else ""
        self._threshold = threshold
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.domains: set[str] = set()
        self._names: set[str] = set()
        self._consts: dict[tuple, str] = {}
        self._counter = 0

    def unique(self, base: str) -> str:
        """Return ``base`` or ``base_N`` — a name not used yet in this graph."""
        name = base
        while name in self._names:
            self._counter += 1
            name = f"{base}_{self._counter}"
        self._names.add(name)
        return name

    def initializer(self, name: str, array: np.ndarray, data_type: int | None = None) -> str:
        """Add a constant tensor (weights etc.); returns its (uniquified) value name.
        ``data_type``: the ONNX element type when ``array`` holds another type's bits (bfloat16
        as uint16: numpy has no bfloat16)."""
        arr = np.ascontiguousarray(array)
        if self._data is None or arr.nbytes < self._threshold:
            name = self.unique(name)
            self.initializers.append(
                numpy_helper.from_array(arr, name)
                if data_type is None
                else helper.make_tensor(name, data_type, arr.shape, arr.tobytes(), raw=True)
            )
            return name
        return self._external(
            name, arr.shape, data_type or helper.np_dtype_to_tensor_dtype(arr.dtype), [arr]
        )

    def initializer_rows(self, name: str, shape: tuple[int, ...], data_type: int, chunks) -> str:
        """Add a constant tensor given as consecutive row chunks of ``shape`` (arrays already in
        ``data_type``'s layout), streamed into the external data file a chunk at a time, so no
        whole copy of a converted table is ever held."""
        if self._data is None:
            return self.initializer(name, np.concatenate(list(chunks)).reshape(shape), data_type)
        return self._external(name, shape, data_type, chunks)

    @property
    def external(self) -> bool:
        """Whether the weights go to an external data file."""
        return self._data is not None

    def external_block(self, chunks) -> dict[str, str | int]:
        """Write ``chunks`` back to back at the next aligned offset of the external data file,
        as data the graph does not read itself (no initializer): returns its ``location``
        (the file's name), ``offset`` and ``length``."""
        offset = -(-self._data.tell() // self.ALIGN) * self.ALIGN
        self._data.seek(offset)
        length = 0
        for chunk in chunks:
            chunk = np.ascontiguousarray(chunk)
            self._data.write(chunk.data)
            length += chunk.nbytes
        return {"location": self._data_name, "offset": offset, "length": length}

    def _external(self, name: str, shape, data_type: int, chunks) -> str:
        """An initializer whose data is an :meth:`external_block`."""
        name = self.unique(name)
        tensor = onnx.TensorProto(name=name, dims=shape, data_type=data_type)
        for key, value in self.external_block(chunks).items():
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        self.initializers.append(tensor)
        return name

    def node(
        self,
        op_type: str,
        inputs: list[str],
        n_out: int = 1,
        domain: str = "",
        name: str | None = None,
        **attrs,
    ) -> str | list[str]:
        """Add one node; returns its output name (``n_out == 1``) or list of output names."""
        name = self.unique(name or op_type)
        outs = [self.unique(f"{name}/out{i}" if n_out > 1 else f"{name}/out") for i in range(n_out)]
        attrs = {k: v for k, v in attrs.items() if v is not None}
        self.nodes.append(
            helper.make_node(op_type, inputs, outs, name=name, domain=domain or None, **attrs)
        )
        if domain:
            self.domains.add(domain)
        return outs[0] if n_out == 1 else outs

    def const_i64(self, values) -> str:
        """A cached small int64 constant (scalar for an int, 1-D for a sequence)."""
        arr = np.asarray(values, dtype=np.int64)
        key = ("i64", arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.initializer("const_i64", arr)
        return self._consts[key]

    def const_f32(self, values) -> str:
        """A cached small float32 constant."""
        arr = np.asarray(values, dtype=np.float32)
        key = ("f32", arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.initializer("const_f32", arr)
        return self._consts[key]

    def input(self, name: str, elem_type: int, shape: list) -> str:
        self._names.add(name)
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, value: str, name: str, elem_type: int, shape: list) -> str:
        """Expose ``value`` as graph output ``name`` (via Identity if the names differ)."""
        if value != name:
            self._names.add(name)
            self.nodes.append(
                helper.make_node("Identity", [value], [name], name=f"{name}/identity")
            )
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def close(self) -> None:
        """Finish the external data file (if any); :meth:`to_model` calls it."""
        if self._data is not None and not self._data.closed:
            self._data.close()

    def to_model(
        self, graph_name: str = "decoder", metadata: dict[str, str] | None = None
    ) -> onnx.ModelProto:
        self.close()
        graph = helper.make_graph(
            self.nodes, graph_name, self.inputs, self.outputs, self.initializers
        )
        opsets = [helper.make_opsetid("", OPSET)] + [
            helper.make_opsetid(d, 1) for d in sorted(self.domains)
        ]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="spark-lsp")
        model.ir_version = 8
        for k, v in (metadata or {}).items():
            entry = model.metadata_props.add()
            entry.key, entry.value = k, v
        return model


@dataclass(frozen=True)
class NormInput:
    """An RMSNorm a linear applies to its input first, for emitters that fuse it
    (``fuses_norm``): the linear reads ``rmsnorm(x + skip) * gamma`` (``skip`` None: of ``x``).
    ``gamma`` is the initializer's name; ``keep_sum``: the node also outputs ``x + skip`` (the
    residual stream the next layer adds to)."""

    gamma: str
    epsilon: float
    skip: str | None = None
    keep_sum: bool = True


class LinearEmitter(Protocol):
    """What ``build_decoder`` needs from a linear emitter."""

    def emit(
        self,
        gb: GraphBuilder,
        x: str,
        weight: np.ndarray,
        *,
        name: str,
        role: str,
        bias: np.ndarray | None = None,
    ) -> str: ...


class DenseLinear:
    """Default emitter: y = x @ W (+ b), one MatMul (ORT fuses MatMul+Add into Gemm).

    MatMul broadcasts over leading axes, so it also takes [1, S, K] activations (``accepts_3d``).
    """

    accepts_3d = True

    def emit(
        self,
        gb: GraphBuilder,
        x: str,
        weight: np.ndarray,
        *,
        name: str,
        role: str,
        bias: np.ndarray | None = None,
    ) -> str:
        w = gb.initializer(f"{name}.weight", np.asarray(weight, dtype=np.float32))
        y = gb.node("MatMul", [x, w], name=f"{name}/matmul")
        if bias is not None:
            b = gb.initializer(f"{name}.bias", bias.astype(np.float32, copy=False))
            y = gb.node("Add", [y, b], name=f"{name}/bias")
        return y

    def cache_key(self) -> str:
        return "dense"


ROLES = ("qkv", "o", "gate_up", "down", "lm_head")


def rope_cache(inv_freq: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [max_len, head_dim/2] for the non-interleaved (rotate-half) RoPE of HF Llama."""
    freqs = np.outer(np.arange(max_len, dtype=np.float64), inv_freq)
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


def padded_head_dim(head_dim: int) -> int:
    """Head size used in the graph: GroupQueryAttention on CPU needs a multiple of 16."""
    return -(-head_dim // 16) * 16


def _pad_rotary_rows(w: np.ndarray, heads: int, h: int, hp: int) -> np.ndarray:
    """Pad the per-head rows of a q/k projection ([heads*h, ...]) to ``hp``, keeping rotate-half pairs.

    Row layout per head becomes [first half, zeros, second half, zeros]: the op's pairs (i, i+hp/2)
    are then the model's pairs (i, i+h/2) or pairs of zeros, and zeros add nothing to q.k.
    """
    if hp == h:
        return w
    src = w.reshape(heads, h, *w.shape[1:])
    out = np.zeros((heads, hp, *w.shape[1:]), dtype=w.dtype)
    half, phalf = h // 2, hp // 2
    out[:, :half] = src[:, :half]
    out[:, phalf : phalf + half] = src[:, half:]
    return out.reshape(heads * hp, *w.shape[1:])


def _pad_value_rows(w: np.ndarray, heads: int, h: int, hp: int) -> np.ndarray:
    """Pad the per-head rows of a v projection to ``hp`` with zeros at the end of each head."""
    if hp == h:
        return w
    out = np.zeros((heads, hp, *w.shape[1:]), dtype=w.dtype)
    out[:, :h] = w.reshape(heads, h, *w.shape[1:])
    return out.reshape(heads * hp, *w.shape[1:])


def _linear_weight(weights: dict[str, np.ndarray], key: str) -> np.ndarray:
    try:
        return weights[key]
    except KeyError:
        raise KeyError(f"weight {key!r} missing from the model's safetensors") from None


def _table_rows(weights, key: str):
    """A vocabulary-sized 2-D tensor read a slice of rows at a time where the store can
    (``WeightStore.rows``: the embedding table and a tied head are then never whole in float32),
    else the whole array (both take ``t[a:b]``, ``len(t)`` and ``t.T``)."""
    rows = getattr(weights, "rows", None)
    if rows is None or key not in weights:
        return _linear_weight(weights, key)
    return rows(key)


#: Rows per chunk when checking and converting the embedding table (bounds the temporaries).
_TABLE_CHUNK = 8192

_BF16, _F16, _F32 = TensorProto.BFLOAT16, TensorProto.FLOAT16, TensorProto.FLOAT


def embedding_type(table: np.ndarray) -> int:
    """The narrowest ONNX type that holds every value of the embedding ``table`` exactly:
    bfloat16 or float16 where each value converts back unchanged, else float32.

    Checkpoints are usually bf16 or fp16, so the table (136M of Qwen2.5-Coder-0.5B's 494M
    parameters) can be stored at half the bytes for the same values: half the disk, page cache
    and resident rows of the one Gather that reads it.  Checked in row chunks (no temporaries the
    size of the table)."""
    if table.dtype == np.float16:
        return _F16

    def chunks():  # one chunk at a time: a lazy table (``WeightStore.rows``) is read per chunk
        for r in range(0, len(table), _TABLE_CHUNK):
            yield np.asarray(table[r : r + _TABLE_CHUNK]).astype(np.float32, copy=False)

    if all(not np.any(c.view(np.uint32) & 0xFFFF) for c in chunks()):
        return _BF16
    with np.errstate(over="ignore", invalid="ignore"):
        if all(np.array_equal(c.astype(np.float16).astype(np.float32), c) for c in chunks()):
            return _F16
    return _F32


def embedding_chunks(table: np.ndarray, kind: int):
    """The rows of ``table`` converted to ``kind`` (:func:`embedding_type`), a chunk at a time:
    bfloat16 as its uint16 bits (numpy has no bfloat16)."""
    for r in range(0, len(table), _TABLE_CHUNK):
        c = np.asarray(table[r : r + _TABLE_CHUNK])
        if kind == _BF16:
            yield (c.astype(np.float32, copy=False).view(np.uint32) >> 16).astype(np.uint16)
        else:
            yield c.astype(np.float16 if kind == _F16 else np.float32, copy=False)


def _fused_qkv(
    w: dict[str, np.ndarray], prefix: str, kind: str, n: int, nkv: int, h: int, hp: int
) -> np.ndarray:
    """HF q/k/v projection weights (or biases) stacked as one Q|K|V block, heads padded to ``hp``."""
    q, k, v = (_linear_weight(w, f"{prefix}{name}_proj.{kind}") for name in "qkv")
    return np.concatenate(
        [
            _pad_rotary_rows(q, n, h, hp),
            _pad_rotary_rows(k, nkv, h, hp),
            _pad_value_rows(v, nkv, h, hp),
        ],
        axis=0,
    )


def build_decoder(
    config,
    weights: Mapping[str, np.ndarray],
    linear: LinearEmitter | None = None,
    *,
    max_len: int | None = None,
    external_data: str | Path | None = None,
    kv_dtype: str = "float32",
    runtime_embedding: bool = True,
) -> onnx.ModelProto:
    """Build the decoder graph (see module docstring for its inputs and outputs).

    ``weights``: HF name -> float32 array; a lazy mapping (``engine.weights.open_weights``) is
    read one tensor at a time.  ``max_len`` bounds the positions the rotary tables cover (default:
    the model's ``max_position_embeddings``); the runtime's KV buffers must not exceed it.
    ``external_data``: stream the weights into this file as they are emitted (see
    :class:`GraphBuilder`); save the returned model next to it.  ``kv_dtype``: the KV cache's
    element type, ``"float32"`` or ``"float16"``; a float16 cache needs the emitter's own
    attention op (GroupQueryAttention on CPU reads float32), so a graph that falls back to
    GroupQueryAttention keeps float32 whatever was asked (its metadata says what it holds).
    ``runtime_embedding``: with ``external_data``, write the embedding table into the data file
    outside the graph (unless a tied LM head reads it in place) and take ``inputs_embeds``, the
    rows :mod:`engine.embedding` reads, instead of ``input_ids``; False keeps the Gather.
    """
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r}: expected one of {KV_DTYPES}")
    linear = linear or DenseLinear()
    c = config
    H0, N, NKV = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    H = padded_head_dim(H0)
    D, F, V = c.hidden_size, c.intermediate_size, c.vocab_size
    max_len = int(max_len or c.max_position_embeddings)
    w = weights
    gb = GraphBuilder(external_data)
    f32, i64, i32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32

    act3d = bool(getattr(linear, "accepts_3d", False))
    kv_types: set[int] = set()  # the KV cache's element type, per layer (all the same)
    seqlens_k = gb.input("seqlens_k", i32, [1])
    total_len = gb.input("total_sequence_length", i32, [])
    logits_from = gb.input("logits_from", i64, [1])

    if hasattr(c, "rope_inv_freq"):
        inv_freq = np.asarray(c.rope_inv_freq(), dtype=np.float64)
    else:
        inv_freq = 1.0 / (c.rope_theta ** (np.arange(0, H0, 2, dtype=np.float64) / H0))
    inv_freq = np.concatenate([inv_freq, np.zeros(H // 2 - H0 // 2)])  # padded dims: no rotation
    cos, sin = rope_cache(inv_freq, max_len)
    cos_c, sin_c = gb.initializer("rope.cos", cos), gb.initializer("rope.sin", sin)
    eps = float(c.rms_norm_eps)
    norm_kind = getattr(c, "norm", "rms")
    layer_norm = norm_kind == "layer"

    def norm_params(key: str, name: str) -> list[str]:
        """The norm's gamma (and beta for LayerNorm) initializers, from HF tensor ``key``.weight."""
        gamma = _linear_weight(w, key + ".weight").astype(np.float32)
        if norm_kind == "rms_offset":
            gamma = gamma + np.float32(1.0)
        params = [gb.initializer(name, gamma)]
        if layer_norm:
            params.append(
                gb.initializer(name + ".bias", _linear_weight(w, key + ".bias").astype(np.float32))
            )
        return params

    def first_norm(x: str, key: str, name: str) -> str:
        op = "LayerNormalization" if layer_norm else "SimplifiedLayerNormalization"
        return gb.node(op, [x, *norm_params(key, name)], name=name, axis=-1, epsilon=eps)

    def skip_norm(pending: str, residual: str, key: str, name: str) -> tuple[str, str]:
        op = "SkipLayerNormalization" if layer_norm else "SkipSimplifiedLayerNormalization"
        outs = gb.node(
            op,
            [pending, residual, *norm_params(key, name)],
            n_out=4,
            domain=MS_DOMAIN,
            name=name,
            epsilon=eps,
        )
        gb.nodes[-1].output[1] = ""
        gb.nodes[-1].output[2] = ""
        return outs[0], outs[3]

    # The norm before qkv, gate_up and the LM head inside the linear where the emitter can (its
    # RMSNorm prologue, the skip norm's residual add included): one node fewer per norm.
    fuse_norm = bool(getattr(linear, "fuses_norm", False)) and norm_kind != "layer"

    def normed(emit, pending, residual, key, name, keep_sum=True):
        """``emit(x, norm)`` -> ``(y, sum)`` on the norm of ``residual`` (+ ``pending``): with
        ``norm=NormInput`` where the emitter fuses norms, else after a norm node (``norm=None``).
        Returns ``y`` and the residual stream after the add."""
        if fuse_norm:
            gamma = norm_params(key, name)[0]
            if pending is None:
                return emit(residual, NormInput(gamma, eps))[0], residual
            return emit(pending, NormInput(gamma, eps, skip=residual, keep_sum=keep_sum))
        if pending is None:
            x = first_norm(residual, key, name)
        else:
            x, residual = skip_norm(pending, residual, key, name)
        return emit(x, None)[0], residual

    def with_norm(norm) -> dict:
        """The emitter keywords for ``norm`` (none without one, so any emitter takes them)."""
        return {} if norm is None else {"norm": norm}

    def pair(out, norm):
        """An emitter's result as ``(y, sum)``: with a norm it already is one."""
        return out if norm is not None else (out, None)

    def head_norm(x: str, key: str, heads: int, name: str) -> str:
        """Per-head RMSNorm over head_dim (Qwen3's q_norm / k_norm) on a [1, S, heads * H] value.

        Padded heads hold zeros, so the mean of squares over H is H0/H times the model's: epsilon
        and gamma are rescaled to give exactly the unpadded norm."""
        gamma = _linear_weight(w, key).astype(np.float32)
        gamma = (
            _pad_rotary_rows(gamma * np.float32(np.sqrt(H0 / H)), 1, H0, H) if H != H0 else gamma
        )
        x4 = gb.node("Reshape", [x, gb.const_i64([0, 0, heads, H])], name=f"{name}/heads")
        y = gb.node(
            "SimplifiedLayerNormalization",
            [x4, gb.initializer(name, gamma)],
            name=name,
            axis=-1,
            epsilon=eps * H0 / H,
        )
        return gb.node("Reshape", [y, gb.const_i64([0, 0, heads * H])], name=f"{name}/flat")

    def activation(x: str, name: str) -> str:
        kind = getattr(c, "mlp_act", "silu")
        if kind == "silu":
            return gb.node(
                "Mul", [x, gb.node("Sigmoid", [x], name=f"{name}/sigmoid")], name=f"{name}/silu"
            )
        if kind == "gelu_tanh":
            return gb.node("FastGelu", [x], domain=MS_DOMAIN, name=f"{name}/gelu_tanh")
        if kind == "gelu":
            return gb.node("Gelu", [x], domain=MS_DOMAIN, name=f"{name}/gelu")
        raise ValueError(f"unsupported MLP activation {kind!r}")

    def mlp_bias(key: str) -> np.ndarray | None:
        return _linear_weight(w, key + ".bias") if getattr(c, "mlp_bias", False) else None

    tied = c.tie_word_embeddings or "lm_head.weight" not in w
    # A tied head read straight from the embedding initializer where the emitter can (the table
    # is then stored once, in float32); else [K, N] as a transposed view, which the emitter copies
    # (or quantises) into the layout it stores, and the table is stored compact.
    emit_tied = getattr(linear, "emit_tied", None) if tied else None
    table = _table_rows(w, "model.embed_tokens.weight")
    in_place = emit_tied is not None and getattr(linear, "reads_tied", lambda: True)()
    table_type = _F32 if in_place else embedding_type(table)
    rows = embedding_chunks(table, table_type)
    embed = None
    embedding: dict[str, str | int] | None = None
    if runtime_embedding and gb.external and not in_place:
        # Only one row per token is read: the runtime reads those rows from the data file
        # (engine.embedding), so the table never enters the graph nor the process's memory.
        embedding = {**gb.external_block(rows), "rows": V, "cols": D, "type": table_type}
        residual = gb.input("inputs_embeds", table_type, [1, "seq", D])
    else:
        embed = gb.initializer_rows("embed_tokens", table.shape, table_type, rows)
        ids = gb.input("input_ids", i64, [1, "seq"])
        residual = gb.node("Gather", [embed, ids], name="embed", axis=0)  # [1, S, D]
    del table, rows
    if table_type != TensorProto.FLOAT:
        residual = gb.node("Cast", [residual], name="embed_f32", to=TensorProto.FLOAT)
    embed_scale = float(getattr(c, "embed_scale", 1.0))
    if embed_scale != 1.0:
        residual = gb.node("Mul", [residual, gb.const_f32(embed_scale)], name="embed_scale")
    if not act3d:
        residual = gb.node("Reshape", [residual, gb.const_i64([-1, D])], name="embed2d")  # [S, D]
    pending: str | None = None
    # Only the trailing positions (from `logits_from`) leave the last layer's attention.
    end = gb.const_i64([INT64_MAX])
    axes = gb.const_i64([1 if act3d else 0])

    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        w_qkv = _fused_qkv(w, a, "weight", N, NKV, H0, H).T
        b_qkv = _fused_qkv(w, a, "bias", N, NKV, H0, H) if c.attention_bias else None

        def emit_qkv(x, norm):
            y = linear.emit(
                gb, x, w_qkv, name=f"layers.{i}.qkv", role="qkv", bias=b_qkv, **with_norm(norm)
            )
            return pair(y, norm)

        qkv, residual = normed(
            emit_qkv, pending, residual, p + "input_layernorm", f"layers.{i}.input_norm"
        )
        qkv3 = (
            qkv
            if act3d
            else gb.node("Unsqueeze", [qkv, gb.const_i64([0])], name=f"layers.{i}.qkv3")
        )
        if getattr(c, "qk_norm", False):
            q, k, v = gb.node(
                "Split",
                [qkv3, gb.const_i64([N * H, NKV * H, NKV * H])],
                n_out=3,
                name=f"layers.{i}.qkv_split",
                axis=-1,
            )
            q = head_norm(q, a + "q_norm.weight", N, f"layers.{i}.q_norm")
            k = head_norm(k, a + "k_norm.weight", NKV, f"layers.{i}.k_norm")
            attn_in = [q, k, v]
        else:
            attn_in = [qkv3, "", ""]
        past_k, past_v = f"past.{i}.key", f"past.{i}.value"  # graph inputs, typed below
        attn_inputs = [*attn_in, past_k, past_v, seqlens_k, total_len, cos_c, sin_c]
        # The emitter's own attention op where it has one (same inputs and outputs), else GQA.
        emit_attention = getattr(linear, "emit_attention", None)
        out = (
            emit_attention(
                gb, attn_inputs, name=f"layers.{i}.attn", heads=N, kv_heads=NKV, scale=H0**-0.5
            )
            if emit_attention
            else None
        )
        attn, pk, pv = out or gb.node(
            "GroupQueryAttention",
            attn_inputs,
            n_out=3,
            domain=MS_DOMAIN,
            name=f"layers.{i}.attn",
            num_heads=N,
            kv_num_heads=NKV,
            do_rotary=1,
            rotary_interleaved=0,
            scale=float(H0) ** -0.5,
        )
        # float16 only where our op reads the cache (GroupQueryAttention on CPU reads float32)
        kv_type = TensorProto.FLOAT16 if kv_dtype == "float16" and out else f32
        kv_types.add(kv_type)
        kv_shape = [1, NKV, "max_len", H]
        gb.input(past_k, kv_type, kv_shape)
        gb.input(past_v, kv_type, kv_shape)
        gb.output(pk, f"present.{i}.key", kv_type, kv_shape)
        gb.output(pv, f"present.{i}.value", kv_type, kv_shape)
        attn2 = (
            attn
            if act3d
            else gb.node("Reshape", [attn, gb.const_i64([-1, N * H])], name=f"layers.{i}.attn2")
        )
        if i == c.num_hidden_layers - 1:
            # Past the last attention only the positions that get logits matter (the KV cache of
            # every position is already written): the last O-proj and MLP run on them alone, so
            # a long prefill skips ~1/L of its matmuls; a decode step is unchanged.
            attn2 = gb.node("Slice", [attn2, logits_from, end, axes], name="tail_attn")
            residual = gb.node("Slice", [residual, logits_from, end, axes], name="tail_residual")
        w_o = _pad_value_rows(_linear_weight(w, a + "o_proj.weight").T, N, H0, H)
        b_o = (
            _linear_weight(w, a + "o_proj.bias")
            if getattr(c, "attention_out_bias", False)
            else None
        )
        pending = linear.emit(gb, attn2, w_o, name=f"layers.{i}.o", role="o", bias=b_o)

        m = p + "mlp."
        if getattr(c, "mlp_gated", True):
            w_gu = np.concatenate(
                [
                    _linear_weight(w, m + "gate_proj.weight"),
                    _linear_weight(w, m + "up_proj.weight"),
                ],
                axis=0,
            ).T
            b_gate, b_up = mlp_bias(m + "gate_proj"), mlp_bias(m + "up_proj")
            b_gu = np.concatenate([b_gate, b_up]) if b_gate is not None else None

            def emit_mlp_in(x, norm):
                # act(gate) * up inside the linear where the emitter can (one node, not four)
                emit_gated = getattr(linear, "emit_gated", None)
                gated = (
                    emit_gated(
                        gb,
                        x,
                        w_gu,
                        name=f"layers.{i}.gate_up",
                        act=getattr(c, "mlp_act", "silu"),
                        bias=b_gu,
                        **with_norm(norm),
                    )
                    if emit_gated
                    else None
                )
                if gated is not None:
                    return pair(gated, norm)
                gu, total = pair(
                    linear.emit(
                        gb,
                        x,
                        w_gu,
                        name=f"layers.{i}.gate_up",
                        role="gate_up",
                        bias=b_gu,
                        **with_norm(norm),
                    ),
                    norm,
                )
                gate, up = gb.node(
                    "Split",
                    [gu, gb.const_i64([F, F])],
                    n_out=2,
                    name=f"layers.{i}.split",
                    axis=-1,
                )
                glu = gb.node(
                    "Mul", [activation(gate, f"layers.{i}.act"), up], name=f"layers.{i}.glu"
                )
                return glu, total

            w_down, b_down = _linear_weight(w, m + "down_proj.weight"), mlp_bias(m + "down_proj")
        else:
            w_fc = _linear_weight(w, m + "c_fc.weight").T

            def emit_mlp_in(x, norm):
                fc, total = pair(
                    linear.emit(
                        gb,
                        x,
                        w_fc,
                        name=f"layers.{i}.gate_up",
                        role="gate_up",
                        bias=mlp_bias(m + "c_fc"),
                        **with_norm(norm),
                    ),
                    norm,
                )
                return activation(fc, f"layers.{i}.act"), total

            w_down, b_down = _linear_weight(w, m + "c_proj.weight"), mlp_bias(m + "c_proj")
        act, residual = normed(
            emit_mlp_in, pending, residual, p + "post_attention_layernorm", f"layers.{i}.post_norm"
        )
        pending = linear.emit(gb, act, w_down.T, name=f"layers.{i}.down", role="down", bias=b_down)

    def emit_head(x, norm):
        out = (
            emit_tied(gb, x, embed, (V, D), name="lm_head", **with_norm(norm)) if in_place else None
        )
        if out is None:
            key = "model.embed_tokens.weight" if tied else "lm_head.weight"
            head = _table_rows(w, key).T  # a lazy view where the store reads rows
            out = linear.emit(gb, x, head, name="lm_head", role="lm_head", **with_norm(norm))
        return pair(out, norm)

    logits, _ = normed(emit_head, pending, residual, "model.norm", "final_norm", keep_sum=False)
    if not act3d:
        logits = gb.node("Unsqueeze", [logits, gb.const_i64([0])], name="logits3d")
    gb.output(logits, "logits", f32, [1, "num_logits", V])
    meta = {
        "spark_lsp.graph_version": str(GRAPH_VERSION),
        "spark_lsp.max_len": str(max_len),
        "spark_lsp.kv_head_dim": str(H),
        "spark_lsp.kv_dtype": "float16" if kv_types == {TensorProto.FLOAT16} else "float32",
    }
    if embedding is not None:
        meta["spark_lsp.embedding"] = json.dumps(embedding)
    return gb.to_model(metadata=meta)
