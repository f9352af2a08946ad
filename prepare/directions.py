"""The directions file: per-module residual-space directions r and coefficients c.

Format (the one the Spark article's tooling uses; docs/adapter.md): a safetensors file with
- one 1-D float tensor per module, named exactly as the module in the base checkpoint
  (e.g. ``model.language_model.layers.3.mlp.down_proj``), of length the module's output
  size (the hidden size);
- a 1-D tensor ``__coefs__`` holding one coefficient per module, in the order given by the
  JSON list stored in the file's metadata under ``coef_order``.
The projection it describes, applied after each module's linear map, is
``y' = y - c r (r^T y)``. The modules it covers are the residual-writing ones of the
decoder layers (`target_modules`): every one, and no other.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from core.atomic import atomic_file
from core.checkpoint import Checkpoint, open_checkpoint
from core.errors import AdapterError
from prepare.weight_formats import describe_linear, linear_modules

if TYPE_CHECKING:
    import torch

COEFS_KEY = "__coefs__"
ORDER_KEY = "coef_order"
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
# The modules a directions file covers: the residual-writing ones of the decoder layers.
TARGET_KINDS = ("linear_attn.out_proj", "self_attn.o_proj", "mlp.down_proj")
# Decoder layers only: `mtp.layers.N...` (the MTP head) and the vision tower do not match.
TARGET_RE = re.compile(
    r"^(?P<prefix>model\.language_model\.|model\.)layers\.(?P<layer>\d+)\."
    r"(?P<kind>linear_attn\.out_proj|self_attn\.o_proj|mlp\.down_proj)$"
)


def target_modules(ckpt: Checkpoint) -> list[str]:
    """The residual-writing modules of ``ckpt``'s decoder layers, in layer order."""
    found = [m for m in linear_modules(ckpt) if TARGET_RE.match(m)]

    def order(name: str) -> tuple[int, int]:
        match = TARGET_RE.match(name)
        assert match is not None
        return int(match["layer"]), TARGET_KINDS.index(match["kind"])

    return sorted(found, key=order)


@dataclass(frozen=True)
class Directions:
    """Directions (fp32, 1-D) and coefficients, keyed by checkpoint module name."""

    vectors: dict[str, torch.Tensor]
    coefs: dict[str, float]

    @property
    def modules(self) -> list[str]:
        return list(self.coefs)


def write_directions(path: Path | str, directions: dict[str, torch.Tensor], coefs: dict[str, float]) -> Path:
    """Write a directions file atomically (module order: the order of ``coefs``)."""
    import torch
    from safetensors.torch import save

    if set(directions) != set(coefs):
        missing = sorted(set(directions) ^ set(coefs))
        raise AdapterError(f"directions and coefficients name different modules: {missing[:3]} ...")
    if COEFS_KEY in directions:
        raise AdapterError(f"{COEFS_KEY!r} is reserved for the coefficients; it cannot name a module")
    order = list(coefs)
    tensors = {name: directions[name].detach().reshape(-1).to(torch.float32).contiguous() for name in order}
    tensors[COEFS_KEY] = torch.tensor([float(coefs[name]) for name in order], dtype=torch.float32)
    data = save(tensors, metadata={ORDER_KEY: json.dumps(order)})
    path = Path(path)
    with atomic_file(path) as handle:
        handle.write(data)
    return path


