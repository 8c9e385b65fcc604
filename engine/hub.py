"""Models by name: the curated catalogue, the Hugging Face Hub, and one resolver for every place a
model is accepted.

:func:`resolve_model` turns what a user writes into a local path the engine loads:

* a folder or a ``.gguf`` file on disk: itself;
* ``hf:ORG/REPO[@REV][:FILE.gguf | :QUANT]`` or a catalogue name (``qwen2.5-coder-1.5b``): the
  repository's files the engine reads, from the local Hugging Face cache when they are there
  (no network), else downloaded once with progress reports, resumable, ``HF_TOKEN`` honoured;
  with ``HF_HUB_OFFLINE=1`` only the cache is used.

Downloads go through ``huggingface_hub`` (its cache layout, so models are shared with other
tools); ``HF_ENDPOINT`` / ``HF_HUB_CACHE`` / ``HF_HUB_OFFLINE`` / ``HF_TOKEN`` are read when a call
is made, not when the library was imported.  :func:`model_info` says what a model needs in memory
at each precision from its ``config.json`` or its GGUF header alone, before anything large is
fetched.
"""

from __future__ import annotations

import fnmatch
import io
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .config import ModelConfig, ModelError, load_config, parse_config

# What sizes a model (.gguf, .graph, .weights) is imported where it is used: those modules bring
# ONNX and ONNX Runtime, and resolving a name to a folder must not (a language server whose
# engine is a daemon resolves the model it names, and never loads the engine's runtime).

#: Files of a model folder the engine reads (everything else in a repository is skipped).
FOLDER_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*-of-*.safetensors",
)
#: Those of them a tokenizer and a configuration are read from (``resolve_model(weights=False)``).
NO_WEIGHTS = tuple(f for f in FOLDER_FILES if ".safetensors" not in f)
#: Preferred quantisation when a GGUF repository is named without a file (llama.cpp's default).
GGUF_PREFERENCE = ("Q4_K_M", "Q8_0", "Q4_0", "Q5_K_M", "Q6_K", "F16", "BF16", "F32")
#: GGUF metadata is read from the first bytes of a remote file, growing to at most this much.
GGUF_HEADER_MAX = 64 << 20

#: progress(done_bytes, total_bytes or None, what): called while downloading.
Progress = Callable[[int, "int | None", str], None]


@dataclass(frozen=True)
class CatalogueEntry:
    """A model the project recommends, by the name users type."""

    name: str
    repo: str
    params: str  # e.g. "0.5B"
    architecture: str
    fim: str  # FIM format name (engine.fim)
    file: str | None = None  # a GGUF file in the repository (None: the safetensors folder)
    note: str = ""

    @property
    def spec(self) -> str:
        return f"hf:{self.repo}" + (f":{self.file}" if self.file else "")


