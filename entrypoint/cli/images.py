"""`qwen38 image`: the images' derived build arguments (labels) and the digests compose pulls
(`entrypoint.images`)."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from entrypoint import images


def _cmd_build_args(args: argparse.Namespace) -> int:
    spec = images.get_image(args.image)
    values = images.build_args(spec, args.revision or images.source_revision())
    if args.format == "json":
        tag = images.published_tag(spec, values["IMAGE_VERSION"])
        print(
            json.dumps(
                {"dockerfile": spec.dockerfile, "platform": spec.platform, "tag": tag, "build_args": values}, indent=2
            )
        )
    elif args.format == "env":
        for key, value in values.items():
            print(f"{key}={value}")
    else:
        print(" ".join(f"--build-arg {shlex.quote(f'{key}={value}')}" for key, value in values.items()))
    return 0


def _cmd_pin(args: argparse.Namespace) -> int:
    from core.atomic import atomic_write_text  # only `image pin` writes a file

    spec = images.get_image(args.image)
    path = Path(args.compose)
    text = path.read_text()
    new = images.pin_compose_image(text, spec, args.reference)
    if new == text:
        print(f"{path.name}: {spec.name} already pins {args.reference}")
        return 0
    before = images.compose_default(text, spec)
    atomic_write_text(path, new)
    was = f"pulled {before}" if images.is_pinned(before) else f"built locally as {before}"
    print(f"{path.name}: {spec.name} now pulls {args.reference} (was: {was})")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "image",
        help="container images: label build arguments, compose digest pins",
        description="The images' derived build arguments (labels), and the digests compose.yaml pulls.",
    )
    actions = parser.add_subparsers(dest="image_action", metavar="ACTION", required=True)

    args = actions.add_parser(
        "build-args",
        help="the --build-arg values that fill an image's labels",
        description="vLLM version (from the lock), patch-set sha256, CUDA arch list (from the profiles), "
        "source revision and version, as docker build arguments.",
    )
    args.add_argument("image", choices=list(images.IMAGES), help="which image")
    args.add_argument("--revision", help="git commit the image is built from (default: HEAD)")
    args.add_argument("--format", choices=["docker", "env", "json"], default="docker")
    args.set_defaults(func=_cmd_build_args)

    pin = actions.add_parser(
        "pin",
        help="make compose.yaml pull this pushed image by default",
        description="Rewrite the default of ${IMAGE_<NAME>:-...} in compose.yaml (the local tag compose "
        "builds while nothing is published, or an earlier pin) to REPOSITORY:TAG@sha256:DIGEST.",
    )
    pin.add_argument("image", choices=list(images.IMAGES), help="which image")
    pin.add_argument("reference", help="REPOSITORY:TAG@sha256:DIGEST of the pushed image")
    pin.add_argument("--compose", default=str(images.COMPOSE_PATH), help=argparse.SUPPRESS)
    pin.set_defaults(func=_cmd_pin)
