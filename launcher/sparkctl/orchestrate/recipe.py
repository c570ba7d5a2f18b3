"""`sparkctl recipe new`'s reading: a checkpoint's config.json (+ quantization_config.json) and its shard bytes,
from a folder on this machine or from the Hugging Face Hub without downloading a weight (config.json by
`hf_hub_download`, the shard sizes from the repo's file listing). The choices: spec/recipe_new.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..spec.planner import read_checkpoint
from ..spec.recipe_new import ModelSource

#: (repo, filename) -> a local path of that file, or None when the repo has no such file.
Downloader = Callable[[str, str], "Path | None"]
#: repo -> {file name: size in bytes} of every file in the repo.
Lister = Callable[[str], dict[str, int]]


def read_local(folder: Path) -> ModelSource:
    """config.json, quantization_config.json and the shard sizes of a checkpoint folder on this machine."""
    info = read_checkpoint(folder)
    quant = folder / "quantization_config.json"
    return ModelSource(config=info.config, weight_bytes=info.index_total_size or info.shard_bytes,
                       where=str(folder), quant_file=_json_or_none(quant))


def _json_or_none(path: Path | None) -> dict[str, Any] | None:
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: not valid JSON ({exc})") from None
    return data if isinstance(data, dict) else None


def hub_downloader(repo: str, filename: str) -> Path | None:  # pragma: no cover - needs the network
    """huggingface_hub's hf_hub_download of one small file (None when the repo has none)."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError
    except ImportError:
        raise UsageError("recipe new --model REPO needs huggingface_hub on this machine",
                         fix="pip install huggingface_hub, or download config.json and pass its folder") from None
    try:
        return Path(hf_hub_download(repo, filename))
    except EntryNotFoundError:
        return None


def hub_lister(repo: str) -> dict[str, int]:  # pragma: no cover - needs the network
    """The repo's files and their sizes, from the Hub's listing (no download)."""
    from huggingface_hub import HfApi

    info = HfApi().model_info(repo, files_metadata=True)
    return {s.rfilename: int(s.size or 0) for s in info.siblings or []}


def read_hub(repo: str, download: Downloader = hub_downloader, listing: Lister = hub_lister) -> ModelSource:
    """config.json (+ quantization_config.json) and the *.safetensors sizes of a Hub repo, no weight fetched."""
    config_path = download(repo, "config.json")
    config = _json_or_none(config_path)
    if config is None:
        raise UsageError(f"hf://{repo}: no config.json (or not a JSON object)",
                         fix="--model must name a model repo (org/name) or a checkpoint folder")
    files = listing(repo)
    weights = sum(size for name, size in files.items() if name.endswith(".safetensors"))
    if weights <= 0:
        raise UsageError(f"hf://{repo}: the repo lists no *.safetensors files, so the weights cannot be planned")
    quant = _json_or_none(download(repo, "quantization_config.json")) if "quantization_config.json" in files else None
    return ModelSource(config=config, weight_bytes=weights, where=f"hf://{repo}", repo=repo, quant_file=quant)


def read_model(model: str, download: Downloader | None = None, listing: Lister | None = None) -> ModelSource:
    """A folder when MODEL is one on this machine, else a Hub repo id (org/name) (default: the real Hub)."""
    path = Path(model)
    if path.is_dir():
        return read_local(path)
    if model.count("/") == 1 and not model.startswith((".", "/")):
        return read_hub(model, download or hub_downloader, listing or hub_lister)
    raise UsageError(f"--model {model}: not a folder on this machine and not a Hub repo id (org/name)",
                     fix="pass the checkpoint folder holding config.json, or the model's Hub repo id (org/name)")
