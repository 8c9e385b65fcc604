"""Partitioned execution: every weight matmul runs as per-PE tiles over an emulated mesh.

``TiledLinear`` is the linear emitter ``engine.graph.build_decoder`` uses when the engine runs
with ``wafer=True`` (the default).  A weight ``W[K, N]`` on an ``R x C`` mesh is tiled in 2D,
PE ``(i, j)`` holding one block, and computed the MeshGEMV way:

* ``qkv``, ``gate_up``, ``lm_head`` — the input is split along the mesh *rows* (K over R) and
  PE (i, j) holds ``W[K-block i, N-block j]``; the partial products are reduced over the rows
  and the output comes out split over the columns.
* ``o``, ``down`` — stored *transposed on the mesh*: PE (i, j) holds ``W[K-block j, N-block i]``,
  so the input is split along the columns (exactly how the previous reduction left it) and the
  reduction runs over the columns.  Consecutive reductions alternate axes; nothing is ever
  transposed on the mesh.

Q, K and V are one fused weight, as are gate and up, so they share one reduction.  Uneven
splits give the last PEs smaller blocks (exact sizes, no padding).

Two ONNX forms of the same tiling (``form=``).  In both, each *mesh line* along the reduction
axis holds its tiles in one ``[K/R, N]`` initializer, side by side (column block j is PE (i, j)'s
tile: splitting a GEMV's output columns needs no communication, so adjacent storage changes
nothing numerically), and line p's partial products are added to the partial sum arriving from
line p-1 — an explicit chain (systolic) reduction along the mesh axis.

* ``op`` (the default where it builds): one ``spark.wafer::MeshLinear`` node per linear over the
  lines' tile initializers (``mesh_op.c``, compiled on first use, see :mod:`.mesh_op`).  Each
  line computes its partial products in registers and reduces them into the output in line
  order.  The op also takes over what surrounds a linear in a pre-norm decoder: a gated MLP's
  act(gate) * up (:meth:`TiledLinear.emit_gated`) and the RMSNorm before a linear, with the skip
  add (``norm=`` of the emit methods, :func:`mesh_node`), so a decode step has fewer nodes than
  the dense graph.
* ``graph`` (standard ONNX ops, the fallback without a C compiler): the input is ``Split`` over
  the reduction axis, line 0 runs ``MatMul`` and every next line ``Gemm(x_p, W_p, C=partial)``.
  Same numbers, but about twice the nodes (a ``Split`` and a second GEMV per linear, reshapes
  around attention), each paying the executor, allocation and thread-pool hand-off: a small
  model loses part of its decode speed to them, a model from hidden size 512 up nothing.

docs/wafer.md describes both forms and the fallback.
"""

from __future__ import annotations

import math

import numpy as np

from ..graph import ROLES, DenseLinear
from . import mesh_op

#: Default emulated grid: 2 x 2 is the smallest mesh on which every linear has a real
#: reduction along its axis (qkv/gate_up/lm_head over 2 rows, o/down over 2 columns) and, by
#: measurement, the one whose extra ops cost least in the ``graph`` form (each extra mesh line
#: adds one Gemm there; in the ``op`` form it adds one pass over shorter tiles).
DEFAULT_GRID = (2, 2)

#: ONNX forms of a tiled linear: ``op`` — one ``spark.wafer::MeshLinear`` node (engine/wafer/mesh_op.c);
#: ``graph`` — standard ops: ``Split`` + a ``MatMul``/``Gemm(C = partial)`` chain per mesh line.
FORMS = ("op", "graph")

#: Roles whose reduction runs over the mesh rows (input split along rows).
ROW_REDUCE = ("qkv", "gate_up", "lm_head")
#: Roles stored transposed on the mesh: reduction over the mesh columns.
COL_REDUCE = ("o", "down")


