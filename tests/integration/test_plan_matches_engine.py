"""The planner against the engine it predicts: `qwen38 serve --profile cpu` prints the KV
pool it planned before it starts vLLM, and the real vLLM 0.28.0 CPU engine then logs its
own ("GPU KV cache size: N tokens, Maximum concurrency ... X.XXx"). They are the same for
prefix caching on and off and speculation on and off. (The CPU build cannot run
speculation with prefix caching on the hybrid target: every command refuses that alike,
tests/unit/test_resolve.py.) The session servers cover two cases; the third is the cold start
`qwen38 bench startup` times (its own cache directory: the plan made afresh), with prefix
caching off, launched when the module starts so that its start overlaps the stall test's
planning and engine: one start proves the startup benchmark and the third case."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from entrypoint.patches import all_present, check_series, find_vllm_dir
from tests.conftest import QWEN38, clean_env, run_cli
from tests.support.kv_pool import pools

pytestmark = pytest.mark.integration


def _assert_plan_is_the_engines(log: str) -> None:
    found = pools(log)
    assert found.planned_tokens == found.engine_tokens, found
    assert found.planned_concurrency == found.engine_concurrency, found
    # The plan answers for the tree that serves: the installed one (patched by `make setup`).
    assert (found.tree == "patched") == all_present(check_series(find_vllm_dir()))


def test_plan_equals_the_engine_with_prefix_caching_and_without_speculation(cpu_server):
    _assert_plan_is_the_engines(cpu_server.log.read_text())


def test_plan_equals_the_engine_with_speculation_and_without_prefix_caching(cpu_spec_server):
    _assert_plan_is_the_engines(cpu_spec_server.log.read_text())


class StartupBench:
    """`qwen38 bench startup --profile cpu --repeat 1` without prefix caching or speculation,
    started at once and read when asked: the benchmark's own `qwen38 serve` from a fresh cache
    directory (verify, a plan made afresh, the engine, the gate), its work directory kept (in
    ``tmp``, its TMPDIR) for the serve log."""

    def __init__(self, tmp: Path, models: Path):
        self.tmp, self.out = tmp, tmp / "startup.json"
        env = clean_env(MODELS_DIR=str(models), PREFIX_CACHING="false", SPECULATION="false", TMPDIR=str(tmp))
        with open(tmp / "bench.stdout", "w") as stdout, open(tmp / "bench.stderr", "w") as stderr:
            self.process = subprocess.Popen(
                [*QWEN38, "bench", "startup", "--profile", "cpu", "--repeat", "1", "--keep", "--out", str(self.out)],
                env=env, cwd=tmp, stdout=stdout, stderr=stderr,
            )  # fmt: skip

    def finished(self, timeout: float = 900) -> tuple[int, str, str]:
        """The benchmark's exit code, stdout and stderr, once it has ended."""
        code = self.process.wait(timeout=timeout)
        return code, (self.tmp / "bench.stdout").read_text(), (self.tmp / "bench.stderr").read_text()

    def serve_log(self) -> str:
        [log] = self.tmp.glob("qwen38-bench-startup-*/serve-0.log")
        return log.read_text(errors="replace")

    def stop(self) -> None:
        """Ends a benchmark still running (its test did not run): SIGINT, on which it stops its server."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            self.process.wait(timeout=180)


@pytest.fixture(scope="module", autouse=True)
def startup_bench(tmp_path_factory, tiny_root) -> Iterator[StartupBench]:
    """The cold start without prefix caching or speculation, started with the module and read
    by the last test."""
    started = StartupBench(tmp_path_factory.mktemp("startup"), tiny_root)
    yield started
    started.stop()


def test_qwen38_plan_answers_what_serve_planned_from_the_same_cache_entry(cpu_server):
    """`qwen38 plan` and `qwen38 serve` resolve the same engine and key the same plan: with
    the server's settings the command reuses the plan serve made, without vLLM."""
    done = run_cli("plan", "--profile", "cpu", "--json", "--no-compare", env=cpu_server.env, cwd=cpu_server.log.parent)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["reused"] is True
    assert plan["pool_tokens"] == pools(cpu_server.log.read_text()).engine_tokens


# ---- a request must fit while it runs (docs/plan.md) --------------------------------------

