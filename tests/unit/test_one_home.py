"""Issue 54, one home per concept: guards that fail when a second copy of a concept appears."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("entrypoint", "prepare")


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def test_the_installed_vllm_directory_is_found_in_one_place():
    """`entrypoint.patches.find_vllm_dir` is the one finder of the installed vLLM package
    directory (find_spec, without importing vLLM; PatchError when absent): call it."""
    finder = re.compile(r"""submodule_search_locations|find_spec\(\s*["']vllm["']""")
    home = REPO / "entrypoint" / "patches.py"
    elsewhere = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in _sources()
        if path != home
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if finder.search(line)
    ]
    assert not elsewhere, "locate vLLM with entrypoint.patches.find_vllm_dir, not again:\n" + "\n".join(elsewhere)
    assert len(re.findall(r"^def find_vllm_dir\(", home.read_text(encoding="utf-8"), re.M)) == 1


def test_a_prepared_directory_is_compared_with_its_manifest_in_one_place():
    """`core.manifest` is the one home of "is this prepared directory current?"
    (`is_current` / `current_manifest`) and of the comparison of a directory's files with
    its manifest (`files_match`, `file_mismatches`): every prepare step calls them.
    entrypoint/verify.py compares each listed file itself because every stat it takes
    becomes a stat cache stamp."""
    home = REPO / "core" / "manifest.py"
    exempt = {home, REPO / "entrypoint" / "verify.py"}
    shapes = re.compile(
        r"exists\(\) else -1"  # {path: size on disk, -1 for a dangling link} of the content files
        r"|\{\s*\w+\.path\s*:\s*\w+\.size\s+for\b"  # {path: size} of the listed files
        r"|\.st_size\s*!=\s*\w+\.size\b"  # a listed file's size on disk against its entry
        r"|recheck: sha256 of"  # the --recheck hashing of a whole directory
    )
    sources = sorted(p for package in ("core", "prepare", "entrypoint", "bench") for p in (REPO / package).rglob("*.py"))
    texts = {path: path.read_text(encoding="utf-8") for path in sources}
    elsewhere = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path, text in texts.items()
        if path not in exempt
        for number, line in enumerate(text.splitlines(), 1)
        if shapes.search(line)
    ]
    assert not elsewhere, (
        "compare a directory with its manifest through core.manifest (is_current, current_manifest, "
        "files_match, file_mismatches), not again:\n" + "\n".join(elsewhere)
    )
    for name in ("is_current", "current_manifest", "files_match", "file_mismatches"):
        homes = [path for path, text in texts.items() if re.search(rf"^\s*def {name}\(", text, re.M)]
        assert homes == [home], f"{name} is defined in {[str(p.relative_to(REPO)) for p in homes]}"
    retired = re.compile(r"^\s*def (is_up_to_date|_is_current|_files_match)\(", re.M)
    again = [str(path.relative_to(REPO)) for path, text in texts.items() if retired.search(text)]
    assert not again, f"a second freshness check is back in {again}; use core.manifest.is_current"


def test_vllm_engine_arguments_are_derived_in_one_place():
    """`entrypoint.engine_args` turns the resolved engine into vLLM's arguments, for the launch
    and the planner alike: no other module gives vLLM one of the arguments it names (a dict key
    or an item assigned, in either spelling), and vLLM's ``EngineArgs`` is built only by the
    planner's child process, from the request's ``engine_args`` alone."""
    import ast

    home = REPO / "entrypoint" / "engine_args.py"
    named = {
        node.value
        for node in ast.walk(ast.parse(home.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and re.fullmatch(r"[a-z]+(-[a-z]+)+", node.value)
    }
    assert {"max-model-len", "kv-cache-memory-bytes", "speculative-config", "tensor-parallel-size"} <= named
    # EngineArgs' spelling of those the planner hands vLLM is checked where they were derived
    # before; elsewhere, and for the others, it names fields of our own (the resolved engine,
    # the profile's engine table, a plan's capacity).
    from entrypoint.engine_args import KV_SHAPING

    planned = {name.replace("-", "_") for name in KV_SHAPING}
    spelled = {REPO / "entrypoint" / name: planned for name in ("launch.py", "plan.py", "serve.py")}

    def keys(tree: ast.AST):
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                yield from (key for key in node.keys if key is not None)
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                yield from (target.slice for target in targets if isinstance(target, ast.Subscript))

    found = []
    for path in sorted(p for package in (*PACKAGES, "bench", "core") for p in (REPO / package).rglob("*.py")):
        if path == home:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        forbidden = named | spelled.get(path, set())
        found += [
            f"{path.relative_to(REPO)}:{key.lineno}: {key.value}"
            for key in keys(tree)
            if isinstance(key, ast.Constant) and key.value in forbidden
        ]
        if path.name == "kv_capacity.py":  # the child reads the request's engine_args whole, not by name
            found += [
                f"{path.relative_to(REPO)}:{node.lineno}: {node.value.id}[{node.slice.value!r}]"
                for node in ast.walk(tree)
                if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                and node.value.id in ("request", "engine") and isinstance(node.slice, ast.Constant)
                and node.slice.value in planned | {"engine", "speculative", "target_dir"}
            ]
        for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call)):
            if getattr(call.func, "id", getattr(call.func, "attr", None)) != "EngineArgs":
                continue
            if path.name != "kv_capacity.py" or call.keywords != [k for k in call.keywords if k.arg is None]:
                found.append(f"{path.relative_to(REPO)}:{call.lineno}: EngineArgs(...) outside the planner's request")
    assert not found, "derive vLLM's arguments in entrypoint.engine_args, not again:\n" + "\n".join(found)


