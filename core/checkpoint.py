"""A Hugging Face checkpoint directory, read without loading any tensor.

``open_checkpoint(dir)`` reads ``config.json``, the shard index
(``model.safetensors.index.json``) or the single ``model.safetensors``, and every shard's
header, and checks they agree: each indexed tensor is in the shard the index names, and
each shard holds only indexed tensors. Tensor bytes are read later, a block at a time,
through `core.safetensors_stream`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import PrepareError
from core.safetensors_stream import TensorEntry, read_header

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a (possibly multimodal) config.json: its ``text_config``, else itself."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


@dataclass(frozen=True)
class Checkpoint:
    root: Path
    config: dict[str, Any]
    index: dict[str, Any] | None  # None for a single-file checkpoint
    shards: dict[str, dict[str, TensorEntry]]  # shard file name -> its tensors
    shard_metadata: dict[str, dict[str, str]]  # shard file name -> its __metadata__

    @property
    def weight_map(self) -> dict[str, str]:
        return {name: shard for shard, entries in self.shards.items() for name in entries}

    def entry(self, name: str) -> TensorEntry:
        for entries in self.shards.values():
            if name in entries:
                return entries[name]
        raise KeyError(name)

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


def open_checkpoint(root: Path | str) -> Checkpoint:
    root = Path(root)
    if not root.is_dir():
        raise PrepareError(f"{root}: no such checkpoint directory; pass the downloaded model directory")
    try:
        config = read_json(root / CONFIG_NAME)
    except FileNotFoundError:
        raise PrepareError(f"{root / CONFIG_NAME}: missing; a checkpoint directory needs its config.json") from None
    if not isinstance(config, dict):
        raise PrepareError(f"{root / CONFIG_NAME}: expected a JSON object")

    index: dict[str, Any] | None
    if (root / INDEX_NAME).is_file():
        index = read_json(root / INDEX_NAME)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise PrepareError(f"{root / INDEX_NAME}: no weight_map; re-download the checkpoint")
        shard_names = sorted(set(weight_map.values()))
    elif (root / SINGLE_NAME).is_file():
        index, weight_map, shard_names = None, None, [SINGLE_NAME]
    else:
        raise PrepareError(f"{root}: neither {INDEX_NAME} nor {SINGLE_NAME}; not a safetensors checkpoint")

    shards: dict[str, dict[str, TensorEntry]] = {}
    metadata: dict[str, dict[str, str]] = {}
    for shard in shard_names:
        path = root / shard
        if "/" in shard or shard.startswith(".") or not path.is_file():
            raise PrepareError(f"{root / INDEX_NAME}: names shard {shard!r}, which is not a file of {root}")
        metadata[shard], shards[shard] = read_header(path)

    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in shards[shard]:
                raise PrepareError(f"{root / INDEX_NAME}: maps {name} to {shard}, which does not hold it")
        for shard, entries in shards.items():
            extra = sorted(set(entries) - {n for n, s in weight_map.items() if s == shard})
            if extra:
                raise PrepareError(f"{root / shard}: holds tensors the index does not list ({', '.join(extra[:3])})")
    return Checkpoint(root=root, config=config, index=index, shards=shards, shard_metadata=metadata)