#: The curated catalogue.  Sizes are the models' own (config.json); speed on this machine comes
#: from `spark-lsp bench` and is reported in docs/models.md, not here.
CATALOGUE: dict[str, CatalogueEntry] = {
    e.name: e
    for e in (
        CatalogueEntry(
            "qwen2.5-coder-0.5b",
            "Qwen/Qwen2.5-Coder-0.5B",
            "0.5B",
            "qwen2",
            "qwen",
            note="the default of llama.vscode; fastest useful completions",
        ),
        CatalogueEntry("qwen2.5-coder-1.5b", "Qwen/Qwen2.5-Coder-1.5B", "1.5B", "qwen2", "qwen"),
        CatalogueEntry("qwen2.5-coder-3b", "Qwen/Qwen2.5-Coder-3B", "3B", "qwen2", "qwen"),
        CatalogueEntry("qwen2.5-coder-7b", "Qwen/Qwen2.5-Coder-7B", "7B", "qwen2", "qwen"),
        CatalogueEntry(
            "qwen2.5-coder-0.5b-q8",
            "ggml-org/Qwen2.5-Coder-0.5B-Q8_0-GGUF",
            "0.5B",
            "qwen2",
            "qwen",
            file="qwen2.5-coder-0.5b-q8_0.gguf",
            note="llama.vscode's preset file",
        ),
        CatalogueEntry(
            "qwen2.5-coder-1.5b-q8",
            "ggml-org/Qwen2.5-Coder-1.5B-Q8_0-GGUF",
            "1.5B",
            "qwen2",
            "qwen",
            file="qwen2.5-coder-1.5b-q8_0.gguf",
            note="llama.vscode's preset file",
        ),
        CatalogueEntry(
            "qwen3-0.6b",
            "Qwen/Qwen3-0.6B-Base",
            "0.6B",
            "qwen3",
            "qwen",
            note="Qwen2.5's FIM tokens; not released as a FIM model: compare with eval",
        ),
        CatalogueEntry(
            "deepseek-coder-1.3b",
            "deepseek-ai/deepseek-coder-1.3b-base",
            "1.3B",
            "llama",
            "deepseek",
        ),
        CatalogueEntry("starcoder2-3b", "bigcode/starcoder2-3b", "3B", "starcoder2", "starcoder"),
        CatalogueEntry(
            "codegemma-2b",
            "google/codegemma-2b",
            "2B",
            "gemma",
            "codegemma",
            note="gated: accept the licence on the Hub and set HF_TOKEN",
        ),
    )
}


@dataclass(frozen=True)
class HubSpec:
    """A model on the Hub: repository, revision, and a GGUF file or quantisation tag (or neither)."""

    repo: str
    revision: str | None = None
    file: str | None = None  # a .gguf path in the repository, or a quantisation tag like Q8_0

    def __str__(self) -> str:
        return (
            f"hf:{self.repo}"
            + (f"@{self.revision}" if self.revision else "")
            + (f":{self.file}" if self.file else "")
        )


_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def wanted(name: str) -> bool:
    """Whether a repository file is one the engine reads (FOLDER_FILES)."""
    return any(fnmatch.fnmatch(name, p) for p in FOLDER_FILES)


def parse_spec(spec: str) -> HubSpec | None:
    """The Hub model a spec names (``hf:...``, ``ORG/REPO[@REV]`` when no such path exists, or a
    catalogue name), or None for a local path."""
    spec = spec.strip()
    if spec in CATALOGUE:
        e = CATALOGUE[spec]
        return HubSpec(e.repo, None, e.file)
    explicit = spec.startswith("hf:")
    if not explicit and (
        Path(spec).expanduser().exists() or not _REPO.fullmatch(spec.split("@")[0])
    ):
        return None
    body = spec[3:] if explicit else spec
    repo, _, file = body.partition(":")
    repo, _, rev = repo.partition("@")
    if not _REPO.fullmatch(repo):
        raise ModelError(f"{spec!r}: expected hf:ORG/REPO[@REVISION][:FILE.gguf]")
    return HubSpec(repo, rev or None, file or None)


def served_name(spec: str) -> str | None:
    """The name an engine service gives the model a catalogue name or ``hf:`` spec resolves to
    (``config.model_name`` of its folder or file: the repository's name, or the GGUF file's
    stem), known without resolving it; None for a local path."""
    hub = parse_spec(spec)
    if hub is None:
        return None
    return Path(hub.file).stem if hub.file else hub.repo.rsplit("/", 1)[-1]


def pinned_spec(spec: str, path: Path) -> str | None:
    """``hf:ORG/REPO@COMMIT[:FILE]``: a Hub spec pinned to the snapshot ``path`` (what it resolved
    to here) is of, naming the file a GGUF repository resolved to, so that another machine
    resolving it gets the same files; None for a local path (or a path outside a Hub cache)."""
    hub = parse_spec(spec)
    if hub is None:
        return None
    for snapshot in (path, *path.parents):
        if snapshot.parent.name == "snapshots":
            break
    else:
        return None
    file = path.relative_to(snapshot).as_posix()
    return f"hf:{hub.repo}@{snapshot.name}" + (f":{file}" if file != "." else "")


