"""The preparation steps a profile slot can name in ``transform``, and their versions.

A slot such as ``[models.target] artifact = "qwen3.8-27b-w4a16", transform =
"requantize-int8"`` says its directory is the output of that step applied to the pinned
artifact. `qwen38 prepare --profile P` runs the step; `qwen38 verify` requires the
directory's `DerivedIdentity` to carry the step's name *and its current version*: a
directory made by an older version of the step is prepared again, never served.

Each step lives in its own module, which defines ``TRANSFORM`` (the name) and
``TRANSFORM_VERSION`` (a string, bumped whenever the output bytes would change for the
same input). A step whose module is not in this build (the adapter builder comes from
another branch) is refused with the command that provides it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from core.errors import PrepareError

TRANSFORM_MODULES: dict[str, str] = {
    "requantize-int8": "prepare.requantize",
    "adapter-build": "prepare.adapter",
}
"""Transform name -> the module that implements it."""

STANDALONE_COMMANDS: dict[str, str] = {
    "requantize-int8": "qwen38 prepare requantize",
    "adapter-build": "qwen38 adapter build",
}
"""Transform name -> the command that runs it on its own (named in refusals)."""


def transform_module(name: str) -> ModuleType:
    """The module implementing transform ``name``; one `PrepareError` line if there is none."""
    module_name = TRANSFORM_MODULES.get(name)
    if module_name is None:
        known = ", ".join(sorted(TRANSFORM_MODULES))
        raise PrepareError(f"transform {name!r} is not a preparation step of this stack (known: {known})")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise PrepareError(
            f"transform {name} needs `{STANDALONE_COMMANDS[name]}` ({module_name}), which this build does "
            "not include; install a build that has it, or prepare the directory with that command elsewhere"
        ) from None
    if getattr(module, "TRANSFORM", None) != name:
        raise PrepareError(f"{module_name}: implements transform {getattr(module, 'TRANSFORM', None)!r}, not {name!r}")
    return module


def transform_version(name: str) -> str:
    """The version of transform ``name`` in this build."""
    return str(transform_module(name).TRANSFORM_VERSION)
