"""Patch 0070's lookup rule (`v1/spec_decode/lookup.py`) as the series in this checkout makes it.

The file is new in the series and imports only NumPy, so its text is taken from the patch
(through the lock's states) and run without vLLM: tests of the rule, and the reference the
V2 kernel (patch 0072) is compared with, follow the series here, never a stale install.
"""

from __future__ import annotations

import functools
import types

from entrypoint.patches import content_at, load_series, state_hashes

LOOKUP_PATH = "v1/spec_decode/lookup.py"


@functools.cache
def load_lookup_rule() -> types.ModuleType:
    series = load_series()
    text = content_at(series, LOOKUP_PATH, None, len(state_hashes(series, LOOKUP_PATH)) - 1)
    assert text is not None
    module = types.ModuleType("qwen38_lookup_rule")
    exec(compile(text, LOOKUP_PATH, "exec"), module.__dict__)
    return module
