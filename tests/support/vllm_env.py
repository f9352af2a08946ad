"""The environment of a vLLM 0.28.0 child process (CPU build) that a test starts directly.

`qwen38 serve --profile cpu` (tests/conftest.py) serves what a profile renders; the adapter's
end-to-end test also runs engines no profile describes (the base without LoRA, a projected
base), offline in a child (tests/support/lora_probe.py), with the engine in-process, as
profiles/cpu.toml runs it. Its vLLM cache is best the session's
(`tests.support.session_cache.session_vllm_cache`): the model information the servers' planner left there
spares the child vLLM's inspection of the model class in a Python of its own (~8 s of one
core); every entry is keyed by what it depends on.
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
