"""A Hugging Face checkpoint directory, read without loading any tensor: the one reader.

``open_checkpoint(dir)`` reads ``config.json``, the shards' map and every shard's header
(`core.safetensors_stream.read_header`), and checks they agree. The shards are those the
index (``model.safetensors.index.json``) names, else the single ``model.safetensors``,
else every ``*.safetensors`` file of the directory (a scan: a tensor in two of them is
refused). With an index, each indexed tensor must be in the shard the index names, and
each shard must hold only indexed tensors. Tensor bytes are read later, a block at a
time, through `core.safetensors_stream`. `text_config` is the one place that picks the
language model's part of a (possibly multimodal) config, and `indexed_shards` lists the
shards an index names without judging it (for a caller that checks the files by hash).
Checkpoints are written by `prepare.checkpoint_writer`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from core.errors import PrepareError
from core.safetensors_stream import TensorEntry, read_header

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SHARD_SUFFIX = ".safetensors"


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a (possibly multimodal) config.json: its ``text_config``, else itself."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


@dataclass(frozen=True)
class Checkpoint:
    root: Path
    config: dict[str, Any]  # {} when opened with require_config=False and there is none
    index: dict[str, Any] | None  # None: no index file (one model.safetensors, or a scan)
    shards: dict[str, dict[str, TensorEntry]]  # shard file name -> its tensors
    shard_metadata: dict[str, dict[str, str]]  # shard file name -> its __metadata__

    @property
    def source(self) -> Literal["index", "scan"]:
        """How the shards were found: named by the index, or found in the directory."""
        return "index" if self.index is not None else "scan"

    @cached_property
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> the shard file holding it."""
        return {name: shard for shard, entries in self.shards.items() for name in entries}

    @property
    def text_config(self) -> Mapping[str, Any]:
        """config.json's language-model part (`text_config` of a VL config, else itself)."""
        return text_config(self.config)

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def entry(self, name: str) -> TensorEntry:
        return self.shards[self.weight_map[name]][name]

    def shard_path(self, name: str) -> Path:
        """The shard file holding tensor ``name``."""
        return self.root / self.weight_map[name]

    def linear_module_names(self) -> set[str]:
        """Modules a quantization config can target: a 2-D ``.weight`` or a ``.weight_packed``.

        (Norms have 1-D weights; ``a.b.weight`` -> module ``a.b``.)
        """
        modules = set()
        for shard in self.shards.values():
            for name, entry in shard.items():
                if name.endswith(".weight_packed") or (name.endswith(".weight") and len(entry.shape) == 2):
                    modules.add(name.rsplit(".", 1)[0])
        return modules


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PrepareError(f"{path}: cannot read JSON ({exc}); re-download the checkpoint") from exc


def indexed_shards(index_path: Path) -> set[str]:
    """The shard file names a safetensors index (``*.index.json``) maps tensors to; empty
    when it cannot be read or has no ``weight_map`` (a caller that hashes the index reports
    a damaged one; `open_checkpoint` refuses it)."""
    try:
        data = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    return {str(name) for name in weight_map.values()} if isinstance(weight_map, dict) else set()


def _read_config(root: Path, required: bool) -> dict[str, Any]:
    try:
        config = read_json(root / CONFIG_NAME)
    except FileNotFoundError:
        if not required:
            return {}
        raise PrepareError(f"{root / CONFIG_NAME}: missing; a checkpoint directory needs its config.json") from None
    if not isinstance(config, dict):
        raise PrepareError(f"{root / CONFIG_NAME}: expected a JSON object")
    return config


def open_checkpoint(root: Path | str, *, require_config: bool = True) -> Checkpoint:
    """Read ``root``'s config, shard map and shard headers (no tensor data); `PrepareError` on any mismatch.

    ``require_config=False`` opens a weights-only directory (its ``config`` is then ``{}``).
    """
    root = Path(root)
    if not root.is_dir():
        raise PrepareError(f"{root}: no such checkpoint directory; pass the downloaded model directory")
    config = _read_config(root, require_config)

    index: dict[str, Any] | None = None
    weight_map: dict[str, str] | None = None
    if (root / INDEX_NAME).is_file():
        index = read_json(root / INDEX_NAME)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise PrepareError(f"{root / INDEX_NAME}: no weight_map; re-download the checkpoint")
        shard_names = sorted(set(weight_map.values()))
    elif (root / SINGLE_NAME).is_file():
        shard_names = [SINGLE_NAME]
    else:
        shard_names = sorted(p.name for p in root.glob(f"*{SHARD_SUFFIX}") if p.is_file())
        if not shard_names:
            raise PrepareError(
                f"{root}: neither {INDEX_NAME} nor any *{SHARD_SUFFIX} file; not a safetensors checkpoint"
            )

    shards: dict[str, dict[str, TensorEntry]] = {}
    metadata: dict[str, dict[str, str]] = {}
    seen: dict[str, str] = {}
    for shard in shard_names:
        if not isinstance(shard, str) or "/" in shard or shard.startswith(".") or not (path := root / shard).is_file():
            raise PrepareError(f"{root / INDEX_NAME}: names shard {shard!r}, which is not a file of {root}")
        metadata[shard], shards[shard] = read_header(path)
        if weight_map is None:
            for name in shards[shard]:
                if name in seen:
                    raise PrepareError(f"{root}: tensor {name!r} is in both {seen[name]} and {shard}")
                seen[name] = shard

    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in shards[shard]:
                raise PrepareError(f"{root / INDEX_NAME}: maps {name} to {shard}, which does not hold it")
        for shard, entries in shards.items():
            extra = sorted(set(entries) - {n for n, s in weight_map.items() if s == shard})
            if extra:
                raise PrepareError(f"{root / shard}: holds tensors the index does not list ({', '.join(extra[:3])})")
    return Checkpoint(root=root, config=config, index=index, shards=shards, shard_metadata=metadata)
