"""Agent clients against the `cpu` demo as a new user runs them: the README's examples print an
answer, the official `openai` and `anthropic` SDKs pass `qwen38 validate clients` for every id
(tool loops, streamed tool_use, `tools: []`, the clients' thinking switches: patches 0080, 0082,
0084), an agent-sized prompt fits the context, and real agent clients complete a turn.

The agent clients are not in the development lock: `make agent-clients` installs them into
.cache/agent-clients (or QWEN38_AGENT_CLIENTS_DIR); each test skips, saying so, where its
client is not installed. docs/clients.md lists what was tried, with versions and results."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from entrypoint.client import StackClient
from tests.conftest import REPO, clean_env, run_cli

pytestmark = pytest.mark.integration

BASE = "qwen3.8-27b"
AGENT_CLIENTS = Path(os.environ.get("QWEN38_AGENT_CLIENTS_DIR", REPO / ".cache" / "agent-clients"))
CLAUDE = AGENT_CLIENTS / "node_modules" / ".bin" / "claude"
CODEX = AGENT_CLIENTS / "node_modules" / ".bin" / "codex"
AGENTS_PYTHON = AGENT_CLIENTS / "venv" / "bin" / "python"
INSTALL_HINT = "not installed: run `make agent-clients` (installs into .cache/agent-clients)"


def _readme_examples() -> tuple[list[str], list[str]]:
    """The README's demo-examples block: its shell commands (one per command) and Python blocks."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = text.split("<!-- demo-examples:start -->", 1)[1].split("<!-- demo-examples:end -->", 1)[0]
    shell = "\n".join(re.findall(r"```bash\n(.*?)```", block, flags=re.S)).replace("\\\n", " ")
    commands = [c.strip() for c in re.split(r"\n(?=\S)", shell) if c.strip() and not c.startswith("#")]
    return commands, re.findall(r"```python\n(.*?)```", block, flags=re.S)


