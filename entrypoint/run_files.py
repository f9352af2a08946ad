"""The run directory: what one start of `qwen38 serve` keeps on disk, and where.

Run files, in ``CACHE_DIR/run/`` (`run_dir`), one set per profile; every function here takes
the ``CACHE_DIR`` (`Settings.cache_dir`):

- ``<profile>.lock`` (`lock_path`): an exclusive ``flock`` the supervisor holds for its whole
  life (`entrypoint.lifecycle.RunLock`). A second start for the same profile and cache
  refuses; the kernel drops the lock when the supervisor dies, even by SIGKILL, so a held lock
  always means a live supervisor.
- ``<profile>.run.json`` (`record_path`): this start's instance id, the supervisor's and the
  engine's pid and kernel start time (`entrypoint.lifecycle.RunRecord`).
- ``<profile>.status.json`` (`status_path`): the readiness verdict (`entrypoint.ready`); removed
  before anything else at every start, so a failed launch never leaves an old ``ready: true``.
- ``<profile>.vllm.yaml`` (`config_path`): the ``--config`` vLLM runs with
  (`entrypoint.launch.render_invocation`), written once the plan passed.
"""

from __future__ import annotations

from pathlib import Path

STATUS_SUFFIX = ".status.json"


def run_dir(cache_dir: Path | str) -> Path:
    return (Path(cache_dir) / "run").absolute()


def lock_path(cache_dir: Path | str, profile: str) -> Path:
    return run_dir(cache_dir) / f"{profile}.lock"


def record_path(cache_dir: Path | str, profile: str) -> Path:
    return run_dir(cache_dir) / f"{profile}.run.json"


def status_path(cache_dir: Path | str, profile: str) -> Path:
    return run_dir(cache_dir) / f"{profile}{STATUS_SUFFIX}"


def statuses(cache_dir: Path | str) -> list[tuple[str, Path]]:
    """(profile, its status file) for every readiness status in the run directory, by name."""
    found = sorted(run_dir(cache_dir).glob(f"*{STATUS_SUFFIX}"))
    return [(path.name.removesuffix(STATUS_SUFFIX), path) for path in found]


def config_path(cache_dir: Path | str, profile: str) -> Path:
    return run_dir(cache_dir) / f"{profile}.vllm.yaml"
