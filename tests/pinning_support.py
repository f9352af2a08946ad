"""Helpers and fixtures shared by the pinning tests (imported by each test module, so they
never collide with another branch's conftest): real safetensors model directories, profiles,
settings pointing into tmp_path, and the local hub-style server."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from core.profiles import Profile
from core.settings import Settings
from prepare.checkpoint_writer import write_checkpoint
from tests.hub_server import FakeHub


def write_model_files(directory: Path, *, shards: int = 2, seed: int = 0, width: int = 64) -> dict[str, bytes]:
    """A small model directory in the real formats: config, safetensors shards and their index."""
    rng = np.random.default_rng(seed)
    write_checkpoint(
        directory,
        {
            f"model-{i + 1:05d}-of-{shards:05d}.safetensors": {
                f"model.layers.{i}.mlp.down_proj.weight": rng.standard_normal((width, width)).astype(np.float32),
                f"model.layers.{i}.input_layernorm.weight": np.ones(width, dtype=np.float32),
            }
            for i in range(shards)
        },
        config={"architectures": ["Qwen3ForCausalLM"], "hidden_size": width},
        index=True,
    )
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def make_profile(models: dict, *, name: str = "test", require_patches: bool = False, **served) -> Profile:
    data = {
        "name": name,
        "description": "test profile",
        "platform": "cpu",
        "machine": "any",
        "require_patches": require_patches,
        "served": {"base": "base", **served},
        "models": models,
        "engine": {"max_model_len": 4096, "max_num_seqs": 2},
    }
    if "drafter" in models:
        data["speculative"] = {"method": "dflash", "num_speculative_tokens": 7}
    if "adapter" in models:
        data["served"]["adapter"] = "base-adapter"
        data["lora"] = {"max_lora_rank": 1}
    return Profile.model_validate(data)


def make_settings(root: Path) -> Settings:
    # model_construct: the profile name is irrelevant to what verify/download read
    # (models_dir, cache_dir), and no profile file exists on this branch.
    return Settings.model_construct(models_dir=root / "models", cache_dir=root / "cache")


def age(path: Path, seconds: float = 3600) -> None:
    """Put a file's mtime in the past (ctime still moves: the kernel sets it)."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - int(seconds * 1e9)))


@pytest.fixture
def no_racy_window(monkeypatch):
    """Files written by a test are hashed within the racy window; allow trusting them."""
    import core.stat_cache

    monkeypatch.setattr(core.stat_cache, "RACY_WINDOW_NS", 0)


@pytest.fixture
def hub():
    server = FakeHub().start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def hf_isolated(tmp_path_factory, monkeypatch):
    # Never touch the user's HF cache or token, never phone home.
    home = tmp_path_factory.mktemp("hf-home")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
