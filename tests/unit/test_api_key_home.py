"""The API key has one home, `core.settings` (`read_api_key`, `client_api_key`): one
precedence for every command (an explicit --api-key / --api-key-file wins over the settings;
else VLLM_API_KEY or API_KEY_FILE, from the environment, then .env), and VLLM_API_KEY with
API_KEY_FILE both set is refused everywhere, in one line that never holds the key."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from core.errors import SettingsError
from entrypoint.cli import build_parser
from tests.conftest import REPO, clean_env, run_cli

HOME = REPO / "entrypoint" / "settings.py"
KEY_VARIABLES = {"VLLM_API_KEY", "API_KEY_FILE"}
KEY_PATH = re.compile(r"api_key|key_file|THROWAWAY_KEY", re.IGNORECASE)  # what names a key file
ENV_KEY = "e" * 24
FILE_KEY = "f" * 24
FLAG_KEY = "a" * 24
DOTENV_KEY = "d" * 24


@pytest.fixture(autouse=True)
def _own_directory(monkeypatch, tmp_path):
    """Each test's `.env` is its own (tests/conftest.py already cleared the caller's shell)."""
    monkeypatch.chdir(tmp_path)


def _key_file(tmp_path: Path, name: str, key: str) -> Path:
    path = tmp_path / name
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path


# ---- the guard: no second reader ------------------------------------------------------


def _reads_of_key_settings(path: Path, root: Path = REPO) -> list[str]:
    """Reads of VLLM_API_KEY / API_KEY_FILE (``env[...]``, ``.get(...)``, ``getenv(...)``,
    ``.pop(...)``) and reads of a key file (``<...api_key...>.read_text()`` / ``read_bytes()`` /
    ``open(<...key_file...>)``) in one source file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if isinstance(node.slice, ast.Constant) and node.slice.value in KEY_VARIABLES:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            args = [a for a in node.args if isinstance(a, ast.Constant)]
            if name in {"get", "getenv", "pop"} and any(a.value in KEY_VARIABLES for a in args):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
            elif name in {"read_text", "read_bytes"} and isinstance(func, ast.Attribute):
                if KEY_PATH.search(ast.unparse(func.value)):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
            elif name == "open" and node.args and KEY_PATH.search(ast.unparse(node.args[0])):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_settings_module_reads_the_api_key():
    sources = [p for d in ("entrypoint", "prepare") for p in sorted((REPO / d).rglob("*.py")) if p != HOME]
    readers = [hit for path in sources for hit in _reads_of_key_settings(path)]
    assert readers == [], "read the API key through core.settings.client_api_key / read_api_key"


def test_the_guard_sees_each_kind_of_read(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os\n"
        "a = os.environ.get('VLLM_API_KEY')\n"
        "b = env['API_KEY_FILE']\n"
        "c = os.getenv('API_KEY_FILE')\n"
        "d = Path(args.api_key_file).read_text().strip()\n"
        "e = open(api_key_path).read()\n"
        "env['API_KEY_FILE'] = 'written, not read'\n"
    )
    hits = _reads_of_key_settings(probe, tmp_path)
    assert len(hits) == 5, hits


# ---- one precedence, through each command's own code path -----------------------------


def _validate_key(*argv: str) -> str | None:
    from entrypoint.cli.validate import server_target

    args = build_parser("validate").parse_args(["validate", "apis", "--base-url", "http://127.0.0.1:1", *argv])
    return server_target(args)[1]


def _validate_local_key(*argv: str) -> str | None:
    """validate without --base-url: the URL from the settings, the key by the same rule."""
    from entrypoint.cli.validate import server_target

    args = build_parser("validate").parse_args(["validate", "apis", *argv])
    return server_target(args)[1]


def _bench_key(*argv: str) -> str | None:
    from bench.commands.server import api_key

    args = build_parser("bench").parse_args(
        ["bench", "c1", "--base-url", "http://127.0.0.1:1", "--model", "m", *argv]
    )
    return api_key(args)


def _watchdog_key(*argv: str) -> str | None:
    from bench.commands.server import api_key

    args = build_parser("bench").parse_args(
        ["bench", "watchdog", "--base-url", "http://127.0.0.1:1", "--model", "m", *argv]
    )
    return api_key(args)


COMMANDS = [_validate_key, _validate_local_key, _bench_key, _watchdog_key]


@pytest.mark.parametrize("key_of", COMMANDS)
def test_the_environment_is_read_as_the_server_reads_it(key_of, monkeypatch, tmp_path):
    assert key_of() is None  # an open server
    monkeypatch.setenv("VLLM_API_KEY", ENV_KEY)
    assert key_of() == ENV_KEY
    monkeypatch.delenv("VLLM_API_KEY")
    monkeypatch.setenv("API_KEY_FILE", str(_key_file(tmp_path, "k", FILE_KEY)))
    assert key_of() == FILE_KEY
    monkeypatch.delenv("API_KEY_FILE")
    (tmp_path / ".env").write_text(f"VLLM_API_KEY={DOTENV_KEY}\n")
    assert key_of() == DOTENV_KEY


