"""Import-only stand-in for torchvision, for CPU test environments without a CPU build.

vLLM's Qwen3.5 model file imports transformers' Qwen2-VL image processor, which imports
torchvision at module level. Text-only models never call it. PyPI's torchvision wheels
are CUDA builds that fail to import against the CPU torch (`torchvision::nms does not
exist`), so tests put this package first on PYTHONPATH when no torchvision is importable.
Any image function raises.
"""

__version__ = "0.0.0+standin"
