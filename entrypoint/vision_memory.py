"""The vision tower's memory, for the planner (VISION=true, issue 58).

Two things occupy the device beside the text model once the tower is loaded:

- the tower's weights: the bytes of the checkpoint's tensors under the tower's prefix
  (``model.visual.*``) when the weights are on this machine, else those the checkpoint's
  ``vision_config`` implies (`prepare.synthetic.vision_tensors`, the generator's tensor list:
  0.92 GB for Qwen3.8-27B's 27-block tower in bf16);
- the encoder cache: vLLM 0.28.0 keeps image embeddings for at most
  max(max_num_batched_tokens, the largest image's tokens) tokens
  (`vllm.v1.core.encoder_cache_manager.compute_mm_encoder_budget`), each ``out_hidden_size``
  values in bf16; the largest image is VISION_MAX_PIXELS over (patch x merge)^2 pixels a token.

With the tower in host memory (VISION_TOWER=host, patch 0087: the RTX 3090 profiles' default)
the device holds only what stays there (the patch and position embeddings) and, while an image
is encoded, one offloaded module at a time (a ViT block, or the merger: the largest, 90 MB).

Every shipped GPU profile pins its KV pool in bytes, sized for the text model on its machine, so
on a GPU the tower and the cache must come out of that pool: `vision_refusal` refuses the
profile's own pool and says the one that leaves room (and the context it then holds, by vLLM's
block layout as the plan read it). A pool the owner sets (KV_CACHE_MEMORY_BYTES) is taken as
meant. On the CPU platform the tower is host memory: counted and shown, never refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from core.checkpoint import open_checkpoint
from entrypoint.resolved_engine import ResolvedEngine
from prepare.synthetic import vision_shape_from_config, vision_tensors

# Where Qwen3-VL-family checkpoints keep the tower (the hub's names, and vLLM's own).
TOWER_PREFIXES = ("model.visual.", "visual.")
EMBEDDING_BYTES = 2  # the tower's output, bf16
# The modules patch 0087 keeps in host memory, each copied to the device for its own forward:
# a tensor name's match is the module it belongs to (one ViT block, or the merger).
OFFLOADED_MODULE = re.compile(r"^(?:model\.)?visual\.(blocks\.\d+|merger)\.")
TowerPlace = Literal["gpu", "host"]
TOWER_HOST_ENV = "QWEN38_VISION_TOWER_HOST"  # the engine's switch for patch 0087


class VisionMemory(BaseModel):
    """What VISION=true adds on the device, in bytes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tower_bytes: int  # the whole tower's weights
    tower_source: str  # where the figure came from, for people
    tower_place: TowerPlace  # VISION_TOWER: on the device, or in host memory (patch 0087)
    device_tower_bytes: int  # the most of the tower the device holds at once
    image_tokens: int  # the most one image becomes (VISION_MAX_PIXELS)
    encoder_cache_tokens: int
    encoder_cache_bytes: int

    @property
    def total_bytes(self) -> int:
        """What the device gives the tower and its cache."""
        return self.device_tower_bytes + self.encoder_cache_bytes


def checkpoint_tower_tensors(directory: Path) -> dict[str, int] | None:
    """The tensors under `TOWER_PREFIXES` in the safetensors of ``directory``, name -> bytes
    (None: no weights there to read, e.g. a config-only copy)."""
    if not any(directory.glob("*.safetensors")):
        return None
    checkpoint = open_checkpoint(directory, require_config=False)
    return {
        name: entry.nbytes
        for entries in checkpoint.shards.values()
        for name, entry in entries.items()
        if name.startswith(TOWER_PREFIXES)
    }


def checkpoint_tower_bytes(directory: Path) -> int | None:
    """Bytes of the tower's tensors in ``directory`` (None: no weights there)."""
    tensors = checkpoint_tower_tensors(directory)
    return None if tensors is None else sum(tensors.values())


def config_tower_tensors(vision_config: Mapping[str, Any]) -> dict[str, int]:
    """The tower ``vision_config`` describes, in bf16 (the generator's tensor list), name -> bytes."""
    return {t.name: t.nbytes for t in vision_tensors(vision_shape_from_config(dict(vision_config)))}


def config_tower_bytes(vision_config: Mapping[str, Any]) -> int:
    """Bytes of the tower ``vision_config`` describes, in bf16."""
    return sum(config_tower_tensors(vision_config).values())


