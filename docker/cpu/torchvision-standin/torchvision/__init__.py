"""Import-only stand-in for torchvision in the CPU build (text-only serving).

PyPI has no CPU build of torchvision for torch 2.13.0+cpu (its wheel needs CUDA's
libc10_cuda.so), yet vLLM's Qwen3.5 model file imports transformers' Qwen2-VL image
processor, which imports torchvision unconditionally. Text-only serving never calls it, so
the stand-in only has to import: every function it exposes raises when called.
"""

from torchvision._standin import unavailable

__version__ = "0.0.0+qwen38.standin"


def __getattr__(name: str):
    return unavailable(f"torchvision.{name}")
