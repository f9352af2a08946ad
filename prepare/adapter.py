"""`qwen38 adapter build`: a residual-space projection rewritten as a rank-1 PEFT LoRA.

For a module y = W x, the projection y' = y - c r (r^T y) equals (W + B A) x with
B = -c r (out x 1) and A = r^T W (1 x in): a standard LoRA with r = 1 and alpha = 1 that
vLLM applies per request, so base requests never enter the adapter path (REFERENCE.md §2).
A is accumulated one block of rows at a time straight from the stored (quantized) weights
(`prepare.weight_formats`); nothing bigger than a row block is ever dequantized.

Both inputs are identified directories (each carries its ``qwen38-manifest.json``): the
base model (a pinned download, or a tiny model) and the directory holding the directions
file (the user-supplied artifact imported with ``qwen38 prepare download KEY --from
PATH``). The output directory holds ``adapter_config.json``, ``adapter_model.safetensors``
(fp32, tensors named ``base_model.model.<checkpoint module>.lora_{A,B}.weight``, which
vLLM 0.28.0's Qwen3.5 `hf_to_vllm_mapper`s map onto both Qwen3_5ForCausalLM and
Qwen3_5ForConditionalGeneration), the conversion record ``qwen38-adapter.json`` (formats,
shapes, coefficients) and its manifest, whose identity is

    DerivedIdentity(transform="adapter-build", transform_version=TRANSFORM_VERSION,
                    params={"row_chunk": N},
                    inputs=(InputRef("model", <base identity>, <base manifest digest>),
                            InputRef("directions", <directions identity>, <its manifest digest>)))

`entrypoint.verify` binds that to the lock like any derived directory (both pinned inputs
at the lock's revision and manifest digest); `verify_adapter_binding` adds what it cannot
see from one slot: that the adapter was built from the very target the profile serves.
The directory is built in a staging directory and swapped in whole.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from core.atomic import atomic_directory
from core.checkpoint import Checkpoint, open_checkpoint
from core.errors import AdapterError, PrepareError, VerifyError
from core.identity import ArtifactIdentity, DerivedIdentity, GeneratedIdentity, InputRef
from core.manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    file_mismatches,
    read_manifest,
    sha256_file,
    write_manifest,
)
from core.progress import Progress
from prepare.directions import TARGET_KINDS, TARGET_RE, Directions, read_directions, target_modules
from prepare.download import default_dir
from prepare.weight_formats import (
    DecodeScratch,
    LinearReader,
    StoredLinear,
    TensorInfo,
    WeightFormatError,
    describe_linear,
    linear_modules,
)

if TYPE_CHECKING:
    import torch

TRANSFORM = "adapter-build"  # a profile slot's `transform`
# Bump whenever the output bytes would change for the same inputs (it is in the identity).
TRANSFORM_VERSION = "2"
MODEL_ROLE = "model"
DIRECTIONS_ROLE = "directions"
# Where a generator that runs the converter itself (`qwen38 tiny`) records the derivation
# inside its GeneratedIdentity's params.
DERIVATION_PARAM = "derivation"
ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
CONVERSION_FILE = "qwen38-adapter.json"
DEFAULT_ROW_CHUNK = 512
_INPUT_HINTS = {
    MODEL_ROLE: "download it with `qwen38 prepare download` (or generate it with `qwen38 tiny`)",
    DIRECTIONS_ROLE: "import the file with `qwen38 prepare download qwen3.8-27b-mode-b-directions --from PATH`",
}


# ---------------------------------------------------------------------------------------
# Inputs: identified directories only


def _input_manifest(directory: Path, role: str) -> Manifest:
    """The input's manifest, with every listed file present at its size and nothing else.

    Sizes, not hashes: like every preparation step this trusts a directory its manifest
    vouches for (`qwen38 verify` proves the bytes before anything is served, and binds the
    adapter to the inputs' manifest digests), but it refuses one visibly out of step.
    """
    hint = _INPUT_HINTS[role]
    if not directory.is_dir():
        raise AdapterError(f"{directory}: {role} directory not found; {hint}")
    try:
        manifest = read_manifest(directory)
    except ManifestError as exc:
        raise AdapterError(f"{role} input: {exc}; the adapter is built from identified inputs only: {hint}") from None
    for mismatch in file_mismatches(directory, manifest)[:1]:
        raise AdapterError(f"{mismatch.describe(directory)}; {hint}")
    return manifest


def directions_location(path: Path | str) -> tuple[Path, Path]:
    """(directory, file) of the directions input: a file of an identified directory, or the directory."""
    path = Path(path)
    if path.is_dir():
        manifest = _input_manifest(path, DIRECTIONS_ROLE)
        files = [f.path for f in manifest.files if f.path.endswith(".safetensors")]
        if len(files) != 1:
            raise AdapterError(
                f"{path}: holds {len(files)} safetensors files, expected 1; pass --directions the directions file"
            )
        return path, path / files[0]
    if not path.is_file():
        raise AdapterError(f"{path}: directions file not found; pass --directions a safetensors file")
    return path.parent, path


def _reference(manifest: Manifest, role: str) -> InputRef:
    # What `core.manifest.input_ref` reads, from the manifest already checked above.
    return InputRef(role=role, identity=manifest.identity, manifest_digest=manifest.digest)


def adapter_identity(model: InputRef, directions: InputRef, row_chunk: int) -> DerivedIdentity:
    """The identity of an adapter built from these inputs (the row chunk moves fp32 rounding)."""
    return DerivedIdentity(
        transform=TRANSFORM,
        transform_version=TRANSFORM_VERSION,
        params={"row_chunk": row_chunk},
        inputs=(model, directions),
    )


# ---------------------------------------------------------------------------------------
# What vLLM calls the LoRA tensors of a target module


def lora_tensor_names(module: str) -> tuple[str, str]:
    """PEFT names of A and B for a checkpoint module name (vLLM strips `base_model.model.`)."""
    return f"base_model.model.{module}.lora_A.weight", f"base_model.model.{module}.lora_B.weight"


# ---------------------------------------------------------------------------------------
# The algebra


def lora_pair(
    reader: LinearReader, direction: torch.Tensor, coef: float, row_chunk: int = DEFAULT_ROW_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) = (r^T W as [1, in], -c r as [out, 1]), fp32; W read ``row_chunk`` rows at a time."""
    import torch

    lin = reader.linear
    r = direction.to(torch.float32).reshape(-1)
    acc = torch.zeros(lin.in_features, dtype=torch.float64)
    for start in range(0, lin.out_features, row_chunk):
        end = min(start + row_chunk, lin.out_features)
        # fp32 within a block, fp64 across blocks: the sum over 17k rows stays exact to
        # fp32 rounding whatever the chunking.
        acc += reader.weighted_row_sum(start, end, r[start:end]).double()
    a = acc.to(torch.float32).reshape(1, -1).contiguous()
    b = (r.double() * -float(coef)).to(torch.float32).reshape(-1, 1).contiguous()
    return a, b


class _StoredDigest:
    """sha256 of every stored tensor the adapter was computed from, whatever the row chunk.

    Each tensor's bytes are hashed as its row slices arrive (in row order, so the digest is
    the sha256 of the tensor's raw bytes); `hexdigest` combines them sorted by name.
    """

    def __init__(self) -> None:
        self._tensors: dict[str, tuple[str, list[int], Any]] = {}

    def __call__(self, info: TensorInfo, start: int, tensor: torch.Tensor) -> None:
        import torch

        if info.name not in self._tensors:
            self._tensors[info.name] = (info.dtype, list(info.shape), hashlib.sha256())
        self._tensors[info.name][2].update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def hexdigest(self) -> str:
        lines = [
            f"{name} {dtype} {shape} {h.hexdigest()}\n" for name, (dtype, shape, h) in sorted(self._tensors.items())
        ]
        return hashlib.sha256("".join(lines).encode()).hexdigest()


# ---------------------------------------------------------------------------------------
# Checking the inputs against each other (all before any heavy work)


def _match_modules(ckpt: Checkpoint, directions: Directions, directions_path: Path) -> list[str]:
    targets = target_modules(ckpt)
    if not targets:
        raise AdapterError(
            f"{ckpt.root}: no residual-writing modules found (expected layers.N."
            f"{{{','.join(TARGET_KINDS)}}} weights); is this a Qwen3.5/3.8 checkpoint?"
        )
    known = set(targets)
    for name in directions.modules:
        if name not in known:
            if name in set(linear_modules(ckpt)):
                why = f"it is not one of the residual-writing modules ({', '.join(TARGET_KINDS)})"
            else:
                prefix = TARGET_RE.match(targets[0])["prefix"]  # type: ignore[index]
                why = f"the checkpoint has no such module (its modules are named {prefix}layers.N...)"
            raise AdapterError(f"{directions_path}: unknown module {name!r}: {why}")
    missing = [m for m in targets if m not in directions.coefs]
    if missing:
        raise AdapterError(
            f"{directions_path}: no direction for {len(missing)} of the {len(targets)} residual-writing modules "
            f"of {ckpt.root}, first {missing[0]!r}; the file must cover every one"
        )
    return targets


def _describe_targets(
    ckpt: Checkpoint, targets: list[str], directions: Directions, directions_path: Path
) -> list[StoredLinear]:
    hidden = ckpt.text_config.get("hidden_size")
    linears = []
    for module in targets:
        try:
            lin = describe_linear(ckpt, module)
        except WeightFormatError as exc:
            raise AdapterError(str(exc)) from None
        if isinstance(hidden, int) and lin.out_features != hidden:
            raise AdapterError(
                f"{ckpt.root}: {module} writes {lin.out_features} outputs but config.json hidden_size is {hidden}"
            )
        size = directions.vectors[module].numel()
        if size != lin.out_features:
            raise AdapterError(
                f"{directions_path}: direction {module!r} has {size} values, the module's output size is "
                f"{lin.out_features}; the directions were made for another model"
            )
        linears.append(lin)
    return linears


def _check_out_dir(out_dir: Path, force: bool, inputs: tuple[Path, ...]) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise AdapterError(f"{out_dir}: exists and is not a directory; pass --out a directory path")
    resolved = out_dir.resolve()
    for source in inputs:
        inp = source.resolve()
        if resolved == inp or resolved.is_relative_to(inp) or inp.is_relative_to(resolved):
            raise AdapterError(f"--out {out_dir} overlaps the input {source}; write the adapter to its own directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise AdapterError(f"{out_dir}: output directory is not empty; pass --force to replace it")


# ---------------------------------------------------------------------------------------
# Building

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def _bound_heap_growth() -> None:
    """Serve allocations of 1 MiB and up with mmap, returned to the OS when freed.

    glibc otherwise raises its mmap threshold after the first large free and then carves
    the multi-MB row-block temporaries out of the heap, which fragments: measured over the
    128 full-size modules of `qwen38 bench adapter`, RSS crept up ~2 MB per module to a
    605 MiB peak instead of staying flat at ~360 MiB. No-op where the C library is not glibc.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass


@dataclass(frozen=True)
class AdapterConversion:
    """A converted adapter, in memory (8.3 MiB at full size), not yet written anywhere."""

    adapter_bytes: bytes
    config: dict[str, Any]
    record: dict[str, Any]
    identity: DerivedIdentity

    def write_files(self, directory: Path) -> None:
        """Write the adapter's files (not its manifest) into ``directory``."""
        (directory / ADAPTER_FILE).write_bytes(self.adapter_bytes)
        for name, data in ((CONFIG_FILE, self.config), (CONVERSION_FILE, self.record)):
            (directory / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def convert(
    model_dir: Path | str,
    directions: Path | str,
    *,
    row_chunk: int = DEFAULT_ROW_CHUNK,
    progress: bool = False,
) -> AdapterConversion:
    """Compute the rank-1 LoRA of ``directions`` for ``model_dir``; every input check first."""
    from safetensors.torch import save

    model_dir = Path(model_dir)
    if row_chunk < 1:
        raise AdapterError(f"--row-chunk must be a positive number of rows, got {row_chunk}")
    directions_dir, directions_path = directions_location(directions)
    model_manifest = _input_manifest(model_dir, MODEL_ROLE)
    directions_manifest = _input_manifest(directions_dir, DIRECTIONS_ROLE)
    directions_sha = sha256_file(directions_path)
    listed = directions_manifest.by_path().get(directions_path.relative_to(directions_dir).as_posix())
    if listed is None or listed.sha256 != directions_sha:
        raise AdapterError(
            f"{directions_path}: sha256 {directions_sha}, its {MANIFEST_NAME} lists "
            f"{listed.sha256 if listed else 'nothing'}; {_INPUT_HINTS[DIRECTIONS_ROLE]}"
        )
    read = read_directions(directions_path)
    try:
        ckpt = open_checkpoint(model_dir, require_config=False)
    except PrepareError as exc:
        raise AdapterError(str(exc)) from None
    targets = _match_modules(ckpt, read, directions_path)
    linears = _describe_targets(ckpt, targets, read, directions_path)
    _bound_heap_growth()

    digest = _StoredDigest()
    scratch = DecodeScratch()
    tensors: dict[str, torch.Tensor] = {}
    modules: list[dict[str, Any]] = []
    bar = _progress(len(linears), progress)
    for lin in linears:
        r = read.vectors[lin.module]
        coef = read.coefs[lin.module]
        try:
            with LinearReader(ckpt, lin, on_stored=digest, scratch=scratch) as reader:
                a, b = lora_pair(reader, r, coef, row_chunk)
        except WeightFormatError as exc:
            raise AdapterError(str(exc)) from None
        if not (bool(a.isfinite().all()) and bool(b.isfinite().all())):
            raise AdapterError(f"{lin.module}: the LoRA factors are not finite; check the stored weights and scales")
        a_name, b_name = lora_tensor_names(lin.module)
        tensors[a_name], tensors[b_name] = a, b
        modules.append(
            {
                "module": lin.module,
                "format": lin.format,
                "out_features": lin.out_features,
                "in_features": lin.in_features,
                "coef": coef,
                "direction_norm": float(r.double().norm()),
                "lora_A": a_name,
                "lora_B": b_name,
            }
        )
        bar.update(1)
    bar.close()

    # One metadata key: safetensors writes several in hash order, and the bytes must repeat.
    adapter_bytes = save(tensors, metadata={"format": "pt"})
    formats: dict[str, int] = {}
    for entry in modules:
        formats[entry["format"]] = formats.get(entry["format"], 0) + 1
    identity = adapter_identity(
        _reference(model_manifest, MODEL_ROLE), _reference(directions_manifest, DIRECTIONS_ROLE), row_chunk
    )
    record = {
        "transform": TRANSFORM,
        "transform_version": TRANSFORM_VERSION,
        "adapter": {
            "file": ADAPTER_FILE,
            "sha256": hashlib.sha256(adapter_bytes).hexdigest(),
            "size": len(adapter_bytes),
            "dtype": "float32",
            "r": 1,
            "lora_alpha": 1,
        },
        # The stored tensors actually read (independent of the shard layout and row chunk).
        "base": {
            "architectures": ckpt.config.get("architectures"),
            "model_type": ckpt.config.get("model_type"),
            "weights_read_sha256": digest.hexdigest(),
            "weights_source": ckpt.source,
        },
        "directions": {"file": directions_path.name, "sha256": directions_sha, "modules": len(modules)},
        "row_chunk": row_chunk,
        "formats": formats,
        "modules": modules,
    }
    config = _adapter_config(model_dir, model_manifest, record["base"]["architectures"], [m["module"] for m in modules])
    return AdapterConversion(adapter_bytes, config, record, identity)


def build_adapter(
    model_dir: Path | str,
    directions: Path | str,
    out_dir: Path | str,
    *,
    force: bool = False,
    row_chunk: int = DEFAULT_ROW_CHUNK,
    progress: bool = False,
) -> dict[str, Any]:
    """`qwen38 adapter build`: convert, then write ``out_dir`` whole with its manifest; returns the record.

    ``directions`` is the directions file inside its identified directory, or that
    directory. Nothing is written unless every check passes; a previous adapter at
    ``out_dir`` is replaced only by a complete new one.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    directions_dir, _ = directions_location(directions)
    _check_out_dir(out_dir, force, (model_dir, directions_dir))
    conversion = convert(model_dir, directions, row_chunk=row_chunk, progress=progress)
    with atomic_directory(out_dir, replace=True) as staging:
        conversion.write_files(staging)
        write_manifest(staging, conversion.identity)
    return conversion.record


def _adapter_config(
    model_dir: Path, model_manifest: Manifest, architectures: Any, modules: list[str]
) -> dict[str, Any]:
    ident = model_manifest.identity
    if isinstance(ident, ArtifactIdentity):
        name, revision = ident.repo or ident.artifact, ident.revision
    else:
        name, revision = model_dir.name, None
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 1,
        "lora_alpha": 1,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        # Full module names: exactly these layers (not, say, the MTP head's or a vision tower's).
        "target_modules": modules,
        "base_model_name_or_path": name,
        "revision": revision,
        "qwen38": {"transform": TRANSFORM, "version": TRANSFORM_VERSION, "base_architectures": architectures},
    }


def _progress(total: int, enabled: bool):
    """Modules converted (a bar in a terminal, else a line every 20 s); nothing unless ``enabled``."""

    return Progress("adapter: modules converted", total, unit="module", shown=enabled)


# ---------------------------------------------------------------------------------------
# Binding a built adapter to the target actually served


def adapter_derivation(manifest: Manifest, where: Path | str) -> DerivedIdentity:
    """How the adapter was derived: its own identity, or the one a generator recorded.

    `qwen38 adapter build` writes a `DerivedIdentity`; `qwen38 tiny` runs the same converter but
    its directories are `generated` (that is what the `cpu` profile's slots check), so it
    records the converter's identity in ``params["derivation"]``.
    """
    ident = manifest.identity
    derived: DerivedIdentity | None = None
    if isinstance(ident, DerivedIdentity):
        derived = ident
    elif isinstance(ident, GeneratedIdentity) and isinstance(ident.params.get(DERIVATION_PARAM), dict):
        try:
            derived = DerivedIdentity.model_validate(ident.params[DERIVATION_PARAM])
        except ValidationError:
            derived = None
    if derived is None or derived.transform != TRANSFORM:
        raise VerifyError(
            f"{where}: identity expected a `{TRANSFORM}` output, found {ident.describe()}; "
            "rebuild it with `qwen38 adapter build`"
        )
    return derived


def derivation_input(derived: DerivedIdentity, role: str) -> InputRef | None:
    return next((ref for ref in derived.inputs if ref.role == role), None)


def binding_problems(
    adapter_manifest: Manifest, target_manifest: Manifest, *, adapter_where: Path | str, target_where: Path | str
) -> list[str]:
    """Problems with serving this adapter on this target (pure: two manifests in, lines out).

    `qwen38 verify` checks each slot against the lock; this checks the slots against each
    other: the adapter's `model` input must be the target's exact manifest (identity and
    digest). An adapter derived from another pinned artifact, or from the same artifact
    before its directory was rebuilt, computed A = r^T W from other weights.
    """
    try:
        derived = adapter_derivation(adapter_manifest, adapter_where)
    except VerifyError as exc:
        return [str(exc)]
    model = derivation_input(derived, MODEL_ROLE)
    if model is None:
        return [
            f"{adapter_where}: its identity records no `{MODEL_ROLE}` input; rebuild it with `qwen38 adapter build`"
        ]
    if model.identity != target_manifest.identity or model.manifest_digest != target_manifest.digest:
        return [
            f"{adapter_where}: built from {model.identity.describe()}#{model.manifest_digest[:12]}, "
            f"the served target {target_where} is {target_manifest.identity.describe()}#"
            f"{target_manifest.digest[:12]}; rebuild the adapter from the target "
            f"(`qwen38 adapter build --model {target_where} ...`)"
        ]
    return []


def verify_adapter_binding(adapter_dir: Path | str, model_dir: Path | str) -> DerivedIdentity:
    """Refuse (one `VerifyError` line) an adapter not built from ``model_dir`` as it is now.

    Reads two manifests, hashes nothing: cheap enough for every start. The files
    themselves are `qwen38 verify`'s job. Returns the adapter's derivation.
    """
    adapter_dir, model_dir = Path(adapter_dir), Path(model_dir)
    adapter_manifest = read_manifest(adapter_dir)
    target_manifest = read_manifest(model_dir)
    problems = binding_problems(adapter_manifest, target_manifest, adapter_where=adapter_dir, target_where=model_dir)
    if problems:
        raise VerifyError(problems[0])
    return adapter_derivation(adapter_manifest, adapter_dir)


def check_profile_adapter(profile, models_dir: Path | str) -> DerivedIdentity | None:
    """`verify_adapter_binding` for a profile's adapter and target slots (None: no adapter)."""
    slot = profile.models.adapter
    if slot is None:
        return None
    models_dir = Path(models_dir)
    return verify_adapter_binding(models_dir / slot.dir, models_dir / profile.models.target.dir)


def build_profile_adapter(profile, models_dir: Path | str, *, row_chunk: int = DEFAULT_ROW_CHUNK) -> dict[str, Any]:
    """The profile's adapter slot (``transform = "adapter-build"``) from its served target and
    the directions artifact imported at ``MODELS_DIR/<artifact key>`` (`prepare download KEY
    --from PATH`); replaces an existing adapter directory. Returns the conversion record."""

    slot = profile.models.adapter
    if slot is None or slot.transform != TRANSFORM or slot.artifact is None:
        raise AdapterError(f"profile {profile.name}: no adapter slot with transform {TRANSFORM!r} and an artifact")
    models_dir = Path(models_dir)
    return build_adapter(
        models_dir / profile.models.target.dir,
        models_dir / default_dir(slot.artifact),
        models_dir / slot.dir,
        force=True,
        row_chunk=row_chunk,
    )