def device_tower_bytes(tensors: Mapping[str, int], place: TowerPlace) -> int:
    """The most of the tower the device holds at once: all of it on the device; in host memory,
    what stays on the device plus the largest module copied over for its forward."""
    if place == "gpu":
        return sum(tensors.values())
    modules: dict[str, int] = {}
    resident = 0
    for name, nbytes in tensors.items():
        match = OFFLOADED_MODULE.match(name)
        if match is None:
            resident += nbytes
        else:
            modules[match.group(1)] = modules.get(match.group(1), 0) + nbytes
    return resident + max(modules.values(), default=0)


def image_tokens(max_pixels: int, vision_config: Mapping[str, Any]) -> int:
    """Tokens of the largest image: one per (patch x merge)^2 pixels (vLLM's smart resize keeps
    an image at most ``max_pixels``)."""
    side = vision_config["patch_size"] * vision_config["spatial_merge_size"]
    return max_pixels // (side * side)


def vision_memory(
    resolved: ResolvedEngine, target_config: Mapping[str, Any], config_path: Path, batched_tokens: int
) -> VisionMemory | None:
    """What the tower and its cache take for ``resolved`` (None: VISION off). ``config_path`` is
    the target config.json the planner read: beside the weights, or the config-only copy."""
    if resolved.vision is None or not target_config.get("vision_config"):
        return None
    vision_config = target_config["vision_config"]
    tensors = checkpoint_tower_tensors(config_path.parent)
    if tensors is not None:
        source = f"tensors {TOWER_PREFIXES[0]}* of {config_path.parent}"
    else:
        tensors, source = config_tower_tensors(vision_config), f"vision_config of {config_path}"
    largest = image_tokens(resolved.vision.max_pixels, vision_config)
    cache_tokens = max(batched_tokens, largest)
    # On the CPU platform every byte is host memory: the place changes nothing there.
    place = resolved.vision.tower if resolved.platform == "cuda" else "gpu"
    return VisionMemory(
        tower_bytes=sum(tensors.values()),
        tower_source=source,
        tower_place=place,
        device_tower_bytes=device_tower_bytes(tensors, place),
        image_tokens=largest,
        encoder_cache_tokens=cache_tokens,
        encoder_cache_bytes=cache_tokens * vision_config["out_hidden_size"] * EMBEDDING_BYTES,
    )


def pool_for_vision(pool_bytes: int, memory: VisionMemory) -> int:
    """The KV pool that leaves the text model's budget as it was: the pool less the tower and cache."""
    return max(0, pool_bytes - memory.total_bytes)


def vision_refusal(resolved: ResolvedEngine, memory: VisionMemory | None, longest_with_less: int | None) -> str | None:
    """One line when VISION=true cannot run on the profile's own pool (GPU profiles); else None.

    ``longest_with_less`` is the longest request the smaller pool (`pool_for_vision`) holds, by
    the plan's block layout."""
    if memory is None or resolved.platform != "cuda" or "kv_cache_memory_bytes" in resolved.overridden:
        return None
    pool = resolved.kv_cache_memory_bytes or 0
    smaller = pool_for_vision(pool, memory)
    holds = (
        f"it holds requests of up to {longest_with_less:,} tokens at this layout"
        + ("" if (longest_with_less or 0) >= resolved.max_model_len else
           f", so set MAX_MODEL_LEN={longest_with_less:,} too")
        if longest_with_less
        else "too small for any request: leave VISION off on this profile"
    )
    tower = (f"the vision tower ({memory.tower_bytes:,} bytes, {memory.tower_source})" if memory.tower_place == "gpu"
             else f"the vision tower's part on the device ({memory.device_tower_bytes:,} of its {memory.tower_bytes:,} "
                  f"bytes with VISION_TOWER=host, {memory.tower_source})")
    return (
        f"VISION=true: profile {resolved.profile}'s KV pool ({pool:,} bytes) is sized for the text model alone; "
        f"{tower} and the encoder cache "
        f"({memory.encoder_cache_bytes:,} bytes: {memory.encoder_cache_tokens:,} tokens) need "
        f"{memory.total_bytes:,} of it: set KV_CACHE_MEMORY_BYTES={smaller} ({holds})"
    )
