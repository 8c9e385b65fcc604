"""Benchmark peers: transformers ``generate()`` and onnxruntime-genai's generator on the same weights.

Both are imported lazily (they are optional and torch must never load at run time otherwise).
Every runner exposes the same ``timed(prompt_ids, new_tokens) -> (token ids, seconds, decode
seconds)``: greedy, eos ignored, exactly ``new_tokens`` new tokens, wall time from the call until
the last token, and the time from its first new token to its last taken inside its own loop, so
``engine.lab.bench`` derives prefill and decode rates the same way for every runner.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class PeerUnavailable(Exception):
    """A peer is not installed or cannot run this model; the message says why."""


class _TokenClock:
    """A transformers streamer that only notes when each new token arrives (its first ``put``
    is the prompt), so decode is timed inside ``generate`` like the other runners."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass

    def span(self) -> float | None:
        """Seconds from the first new token to the last (None with fewer than two)."""
        return self.times[-1] - self.times[0] if len(self.times) > 1 else None


class TransformersPeer:
    """transformers + torch (fp32, eager CPU), ``model.generate`` with greedy search."""

    name = "transformers"

    def __init__(self, model_dir: Path, threads: int) -> None:
        try:
            import torch
            import transformers
        except ImportError as e:
            raise PeerUnavailable(
                f"transformers/torch not installed ({e.name}); pip install torch --index-url https://download.pytorch.org/whl/cpu transformers"
            ) from None
        torch.set_num_threads(threads)
        transformers.utils.logging.disable_progress_bar()
        self._torch = torch
        self.version = f"transformers {transformers.__version__}, torch {torch.__version__}"
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32
        )
        self.model.eval()
        gc = self.model.generation_config
        gc.eos_token_id = None  # generate exactly new_tokens tokens, like the other runners
        gc.pad_token_id = gc.pad_token_id if gc.pad_token_id is not None else 0

    def timed(self, prompt: list[int], new_tokens: int) -> tuple[list[int], float, float | None]:
        torch = self._torch
        ids = torch.tensor([prompt], dtype=torch.long)
        mask = torch.ones_like(ids)
        clock = _TokenClock()
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                num_beams=1,
                streamer=clock,
            )
            dt = time.perf_counter() - t0
        return out[0, len(prompt) :].tolist(), dt, clock.span()


#: onnxruntime-genai builder precisions the benchmark runs (its CPU int4 is MatMulNBits).
GENAI_PRECISIONS = ("fp32", "int4")


def genai_model_dir(
    model_dir: Path, digest: str, cache_root: Path, log=print, precision: str = "fp32"
) -> Path:
    """Build (once, cached by the weights digest) onnxruntime-genai's CPU model of a folder at
    ``precision`` (its builder's ``-p``)."""
    if precision not in GENAI_PRECISIONS:
        raise ValueError(f"onnxruntime-genai precision {precision!r}: one of {GENAI_PRECISIONS}")
    out = cache_root / "genai" / (digest if precision == "fp32" else f"{digest}-{precision}")
    if (out / "genai_config.json").is_file():
        return out
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="genai-", dir=cache_root))
    log(f"building the onnxruntime-genai {precision} model (once; cached in {out}) ...")
    cmd = [
        sys.executable,
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        str(model_dir),
        "-o",
        str(tmp / "model"),
        "-p",
        precision,
        "-e",
        "cpu",
        "-c",
        str(tmp / "hf_cache"),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0 or not (tmp / "model" / "genai_config.json").is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise PeerUnavailable(f"onnxruntime-genai builder failed: {tail[0]}")
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp / "model", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


class GenaiPeer:
    """onnxruntime-genai's generator (its own builder: GroupQueryAttention, shared KV buffer) at
    one of its builder's precisions; named ``onnxruntime-genai`` (fp32) or ``onnxruntime-genai
    int4``."""

    name = "onnxruntime-genai"
    bits = 32

    def __init__(
        self,
        model_dir: Path,
        threads: int,
        digest: str,
        cache_root: Path,
        log=print,
        profile: str | None = None,
        precision: str = "fp32",
    ) -> None:
        """``profile``: record ONNX Runtime's per-node profile to files with this prefix (a copy of
        the built model's config turns it on; :meth:`end_profiling` returns the files)."""
        if precision != "fp32":
            self.name, self.bits = f"onnxruntime-genai {precision}", {"int4": 4}[precision]
        try:
            import onnxruntime_genai as og
        except ImportError as e:
            raise PeerUnavailable(
                f"onnxruntime-genai not installed ({e.name}); pip install onnxruntime-genai onnx-ir"
            ) from None
        try:
            import onnx_ir  # noqa: F401  (the builder needs it)
        except ImportError:
            raise PeerUnavailable(
                "onnx-ir not installed (needed by the onnxruntime-genai builder)"
            ) from None
        self._og = og
        self.version = f"onnxruntime-genai {og.__version__}"
        path = genai_model_dir(model_dir, digest, cache_root, log, precision)
        self._set_threads(path, threads)
        self._profile = profile
        if profile:
            path = self._profiled_copy(path, profile)
        self.model = og.Model(str(path))

    @staticmethod
    def _profiled_copy(path: Path, prefix: str) -> Path:
        """A folder beside the profile files: links to the built model, a config that profiles."""
        out = Path(tempfile.mkdtemp(prefix="genai-profiled-", dir=Path(prefix).parent))
        for f in path.iterdir():
            if f.name != "genai_config.json":
                (out / f.name).symlink_to(f.resolve())
        cfg = json.loads((path / "genai_config.json").read_text())
        cfg["model"]["decoder"].setdefault("session_options", {})["enable_profiling"] = str(prefix)
        (out / "genai_config.json").write_text(json.dumps(cfg, indent=4))
        return out

    def end_profiling(self) -> list[str]:
        """Release the model (onnxruntime-genai writes its profile then) and return the files."""
        self.model = None
        gc.collect()
        if not self._profile:
            return []
        return sorted(
            str(p) for p in Path(self._profile).parent.glob(Path(self._profile).name + "*.json")
        )

    @staticmethod
    def _set_threads(path: Path, threads: int) -> None:
        """Pin intra-op threads in genai_config.json (the same count our session uses)."""
        cfg_path = path / "genai_config.json"
        cfg = json.loads(cfg_path.read_text())
        so = cfg["model"]["decoder"].setdefault("session_options", {})
        if so.get("intra_op_num_threads") != threads:
            so["intra_op_num_threads"] = threads
            so["inter_op_num_threads"] = 1
            cfg_path.write_text(json.dumps(cfg, indent=4))

    def timed(self, prompt: list[int], new_tokens: int) -> tuple[list[int], float, float | None]:
        og = self._og
        t0 = time.perf_counter()
        params = og.GeneratorParams(self.model)
        total = len(prompt) + new_tokens
        params.set_search_options(do_sample=False, max_length=total, min_length=total)
        gen = og.Generator(self.model, params)
        gen.append_tokens(prompt)
        out: list[int] = []
        stamps: list[float] = []
        while len(out) < new_tokens and not gen.is_done():
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
            stamps.append(time.perf_counter())
        dt = time.perf_counter() - t0
        return out, dt, stamps[-1] - stamps[0] if len(stamps) > 1 else None
