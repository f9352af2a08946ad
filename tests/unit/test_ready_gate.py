"""The readiness watcher fails closed: no ready server within the timeout -> engine stopped."""

from __future__ import annotations

import json
import subprocess
import sys

from core.profiles import load_profile
from core.settings import Settings
from entrypoint.run_files import status_path
from entrypoint.ready import Watcher, base_url_for
from tests.conftest import free_port


def test_a_gate_that_cannot_pass_stops_the_engine_and_records_why(tmp_path):
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        settings = Settings(_env_file=None, port=free_port(), cache_dir=tmp_path)
        # model_copy skips validation: a READY_TIMEOUT shorter than the knob allows (10 s), for the test
        settings = settings.model_copy(update={"ready_timeout": 2.0})
        code = Watcher(load_profile("cpu"), settings, None).run(engine.pid)
        assert code == 1
        assert engine.wait(timeout=10) == -15  # SIGTERM from the watcher
        status = json.loads(status_path(settings.cache_dir, "cpu").read_text())
        assert status["ready"] is False and "did not answer 200 within 2 s" in status["error"]
    finally:
        engine.kill()


def test_base_url_never_targets_a_wildcard_address():
    s = Settings(_env_file=None, host="0.0.0.0", vllm_api_key="k" * 20, port=18123)
    assert base_url_for(s) == "http://127.0.0.1:18123"
    assert base_url_for(Settings(_env_file=None, host="::1", port=1)) == "http://[::1]:1"