def parse_grid(text: str, what: str = "--grid") -> tuple[int, int]:
    """``"RxC"`` -> ``(R, C)``; a ValueError naming ``what`` otherwise."""
    parts = str(text).strip().lower().replace("×", "x").split("x")
    try:
        r, c = (int(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"{what} {text!r}: expected RxC with positive integers, e.g. 4x4"
        ) from None
    if r <= 0 or c <= 0:
        raise ValueError(f"{what} {text!r}: rows and columns must be positive")
    return r, c


def reduce_axis(role: str) -> str:
    """The mesh axis a linear's input is split along and its partial sums are reduced over."""
    if role in ROW_REDUCE:
        return "rows"
    if role in COL_REDUCE:
        return "cols"
    raise ValueError(f"unknown linear role {role!r}; expected one of {ROW_REDUCE + COL_REDUCE}")


def block_sizes(n: int, parts: int) -> list[int]:
    """Split ``n`` elements over ``parts`` PEs: blocks of ceil(n/parts), the last ones smaller.

    PEs that would get nothing are dropped (a grid wider than the dimension).
    """
    b = math.ceil(n / parts)
    return [min(b, n - p * b) for p in range(parts) if p * b < n]


def pe_tiles(
    weight: np.ndarray, grid: tuple[int, int], role: str
) -> dict[tuple[int, int], np.ndarray]:
    """The block each PE (i, j) stores (a view into ``weight``); the reference for tests/reports."""
    R, C = grid
    K, N = weight.shape
    k_parts, n_parts = (R, C) if reduce_axis(role) == "rows" else (C, R)
    ko = np.cumsum([0] + block_sizes(K, k_parts))
    no = np.cumsum([0] + block_sizes(N, n_parts))
    tiles = {}
    for a in range(len(ko) - 1):
        for b in range(len(no) - 1):
            pe = (a, b) if reduce_axis(role) == "rows" else (b, a)
            tiles[pe] = weight[ko[a] : ko[a + 1], no[b] : no[b + 1]]
    return tiles


def mesh_node(gb, op: str, x: str, inputs: list[str], *, name: str, norm=None, **attrs):
    """One ``spark.wafer`` node computing a linear of ``x`` (``inputs``: shape, weights, bias).

    With ``norm`` (an ``engine.graph.NormInput``) the node runs its RMSNorm prologue first
    (attribute ``norm``: 1 with a skip input, 2 without; ``epsilon``): its inputs are then
    ``x, [skip,] gamma, shape, ...`` and it returns ``(y, x + skip)`` (``None`` for the sum
    without a skip or with ``keep_sum=False``); without ``norm`` it returns ``y``."""
    if norm is None:
        return gb.node(op, [x, *inputs], domain=mesh_op.DOMAIN, name=name, **attrs)
    pre = [x, norm.skip, norm.gamma] if norm.skip else [x, norm.gamma]
    n_out = 2 if norm.skip and norm.keep_sum else 1
    out = gb.node(
        op,
        [*pre, *inputs],
        n_out=n_out,
        domain=mesh_op.DOMAIN,
        name=name,
        norm=1 if norm.skip else 2,
        epsilon=float(norm.epsilon),
        **attrs,
    )
    return (out[0], out[1]) if n_out == 2 else (out, None)


class TiledLinear:
    """Linear emitter that stores weights as per-PE tiles and reduces explicitly over the mesh.

    ``grid`` is the emulated execution grid (R rows x C columns of PEs per weight); ``None``
    picks :data:`DEFAULT_GRID`.  ``form`` is one of :data:`FORMS`; ``None`` picks ``op`` where
    the MeshLinear op builds, else ``graph`` (``op`` where it cannot build is a ValueError).  ``roles`` limits the tiling to some linears (the others stay one
    plain ``MatMul``): to measure what each costs (``spark-lsp bench wafer --tile``), not to run.
    ``layout`` records, per emitted linear, its role, shape, grid, reduction axis and block sizes.
    """

    def __init__(
        self, grid: tuple[int, int] | None = None, roles=None, form: str | None = None
    ) -> None:
        if form is None:
            form = "op" if mesh_op.library() else "graph"
        if form not in FORMS:
            raise ValueError(f"form: expected one of {', '.join(FORMS)}, got {form!r}")
        if form == "op" and not mesh_op.library():
            raise ValueError(f"form='op': the MeshLinear op is unavailable ({mesh_op.why_not()})")
        self.form = form
        roles = ROLES if roles is None else tuple(roles)
        if not roles or any(r not in ROLES for r in roles):
            raise ValueError(f"roles: expected some of {', '.join(ROLES)}, got {roles!r}")
        self.roles = roles
        if grid is None:
            grid = DEFAULT_GRID
        try:
            r, c = (int(v) for v in grid)
        except (TypeError, ValueError):
            raise ValueError(f"grid must be a pair (rows, cols), got {grid!r}") from None
        if r <= 0 or c <= 0:
            raise ValueError(f"grid rows and cols must be positive, got {grid!r}")
        self.grid = (r, c)
        self.layout: dict[str, dict] = {}

    @property
    def partial(self) -> bool:
        """Some linears are left whole (an ablation, see ``roles``)."""
        return set(self.roles) != set(ROLES)

    @property
    def accepts_3d(self) -> bool:
        """The op takes [1, S, K] activations; the standard-op form's Gemm needs 2-D ones."""
        return self.form == "op"

    @property
    def custom_op_libraries(self) -> tuple[str, ...]:
        """Libraries the sessions running this emitter's graphs must register."""
        return (mesh_op.library(),) if self.form == "op" else ()

    @property
    def fuses_norm(self) -> bool:
        """The ``op`` form runs the RMSNorm before a linear in the op (``norm=`` of the emit
        methods, see :func:`mesh_node`)."""
        return self.form == "op" and not self.partial

    def cache_key(self) -> str:
        form = "meshop-v5" if self.form == "op" else "chain-v1"
        return f"tiled-{self.grid[0]}x{self.grid[1]}-{form}" + (
            "-only-" + "-".join(sorted(self.roles)) if self.partial else ""
        )

    def emit_attention(self, gb, inputs: list[str], *, name: str, heads, kv_heads, scale):
        """The decoder's attention as one ``spark.wafer::DecoderAttention`` node (form ``op``,
        where the op passed its self-test; see :func:`mesh_op.emit_attention`): GroupQueryAttention's
        inputs and outputs, without its per-head dispatch.  ``None``: the graph emits GQA."""
        if self.form != "op":
            return None
        return mesh_op.emit_attention(
            gb, inputs, name=name, heads=heads, kv_heads=kv_heads, scale=scale
        )

    def _tile(self, name: str, role: str, shape: tuple[int, int], **extra) -> list[int]:
        """Record linear ``name``'s tiling in ``layout`` (the ``role``'s reduction axis, the K and
        N blocks of ``shape`` = (K, N) over the grid, and ``extra``); return the K blocks."""
        K, N = shape
        R, C = self.grid
        axis = reduce_axis(role)
        k_parts, n_parts = (R, C) if axis == "rows" else (C, R)
        k_sizes = block_sizes(K, k_parts)
        self.layout[name] = {
            "role": role,
            "shape": (K, N),
            "grid": (R, C),
            "reduce_axis": axis,
            "k_blocks": k_sizes,
            "n_blocks": block_sizes(N, n_parts),
            **extra,
        }
        return k_sizes

    def emit(
        self,
        gb,
        x: str,
        weight: np.ndarray,
        *,
        name: str,
        role: str,
        bias: np.ndarray | None = None,
        norm=None,
    ):
        """``x @ weight (+ bias)``; with ``norm`` (``fuses_norm`` only) the op's RMSNorm
        prologue first, and the result is ``(y, sum)`` (see :func:`mesh_node`)."""
        weight = np.asarray(weight, dtype=np.float32)
        if weight.ndim != 2:
            raise ValueError(f"{name}: weight must be 2-D [K, N], got shape {weight.shape}")
        if norm is not None and not self.fuses_norm:
            raise ValueError(f"{name}: this emitter does not fuse norms (form {self.form!r})")
        axis = reduce_axis(role)  # (an unknown role is a ValueError)
        if role not in self.roles:  # left whole (an ablation): the dense emitter's one MatMul
            return DenseLinear().emit(gb, x, weight, name=name, role=role, bias=bias)
        k_sizes = self._tile(name, role, weight.shape)

        # Mesh line p's tiles, side by side: the rows of W in its K-block.
        line = "row" if axis == "rows" else "col"
        k0 = np.cumsum([0] + k_sizes)
        if self.form == "op":  # every line's GEMVs and the chain reduction in one op
            # stored in the panels the op streams: the session uses them in place, no copy
            shape, packed = mesh_op.float_node_inputs(weight, k_sizes)
            tiles = [gb.initializer(f"{name}.{line}{p}", t) for p, t in enumerate(packed)]
            ins = [gb.initializer(f"{name}.mesh_shape", shape), *tiles]
            if bias is not None:  # added by the op after the reduction: one node fewer
                ins.append(gb.initializer(f"{name}.bias", np.asarray(bias, dtype=np.float32)))
            return mesh_node(gb, mesh_op.OP, x, ins, name=f"{name}/mesh_linear", norm=norm)
        else:
            tiles = [
                gb.initializer(f"{name}.{line}{p}", np.ascontiguousarray(weight[k0[p] : k0[p + 1]]))
                for p in range(len(k_sizes))
            ]
            # Split the input along the reduction axis: mesh line p receives x[:, K-block p].
            xs = (
                gb.node(
                    "Split",
                    [x, gb.const_i64(k_sizes)],
                    n_out=len(k_sizes),
                    name=f"{name}/to_mesh",
                    axis=1,
                )
                if len(k_sizes) > 1
                else [x]
            )
            y = gb.node("MatMul", [xs[0], tiles[0]], name=f"{name}/{line}0_gemv")
            for p in range(
                1, len(k_sizes)
            ):  # line p's partial products + the partial sum from line p-1
                y = gb.node("Gemm", [xs[p], tiles[p], y], name=f"{name}/{line}{p}_gemv_reduce")
        if bias is not None:
            b = gb.initializer(f"{name}.bias", np.asarray(bias, dtype=np.float32))
            y = gb.node("Add", [y, b], name=f"{name}/bias")
        return y

    def emit_gated(
        self,
        gb,
        x: str,
        weight: np.ndarray,
        *,
        name: str,
        act: str,
        bias: np.ndarray | None = None,
        norm=None,
    ):
        """A gated MLP's ``act(x @ W_gate) * (x @ W_up)`` as one ``MeshLinear(glu=...)`` node
        (with ``norm``: after the op's RMSNorm prologue, and ``(y, sum)`` as :meth:`emit`).

        ``weight`` is the ``gate_up`` role's ``[K, 2F]`` (gate columns, then up), ``bias`` its
        ``[2F]``.  The columns are stored in the op's ``glu`` order (:func:`mesh_op.glu_columns`:
        each 64-column panel holds 32 gate columns and their 32 up columns), and the op applies
        the activation and the product after each panel's reduction, so the graph needs no
        Split, activation and Mul after the linear: three nodes fewer per layer.  ``None`` where
        this emitter cannot (the ``graph`` form, ``gate_up`` left whole, an activation the op
        lacks): the builder then emits the linear and the gating as separate nodes."""
        if self.form != "op" or "gate_up" not in self.roles or act not in mesh_op.GLU:
            return None
        weight = np.asarray(weight, dtype=np.float32)
        K, N2 = weight.shape
        if N2 % 2:
            raise ValueError(f"{name}: a [gate | up] weight needs an even column count, got {N2}")
        F = N2 // 2
        k_sizes = self._tile(name, "gate_up", (K, N2), glu=act)
        _, packed = mesh_op.float_node_inputs(mesh_op.glu_interleave(weight, F), k_sizes)
        shape = np.array([F, *k_sizes], np.int64)  # the op's output columns: the F gated ones
        tiles = [gb.initializer(f"{name}.row{p}", t) for p, t in enumerate(packed)]
        ins = [gb.initializer(f"{name}.mesh_shape", shape), *tiles]
        if bias is not None:
            ins.append(gb.initializer(f"{name}.bias", mesh_op.glu_interleave(bias, F)))
        return mesh_node(
            gb, mesh_op.OP, x, ins, name=f"{name}/mesh_linear_glu", norm=norm, glu=mesh_op.GLU[act]
        )

    def reads_tied(self) -> bool:
        """Whether :meth:`emit_tied` reads the embedding table in place (then the builder stores
        it in float32, the type the op reads)."""
        return self.form == "op" and "lm_head" in self.roles

    def emit_tied(self, gb, x: str, table: str, shape: tuple[int, int], *, name: str, norm=None):
        """The LM head of a model whose head is its token embedding: ``x @ E.T`` read straight from
        the embedding initializer ``table`` ``[N, K]`` (``shape``) with ``MeshLinear(transposed=1)``,
        so the graph stores the table once.  The tiling is the ``lm_head`` role's (K split over
        the mesh rows, chain reduction).  ``None`` where this emitter cannot (the ``graph`` form,
        or the head left whole): the builder then emits a copy with :meth:`emit`.  ``norm``: as
        :meth:`emit`."""
        if not self.reads_tied():
            return None
        N, K = shape
        k_sizes = self._tile(name, "lm_head", (K, N), tied=table)
        shape_init = gb.initializer(f"{name}.mesh_shape", np.array([N, *k_sizes], np.int64))
        return mesh_node(
            gb,
            mesh_op.OP,
            x,
            [shape_init, table],
            name=f"{name}/mesh_linear",
            norm=norm,
            transposed=1,
        )
