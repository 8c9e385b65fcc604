"""llama.cpp as a benchmark peer, through ``llama-cpp-python``, on the same weights as our engine.

The GGUF files are made the way llama.cpp users make them: ``convert_hf_to_gguf.py`` from the
llama.cpp sources vendored in the ``llama-cpp-python`` sdist converts the model folder (F32, Q8_0),
and llama.cpp's own quantiser (``llama_model_quantize``, through the bindings) makes Q4_0 and
Q4_K_M from the F32 file.  Every file is cached under the bench root by the weights' digest.

The converter identifies a BPE tokenizer's pre-tokenizer by hashing how it splits a test string
and refuses one it does not know (a synthetic model's trained tokenizer): the pre-tokenizer name
then falls back to the architecture's.  Prompts reach llama.cpp as token ids, so its own text
splitting never runs here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from .peers import PeerUnavailable

#: GGUF types this peer runs: name -> (bits class, how it is made).
GGUF_TYPES = {"F32": 32, "Q8_0": 8, "Q4_0": 4, "Q4_K_M": 4}

#: llama.cpp's pre-tokenizer name for an architecture whose tokenizer the converter does not know.
_PRE_TOKENIZERS = {"qwen2": "qwen2", "qwen3": "qwen2", "starcoder2": "starcoder"}

# Run in a subprocess: the converter imports torch and its own gguf-py.
_CONVERT = r"""
import sys
src, model, out, outtype, fallback = sys.argv[1:6]
sys.path.insert(0, src)
sys.path.insert(1, src + "/gguf-py")
from conversion import base
_pre = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return _pre(self, tokenizer)
    except NotImplementedError:
        return fallback
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", model, "--outfile", out, "--outtype", outtype]
convert_hf_to_gguf.main()
"""


def _version() -> str:
    try:
        import llama_cpp
    except ImportError:
        raise PeerUnavailable(
            "llama-cpp-python not installed; pip install 'spark-lsp[peers]'"
        ) from None
    return llama_cpp.__version__


def converter_dir(cache_root: Path, log=print) -> Path:
    """llama.cpp's sources from the ``llama-cpp-python`` sdist of the installed version (the sdist
    from ``~/.cache/spark-lsp/sdist``, else fetched with ``pip download``), unpacked once."""
    version = _version()
    out = cache_root / f"llama.cpp-{version}"
    if (out / "convert_hf_to_gguf.py").is_file():
        return out
    name = f"llama_cpp_python-{version}.tar.gz"
    sdist_dir = cache_root.parent / "sdist"
    sdist = next(
        (
            d / name
            for d in (sdist_dir, Path.home() / ".cache" / "spark-lsp" / "sdist")
            if (d / name).is_file()
        ),
        sdist_dir / name,
    )
    if not sdist.is_file():
        log(f"fetching the llama-cpp-python {version} sdist (for llama.cpp's converter) ...")
        sdist_dir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(sdist_dir),
                f"llama-cpp-python=={version}",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode != 0 or not sdist.is_file():
            raise PeerUnavailable(
                f"no llama-cpp-python {version} sdist for convert_hf_to_gguf.py "
                f"(pip download failed: {(proc.stderr or '').strip().splitlines()[-1:]})"
            )
    tmp = Path(tempfile.mkdtemp(prefix="llama.cpp-", dir=cache_root))
    try:
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [
                m
                for m in tar.getmembers()
                if m.name.startswith(prefix)
                and (m.name.endswith(".py") or "/gguf-py/" in m.name)
                and (m.isfile() or m.isdir())
            ]
            tar.extractall(tmp, members=members, filter="data")
        os.replace(tmp / prefix, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_file(
    model_dir: Path, digest: str, gguf_type: str, cache_root: Path, architecture: str, log=print
) -> Path:
    """The model as a GGUF of ``gguf_type`` (made once, cached by the weights digest)."""
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"gguf type {gguf_type!r}: expected one of {', '.join(GGUF_TYPES)}")
    out = cache_root / "gguf" / digest / f"model-{gguf_type}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    if gguf_type in ("F32", "Q8_0"):
        src = converter_dir(cache_root, log)
        log(
            f"converting {model_dir.name} to GGUF {gguf_type} with llama.cpp's convert_hf_to_gguf.py (once) ..."
        )
        fallback = _PRE_TOKENIZERS.get(architecture, "default")
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                _CONVERT,
                str(src),
                str(model_dir),
                str(tmp),
                gguf_type.lower(),
                fallback,
            ],
            capture_output=True,
            text=True,
            timeout=3600,
        )
        if proc.returncode != 0 or not tmp.is_file():
            tmp.unlink(missing_ok=True)
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise PeerUnavailable(f"convert_hf_to_gguf.py failed: {tail[0]}")
    else:
        import llama_cpp

        f32 = gguf_file(model_dir, digest, "F32", cache_root, architecture, log)
        log(
            f"quantising {model_dir.name} to GGUF {gguf_type} with llama.cpp's quantiser (once) ..."
        )
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{gguf_type}")
        params.nthread = os.cpu_count() or 1
        rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), params)
        if rc != 0 or not tmp.is_file():
            tmp.unlink(missing_ok=True)
            raise PeerUnavailable(f"llama_model_quantize to {gguf_type} failed (rc {rc})")
    os.replace(tmp, out)
    return out


# Loads a GGUF and decodes a few tokens: run in a subprocess before the peer loads in-process.
_PROBE = r"""
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=int(sys.argv[2]), verbose=False)
llm.eval([1, 2, 3, 4])
"""


def probe(path: Path, threads: int) -> None:
    """Check in a subprocess that llama.cpp runs ``path`` on this machine: a build whose kernels
    crash here (a segfault cannot be caught) must skip the peer, not kill the benchmark."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(path), str(threads)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        raise PeerUnavailable(
            f"llama.cpp fails on {path.name} on this machine (exit {proc.returncode}: "
            f"{tail[0]}); rebuild llama-cpp-python for this CPU"
        )


