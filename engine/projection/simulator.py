"""Discrete mesh simulator: one decode step of a layer, message by message, on a small region.

The check on :mod:`engine.projection.perfmodel` the way Cerebras' cycle-accurate fabric simulator is
used for small rectangles: every PE has its own clock (when its data is ready), every directed
link between neighbouring routers carries one 32-bit word per cycle and is reserved while a
message streams over it (a message queues behind earlier ones: contention), each hop costs the
chip's hop cycles and entering / leaving a core costs the ramp latency.  Reductions are the same
trees as the analytic model (distance doubling toward the line's first PE, multicast back), but here
each PE proceeds as soon as *its* inputs arrive, uneven tiles give PEs uneven compute, and
routes that share links wait for each other.

Messages are processed in order of injection time with per-link reservations (virtual
cut-through), so a 64 x 64 layer simulates in well under a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .chips import Chip
from .perfmodel import (
    ROOT_AT,
    Constants,
    allreduce_cycles,
    layer_cycles,
    layer_phases,
    tree_levels,
    words,
)
from .placement import ModelShape, _blocks


@dataclass
class SimResult:
    cycles: float  # c0 + the simulated dataflow, up to the next region having the output
    dataflow: float  # the simulated part (compute + messages)
    phases: dict[str, float]  # phase -> time the last PE finished it
    messages: int = 0
    stall_cycles: float = 0.0  # cycles messages spent waiting for busy links
    link_words: int = 0  # word-hops carried
    extra: dict = field(default_factory=dict)


class Mesh:
    """Link reservations of an ``rows x cols`` mesh; routes are X-then-Y (dimension order)."""

    def __init__(self, rows: int, cols: int, chip: Chip) -> None:
        self.rows, self.cols, self.chip = rows, cols, chip
        # free time of each directed link: east/west between (r, c) and (r, c+1); south/north.
        self.east = np.zeros((rows, max(cols - 1, 0)))
        self.west = np.zeros((rows, max(cols - 1, 0)))
        self.south = np.zeros((max(rows - 1, 0), cols))
        self.north = np.zeros((max(rows - 1, 0), cols))
        self.messages = 0
        self.stall = 0.0
        self.word_hops = 0

    def _links(self, src, dst):
        """The directed links (array, index) of the X-then-Y route, and the node after each."""
        (r, c), (r2, c2) = src, dst
        out = []
        while c != c2:
            if c2 > c:
                out.append((self.east, (r, c), (r, c + 1)))
                c += 1
            else:
                out.append((self.west, (r, c - 1), (r, c - 1)))
                c -= 1
        while r != r2:
            if r2 > r:
                out.append((self.south, (r, c), (r + 1, c)))
                r += 1
            else:
                out.append((self.north, (r - 1, c), (r - 1, c)))
                r -= 1
        return out

    def send(self, src, dst, t0: float, m: int, multicast: bool = False) -> dict:
        """Stream ``m`` words from core ``src`` to core ``dst`` injected at ``t0``.

        Returns {node: time the whole message is in that node's core}: just ``dst``, or every
        node on the path when the routers multicast it.
        """
        hop, ramp = self.chip.hop_cycles, self.chip.ramp_cycles
        self.messages += 1
        head = t0 + ramp
        got = {}
        for arr, idx, node in self._links(src, dst):
            start = max(head, arr[idx])
            self.stall += start - head
            arr[idx] = start + m
            head = start + hop
            self.word_hops += m
            if multicast or node == tuple(dst):
                got[node] = start + hop + (m - 1) + ramp
        return got


def _allreduce(mesh: Mesh, ready: np.ndarray, lines: list[list[tuple[int, int]]], m: int) -> None:
    """All-reduce ``m`` words along each line of PE coordinates; updates ``ready`` in place."""
    chip = mesh.chip
    add = math.ceil(m * chip.link_bits / 16 / chip.simd_fp16)
    states = []
    for line in lines:
        n = len(line)
        if n <= 1:
            continue
        root = ROOT_AT(n)
        acc = {p: float(ready[line[p]]) for p in range(n)}
        states.append((line, root, acc))
    levels = max(
        (tree_levels(max(root, len(line) - 1 - root)) for line, root, _ in states), default=0
    )
    for lv in range(levels):
        msgs = []
        for line, root, acc in states:
            n = len(line)
            for side in (-1, 1):
                span = root if side < 0 else n - 1 - root
                for delta in range(2**lv, span + 1, 2 ** (lv + 1)):
                    src, dst = root + side * delta, root + side * (delta - 2**lv)
                    msgs.append((acc[src], line, acc, src, dst))
        msgs.sort(key=lambda x: x[0])
        for t0, line, acc, src, dst in msgs:
            arrival = mesh.send(line[src], line[dst], t0, m)[line[dst]]
            acc[dst] = max(acc[dst], arrival) + add
    for line, root, acc in states:  # multicast the sum back out to both ends
        t = acc[root]
        ready[line[root]] = t
        for end in (0, len(line) - 1):
            if end != root:
                for node, when in mesh.send(line[root], line[end], t, m, multicast=True).items():
                    ready[node] = when


def _pe_compute(
    phase: str, shape: ModelShape, R: int, C: int, context: int, chip: Chip, k: Constants
) -> np.ndarray:
    """Per-PE compute cycles of a phase from the PE's actual (uneven) block sizes."""
    d_r, q_c = _blocks(shape.hidden, R), _blocks(shape.q_dim, C)
    tok_r = _blocks(context, R)
    heads_c = np.maximum(1, np.ceil(shape.heads / C)) * np.ones(C)
    gemv = 1.0 / (chip.simd_fp16 * k.eta)
    simd = chip.simd_fp16
    if phase in ("norm1", "norm2"):
        return np.ceil(np.outer(d_r, np.ones(C)) / simd)
    if phase == "qkv":
        return np.outer(d_r, _blocks(shape.qkv_out, C)) * gemv
    if phase in ("scores", "attn_v"):
        return np.outer(tok_r, q_c) * gemv
    if phase in ("softmax_max", "softmax_sum"):
        return np.ceil(np.outer(tok_r, heads_c) / simd)
    if phase == "o":
        return np.outer(d_r, q_c) * gemv
    if phase == "gate_up":
        return np.outer(d_r, _blocks(shape.up_out, C)) * gemv
    if phase == "down":
        return np.outer(d_r, _blocks(shape.ffn, C)) * gemv
    raise ValueError(f"unknown phase {phase!r}")


def simulate_layer(
    shape: ModelShape,
    grid: tuple[int, int],
    chip: Chip,
    *,
    context: int = 256,
    constants: Constants | None = None,
    handoff: str = "rows",
) -> SimResult:
    """Simulate one decode step of one layer on an ``R x C`` region and the hand-off of its
    output to the next region (placed to the east, as the shelf packer does).

    ``handoff``: ``"rows"`` — the designed route, mesh row i forwards its slice straight east and
    the routers multicast it along the next region's row i; ``"corner"`` — a naive route that
    gathers all slices at the region's corner PE first (to show link contention).
    """
    k = constants or Constants()
    R, C = grid
    if R * C > 64 * 64 * 4:
        raise ValueError(f"grid {R}x{C}: the simulator is meant for small regions (up to ~64x64)")
    mesh = Mesh(R, 2 * C, chip)  # this region + the next one to the east
    ready = np.zeros((R, 2 * C))
    phases = {}
    for ph in layer_phases(shape, R, C, context, chip, k):
        comp = _pe_compute(ph["name"], shape, R, C, context, chip, k)
        ready[:, :C] += comp
        if ph["axis"] == "cols":
            lines = [[(i, j) for i in range(R)] for j in range(C)]
        else:
            seg = ph["n"]  # along a row: one line per segment (a head's columns for 'scores')
            lines = [
                [(i, j) for j in range(s, min(s + seg, C))]
                for i in range(R)
                for s in range(0, C, seg)
            ]
        _allreduce(mesh, ready, lines, ph["words"])
        phases[ph["name"]] = float(ready[:, :C].max())
    m = words(math.ceil(shape.hidden / R), chip)
    if handoff == "rows":
        for i in range(R):
            for node, when in mesh.send(
                (i, C - 1), (i, 2 * C - 1), ready[i, C - 1], m, multicast=True
            ).items():
                if node[1] >= C:
                    ready[node] = when
    elif handoff == "corner":
        corner = (0, C - 1)
        got = [float(ready[corner])]
        for i in range(1, R):
            got.append(mesh.send((i, C - 1), corner, ready[i, C - 1], m)[corner])
        t = max(got)
        for i in range(R):
            for node, when in mesh.send(corner, (i, 2 * C - 1), t, m, multicast=True).items():
                if node[1] >= C and node[0] == i:
                    ready[node] = when
    else:
        raise ValueError(f"handoff={handoff!r}: expected 'rows' or 'corner'")
    end = float(ready[:, C:].max())
    phases["handoff"] = end
    return SimResult(
        cycles=k.c0 + end,
        dataflow=end,
        phases=phases,
        messages=mesh.messages,
        stall_cycles=mesh.stall,
        link_words=mesh.word_hops,
    )


def analytic_layer(
    shape: ModelShape,
    grid: tuple[int, int],
    chip: Chip,
    *,
    context: int = 256,
    constants: Constants | None = None,
) -> dict:
    """The analytic model's cycles for the same layer + east hand-off (for comparison)."""
    k = constants or Constants()
    R, C = grid
    lc = layer_cycles(shape, R, C, context, chip, k)
    m = words(math.ceil(shape.hidden / R), chip)
    hand = C * chip.hop_cycles + (m - 1) + 2 * chip.ramp_cycles  # to the far end of the next row
    return {
        "cycles": lc["total"] + hand,
        "dataflow": lc["compute"] + lc["reduce"] + hand,
        "compute": lc["compute"],
        "reduce": lc["reduce"],
        "handoff": hand,
        "allreduce_check": allreduce_cycles(R, 1, chip),
    }
