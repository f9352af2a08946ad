"""No secret value in what is checked in and shipped: compose.yaml, the Dockerfiles, the
generated .env.example. The key only ever exists as the file secrets/api_key (a Docker secret)."""

from __future__ import annotations

import re

import pytest

from tests.container.tools import COMPOSE_FILE, DOCKERFILES, REPO, compose_config

pytestmark = pytest.mark.container

SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.I)
# Token-shaped strings: `qwen38 key init` writes 48 hex digits; sha256 digests are exactly 64.
TOKEN_SHAPED = re.compile(
    r"(?<![0-9A-Za-z])([0-9a-f]{32,63}|[0-9a-f]{65,}|sk-[A-Za-z0-9_-]{16,}|hf_[A-Za-z0-9]{20,})(?![0-9A-Za-z])"
)
SHIPPED = [COMPOSE_FILE, REPO / ".env.example", REPO / ".dockerignore", *DOCKERFILES]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_no_token_shaped_value_is_checked_in(path):
    assert TOKEN_SHAPED.findall(path.read_text()) == []


def test_env_example_leaves_every_secret_empty():
    for line in (REPO / ".env.example").read_text().splitlines():
        if line.startswith("#") or "=" not in line:
            continue
        name, value = line.split("=", 1)
        if SECRET_NAME.search(name) and name != "API_KEY_FILE":
            assert value == "", f"{name} has a value in .env.example"
    assert re.search(r"^VLLM_API_KEY=$", (REPO / ".env.example").read_text(), re.M)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_bake_no_secret_in(path):
    text = path.read_text()
    for instruction, body in re.findall(r"^(ENV|ARG|LABEL)\s+(.*(?:\\\n.*)*)", text, re.M):
        for name in re.findall(r"([A-Za-z_][A-Za-z0-9_.-]*)=", body):
            assert not SECRET_NAME.search(name), f"{path.name}: {instruction} {name}"
    assert not re.search(r"^(COPY|ADD)\s.*(secrets|\.env)\b", text, re.M)
    # The only secret a build sees is the optional CA bundle, mounted for one RUN and not kept.
    assert set(re.findall(r"--mount=type=secret,id=(\w+)", text)) == {"pip_cert"}


def test_compose_environment_carries_no_secret_value():
    for profile in ("single", "long", "spark-lora", "cpu"):
        for name, service in compose_config(profile)["services"].items():
            for key, value in (service.get("environment") or {}).items():
                if SECRET_NAME.search(key):
                    # Only where a secret file is mounted: the values are paths, never secrets.
                    assert (key, value) in {
                        ("API_KEY_FILE", "/run/secrets/api_key"),
                        ("HF_TOKEN_PATH", "/run/secrets/hf_token"),
                    }, (name, key)
    text = COMPOSE_FILE.read_text()
    assert "VLLM_API_KEY" not in text and not re.search(r"\bHF_TOKEN\b", text)


def test_dotenv_secrets_do_not_reach_the_containers(tmp_path):
    """A key someone put in .env anyway stays out of every container's environment."""
    (tmp_path / ".env").write_text("VLLM_API_KEY=" + "s" * 40 + "\nHF_TOKEN=hf_" + "x" * 30 + "\n")
    config = compose_config("single", files=(COMPOSE_FILE,), project_directory=tmp_path)
    dumped = repr(config)
    assert "s" * 40 not in dumped and "x" * 30 not in dumped
