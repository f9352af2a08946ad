"""qwen38-stack entrypoint: settings, verify, plan, launch, ready gate, validators, bench."""

__version__ = "0.1.0"