RUNS = r"""
import json, sys
from vllm import LLM, SamplingParams

pool, max_len, fits = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, kv_cache_memory_bytes=pool, max_model_len=max_len,
          max_num_seqs=1, max_num_batched_tokens=1024, enable_prefix_caching=True, enforce_eager=True,
          mamba_ssm_cache_dtype="float32", dtype="bfloat16")
engine = llm.llm_engine
scheduler = engine.engine_core.engine_core.scheduler
params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0, detokenize=False)


def run(request_id, length, steps=400):
    # One request stepped by hand: finished, or stalled (waiting, nothing scheduled, no progress).
    tokens = [(i * 7919 + 13) % 1000 + 3 for i in range(length)]
    engine.add_request(request_id, {"prompt_token_ids": tokens}, params)
    idle = 0
    for _ in range(steps):
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return {"finished": True, "tokens": len(out.outputs[0].token_ids)}
        idle = idle + 1 if not scheduler.running else 0
        if idle >= 50:
            return {"finished": False, "waiting": len(scheduler.waiting), "running": len(scheduler.running)}
    return {"finished": False, "steps": steps}


print(json.dumps({"blocks": scheduler.kv_cache_manager.block_pool.num_gpu_blocks,
                  "fits": run("fits", fits - 4), "past": run("past", max_len - 64)}))
"""


def test_a_request_the_plan_says_runs_finishes_and_one_past_it_stalls_the_engine(tiny_root, tmp_path):
    """At a pool vLLM admits at exactly 1.00x (19 blocks of 640 tokens for 8,192), the plan
    refuses 8,192 and names 7,680: the null block and the GDN groups' state blocks take the rest.
    The real engine, given 8,192 anyway: a request of 7,680 tokens in all runs to its end; one of
    8,128 + 4 preempts itself and is never admitted again (the H200's 112k stall, at tiny size)."""
    import subprocess
    import sys

    from tests.conftest import REPO, clean_env
    from tests.support.session_cache import session_vllm_cache
    from tests.support.vllm_env import vllm_child_env

    pool, max_len = 19 * 327_680, 8192
    env = clean_env(MODELS_DIR=str(tiny_root), CACHE_DIR=str(tmp_path / "cache"), KV_CACHE_MEMORY_BYTES=str(pool),
                    MAX_MODEL_LEN=str(max_len))
    done = run_cli("plan", "--profile", "cpu", "--no-compare", "--json", env=env)
    plan = json.loads(done.stdout)
    assert done.returncode != 0 and not plan["fits"] and plan["max_concurrency"] == 1.0, done.stdout + done.stderr
    serving = plan["serving"]
    assert serving["num_blocks"] == 19 and serving["block_size"] == 640
    assert serving["blocks_per_request_at_peak"] == 20 and "would preempt itself" in serving["stall"]
    fits = serving["max_model_len_that_fits"]
    assert fits == 7680 and "MAX_MODEL_LEN" in done.stderr and "7,680" in done.stderr
    ran = subprocess.run([sys.executable, "-c", RUNS, str(tiny_root / "tiny" / "target"), str(pool), str(max_len),
                          str(fits)], env={**vllm_child_env(session_vllm_cache()), "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-4000:]
    result = json.loads(ran.stdout.strip().splitlines()[-1])
    assert result["blocks"] == 19
    assert result["fits"] == {"finished": True, "tokens": 4}
    assert result["past"]["finished"] is False and result["past"].get("waiting") == 1, result


# Last in the module: the tests before it ran while this benchmark started its server.
def test_startup_bench_times_a_cold_serve_to_a_passed_gate_whose_plan_equals_the_engine(startup_bench):
    """`qwen38 bench startup` times serve to a passed gate; that start, without prefix caching or
    speculation, planned the pool its engine then logged."""
    code, stdout, stderr = startup_bench.finished()
    assert code == 0, stdout[-2000:] + stderr[-2000:]
    doc = json.loads(startup_bench.out.read_text())
    [run] = doc["runs"]
    assert 0 < run["health_s"] <= run["ready_s"] and run["identity"].startswith("profile=cpu;")
    assert run["cache"] == "cold cache" and "-> ready in" in stdout
    _assert_plan_is_the_engines(startup_bench.serve_log())
