"""Models already on this machine: the default model's package and the Hugging Face cache.

A model argument may be a path, the name of a GGUF file found here (``SmolLM2-135M-Instruct.Q4_1``
or with ``.gguf``), or a Hugging Face repo id (``org/name``) whose files are in the local
Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``).
Nothing is ever downloaded: a repo id that is not in the cache is an error that says how to get it.
"""

from __future__ import annotations

import collections
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hybridllm.errors import HybridLLMError, ModelLoadError
from hybridllm.loading.gguf import GGUFFile
from hybridllm.loading.hf_config import read_hf_config

GGUF_SUFFIX = ".gguf"


@dataclass(frozen=True)
class LocalModel:
    """One model found on this machine.

    Attributes:
        name: the model's name (:func:`model_name`: what the server and chat call it), which
            ``--model`` also takes: a GGUF file's name without ``.gguf``, a cached folder's repo id.
        path: the GGUF file or the Hugging Face folder.
        source: "default model" or "huggingface cache".
        file_format: "gguf" or "safetensors".
        size_bytes: bytes on disk (the weights).
        architecture: the model's architecture as the file names it ("llama", "qwen2", ...).
        weight_type: the tensor type holding most of the bytes ("Q4_1", "F16", ...).
    """

    name: str
    path: Path
    source: str
    file_format: str
    size_bytes: int
    architecture: str
    weight_type: str

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["path"] = str(self.path)
        return out


def model_name(path: str | os.PathLike) -> str:
    """A model's one name, as ``hybridllm models`` lists it, the server serves it (its model id)
    and chat greets with it: a GGUF (or safetensors) file's name without its suffix
    (``SmolLM2-135M-Instruct.Q4_1``), a Hugging Face cache snapshot folder's repo id
    (``org/name``), else the folder's name. Never the file's own ``general.name`` metadata."""
    p = Path(path)
    if p.suffix in (GGUF_SUFFIX, ".safetensors"):
        return p.stem
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return repo_id_of(p.parent.parent)
    return p.name


def repo_id_of(repo_folder: Path) -> str:
    """``models--org--name`` (a Hugging Face cache repo folder) -> ``org/name``."""
    return repo_folder.name.removeprefix("models--").replace("--", "/", 1)


def hf_hub_dir() -> Path:
    """The Hugging Face hub cache folder this machine uses (it may not exist)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or "~/.cache/huggingface"
    return Path(home).expanduser() / "hub"


def repo_snapshot(repo_id: str, hub: Path | None = None) -> Path | None:
    """The cached snapshot folder of ``repo_id`` (the one ``refs/main`` names, else the newest)."""
    repo = (hub or hf_hub_dir()) / f"models--{repo_id.replace('/', '--')}"
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    main = repo / "refs" / "main"
    if main.is_file() and (snapshots / main.read_text().strip()).is_dir():
        return snapshots / main.read_text().strip()
    candidates = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    return candidates[-1] if candidates else None


def snapshot_model(snapshot: Path) -> Path | None:
    """The model inside a snapshot folder: its one GGUF file, or the folder itself when it holds
    a ``config.json`` and safetensors. Raises ModelLoadError when several GGUF files leave the
    choice open."""
    ggufs = sorted(snapshot.rglob(f"*{GGUF_SUFFIX}"))
    if len(ggufs) == 1:
        return ggufs[0]
    if len(ggufs) > 1:
        names = ", ".join(str(p.relative_to(snapshot)) for p in ggufs[:4])
        raise ModelLoadError(f"{snapshot} holds several GGUF files ({names}); pass the one you want as a path")
    return snapshot if is_hf_folder(snapshot) else None


def is_hf_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a Hugging Face model (a ``config.json`` and safetensors)."""
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def find_model(name: str, default_model: Path | None = None) -> Path:
    """The path a model argument that is not a path names (a repo id or a GGUF name).

    Raises:
        ModelLoadError: nothing of that name on this machine, with what to do about it.
    """
    if name.count("/") == 1 and not name.startswith(("/", ".", "~")):
        snapshot = repo_snapshot(name)
        model = snapshot_model(snapshot) if snapshot is not None else None
        if model is not None:
            return model
        raise ModelLoadError(
            f"model not found: {name} is neither a file nor a model in the local Hugging Face cache "
            f"({hf_hub_dir()}); hybridllm never downloads: fetch it first (huggingface-cli download {name}) "
            f"or pass the path of a GGUF file or a Hugging Face folder")
    wanted = name if name.endswith(GGUF_SUFFIX) else name + GGUF_SUFFIX
    for _name, path, _source in model_paths(default_model):
        if path.name == wanted:
            return path
    raise ModelLoadError(f"model not found: {name} (no such file, and no GGUF of that name in the default "
                         f"model's package or the Hugging Face cache; `hybridllm models` lists what is here)")


def model_paths(default_model: Path | None = None) -> list[tuple[str, Path, str]]:
    """(name, path, source) of every model found, without reading any of them: the default model
    (``default_model``, when installed) first, then the Hugging Face cache's repos, by name."""
    found: list[tuple[str, Path, str]] = []
    if default_model is not None and default_model.is_file():
        found.append((model_name(default_model), default_model, "default model"))
    hub = hf_hub_dir()
    if hub.is_dir():
        for repo in sorted(hub.glob("models--*")):
            snapshot = repo_snapshot(repo_id_of(repo), hub)
            if snapshot is None:
                continue
            ggufs = sorted(snapshot.rglob(f"*{GGUF_SUFFIX}"))
            for gguf in ggufs:
                found.append((model_name(gguf), gguf, "huggingface cache"))
            if not ggufs and is_hf_folder(snapshot):
                found.append((model_name(snapshot), snapshot, "huggingface cache"))
    return found


def local_models(default_model: Path | None = None) -> list[LocalModel]:
    """Every model found (:func:`model_paths`), described from its header or config."""
    return [describe(path, name, source) for name, path, source in model_paths(default_model)]


def describe(path: Path, name: str, source: str) -> LocalModel:
    """A :class:`LocalModel` for a GGUF file or a Hugging Face folder (its header or config only)."""
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        try:
            raw = read_hf_config(path / "config.json")
            architecture = str(raw.get("model_type", "?"))
            weight_type = str(raw.get("torch_dtype", "?"))
        except HybridLLMError as exc:
            architecture, weight_type = f"unreadable: {exc}", "?"
        return LocalModel(name, path, source, "safetensors", size, architecture, weight_type)
    size = path.stat().st_size
    try:
        gguf = GGUFFile(path, header_only=True)
        try:
            architecture = str(gguf.metadata.get("general.architecture", "?"))
            by_type: collections.Counter[str] = collections.Counter()
            for tensor in gguf.tensors.values():
                by_type[tensor.type_name] += tensor.nbytes
            weight_type = by_type.most_common(1)[0][0] if by_type else "?"
        finally:
            gguf.close()
    except HybridLLMError as exc:
        architecture, weight_type = f"unreadable: {str(exc).splitlines()[0]}", "?"
    return LocalModel(name, path, source, "gguf", size, architecture, weight_type)
