"""What a preparation command hashed, left in verify's stat cache.

Every `qwen38 prepare` command runs inside `leaving_proofs`: it records what it hashes
(`core.proofs`) and, when it ends, leaves what that proves in verify's stat cache under
CACHE_DIR (`core.stat_cache.leave_proofs`): the first `qwen38 serve` then verifies those
files without reading them again.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from core.errors import StackError
from core.progress import say
from core.proofs import Ledger, recording
from core.stat_cache import CACHE_FILE, StatCache, leave_proofs


@contextlib.contextmanager
def leaving_proofs(profile: str | None) -> Iterator[None]:
    """Record what the body hashes; what that proves ends in the stat cache of ``profile``'s settings."""
    with recording() as ledger:
        try:
            yield
        finally:
            if ledger.directories():
                leave_in_stat_cache(ledger, profile)


def leave_in_stat_cache(ledger: Ledger, profile: str | None) -> None:
    # pydantic's settings only once something was hashed: a step's start stays light
    from core.settings import load_settings

    try:
        cache_dir = Path(load_settings(profile=profile).cache_dir)
    except StackError:
        return  # the command has said what is wrong with the settings
    cache = StatCache.load(cache_dir / CACHE_FILE)
    recorded = leave_proofs(cache, ledger)
    try:
        cache.save()
    except OSError as exc:
        say(f"qwen38: prepare: cannot write the stat cache {cache.path} ({exc}); the first verify will hash "
            "every file again", level="warning", file=sys.stderr)
        return
    if recorded:
        say(f"qwen38: prepare: {recorded} files it hashed are in verify's stat cache ({cache.path}): the first "
            "`qwen38 verify` or `qwen38 serve` will not read them again")