def test_the_run_directory_is_described_in_one_place():
    """`entrypoint.run_files` names ``CACHE_DIR/run/`` and every file a start keeps there (the
    lock, the run record, the readiness status, the --config YAML): no other module spells them."""
    spelled = re.compile(r"""/\s*["']run["']|\}\.(status\.json|run\.json|vllm\.yaml)["']|["']\*\.status\.json["']""")
    home = REPO / "entrypoint" / "run_files.py"
    elsewhere = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in sorted(p for package in (*PACKAGES, "bench", "core") for p in (REPO / package).rglob("*.py"))
        if path != home
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if spelled.search(line)
    ]
    assert not elsewhere, "name the run files with entrypoint.run_files:\n" + "\n".join(elsewhere)


def _lines(paths, pattern: re.Pattern[str], exempt=()) -> list[str]:
    return [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in paths
        if path not in exempt
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]


def _code_base() -> list[Path]:
    packages = ("core", "prepare", "entrypoint", "bench", "tests")
    return sorted(p for package in packages for p in (REPO / package).rglob("*.py"))


def test_a_checkpoint_directory_is_read_in_one_place():
    """`core.checkpoint` is the one reader of a checkpoint directory (`open_checkpoint` ->
    `Checkpoint`: config.json, the index or the shards found, every shard's header via
    `core.safetensors_stream`), of an index's shard names (`indexed_shards`) and of a VL
    config's language-model part (`text_config`); `prepare.weight_formats` only says what
    format the tensors are in."""
    home = REPO / "core" / "checkpoint.py"
    sources = _code_base()
    defined = _lines(sources, re.compile(r"^\s*(def open_checkpoint\(|class Checkpoint\b)"))
    assert [line.split(":")[0] for line in defined] == ["core/checkpoint.py"] * 2, (
        "one Checkpoint and one open_checkpoint, in core/checkpoint.py:\n" + "\n".join(defined)
    )
    code = sorted(p for package in ("core", "prepare", "entrypoint", "bench") for p in (REPO / package).rglob("*.py"))
    reads = re.compile(
        r"""\[\s*["']weight_map["']\s*\](?!\s*=[^=])"""  # an index's map read by hand
        r"""|get\(\s*["']weight_map["']"""
        r"""|["']text_config["']\s*\)\s*or\b"""  # the "text_config, else the config" fallback
        r"""|["']text_config["']\s*\)\s*if\b"""
        r"""|\bread_header\("""  # shard headers, read for a checkpoint
    )
    elsewhere = _lines(code, reads, exempt={home, REPO / "core" / "safetensors_stream.py"})
    assert not elsewhere, "read checkpoints with core.checkpoint, not again:\n" + "\n".join(elsewhere)


def test_a_synthetic_checkpoint_is_written_in_one_place():
    """`prepare.checkpoint_writer` is the one writer of generated checkpoints (`CheckpointWriter`,
    `write_checkpoint`): `qwen38 generate`, the bench inputs and the tests' model builders lay
    shards out and write index and config through it. Only `core.safetensors_stream` (the
    format) and the writer encode headers; the only ``save_file`` of the code is the plain-I/O
    baseline of `bench.requantize`, and the tests' builders (tests/support, pinning_support)
    have none."""
    home = REPO / "prepare" / "checkpoint_writer.py"
    sources = _code_base()
    defined = _lines(sources, re.compile(r"^\s*(def write_checkpoint\(|class CheckpointWriter\b)"))
    assert [line.split(":")[0] for line in defined] == ["prepare/checkpoint_writer.py"] * 2, "\n".join(defined)
    code = sorted(p for package in ("core", "prepare", "entrypoint", "bench") for p in (REPO / package).rglob("*.py"))
    headers = _lines(code, re.compile(r"\bencode_header\("), exempt={home, REPO / "core" / "safetensors_stream.py"})
    assert not headers, "write checkpoints with prepare.checkpoint_writer:\n" + "\n".join(headers)
    builders = [*sorted((REPO / "tests" / "support").rglob("*.py")), REPO / "tests" / "pinning_support.py"]
    saved = _lines([*code, *builders], re.compile(r"\bsave_file\("), exempt={REPO / "bench" / "requantize.py"})
    assert not saved, "write checkpoints with prepare.checkpoint_writer:\n" + "\n".join(saved)
