"""Settings: one definition per knob, one clear line per bad value, never a secret."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import SettingsError
from core.settings import Settings, load_settings, masked, read_api_key, render_env_example, render_settings_table
from tests.conftest import REPO, clean_env, run_cli

KEY = "k" * 24


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch, tmp_path):
    """No knob from the developer's shell or .env leaks into these tests."""
    for name in Settings.model_fields:
        monkeypatch.delenv(name.upper(), raising=False)
    monkeypatch.chdir(tmp_path)


def test_defaults_are_the_documented_ones():
    s = load_settings(env_file=None)
    assert (s.profile, s.host, s.port) == ("cpu", "127.0.0.1", 18020)
    assert s.cuda_visible_devices is None  # the profile's first GPUs: 0, or 0,1 for `dual`
    assert s.max_model_len is None and s.speculation is None
    assert (s.gpu_link, s.node_rank, s.head_port, s.gpu_devices) == ("auto", 0, 29501, "0,1")


def test_environment_and_dotenv_are_read_and_environment_wins(monkeypatch, tmp_path):
    (tmp_path / ".env").write_text("PORT=18555\nMAX_NUM_SEQS=3\n")
    monkeypatch.setenv("PORT", "18666")
    s = load_settings()
    assert s.port == 18666 and s.max_num_seqs == 3


def test_unknown_key_in_dotenv_is_named_with_a_suggestion(tmp_path):
    (tmp_path / ".env").write_text("MAX_MODEL_LENGTH=4096\n")
    with pytest.raises(SettingsError, match=r"unknown setting MAX_MODEL_LENGTH in \.env; did you mean MAX_MODEL_LEN\?"):
        load_settings()


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("PORT", "70000", r"PORT=\"70000\": Input should be less than or equal to 65535"),
        ("MAX_MODEL_LEN", "0", r"MAX_MODEL_LEN=\"0\": Input should be greater than or equal to 256"),
        ("SPECULATION", "maybe", r"SPECULATION=\"maybe\": expected dflash, mtp or off \(true: the profile's own"),
        ("SPECULATION", "eagle", r"SPECULATION=\"eagle\": expected dflash, mtp or off"),
        ("SPECULATION", "2", r"SPECULATION=\"2\": expected dflash, mtp or off"),
        ("MTP_DEPTH", "0", r"MTP_DEPTH=\"0\": Input should be greater than or equal to 1"),
        ("MTP_DEPTH", "16", r"MTP_DEPTH=\"16\": Input should be less than or equal to 15"),
        ("MTP_DEPTH", "four", r"MTP_DEPTH=\"four\": Input should be a valid integer"),
        ("PROFILE", "fast",
         r"PROFILE=fast: no profile 'fast' in \S+; known profiles: "
         r"batch, cpu, dual, huge, long, single, spark-lora, spark-pair"),
        ("CUDA_VISIBLE_DEVICES", "all", r"CUDA_VISIBLE_DEVICES=\"all\": String should match pattern"),
        ("CUDA_VISIBLE_DEVICES", "0,", r"CUDA_VISIBLE_DEVICES=\"0,\": String should match pattern"),
        ("GPU_DEVICES", "0", r"GPU_DEVICES=\"0\": String should match pattern"),
        ("GPU_LINK", "sli", r"GPU_LINK=\"sli\": Input should be 'auto', 'pcie' or 'nvlink'"),
        ("HEAD_ADDRESS", "spark-1", r"HEAD_ADDRESS=\"spark-1\": not an IP address: 'spark-1'"),
        ("NETWORK_INTERFACE", "enp1s0f1np1;rm", r"NETWORK_INTERFACE=\"enp1s0f1np1;rm\": String should match pattern"),
        ("NODE_RANK", "8", r"NODE_RANK=\"8\": Input should be less than or equal to 7"),
        ("LOG_LEVEL", "verbose", r"LOG_LEVEL=\"verbose\": Input should be"),
    ],
)
def test_bad_values_fail_with_one_line_naming_the_knob(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=message) as info:
        load_settings(env_file=None)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("value", "chosen"),
    [
        ("dflash", "dflash"), ("mtp", "mtp"), ("MTP", "mtp"), (" Dflash ", "dflash"),
        ("off", False), ("false", False), ("0", False), ("no", False), ("n", False), ("f", False),
        ("on", True), ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("y", True), ("t", True),
    ],
)
def test_speculation_takes_a_method_or_the_booleans_it_always_took(monkeypatch, value, chosen):
    """`dflash`/`mtp` name a method; true keeps meaning the profile's own method, false (and
    `off`) none, in every spelling pydantic read as a boolean before SPECULATION took names."""
    monkeypatch.setenv("SPECULATION", value)
    assert load_settings(env_file=None).speculation == chosen
    assert type(load_settings(env_file=None).speculation) is type(chosen)


def test_speculation_and_mtp_depth_from_code_keep_their_types():
    assert load_settings(env_file=None, speculation=True).speculation is True
    assert load_settings(env_file=None, speculation=False).speculation is False
    assert load_settings(env_file=None, speculation="mtp", mtp_depth=3).mtp_depth == 3


def test_empty_value_means_unset_not_zero(monkeypatch):
    monkeypatch.setenv("MAX_MODEL_LEN", "")
    assert load_settings(env_file=None).max_model_len is None


