"""Part of the import-only torchvision stand-in (see torchvision/__init__.py)."""

from torchvision._standin import unavailable


def __getattr__(name: str):
    return unavailable(f"{__name__}.{name}")


class InterpolationMode:
    """The interpolation names transformers maps PIL resampling modes onto at import time."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"
