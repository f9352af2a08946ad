"""`make test`: the whole suite as two pytest runs side by side.

The integration and container tests spend most of their time waiting on vLLM servers that
start beside them (one or two cores busy at a time); the unit tests run one at a time, mostly
on one core. Run as one session they leave a core idle for the unit tests' ~13 minutes on a
2-core machine. So the unit tests run in a second pytest process beside the rest, at a lower
CPU priority (`nice`): the servers and the timing-sensitive checks of the first run keep the
CPU they had, and the unit tests take what is left. Both must pass; the unit run's report is
printed after the first run's. With arguments (``make test PYTEST_ARGS=...``) it is one plain
pytest run of exactly those.

    python -m tests.suite [PYTEST_ARGS...]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UNIT = "tests/unit"
UNIT_NICENESS = 10


def main(argv: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest"]
    if argv:
        return subprocess.call([*pytest, *argv], cwd=REPO)
    began = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as unit_log:
        unit = subprocess.Popen(
            [*pytest, UNIT], cwd=REPO, stdout=unit_log, stderr=subprocess.STDOUT,
            preexec_fn=lambda: os.nice(UNIT_NICENESS),
        )  # fmt: skip
        try:
            rest = subprocess.call([*pytest, f"--ignore={UNIT}"], cwd=REPO)
            unit_code = unit.wait()
        except BaseException:
            unit.kill()
            raise
        unit_log.seek(0)
        print(f"\n===== {UNIT} (run beside the above, at nice {UNIT_NICENESS}) =====", flush=True)
        sys.stdout.write(unit_log.read())
    minutes, seconds = divmod(round(time.monotonic() - began), 60)
    verdict = "passed" if rest == 0 and unit_code == 0 else "FAILED"
    print(f"\nmake test: {verdict} in {minutes} min {seconds} s (the rest: exit {rest}; {UNIT}: exit {unit_code})")
    return 0 if verdict == "passed" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
