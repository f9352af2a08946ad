"""Part of the import-only torchvision stand-in (see torchvision/__init__.py)."""

from torchvision._standin import unavailable


def __getattr__(name: str):
    return unavailable(f"{__name__}.{name}")