def test_readme_examples_print_an_answer_on_the_demo(cpu_server, tmp_path):
    """Every example, run as printed (from a checkout with .venv/ and secrets/), prints text."""
    commands, scripts = _readme_examples()
    assert len(commands) >= 4 and scripts, (commands, scripts)
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "api_key").write_text(cpu_server.api_key)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").symlink_to(Path(sys.executable))
    runs = [["bash", "-c", c] for c in commands] + [[sys.executable, "-c", s] for s in scripts]
    for argv in runs:
        argv[-1] = argv[-1].replace("http://127.0.0.1:18020", cpu_server.base_url)

    def run(argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": ""})

    # Side by side, as several users would: each example mostly waits for the server.
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        results = list(pool.map(run, runs))
    for argv, done in zip(runs, results, strict=True):
        assert done.returncode == 0, (argv[-1], done.stderr[-2000:])
        lines = done.stdout.strip().splitlines()
        assert lines and all(line.strip() and line not in ("null", "None") for line in lines), (argv[-1], done.stdout)


def test_validate_clients_passes_for_every_model_id(cpu_server):
    result = run_cli("validate", "clients", "--json", "--base-url", cpu_server.base_url,
                     env=clean_env(VLLM_API_KEY=cpu_server.api_key))
    report = json.loads(result.stdout)
    failed = [c for c in report["checks"] if c["outcome"] != "pass"]
    assert result.returncode == 0 and not failed, failed
    assert {c["model"] for c in report["checks"]} == {BASE, "qwen3.8-27b-mode-b"}
    names = {c["name"] for c in report["checks"]}
    assert {"openai chat stream", "openai tool result chat", "openai tool result responses", "openai tools [] chat",
            "openai reasoning_effort switch", "anthropic messages stream", "anthropic tool_use",
            "anthropic tool_use stream", "anthropic tool result", "anthropic tools []",
            "anthropic thinking switch"} <= names


def test_an_agent_sized_shared_prefix_fits_and_is_reused(cpu_server):
    """The issue's case: a long shared prefix (system prompt + repository context), twice."""
    # ~18.4k tokens in the tiny model's vocabulary
    context = " ".join(f"def handler_{i}(request): return cache.get(request.key, {i})" for i in range(700))
    with StackClient(cpu_server.base_url, cpu_server.api_key) as client:
        usages = []
        for question in ("Which handler returns 7?", "Which handler returns 9?"):
            body = {"model": BASE, "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "system", "content": context}, {"role": "user", "content": question}]}
            usages.append(client.post_json("/v1/chat/completions", body)["usage"])
    assert usages[0]["prompt_tokens"] > 16384, usages[0]
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 16000, usages[1]


# ---- real agent clients (opt-in: installed by `make agent-clients`) -----------------------


def _statuses(server, offset: int, path: str) -> list[str]:
    """HTTP statuses vLLM logged for POSTs to ``path`` since ``offset`` bytes into its log."""
    with open(server.log, "rb") as log:
        log.seek(offset)
        text = log.read().decode(errors="replace")
    return re.findall(rf'"POST {re.escape(path)}[^"]*" (\d{{3}})', text)


def test_claude_code_completes_a_turn_without_a_protocol_error(cpu_server, tmp_path):
    if not CLAUDE.exists():
        pytest.skip(f"Claude Code {INSTALL_HINT}")
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "PATH": os.environ["PATH"], "HOME": str(home),  # a fresh HOME: no login, no settings of the user's
        "ANTHROPIC_BASE_URL": cpu_server.base_url, "ANTHROPIC_API_KEY": cpu_server.api_key,
        "ANTHROPIC_MODEL": BASE, "ANTHROPIC_DEFAULT_HAIKU_MODEL": BASE, "ANTHROPIC_SMALL_FAST_MODEL": BASE,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
        # The tiny model never ends a turn by itself (no end-of-turn successor): keep turns short.
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64",
    }
    offset = cpu_server.log.stat().st_size
    done = subprocess.run([str(CLAUDE), "-p", "Say hello.", "--output-format", "json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    result = json.loads(done.stdout)
    statuses = _statuses(cpu_server, offset, "/v1/messages")
    assert statuses and set(statuses) == {"200"}, statuses
    usage = result["modelUsage"][BASE]
    assert usage["inputTokens"] + usage["cacheReadInputTokens"] > 16384  # its whole prompt, every request
    assert result["api_error_status"] is None, result
    # What ends the turn is the model's length, never the protocol: a turn of random tokens
    # runs to max_tokens, which Claude Code reports as exceeding its output maximum.
    assert result.get("api_error") in (None, "max_output_tokens"), result


def test_codex_cli_completes_a_turn_over_the_responses_api(cpu_server, tmp_path):
    if not CODEX.exists():
        pytest.skip(f"Codex CLI {INSTALL_HINT}")
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{BASE}"\nmodel_provider = "qwen38"\n\n[model_providers.qwen38]\nname = "qwen38-stack"\n'
        f'base_url = "{cpu_server.base_url}/v1"\nenv_key = "QWEN38_API_KEY"\nwire_api = "responses"\n'
    )
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home), "QWEN38_API_KEY": cpu_server.api_key}
    offset = cpu_server.log.stat().st_size
    # Codex asks for no output limit: the tiny model writes until the context is full (~2.5 min).
    done = subprocess.run([str(CODEX), "exec", "--skip-git-repo-check", "Say hello."], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    statuses = _statuses(cpu_server, offset, "/v1/responses")
    assert statuses and set(statuses) == {"200"}, statuses
    assert done.stdout.strip(), done.stderr[-3000:]  # the turn's answer
    assert "tokens used" in done.stderr


def _agents_turn(server, api: str, behavior: str) -> dict:
    if not AGENTS_PYTHON.exists():
        pytest.skip(f"the OpenAI Agents SDK {INSTALL_HINT}")
    script = REPO / "tests" / "support" / "openai_agents_turn.py"
    done = subprocess.run(
        [str(AGENTS_PYTHON), str(script), server.base_url, BASE, api, behavior], capture_output=True, text=True,
        timeout=600, env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"),
                          "VLLM_API_KEY": server.api_key, "OPENAI_AGENTS_DISABLE_TRACING": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tool_calls"] and result["tool_calls"][0]["city"] in ("Paris", "Oslo", "Lima"), result
    return result


def test_openai_agents_sdk_runs_a_tool_loop_to_a_final_answer_over_chat(cpu_server):
    result = _agents_turn(cpu_server, "chat", "run_llm_again")
    assert result["items"] == ["tool_call_item", "tool_call_output_item", "message_output_item"], result
    assert result["final_output"] and result["responses"] == 2  # the call, then the answer to its result


def test_openai_agents_sdk_runs_a_tool_over_responses(cpu_server):
    result = _agents_turn(cpu_server, "responses", "stop_on_first_tool")
    assert result["items"] == ["tool_call_item", "tool_call_output_item"], result
    call = result["tool_calls"][0]
    assert result["final_output"] == f"{call['city']}: 18 degrees {call['unit']}, light rain."


def test_the_skip_hint_names_a_make_target_that_exists():
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^agent-clients:", makefile, flags=re.M), "the skip reason's `make agent-clients` must work"
