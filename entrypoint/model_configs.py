"""The config.json files that give a resolved engine's models their shapes.

A model's shapes come from the served directory's config.json when it exists, else from
the config-only copy in ``profiles/model-configs/<artifact>/`` (so a GPU profile can be
planned on a machine that never downloaded its 20 GB). The planner hands vLLM a copy
without the weight quantization (it does not change the KV cache), and the plan cache key
hashes the text read here. `check_model_limits` refuses, from the same config.json, values
the model itself cannot take (a context above its position limit) before anything as slow
as vLLM is started.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.checkpoint import text_config
from core.errors import PlanError, ProfileError, SettingsError
from core.profiles import PROFILES_DIR, ModelSlot, Profile
from entrypoint.resolved_engine import ResolvedEngine

MODEL_CONFIGS_DIR = PROFILES_DIR / "model-configs"


@dataclass(frozen=True)
class ModelConfig:
    """One model's config.json: where it was read and what it says."""

    path: Path
    text: str

    @property
    def data(self) -> dict[str, Any]:
        return json.loads(self.text)


@dataclass(frozen=True)
class ModelConfigs:
    """The configs a resolved engine reads: the target, and the drafter when it runs."""

    target: ModelConfig
    drafter: ModelConfig | None

    def sources(self) -> dict[str, str]:
        found = {"target": str(self.target.path)}
        if self.drafter is not None:
            found["drafter"] = str(self.drafter.path)
        return found


def config_source(slot: ModelSlot, models_dir: Path) -> Path:
    """config.json of the served directory, else the artifact's config-only copy."""
    served = models_dir / slot.dir / "config.json"
    if served.is_file():
        return served
    if slot.artifact is not None:
        copy = MODEL_CONFIGS_DIR / slot.artifact / "config.json"
        if copy.is_file():
            return copy
    missing = f"neither {served} nor {MODEL_CONFIGS_DIR / slot.artifact / 'config.json'} exists" if slot.artifact \
        else f"{served} does not exist"
    raise PlanError(f"no config.json for model dir {slot.dir!r}: {missing}; prepare the model first")


def _read(path: Path) -> ModelConfig:
    text = path.read_text(encoding="utf-8")
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"{path}: not valid JSON ({exc})") from None
    return ModelConfig(path, text)


def read_model_configs(profile: Profile, resolved: ResolvedEngine, models_dir: Path) -> ModelConfigs:
    """The target's config, and the drafter's when the resolved engine drafts with it."""
    target = _read(config_source(profile.models.target, Path(models_dir)))
    drafter = None
    if resolved.speculative is not None and resolved.speculative.drafter_dir and profile.models.drafter:
        drafter = _read(config_source(profile.models.drafter, Path(models_dir)))
    return ModelConfigs(target, drafter)


def shape_only_copy(config: ModelConfig, dest: Path) -> str:
    """The config without weight quantization, alone in directory ``dest`` (returned)."""
    data = config.data
    data.pop("quantization_config", None)
    if isinstance(data.get("text_config"), dict):
        data["text_config"].pop("quantization_config", None)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    return str(dest)


# ---- what the model itself allows (from its config.json; pure) -------------------------


def max_positions(config: Mapping[str, Any]) -> int | None:
    """The longest context the model's position encoding is declared for, or None if the
    config does not say. vLLM derives its own limit (and refuses above it); this bound is
    never below vLLM's: the declared positions times the largest RoPE scaling factor."""
    text = text_config(config)
    positions = [text.get("max_position_embeddings")]
    factor = 1.0
    for key in ("rope_parameters", "rope_scaling"):
        params = text.get(key)
        if not isinstance(params, Mapping):
            continue
        nested = params.values() if all(isinstance(v, Mapping) for v in params.values()) and params else [params]
        for entry in nested:
            factor = max(factor, float(entry.get("factor") or 1.0))
            positions.append(entry.get("original_max_position_embeddings"))
    known = [int(p) for p in positions if isinstance(p, int) and p > 0]
    return int(max(known) * factor) if known else None


def check_model_limits(
    resolved: ResolvedEngine,
    target: Mapping[str, Any],
    *,
    target_source: str = "the target's config.json",
) -> None:
    """Refuse, in one line, what the models cannot run, before any planning."""
    limit = max_positions(target)
    allow_long = (resolved.env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") or "").lower() in ("1", "true")
    if limit is not None and resolved.max_model_len > limit and not allow_long:
        error = SettingsError if "max_model_len" in resolved.overridden else ProfileError
        raise error(
            f"{resolved.origin('max_model_len')}: above the {limit:,} positions the model is made for "
            f"({target_source}); use at most {limit:,}"
        )
    spec = resolved.speculative
    if spec is not None and spec.method == "mtp" and not text_config(target).get("mtp_num_hidden_layers"):
        error = SettingsError if "speculation" in resolved.overridden else ProfileError
        raise error(
            f"profile {resolved.profile}: speculation mtp needs the target's MTP head, and {target_source} "
            "declares none (no mtp_num_hidden_layers); choose SPECULATION=dflash or off"
        )
    if resolved.vision is not None and not target.get("vision_config"):
        raise SettingsError(
            f"VISION=true: profile {resolved.profile}'s target has no vision tower (no vision_config in "
            f"{target_source}); serve a vision-language checkpoint (Qwen3_5ForConditionalGeneration) or unset VISION"
        )
