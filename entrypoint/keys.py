"""`qwen38 key init`: create an API key file once, never print the key.

The file is what API_KEY_FILE points at (and what compose mounts as a Docker secret):
one random word, mode 0600, written atomically; an existing key is kept.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from core.atomic import atomic_file
from core.errors import SettingsError

DEFAULT_KEY_FILE = Path("secrets/api_key")


def init_key_file(path: Path) -> bool:
    """Create ``path`` with a fresh key unless it exists; True when a key was created.

    Only the default directory (``secrets/``) is created, private; any other must exist:
    a mistyped ``--file`` must not leave directories behind.
    """
    if path.exists():
        if not path.is_file():
            raise SettingsError(f"{path}: exists and is not a file")
        return False
    if not path.parent.is_dir():
        if path.parent != DEFAULT_KEY_FILE.parent:
            raise SettingsError(
                f"--file {path}: directory {path.parent} does not exist; create it first "
                f"(`mkdir -p -m 700 {path.parent}`) or name a file in an existing directory"
            )
        path.parent.mkdir(mode=0o700)
    old_umask = os.umask(0o077)
    try:
        with atomic_file(path, "w") as handle:
            handle.write(secrets.token_hex(24) + "\n")
    finally:
        os.umask(old_umask)
    path.chmod(0o600)
    return True