#: CPU features worth naming in a llama.cpp build (its system info) and this CPU's flag for each.
_FEATURES = {
    "AVX2": "avx2",
    "AVX512": "avx512f",
    "AVX512_VNNI": "avx512_vnni",
    "AMX_INT8": "amx_int8",
}


def build_features() -> tuple[list[str], list[str]]:
    """(the features the installed llama.cpp was compiled with, of those in ``_FEATURES``; the
    ones this CPU has that the build lacks).  A build without this CPU's vector extensions is a
    weak peer (a wheel built with ``GGML_NATIVE=OFF`` alone stops at AVX2), so the benchmark
    says so next to its figures instead of reporting an unfair ratio silently."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    built = [f for f in _FEATURES if f"{f} = 1" in info]
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        flags = []
    # AMX is left out of llama.cpp builds on purpose where its kernels crash (see docs/speed.md)
    missing = [
        f for f, flag in _FEATURES.items() if flag in flags and f not in built and f != "AMX_INT8"
    ]
    return built, missing


class LlamaCppPeer:
    """llama.cpp (``llama-cpp-python``) on one GGUF file: greedy, eos ignored, a fresh KV cache per call."""

    def __init__(
        self,
        model_dir: Path,
        threads: int,
        digest: str,
        cache_root: Path,
        gguf_type: str,
        architecture: str,
        context: int,
        log=print,
    ) -> None:
        version = _version()
        import llama_cpp

        path = gguf_file(model_dir, digest, gguf_type, cache_root, architecture, log)
        probe(path, threads)
        self.name = f"llama.cpp {gguf_type}"
        self.bits = GGUF_TYPES[gguf_type]
        self.gguf_type = gguf_type
        self.path = path
        built, missing = build_features()
        self.version = f"llama-cpp-python {version} ({', '.join(built) or 'no SIMD features'})"
        if missing:
            log(
                f"warning: llama.cpp is built without {', '.join(missing)}, which this CPU has: "
                "its figures understate llama.cpp here; rebuild llama-cpp-python with them "
                "(docs/speed.md, 'llama.cpp')"
            )
        try:
            self.llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=context,
                n_batch=512,
                n_ubatch=512,
                n_threads=threads,
                n_threads_batch=threads,
                verbose=False,
            )
        except ValueError as e:  # llama.cpp refused the file
            raise PeerUnavailable(f"llama.cpp cannot load {path.name}: {e}") from None

    def timed(self, prompt: list[int], new_tokens: int) -> tuple[list[int], float, float | None]:
        self.llm.reset()
        out: list[int] = []
        stamps: list[float] = []
        t0 = time.perf_counter()
        for tok in self.llm.generate(
            prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True
        ):
            out.append(int(tok))
            stamps.append(time.perf_counter())
            if len(out) >= new_tokens:
                break
        dt = time.perf_counter() - t0
        return out, dt, stamps[-1] - stamps[0] if len(stamps) > 1 else None

    def close(self) -> None:
        self.llm.close()