# -- environment (read per call: huggingface_hub reads it once, at import) ------------------------


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def _hub_kw() -> dict[str, Any]:
    kw: dict[str, Any] = {"cache_dir": str(cache_dir())}
    if os.environ.get("HF_ENDPOINT"):
        kw["endpoint"] = os.environ["HF_ENDPOINT"].rstrip("/")
    if os.environ.get("HF_TOKEN"):
        kw["token"] = os.environ["HF_TOKEN"]
    return kw


def _api():
    from huggingface_hub import HfApi

    kw = _hub_kw()
    return HfApi(endpoint=kw.get("endpoint"), token=kw.get("token"))


def _progress_class(progress: Progress | None, what: str):
    """A tqdm class for huggingface_hub that also reports to ``progress`` (None: the plain bar)."""
    from tqdm.auto import tqdm

    if progress is None:
        return tqdm

    # huggingface_hub's download threads update the bytes bar concurrently: one lock orders the
    # reports, and only a count past the last one reported is passed on (never a step back)
    lock = threading.Lock()
    last = [-1]

    class Reporting(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = False
            kwargs["file"] = io.StringIO()  # the callback reports; no bar on stderr
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            with lock:
                out = super().update(n)
                done = int(self.n)
                if self.unit != "B" or done <= last[0]:
                    return out
                last[0] = done
                progress(done, int(self.total) if self.total else None, what)
            return out

    return Reporting


#: httpx's names for a Hub that cannot be reached (huggingface_hub may vendor httpx).
_NETWORK_ERRORS = {
    "ConnectError",
    "ConnectTimeout",
    "ReadTimeout",
    "TimeoutException",
    "NetworkError",
    "RemoteProtocolError",
    "ProxyError",
}


def _not_downloaded(spec: HubSpec) -> ModelError:
    why = "HF_HUB_OFFLINE is set" if offline() else "the Hub cannot be reached"
    return ModelError(
        f"{spec}: not downloaded yet and {why}; run `spark-lsp models pull {spec}` with a "
        "connection"
    )


def _hub_error(spec: HubSpec, e: Exception) -> ModelError:
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(e, GatedRepoError):
        return ModelError(
            f"{spec}: the repository is gated; accept its licence on the Hub and set HF_TOKEN"
        )
    if isinstance(e, RepositoryNotFoundError):
        return ModelError(f"{spec}: repository not found (or private: set HF_TOKEN)")
    if isinstance(e, RevisionNotFoundError):
        return ModelError(f"{spec}: revision {spec.revision!r} not found")
    if isinstance(e, LocalEntryNotFoundError):
        return _not_downloaded(spec)
    if isinstance(e, ConnectionError) or type(e).__name__ in _NETWORK_ERRORS:
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        return ModelError(
            f"{spec}: cannot reach the Hub at {endpoint} ({e}); check the connection "
            "(or HF_ENDPOINT); models already pulled work offline"
        )
    return ModelError(f"{spec}: download failed: {e}")


# -- resolving -------------------------------------------------------------------------------------


def resolve_model(
    spec: str | os.PathLike | None, *, progress: Progress | None = None, weights: bool = True
) -> Path | None:
    """The local path of a model spec (see the module docstring); None stays None (bundled model).

    A Hub model already in the cache is used without any network request; otherwise it is
    downloaded (``progress`` gets byte counts; None shows a progress bar on stderr).
    ``weights=False``: a folder model's configuration and tokenizer files only, for a client whose
    engine runs elsewhere (a GGUF file, which holds its tokenizer, is fetched whole)."""
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return None
    if isinstance(spec, os.PathLike):
        return Path(spec).expanduser()
    hub = parse_spec(spec)
    if hub is None:
        return Path(spec).expanduser()
    try:
        return _fetch(hub, progress, local_only=True, weights=weights)
    except ModelError:
        if offline():
            raise
    return _fetch(hub, progress, local_only=False, weights=weights)


def pull(spec: str, *, progress: Progress | None = None) -> Path:
    """Download (or complete, or update) a Hub model; its local path."""
    hub = parse_spec(spec)
    if hub is None:
        raise ModelError(
            f"{spec!r} is a local path, not a Hub model (expected NAME, ORG/REPO or hf:ORG/REPO)"
        )
    return _fetch(hub, progress, local_only=offline())


def _fetch(
    hub: HubSpec, progress: Progress | None, *, local_only: bool, weights: bool = True
) -> Path:
    from huggingface_hub import hf_hub_download, snapshot_download

    kw = _hub_kw()
    try:
        file = hub.file
        if file is None or not file.endswith(".gguf"):
            if local_only:
                files = [str(p) for p in _cached_snapshot_files(hub)]
            else:
                files = _repo_files(hub)
            if file is not None or "config.json" not in files:
                file = _pick_gguf(hub, files)
        if file is not None:
            path = hf_hub_download(
                hub.repo,
                file,
                revision=hub.revision,
                local_files_only=local_only,
                tqdm_class=_progress_class(progress, file),
                **kw,
            )
            return Path(path)
        path = snapshot_download(
            hub.repo,
            revision=hub.revision,
            allow_patterns=list(FOLDER_FILES if weights else NO_WEIGHTS),
            local_files_only=local_only,
            tqdm_class=_progress_class(progress, hub.repo),
            **kw,
        )
        folder = Path(path)
        _check_complete(hub, folder, weights)
        return folder
    except ModelError:
        raise
    except Exception as e:  # huggingface_hub's errors, httpx's, OSError
        raise _hub_error(hub, e) from None


def _check_complete(hub: HubSpec, folder: Path, weights: bool = True) -> None:
    """ModelError unless a snapshot holds a loadable folder (config, tokenizer and, with
    ``weights``, every shard)."""
    for name in ("config.json", "tokenizer.json"):
        if not (folder / name).is_file():
            raise ModelError(f"{hub}: {name} is missing from the downloaded snapshot")
    if not weights:
        return
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
        if not all((folder / s).is_file() for s in shards):
            raise ModelError(f"{hub}: some weight shards are missing from the downloaded snapshot")
    elif not (folder / "model.safetensors").is_file():
        raise ModelError(
            f"{hub}: no safetensors weights in the downloaded snapshot (a client of a remote "
            f"engine fetches the tokenizer only; `spark-lsp models pull {hub}` fetches them)"
        )


def _repo_files(hub: HubSpec) -> list[str]:
    info = _api().model_info(hub.repo, revision=hub.revision, files_metadata=False)
    return [s.rfilename for s in (info.siblings or [])]


def _pick_gguf(hub: HubSpec, files: list[str]) -> str:
    """The GGUF file a repository spec means: the tag's file, else llama.cpp's preference order."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if not ggufs:
        raise ModelError(f"{hub}: the repository has neither config.json nor .gguf files")
    tags = [hub.file] if hub.file else list(GGUF_PREFERENCE)
    for tag in tags:
        hits = sorted(f for f in ggufs if tag.lower() in f.lower() and "-of-" not in f)
        if hits:
            return hits[0]
    if hub.file:
        raise ModelError(
            f"{hub}: no .gguf file matches {hub.file!r}; files: {', '.join(sorted(ggufs))}"
        )
    return sorted(ggufs)[0]


def _cached_snapshot_files(hub: HubSpec) -> list[Path]:
    """Files (relative paths) of the newest cached snapshot of a repository."""
    root = cache_dir() / ("models--" + hub.repo.replace("/", "--")) / "snapshots"
    snaps = sorted(root.iterdir(), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    if not snaps:
        raise _not_downloaded(hub)
    return [p.relative_to(snaps[-1]) for p in snaps[-1].rglob("*") if p.is_file()]


# -- local models ---------------------------------------------------------------------------------


@dataclass
class LocalModel:
    """A model in the local Hub cache."""

    repo: str
    revision: str  # commit hash
    path: Path
    size: int  # bytes on disk
    architecture: str = "?"
    precision: str = "?"
    files: list[str] = field(default_factory=list)
    #: False for a configuration and tokenizer alone (what a client of a remote engine fetches)
    weights: bool = True


def list_models() -> list[LocalModel]:
    """Every model repository in the Hub cache, with its architecture and precision when readable."""
    from huggingface_hub import scan_cache_dir

    root = cache_dir()
    if not root.is_dir():
        return []
    out = []
    for repo in sorted(scan_cache_dir(root).repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.last_modified):
            m = LocalModel(
                repo.repo_id,
                rev.commit_hash,
                rev.snapshot_path,
                rev.size_on_disk,
                files=sorted(f.file_name for f in rev.files),
            )
            _describe(m)
            out.append(m)
    return out


def _describe(m: LocalModel) -> None:
    from .gguf import GGUFModel, default_precision

    try:
        ggufs = sorted(m.path.glob("*.gguf"))
        if ggufs:
            g = GGUFModel(ggufs[0])
            m.architecture, m.precision = g.arch, default_precision(g)
        elif (m.path / "config.json").is_file():
            raw = json.loads((m.path / "config.json").read_text(encoding="utf-8"))
            m.architecture = (raw.get("architectures") or ["?"])[0]
            m.precision = raw.get("dtype") or raw.get("torch_dtype") or "?"
            m.weights = any(m.path.glob("*.safetensors"))
    except (ModelError, OSError, ValueError):
        pass


def remove(spec: str) -> list[Path]:
    """Delete a Hub model (every revision) from the cache; the folders removed."""
    hub = parse_spec(spec)
    if hub is None:
        raise ModelError(
            f"{spec!r} is a local path; delete it yourself (spark-lsp only removes downloads)"
        )
    folder = cache_dir() / ("models--" + hub.repo.replace("/", "--"))
    if not folder.is_dir():
        raise ModelError(f"{hub.repo}: not in the model cache ({cache_dir()})")
    shutil.rmtree(folder)
    return [folder]


# -- memory before download -----------------------------------------------------------------------

#: Bytes per weight at each precision (MatMulNBits: codes + one float32 scale per block, and for
#: the asymmetric int4 default a 4-bit zero point per block).
BYTES_PER_WEIGHT = {"fp32": 4.0, "int8": 1 + 4 / 128, "int4": 0.5 + (4 + 0.5) / 32}


@dataclass
class ModelInfo:
    """What a model is and what it needs, from its config alone."""

    name: str
    config: ModelConfig
    parameters: int
    memory: dict[str, int]  # precision -> bytes of weights in the engine's graph
    kv_bytes_per_token: int
    file_size: int | None = None
    file_precision: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "architecture": self.config.architecture,
            "parameters": self.parameters,
            "memory_bytes": self.memory,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "file_size": self.file_size,
            "file_precision": self.file_precision,
            "context": self.config.max_position_embeddings,
        }


def estimate(config: ModelConfig) -> tuple[int, dict[str, int], int]:
    """(parameters, bytes of the engine's weights per precision, KV cache bytes per token).

    The token embedding stays float32 (a Gather reads one row per token); every linear, the LM
    head included, is stored at the precision; norms and biases are float32. A tied LM head reads
    the embedding table in place at fp32 (on a wafer grid, the default) and is its own quantised
    initializer at the other precisions."""
    from .graph import padded_head_dim
    from .weights import expected_shapes

    shapes = expected_shapes(config)
    embed = config.vocab_size * config.hidden_size
    linear = small = 0
    for name, shape in shapes.items():
        n = int(np.prod(shape, dtype=np.int64))
        if name == "model.embed_tokens.weight":
            continue
        if len(shape) == 2:
            linear += n
        else:
            small += n
    head = embed if config.tie_word_embeddings else 0  # a tied head, stored apart when quantised
    params = embed + linear + small
    memory = {
        p: int(4 * (embed + small) + b * linear + (0 if p == "fp32" else b * head))
        for p, b in BYTES_PER_WEIGHT.items()
    }
    kv = (
        2
        * config.num_hidden_layers
        * config.num_key_value_heads
        * padded_head_dim(config.head_dim)
        * 4
    )
    return params, memory, kv


def model_info(spec: str, *, progress: Progress | None = None) -> ModelInfo:
    """A model's size and memory needs, reading only its config.json or its GGUF header."""
    from .gguf import GGUFModel, default_precision, is_gguf

    hub = parse_spec(spec)
    if hub is None:
        path = Path(spec).expanduser()
        if is_gguf(path):
            g = GGUFModel(path)
            return _info(path.name, g.config(), path.stat().st_size, default_precision(g))
        return _info(path.name, load_config(path), None, None)
    kw = _hub_kw()
    try:
        files = [str(p) for p in _cached_snapshot_files(hub)] if offline() else _repo_files(hub)
        file = hub.file
        if file is None or not file.endswith(".gguf"):
            if file is not None or "config.json" not in files:
                file = _pick_gguf(hub, files)
        if file is None:
            from huggingface_hub import hf_hub_download

            if offline():
                folder = _fetch(hub, None, local_only=True)
                raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            else:  # config.json alone, outside the cache (a partial snapshot would look pulled)
                with tempfile.TemporaryDirectory() as tmp:
                    cfg = hf_hub_download(
                        hub.repo,
                        "config.json",
                        revision=hub.revision,
                        local_dir=tmp,
                        **{k: v for k, v in kw.items() if k != "cache_dir"},
                    )
                    raw = json.loads(Path(cfg).read_text(encoding="utf-8"))
            return _info(str(hub), parse_config(raw, path=f"{hub}/config.json"), None, None)
        if offline():
            path = _fetch(HubSpec(hub.repo, hub.revision, file), None, local_only=True)
            g = GGUFModel(path)
            return _info(
                f"{hub.repo}:{file}", g.config(), path.stat().st_size, default_precision(g)
            )
        return _remote_gguf_info(hub, file)
    except ModelError:
        raise
    except Exception as e:
        raise _hub_error(hub, e) from None


def _info(name: str, config: ModelConfig, size: int | None, precision: str | None) -> ModelInfo:
    params, memory, kv = estimate(config)
    return ModelInfo(name, config, params, memory, kv, size, precision)


def _remote_gguf_info(hub: HubSpec, file: str) -> ModelInfo:
    """Read a remote GGUF's header with HTTP range requests (doubling until it parses)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session

    from .gguf import GGUFModel, HeaderIncomplete, default_precision, parse_header

    kw = _hub_kw()
    url = hf_hub_url(hub.repo, file, revision=hub.revision, endpoint=kw.get("endpoint"))
    meta = get_hf_file_metadata(url, token=kw.get("token"))
    headers = build_hf_headers(token=kw.get("token"))
    want = 1 << 20
    while True:
        r = get_session().get(
            meta.location,
            headers={**headers, "Range": f"bytes=0-{want - 1}"},
            follow_redirects=True,
        )
        r.raise_for_status()
        try:
            fields, infos, _ = parse_header(r.content, complete=False)
            break
        except HeaderIncomplete:
            if want >= GGUF_HEADER_MAX or len(r.content) < want:
                raise ModelError(
                    f"{hub}:{file}: GGUF header larger than {GGUF_HEADER_MAX >> 20} MB"
                ) from None
            want *= 4
    g = GGUFModel.from_header(Path(file), fields, infos)
    return _info(f"{hub.repo}:{file}", g.config(), meta.size, default_precision(g))


def catalogue_rows() -> list[dict[str, str]]:
    return [
        {
            "name": e.name,
            "repository": e.repo + (f" : {e.file}" if e.file else ""),
            "parameters": e.params,
            "architecture": e.architecture,
            "fim": e.fim,
            "note": e.note,
        }
        for e in CATALOGUE.values()
    ]