@pytest.mark.parametrize("key_of", COMMANDS)
def test_both_variables_set_are_refused_by_every_command(key_of, monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_API_KEY", ENV_KEY)
    monkeypatch.setenv("API_KEY_FILE", str(_key_file(tmp_path, "k", FILE_KEY)))
    with pytest.raises(SettingsError) as info:
        key_of()
    assert str(info.value) == "VLLM_API_KEY and API_KEY_FILE are both set; set one of them"


@pytest.mark.parametrize("key_of", COMMANDS)
def test_a_flag_wins_over_the_environment(key_of, monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_API_KEY", ENV_KEY)
    assert key_of("--api-key", FLAG_KEY) == FLAG_KEY
    assert key_of("--api-key-file", str(_key_file(tmp_path, "flag", FLAG_KEY))) == FLAG_KEY
    monkeypatch.delenv("VLLM_API_KEY")
    monkeypatch.setenv("API_KEY_FILE", str(_key_file(tmp_path, "k", FILE_KEY)))
    assert key_of("--api-key-file", str(tmp_path / "flag")) == FLAG_KEY


@pytest.mark.parametrize("key_of", COMMANDS)
def test_bad_flags_are_one_line_without_the_key(key_of, tmp_path):
    with pytest.raises(SettingsError, match="--api-key and --api-key-file are both given; use one"):
        key_of("--api-key", FLAG_KEY, "--api-key-file", str(tmp_path / "flag"))
    with pytest.raises(SettingsError) as info:
        key_of("--api-key-file", str(tmp_path / "missing"))
    assert str(info.value) == f"--api-key-file {tmp_path / 'missing'}: no such file"
    with pytest.raises(SettingsError) as info:
        key_of("--api-key", "short secret")
    assert "short secret" not in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).startswith("--api-key: the key must be one word")
    loose = _key_file(tmp_path, "loose", FLAG_KEY)
    loose.chmod(0o666)
    with pytest.raises(SettingsError, match=r"--api-key-file .*loose: mode 0666 lets other users replace the key"):
        key_of("--api-key-file", str(loose))


def _run_shutdown(monkeypatch, tmp_path, generated: bool) -> str:
    """`bench shutdown` up to the key it sends, the server and the streams faked."""
    import subprocess

    import bench.shutdown as shutdown
    import bench.startup as startup
    from entrypoint.keys import init_key_file

    def engine_env(profile, workdir):
        env = dict(os.environ)
        if generated:
            init_key_file(workdir / startup.THROWAWAY_KEY)
            env["API_KEY_FILE"] = str(workdir / startup.THROWAWAY_KEY)
        return env

    class Process:
        pid = 0

        def poll(self):
            return 0

    sent = {}

    class Sent(Exception):
        pass

    def stop_mid_stream(process, base_url, key, **kw):
        sent["key"] = key
        raise Sent

    cache = tmp_path / "cache"
    (cache / "run").mkdir(parents=True, exist_ok=True)
    (cache / "run" / "cpu.vllm.yaml").write_text("shutdown-timeout: 30\n")
    monkeypatch.setattr(startup, "engine_env", engine_env)
    monkeypatch.setattr(startup, "gate_verdict", lambda status, pid: {"ready": True})
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **kw: Process())
    monkeypatch.setattr(shutdown, "stop_mid_stream", stop_mid_stream)
    args = build_parser("bench").parse_args(["bench", "shutdown", "--profile", "cpu", "--cache-dir", str(cache)])
    with pytest.raises(Sent):
        args.func(args)
    return sent["key"]


def test_bench_shutdown_sends_the_servers_key(monkeypatch, tmp_path):
    assert _run_shutdown(monkeypatch, tmp_path, generated=False) == ""  # an open server
    monkeypatch.setenv("API_KEY_FILE", str(_key_file(tmp_path, "k", FILE_KEY)))
    assert _run_shutdown(monkeypatch, tmp_path, generated=False) == FILE_KEY
    monkeypatch.delenv("API_KEY_FILE")
    thrown_away = _run_shutdown(monkeypatch, tmp_path, generated=True)
    assert len(thrown_away) >= 16 and thrown_away not in (FILE_KEY, ENV_KEY)


def test_bench_shutdown_refuses_both_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_API_KEY", ENV_KEY)
    monkeypatch.setenv("API_KEY_FILE", str(_key_file(tmp_path, "k", FILE_KEY)))
    with pytest.raises(SettingsError, match="VLLM_API_KEY and API_KEY_FILE are both set"):
        _run_shutdown(monkeypatch, tmp_path, generated=False)


def test_the_cli_refusal_is_one_line_without_the_key(tmp_path):
    key_file = _key_file(tmp_path, "k", FILE_KEY)
    result = run_cli(
        "validate", "apis", "--base-url", "http://127.0.0.1:1",
        env=clean_env(VLLM_API_KEY=ENV_KEY, API_KEY_FILE=str(key_file)), cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "VLLM_API_KEY and API_KEY_FILE are both set" in lines[0], result.stderr
    assert ENV_KEY not in result.stdout + result.stderr and FILE_KEY not in result.stdout + result.stderr

