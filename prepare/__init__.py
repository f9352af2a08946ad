"""qwen38-stack preparation: pinned downloads and model transformations.

Every step streams (one tensor or row-block at a time), writes atomically and is
idempotent; every output directory carries a manifest binding it to what it came from.
"""
