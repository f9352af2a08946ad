"""`entrypoint.engine_output`: the engine's output passes through unchanged, and its own log
lines (vLLM 0.28.0's real messages) tell the phase the start-up heartbeat prints."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from core import progress
from entrypoint import ready
from entrypoint.engine_output import FIRST_PHASE, PHASES, SERVING, Heartbeat, Relay, StartPhase, heartbeat_line

SITE = Path(importlib.util.find_spec("vllm").origin).resolve().parents[1]  # found, not imported

# A GPU start of vLLM 0.28.0 as `docker compose logs` shows it (the messages are vLLM's own,
# their arguments filled in), with the phase the heartbeat says from each line on.
START = [
    ("INFO 07-04 10:00:00 [importing.py:53] Triton is installed but 0 active driver(s) found", FIRST_PHASE),
    ("(APIServer pid=1) INFO 07-04 10:00:01 [api_utils.py:272] non-default args: {'model': '/models/prepared/x'}",
     "starting the engine core process"),
    ("(EngineCore pid=212) INFO 07-04 10:00:09 [core.py:123] Initializing a V1 LLM engine (v0.28.0) with config: "
     "model='/models/prepared/x', speculative_config=None", "initializing the engine"),
    ("(EngineCore pid=212) INFO 07-04 10:00:14 [gpu_model_runner.py:5442] Starting to load model "
     "/models/prepared/x...", "loading weights"),
    ("(EngineCore pid=212) \rLoading safetensors checkpoint shards:  40% Completed | 2/5 [00:31<00:47, 15.6s/it]",
     "loading weights"),
    ("(EngineCore pid=212) INFO 07-04 10:01:32 [default_loader.py:431] Loading weights took 77.21 seconds",
     "loading weights"),
    ("(EngineCore pid=212) INFO 07-04 10:01:33 [gpu_model_runner.py:5538] Model loading took 15.9 GiB memory and "
     "78.412345 seconds", "profiling / KV cache"),
    ("(EngineCore pid=212) INFO 07-04 10:01:40 [backends.py:1095] Using cache directory: /var/cache/qwen38/vllm/"
     "torch_compile_cache/ab12/rank_0_0/backbone for vLLM's torch.compile", "compiling (torch.compile / Dynamo)"),
    ("(EngineCore pid=212) INFO 07-04 10:02:05 [backends.py:1156] Dynamo bytecode transform time: 24.91 s",
     "compiling (torch.compile / Inductor)"),
    ("(EngineCore pid=212) INFO 07-04 10:04:30 [backends.py:394] Compiling a graph for compile range (1, 2048) "
     "takes 141.77 s", "compiling (torch.compile / Inductor)"),
    ("(EngineCore pid=212) INFO 07-04 10:04:31 [monitor.py:82] torch.compile took 170.52 s in total",
     "profiling / KV cache"),
    ("(EngineCore pid=212) INFO 07-04 10:04:40 [monitor.py:82] Initial profiling/warmup run took 8.91 s",
     "profiling / KV cache"),
    ("(EngineCore pid=212) INFO 07-04 10:04:41 [gpu_worker.py:579] Available KV cache memory: 5.2 GiB",
     "profiling / KV cache"),
    ("(EngineCore pid=212) INFO 07-04 10:04:41 [kv_cache_utils.py:1958] GPU KV cache size: 69,758 tokens, Maximum "
     "concurrency for 65,536 tokens per request: 1.06x", "allocating the KV cache"),
    ("(EngineCore pid=212) INFO 07-04 10:04:43 [gpu_model_runner.py:7022] Rank 0: Torch profiler disabled for CUDA "
     "graph capture", "capturing CUDA graphs"),
    ("(EngineCore pid=212) \rCapturing CUDA graphs (mixed prefill-decode, PIECEWISE):  43%|####3     | 29/67 "
     "[00:41<00:54,  1.43s/it]", "capturing CUDA graphs"),
    ("(EngineCore pid=212) INFO 07-04 10:08:55 [gpu_model_runner.py:7071] Graph capturing finished in 252 secs, "
     "took 0.61 GiB", "warming up"),
    ("(EngineCore pid=212) INFO 07-04 10:08:58 [core.py:355] init engine (profile, create kv cache, warmup model) "
     "took 420.13 s", "starting the API server"),
    ("(APIServer pid=1) INFO 07-04 10:09:03 [api_server.py:657] Starting vLLM server on http://0.0.0.0:18020",
     "starting the API server"),
    ("(APIServer pid=1) INFO:     Application startup complete.", SERVING),
]


def _python_sources() -> str:
    roots = [SITE / "vllm" / part for part in ("v1", "compilation", "model_executor", "entrypoints")]
    roots.append(SITE / "uvicorn")
    return "\n".join(p.read_text(errors="replace") for root in roots for p in root.rglob("*.py"))


def test_every_marker_is_a_message_of_the_installed_vllm_or_uvicorn():
    from entrypoint.patches import installed_vllm

    assert installed_vllm()[1].startswith("0.28.0")
    sources = _python_sources()
    missing = [marker for marker, _ in PHASES if marker not in sources]
    assert missing == []


def test_the_phase_follows_a_real_start_line_by_line():
    phase = StartPhase()
    seen = []
    for line, expected in START:
        phase.see(line)
        seen.append((line[:60], phase.current))
        assert phase.current == expected, seen
    assert phase.scanning is False  # the API server is up: request logs are not scanned


def test_the_phase_is_found_in_chunks_cut_anywhere_and_in_tqdm_redraws():
    data = ("\n".join(line for line, _ in START) + "\n").encode()
    phase = StartPhase()
    pending = b""
    phases = []
    for start in range(0, len(data), 37):  # an arbitrary cut, inside lines and inside UTF-8
        pending = phase.feed(pending, data[start : start + 37])
        phases.append(phase.current)
    assert "capturing CUDA graphs" in phases and phases[-1] == SERVING
    assert phases.index("loading weights") < phases.index("capturing CUDA graphs")


def test_the_relay_passes_every_byte_on_as_it_comes_and_reads_the_phase():
    source_read, source_write = os.pipe()
    target_read, target_write = os.pipe()
    phase = StartPhase()
    relay = Relay(source_read, target_write, phase, "stdout").start()
    chunks = [
        b"INFO [core.py:123] Initializing a V1 LLM engine (v0.28.0)\nhalf a li",
        b"ne\rCapturing CUDA graphs (FULL):  10%|#",
        b"         | 1/10 [00:01<00:09]\xc3",  # a UTF-8 character cut in two
        b"\xa9\n",
    ]
    received = b""
    for chunk in chunks:
        os.write(source_write, chunk)
        while len(received) < sum(map(len, chunks[: chunks.index(chunk) + 1])):
            received += os.read(target_read, 1 << 16)  # each chunk arrives without waiting for more
    os.close(source_write)
    relay.join(5)
    os.close(target_write)
    assert received == b"".join(chunks)
    assert not relay.thread.is_alive()
    assert phase.current == "capturing CUDA graphs"
    os.close(target_read)


def test_the_relay_keeps_reading_when_our_own_output_is_gone():
    """The engine must never block on a full pipe: with our stdout closed, its bytes are read and dropped."""
    source_read, source_write = os.pipe()
    target_read, target_write = os.pipe()
    os.close(target_read)  # writes to target_write now fail (EPIPE)
    phase = StartPhase()
    relay = Relay(source_read, target_write, phase, "stdout").start()
    for _ in range(64):  # 4 MiB: far more than a pipe holds
        os.write(source_write, b"x" * (64 << 10))
    os.write(source_write, b"\nINFO Starting to load model /m...\n")
    os.close(source_write)
    relay.join(10)
    assert not relay.thread.is_alive()
    assert phase.current == "loading weights"
    os.close(target_write)


def test_the_heartbeat_says_the_phase_the_time_spent_and_the_time_left_every_30_s():
    assert heartbeat_line("capturing CUDA graphs", 250, 1800) == (
        "qwen38: starting: capturing CUDA graphs (4 min 10 s in, 25 min 50 s left of READY_TIMEOUT)"
    )
    lines: list[str] = []
    phase = StartPhase()
    beat = Heartbeat(lambda: phase.current, 1800, every=30, emit=lines.append)
    loading, capturing = (next(line for line, phase in START if phase == p) for p in ("loading weights",
                                                                                   "capturing CUDA graphs"))
    for waited, line in [(0.2, None), (29.9, None), (30.1, loading), (45, None), (61, capturing), (250, None)]:
        if line:
            phase.see(line)
        beat(waited)
    assert lines == [
        "qwen38: starting: loading weights (30 s in, 29 min 30 s left of READY_TIMEOUT)",
        "qwen38: starting: capturing CUDA graphs (1 min 1 s in, 28 min 59 s left of READY_TIMEOUT)",
        "qwen38: starting: capturing CUDA graphs (4 min 10 s in, 25 min 50 s left of READY_TIMEOUT)",
    ]
    assert heartbeat_line("loading weights", 2000, 1800).endswith("(33 min 20 s in, 0 s left of READY_TIMEOUT)")


def test_the_heartbeat_interval_and_log_level(monkeypatch, capsys):
    monkeypatch.setenv("QWEN38_HEARTBEAT_S", "2")
    beat = Heartbeat(lambda: FIRST_PHASE, 600)
    assert beat.every == 2.0
    progress.set_level("warning")
    try:
        beat(3.0)
    finally:
        progress.set_level(None)
    assert capsys.readouterr().out == ""  # LOG_LEVEL=warning: no heartbeat
    progress.set_level("info")
    try:
        beat(4.5)
    finally:
        progress.set_level(None)
    assert re.fullmatch(r"qwen38: starting: starting the engine \(4 s in, 9 min 56 s left of READY_TIMEOUT\)\n",
                        capsys.readouterr().out)


def test_the_readiness_gate_beats_while_health_does_not_answer(monkeypatch):
    answers = iter([False, False, False, True])

    class Client:
        base_url = "http://127.0.0.1:1"

        def health(self) -> bool:
            return next(answers)

    monkeypatch.setattr(ready.time, "sleep", lambda seconds: None)
    waited: list[float] = []
    ready.wait_for_health(Client(), 60, on_wait=waited.append)
    assert len(waited) == 3 and waited == sorted(waited)


def test_a_start_that_runs_out_of_time_says_where_it_was(tmp_path):
    import json
    import subprocess
    import sys

    from core.profiles import load_profile
    from core.settings import Settings
    from entrypoint.run_files import status_path
    from tests.conftest import free_port

    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        settings = Settings(_env_file=None, port=free_port(), cache_dir=tmp_path)
        settings = settings.model_copy(update={"ready_timeout": 1.0})  # under the knob's minimum, for the test
        phase = StartPhase()
        phase.see(next(line for line, p in START if p == "capturing CUDA graphs"))
        assert ready.Watcher(load_profile("cpu"), settings, None, phase=phase).run(engine.pid) == 1
        status = json.loads(status_path(settings.cache_dir, "cpu").read_text())
        assert status["error"].endswith(
            "did not answer 200 within 1 s (READY_TIMEOUT); last phase in its output: capturing CUDA graphs"
        )
    finally:
        engine.kill()
