"""What every module of the torchvision stand-in shares: names resolve to functions that fail."""

from __future__ import annotations


def unavailable(qualname: str):
    def _fail(*_args, **_kwargs):
        raise RuntimeError(
            f"{qualname}: qwen38-stack's CPU image has an import-only torchvision stand-in; "
            "image and video inputs are not supported there"
        )

    _fail.__name__ = qualname.rsplit(".", 1)[-1]
    _fail.__qualname__ = qualname
    return _fail
