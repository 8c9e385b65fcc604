"""Wafer-scale chip specs: the built-in WSE-2 / WSE-3 and custom specs from a TOML or JSON file.

Figures come from Cerebras' public documentation and the WaferLLM paper (see
``docs`` / the research notes): a 2D mesh of PEs with 48 KB of SRAM each, one 32-bit word per
link per cycle, about 2 cycles on the router-to-core ramp, and slow off-wafer I/O.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path


class ChipError(ValueError):
    """A bad chip name or spec file; the message names the file and field."""


@dataclass(frozen=True)
class Chip:
    name: str
    mesh_rows: int  # PE rows visible to programs
    mesh_cols: int  # PE columns visible to programs
    sram_kb_per_pe: float  # SRAM per PE, KB (1 KB = 1024 bytes)
    clock_ghz: float
    simd_fp16: int  # fp16 multiply-accumulates per PE per cycle
    link_bits: int = 32  # one word of this many bits crosses one link per cycle
    hop_cycles: float = 1.0  # cycles per router hop
    ramp_cycles: float = 2.0  # router <-> core latency, each way
    io_tbps: float = 1.2  # off-wafer I/O bandwidth, Tb/s (12 x 100 GbE)
    io_latency_us: float = 1.0  # one wafer-to-wafer activation hand-off (NIC + switch + NIC)

    @property
    def pes(self) -> int:
        return self.mesh_rows * self.mesh_cols

    @property
    def sram_bytes_per_pe(self) -> int:
        return int(self.sram_kb_per_pe * 1024)

    @property
    def words_per_fp16(self) -> float:
        """Link words needed per fp16 element (two fp16 values share a 32-bit word)."""
        return 16 / self.link_bits

    def to_dict(self) -> dict:
        return asdict(self)


WSE2 = Chip("wse2", mesh_rows=757, mesh_cols=996, sram_kb_per_pe=48, clock_ghz=1.1, simd_fp16=4)
WSE3 = Chip("wse3", mesh_rows=762, mesh_cols=1172, sram_kb_per_pe=48, clock_ghz=1.1, simd_fp16=8)
BUILTIN = {"wse2": WSE2, "wse3": WSE3}

_REQUIRED = ("mesh_rows", "mesh_cols", "sram_kb_per_pe", "clock_ghz", "simd_fp16")
_INTS = ("mesh_rows", "mesh_cols", "simd_fp16", "link_bits")


def _validate(data: dict, where: str) -> Chip:
    known = {f.name for f in fields(Chip)}
    unknown = sorted(set(data) - known - {"base"})
    if unknown:
        raise ChipError(
            f"{where}: unknown field(s) {', '.join(unknown)}; known: base, {', '.join(sorted(known))}"
        )
    base = None
    if "base" in data:
        base = BUILTIN.get(str(data["base"]).lower())
        if base is None:
            raise ChipError(
                f"{where}: field 'base' must be one of {', '.join(BUILTIN)}, got {data['base']!r}"
            )
    missing = [k for k in _REQUIRED if k not in data] if base is None else []
    if missing:
        raise ChipError(f"{where}: required field(s) missing: {', '.join(missing)}")
    values = {}
    for f in fields(Chip):
        if f.name not in data:
            continue
        v = data[f.name]
        if f.name == "name":
            if not isinstance(v, str) or not v:
                raise ChipError(f"{where}: field 'name' must be a non-empty string, got {v!r}")
            values["name"] = v
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ChipError(f"{where}: field '{f.name}' must be a number, got {v!r}")
        if f.name in _INTS and v != int(v):
            raise ChipError(f"{where}: field '{f.name}' must be an integer, got {v!r}")
        if v < 0 or (v == 0 and f.name != "io_latency_us"):
            raise ChipError(f"{where}: field '{f.name}' must be positive, got {v!r}")
        values[f.name] = int(v) if f.name in _INTS else float(v)
    if base is not None:
        return replace(base, **values)
    values.setdefault("name", Path(where).stem)
    return Chip(**values)


def load_chip(spec: str | Path) -> Chip:
    """``wse2`` / ``wse3`` or a path to a ``.toml`` / ``.json`` spec.

    A spec file holds the :class:`Chip` fields (``mesh_rows``, ``mesh_cols``, ``sram_kb_per_pe``,
    ``clock_ghz``, ``simd_fp16`` required; the others default to the WSE values), or
    ``base = "wse3"`` plus the fields it overrides.
    """
    key = str(spec).strip()
    if key.lower() in BUILTIN:
        return BUILTIN[key.lower()]
    path = Path(key)
    if not path.is_file():
        raise ChipError(
            f"--chip {key!r}: not a built-in chip ({', '.join(BUILTIN)}) and no such file"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ChipError(f"{path}: cannot read: {e}") from None
    if path.suffix.lower() == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise ChipError(
                f"{path}: TOML chip specs need Python 3.11+; use a .json spec"
            ) from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ChipError(f"{path}: invalid TOML: {e}") from None
    elif path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ChipError(
                f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
            ) from None
    else:
        raise ChipError(f"{path}: chip spec must be a .toml or .json file")
    if not isinstance(data, dict):
        raise ChipError(f"{path}: expected a table/object of chip fields")
    if isinstance(data.get("chip"), dict) and len(data) == 1:
        data = data["chip"]  # allow a [chip] table
    return _validate(dict(data), str(path))
