"""The environment the tests run in is exactly the development lock (`make setup`).

Every machine is meant to test against the same versions: docker/lock/dev-x86_64.txt pins
them with hashes, docker/cpu/install_lock.py installs exactly that. This fails when the
installed packages and the lock disagree (a package upgraded by hand, one the lock does not
name, a lock regenerated without re-running `make setup`), naming each difference.
"""

from __future__ import annotations

import importlib.metadata as md
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