def test_listening_beyond_loopback_needs_a_key(monkeypatch):
    monkeypatch.setenv("HOST", "0.0.0.0")
    with pytest.raises(SettingsError, match="HOST=0.0.0.0 would expose the API without a key"):
        load_settings(env_file=None)
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    assert load_settings(env_file=None).host == "0.0.0.0"


def test_two_key_sources_conflict(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    monkeypatch.setenv("API_KEY_FILE", str(tmp_path / "k"))
    with pytest.raises(SettingsError, match="VLLM_API_KEY and API_KEY_FILE are both set"):
        load_settings(env_file=None)


def test_api_key_file_is_read_and_checked(monkeypatch, tmp_path):
    path = tmp_path / "key"
    monkeypatch.setenv("API_KEY_FILE", str(path))
    with pytest.raises(SettingsError, match=f"API_KEY_FILE={path}: no such file"):
        read_api_key(load_settings(env_file=None))
    path.write_text("short\n")
    with pytest.raises(SettingsError, match="at least 16 characters") as info:
        read_api_key(load_settings(env_file=None))
    assert "short" not in str(info.value)
    path.write_text(KEY + "\n")
    assert read_api_key(load_settings(env_file=None)).get_secret_value() == KEY


def test_the_key_is_never_shown(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    s = load_settings(env_file=None)
    assert KEY not in repr(s) and KEY not in str(masked(s))
    result = run_cli("settings", "show", env=clean_env(VLLM_API_KEY=KEY))
    assert result.returncode == 0 and KEY not in result.stdout and "********" in result.stdout


def test_env_example_is_generated_from_the_settings_and_has_not_drifted():
    committed = (REPO / ".env.example").read_text()
    assert committed == render_env_example(), "regenerate with `make docs`"
    for name in Settings.model_fields:
        assert f"\n{name.upper()}=" in committed


def test_the_settings_and_profiles_tables_are_generated_and_have_not_drifted():
    from entrypoint.generated_docs import SETTINGS_DOC, render_generated, render_readme

    readme = (REPO / "README.md").read_text()
    assert readme == render_readme(readme), "regenerate with `qwen38 docs`"
    settings_doc = SETTINGS_DOC.read_text()
    assert settings_doc == render_generated(SETTINGS_DOC, settings_doc), "regenerate with `qwen38 docs`"
    assert render_settings_table() in settings_doc


def test_bad_setting_on_the_cli_is_one_line_and_no_traceback():
    result = run_cli("render", "--profile", "cpu", env=clean_env(PORT="http"))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith("qwen38: settings: PORT=")
    assert "Traceback" not in result.stderr


def test_unknown_profile_on_the_cli_lists_the_known_ones():
    result = run_cli("render", "--profile", "turbo")
    assert result.returncode == 2
    assert "no profile 'turbo'" in result.stderr and "spark-lora" in result.stderr


def test_paths_are_paths(monkeypatch):
    monkeypatch.setenv("MODELS_DIR", "/srv/models")
    assert load_settings(env_file=None).models_dir == Path("/srv/models")


# ---- a .env python-dotenv would half-read -----------------------------------------------


def test_an_unparsable_dotenv_line_is_an_error_naming_the_line_never_the_value(tmp_path):
    (tmp_path / ".env").write_text('PROFILE=cpu\n# a comment\nPORT="19000\nMAX_NUM_SEQS=2\n')
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert str(info.value) == (
        ".env:3: cannot parse `PORT=...`; write NAME=value, with any quote closed on the same line"
    )
    (tmp_path / ".env").write_text('VLLM_API_KEY="s3cret-unclosed\n')
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert "s3cret" not in str(info.value) and str(info.value).startswith(".env:1: cannot parse `VLLM_API_KEY=...`")


def test_a_dotenv_that_is_not_utf8_is_one_line_on_the_cli(tmp_path):
    (tmp_path / ".env").write_bytes(b"PROFILE=cpu\nHOST=caf\xe9\n")
    result = run_cli("settings", "show", env=clean_env(), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr == "qwen38: settings: .env:2: not UTF-8 text (byte 0xe9); save the file as UTF-8\n"


def test_a_garbage_dotenv_line_stops_serve_before_anything_starts(tmp_path):
    (tmp_path / ".env").write_text('PORT="19000\n')
    result = run_cli("serve", "--profile", "cpu", env=clean_env(), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        "qwen38: settings: .env:1: cannot parse `PORT=...`; write NAME=value, with any quote closed on the same line\n"
    )


# ---- key file permissions ---------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602])
def test_a_key_file_other_users_can_write_is_refused(monkeypatch, tmp_path, mode):
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    path.chmod(mode)
    monkeypatch.setenv("API_KEY_FILE", str(path))
    with pytest.raises(SettingsError) as info:
        read_api_key(load_settings(env_file=None))
    assert str(info.value) == (
        f"API_KEY_FILE={path}: mode {mode:04o} lets other users replace the key; run `chmod go-w {path}`"
    )


def test_a_world_readable_key_file_is_read_with_a_warning_owner_and_group_read_silently(
    monkeypatch, tmp_path, capsys
):
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    monkeypatch.setenv("API_KEY_FILE", str(path))
    path.chmod(0o640)
    assert read_api_key(load_settings(env_file=None)).get_secret_value() == KEY
    assert capsys.readouterr().err == ""
    path.chmod(0o644)
    assert read_api_key(load_settings(env_file=None)).get_secret_value() == KEY
    assert f"run `chmod o-r {path}`" in capsys.readouterr().err