def read_directions(path: Path | str) -> Directions:
    """Read and validate a directions file; every problem is one `AdapterError` line."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise AdapterError(f"{path}: directions file not found; pass --directions a safetensors file")
    try:
        handle_cm = safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise AdapterError(f"{path}: not a readable safetensors file ({exc})") from None
    with handle_cm as handle:
        metadata = handle.metadata() or {}
        if ORDER_KEY not in metadata:
            raise AdapterError(
                f"{path}: metadata has no {ORDER_KEY!r} (JSON list of module names); see docs/adapter.md"
            )
        try:
            order = json.loads(metadata[ORDER_KEY])
        except json.JSONDecodeError:
            raise AdapterError(f"{path}: metadata {ORDER_KEY!r} is not JSON; expected a list of module names") from None
        if not isinstance(order, list) or not all(isinstance(n, str) for n in order):
            raise AdapterError(f"{path}: metadata {ORDER_KEY!r} must be a JSON list of module names")
        if len(set(order)) != len(order):
            dup = next(n for n in order if order.count(n) > 1)
            raise AdapterError(f"{path}: {ORDER_KEY!r} names {dup!r} twice")
        keys = set(handle.keys())
        if COEFS_KEY not in keys:
            raise AdapterError(f"{path}: no {COEFS_KEY!r} tensor (one coefficient per module, in {ORDER_KEY} order)")
        vectors_in_file = keys - {COEFS_KEY}
        if set(order) != vectors_in_file:
            extra = sorted(vectors_in_file - set(order))
            missing = sorted(set(order) - vectors_in_file)
            if extra:
                detail = f"tensors not in {ORDER_KEY}: {extra[:3]}"
            else:
                detail = f"{ORDER_KEY} entries without a tensor: {missing[:3]}"
            raise AdapterError(f"{path}: {ORDER_KEY} and the direction tensors disagree ({detail})")
        coef_slice = handle.get_slice(COEFS_KEY)
        if coef_slice.get_dtype() not in FLOAT_DTYPES or list(coef_slice.get_shape()) != [len(order)]:
            raise AdapterError(
                f"{path}: {COEFS_KEY!r} must be a 1-D float tensor of {len(order)} values, found "
                f"{coef_slice.get_dtype()} {list(coef_slice.get_shape())}"
            )
        coef_values = handle.get_tensor(COEFS_KEY).double().tolist()
        vectors = {}
        for name in order:
            sl = handle.get_slice(name)
            if sl.get_dtype() not in FLOAT_DTYPES or len(sl.get_shape()) != 1:
                raise AdapterError(
                    f"{path}: direction {name!r} must be a 1-D float tensor, "
                    f"found {sl.get_dtype()} {list(sl.get_shape())}"
                )
            vec = handle.get_tensor(name).float()
            if not bool(vec.isfinite().all()):
                raise AdapterError(f"{path}: direction {name!r} has NaN or infinite values")
            vectors[name] = vec
    coefs = {}
    for name, value in zip(order, coef_values, strict=True):
        if not math.isfinite(value):
            raise AdapterError(f"{path}: coefficient of {name!r} is not finite ({value})")
        coefs[name] = value
    return Directions(vectors, coefs)


def random_directions(
    model_dir: Path | str, out_path: Path | str, seed: int, *, coef_range: tuple[float, float] = (4.0, 8.0)
) -> Path:
    """Write a deterministic random directions file for every target module of a model.

    Unit directions (Gaussian, normalised) and coefficients uniform in ``coef_range``,
    drawn from one seeded generator in module order: the same model and seed give the same
    bytes. Meant for tiny test models. The default strengths are well above 1 on purpose: a
    projection of strength ~1 along a random direction can leave the first greedy tokens of
    a tiny model unchanged, while the readiness gate needs adapter output != base output.
    ``qwen38 tiny`` passes ``coef_range=(100, 100)``: its target is built with wide greedy
    margins (`prepare.generate.TINY_ADAPTER_STRENGTH`).
    """
    import torch

    ckpt = open_checkpoint(model_dir, require_config=False)
    modules = target_modules(ckpt)
    gen = torch.Generator().manual_seed(int(seed))
    vectors: dict[str, torch.Tensor] = {}
    coefs: dict[str, float] = {}
    for module in modules:
        out_features = describe_linear(ckpt, module).out_features
        vec = torch.randn(out_features, generator=gen, dtype=torch.float64)
        vectors[module] = (vec / vec.norm()).float()
        low, high = coef_range
        coefs[module] = low + (high - low) * float(torch.rand((), generator=gen, dtype=torch.float64))
    return write_directions(out_path, vectors, coefs)
