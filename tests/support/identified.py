"""Give a test-made directory an identity, as every input of a preparation step must have.

`prepare.adapter` builds only from identified directories (each with its
``qwen38-manifest.json``); test checkpoints and directions files get a `GeneratedIdentity`
of generator ``test`` (any other identity is written the same way with `write_manifest`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.identity import GeneratedIdentity
from core.manifest import Manifest, write_manifest

TEST_GENERATOR = "test"


def seal(directory: Path | str, **params: Any) -> Manifest:
    """(Re)write ``directory``'s manifest over its current files; call it after every change."""
    return write_manifest(directory, GeneratedIdentity(generator=TEST_GENERATOR, generator_version="1", params=params))
