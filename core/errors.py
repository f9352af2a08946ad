"""The stack's errors: one small hierarchy, each carrying a short code.

Expected failures (bad input, a file that does not match its pin, a profile that cannot
fit) are raised as a `StackError`; the CLI prints ``qwen38: <code>: <message>`` once and
exits non-zero, without a traceback. Messages name the file or knob, the expected and the
found value, and what to do - never a secret.
"""

from __future__ import annotations


class StackError(Exception):
    """Base class for every expected failure of the stack."""

    code = "error"
    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class SettingsError(StackError):
    """A bad environment / .env value, an unknown knob or conflicting knobs."""

    code = "settings"


class ProfileError(StackError):
    """A profile file that is missing, malformed or inconsistent."""

    code = "profile"


class ArtifactError(StackError):
    """A pinned artifact that is missing, not pinned, or not what was pinned."""

    code = "artifact"


class DownloadError(ArtifactError):
    """A download that failed or did not match its pin (repo, revision, file named)."""

    code = "download"


class VerifyError(ArtifactError):
    """A served file, manifest or engine that does not match its pin."""

    code = "verify"


class PrepareError(StackError):
    """A model transformation that cannot run on its input."""

    code = "prepare"


class AdapterError(PrepareError):
    """The projection -> rank-1 LoRA converter refused its input."""

    code = "adapter"


class PatchError(StackError):
    """A patch of the series that does not apply or is not delivered."""

    code = "patch"


class DependencyLockError(StackError):
    """A Python package lock (docker/lock/) that cannot be made or is not installable."""

    code = "deps"


class ImageError(StackError):
    """A container image reference or build input that is malformed or inconsistent."""

    code = "image"


class ToolchainError(StackError):
    """The CUDA JIT toolchain of an image is missing a piece, or cannot be laid out."""

    code = "toolchain"


class PlanError(StackError):
    """A profile that cannot fit in its memory budget."""

    code = "plan"


class LaunchError(StackError):
    """The engine cannot be started (missing executable, bad invocation)."""

    code = "launch"


class ReadinessError(StackError):
    """The server did not become ready, or answered wrongly while proving it."""

    code = "ready"


class ValidationFailed(StackError):
    """A validator ran and at least one of its checks failed."""

    code = "validate"
    exit_code = 1


class MonitoringError(StackError):
    """A monitoring endpoint (Prometheus, a server's /metrics) that cannot be read."""

    code = "monitoring"


class BenchError(StackError):
    """A benchmark could not run or its numbers are inconsistent."""

    code = "bench"
