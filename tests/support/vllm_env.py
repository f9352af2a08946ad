"""The environment of a vLLM 0.28.0 child process (CPU build) that a test starts directly.

`qwen38 serve --profile cpu` (tests/conftest.py) serves what a profile renders; the adapter's
end-to-end test also runs engines no profile describes (the base without LoRA, a projected
base), offline in a child (tests/support/lora_probe.py), with its own vLLM cache and the
engine in-process, as profiles/cpu.toml runs it.
"""

from __future__ import annotations

import os
from pathlib import Path


def vllm_child_env(cache_root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_CACHE_ROOT"] = str(cache_root)
    env["PYTHONUNBUFFERED"] = "1"
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the CPU worker in the engine core, as profiles/cpu.toml runs it
    return env
