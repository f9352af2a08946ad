"""VISION (issue 58): the setting, what it resolves to, vLLM's arguments for it, and the one-line
refusals (a bad value, limits without vision, a target without a tower)."""

from __future__ import annotations

import json
import subprocess

import pytest

from core.errors import SettingsError
from core.profiles import load_profile, profile_names
from core.settings import DEFAULT_IMAGES_PER_PROMPT, DEFAULT_MAX_PIXELS, load_settings
from entrypoint.engine_args import engine_args
from entrypoint.image_requests import VISION_ENV, ImageLimits
from entrypoint.launch import render_invocation
from entrypoint.model_configs import check_model_limits
from entrypoint.resolve import resolve
from tests.conftest import QWEN38, clean_env
from tests.support.plans import user_settings


@pytest.mark.parametrize("name", profile_names())
def test_every_shipped_profile_serves_text_only_unless_vision_is_asked_for(name, tmp_path):
    resolved = resolve(load_profile(name), user_settings(name, models_dir=tmp_path))
    args = engine_args(resolved)
    assert resolved.vision is None
    assert "limit-mm-per-prompt" not in args and "mm-processor-kwargs" not in args
    if load_profile(name).engine.language_model_only:
        assert args["language-model-only"] is True


@pytest.mark.parametrize("name", ["single", "spark-lora", "cpu"])
def test_vision_true_loads_the_tower_with_one_image_of_2_mp_by_default(name, tmp_path):
    resolved = resolve(load_profile(name), user_settings(name, models_dir=tmp_path, vision=True))
    args = engine_args(resolved)
    assert "language-model-only" not in args
    assert args["limit-mm-per-prompt"] == {"image": DEFAULT_IMAGES_PER_PROMPT, "video": 0} == {"image": 1, "video": 0}
    pil = {"use_fast": False} if name == "cpu" else {}  # the CPU image's processor (test below)
    assert args["mm-processor-kwargs"] == {"max_pixels": DEFAULT_MAX_PIXELS, **pil}
    assert DEFAULT_MAX_PIXELS == 2_097_152 and "vision" in resolved.overridden


def test_the_limits_are_settings(tmp_path):
    settings = user_settings("single", models_dir=tmp_path, vision=True, vision_images_per_prompt=3,
                             vision_max_pixels=1_000_000)
    args = engine_args(resolve(load_profile("single"), settings))
    assert args["limit-mm-per-prompt"] == {"image": 3, "video": 0}
    assert args["mm-processor-kwargs"] == {"max_pixels": 1_000_000}


def test_only_the_cpu_build_gives_the_engine_the_pil_processor(tmp_path):
    """The CPU image's torchvision is a stand-in: its engine reads images with transformers' PIL
    processor, which vLLM's Qwen3-VL processing takes from the engine's options with patch 0086."""
    cpu = resolve(load_profile("cpu"), user_settings("cpu", models_dir=tmp_path, vision=True))
    gpu = resolve(load_profile("single"), user_settings("single", models_dir=tmp_path, vision=True))
    assert cpu.vision.processor_kwargs == {"use_fast": False} and gpu.vision.processor_kwargs == {}
    assert engine_args(cpu)["mm-processor-kwargs"] == {"max_pixels": DEFAULT_MAX_PIXELS, "use_fast": False}
    assert engine_args(gpu)["mm-processor-kwargs"] == {"max_pixels": DEFAULT_MAX_PIXELS}


def test_vision_false_makes_a_vl_target_text_only(tmp_path):
    resolved = resolve(load_profile("cpu"), user_settings("cpu", models_dir=tmp_path, vision=False))
    assert resolved.vision is None and resolved.language_model_only


@pytest.mark.parametrize("knob", ["vision_images_per_prompt", "vision_max_pixels"])
def test_a_vision_limit_without_vision_is_refused_in_one_line(knob, tmp_path):
    settings = user_settings("single", models_dir=tmp_path, **{knob: 4096 if knob.endswith("pixels") else 4})
    value = settings.vision_max_pixels or settings.vision_images_per_prompt
    with pytest.raises(SettingsError, match=rf"^{knob.upper()}={value}: vision is off for profile single; "
                                            rf"set VISION=true or unset {knob.upper()}$"):
        resolve(load_profile("single"), settings)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"VISION": "maybe"}, 'VISION="maybe": Input should be a valid boolean'),
        ({"VISION_MAX_PIXELS": "0"}, 'VISION_MAX_PIXELS="0": Input should be greater than or equal to 1024'),
        ({"VISION_IMAGES_PER_PROMPT": "0"}, 'VISION_IMAGES_PER_PROMPT="0": Input should be greater than or equal to 1'),
        ({"VISION_IMAGES_PER_PROMPT": "two"}, 'VISION_IMAGES_PER_PROMPT="two": Input should be a valid integer'),
    ],
)
def test_a_bad_vision_value_is_one_line_and_a_non_zero_exit(env, expected, tmp_path):
    done = subprocess.run([*QWEN38, "settings", "show"], env=clean_env(**env), cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [f"qwen38: settings: {expected}"] or expected in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_vision_is_read_from_dotenv_like_every_setting(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("VISION=true\nVISION_MAX_PIXELS=65536\n")
    settings = load_settings(env_file)
    assert settings.vision is True and settings.vision_max_pixels == 65536


def test_a_target_without_a_tower_is_refused_naming_what_to_do(tmp_path):
    resolved = resolve(load_profile("cpu"), user_settings("cpu", models_dir=tmp_path, vision=True))
    text_only = {"architectures": ["Qwen3_5ForCausalLM"], "max_position_embeddings": 32768}
    with pytest.raises(SettingsError, match=r"^VISION=true: profile cpu's target has no vision tower \(no "
                                            r"vision_config in .*/tiny/target/config.json\); serve a "
                                            r"vision-language checkpoint .* or unset VISION$"):
        check_model_limits(resolved, text_only, target_source=str(tmp_path / "tiny/target/config.json"))
    check_model_limits(resolved, {**text_only, "vision_config": {"depth": 2}})


def test_the_launch_hands_the_limits_to_the_api_layer_only_with_vision_on(tmp_path):
    from pydantic import SecretStr

    profile, key = load_profile("cpu"), SecretStr("k" * 24)

    def env(**values) -> dict[str, str]:
        settings = user_settings("cpu", models_dir=tmp_path, **values)
        return render_invocation(profile, settings, key, resolved=resolve(profile, settings)).env

    assert VISION_ENV not in env()
    on = env(vision=True, vision_images_per_prompt=2)
    assert ImageLimits.from_env(on[VISION_ENV]) == ImageLimits(2, DEFAULT_MAX_PIXELS)
    assert json.loads(on[VISION_ENV])["images_per_prompt"] == 2


@pytest.mark.parametrize("name", ["cpu", "single"])
def test_vllms_own_parser_reads_the_rendered_vision_arguments(name, tmp_path):
    """The YAML with VISION=true goes through vLLM 0.28.0's FlexibleArgumentParser as at serve time."""
    from pydantic import SecretStr
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from tests.support.plans import render_resolved

    profile = load_profile(name)
    chosen = user_settings(name, models_dir=tmp_path, cache_dir=tmp_path / "cache", vision=True,
                           vision_images_per_prompt=2, vision_max_pixels=1_000_000)
    inv = render_resolved(profile, chosen, SecretStr("k" * 24))
    inv.config_path.parent.mkdir(parents=True)
    inv.config_path.write_text(inv.config_yaml())
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(inv.argv[3:])
    assert args.limit_mm_per_prompt == {"image": 2, "video": 0}
    assert args.mm_processor_kwargs == {"max_pixels": 1_000_000, **({"use_fast": False} if name == "cpu" else {})}
    assert args.mm_processor_cache_gb == 0 and args.language_model_only is False
    assert not args.skip_mm_profiling  # the start-up profiling reads its dummy image like a request's
    assert args.allowed_media_domains is None  # our layer alone refuses every URL


# ---- VISION_URL_DOMAINS --------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, reason",
    [
        ("https://images.lan", "'https://images.lan' carries a scheme: write the host name alone"),
        ("images.lan/cats", "'images.lan/cats' carries a path"),
        ("images.lan:8080", "'images.lan:8080' carries a port or an IPv6 address"),
        ("::1", "'::1' carries a port or an IPv6 address"),
        ("*.images.lan", "'*.images.lan' carries a wildcard"),
        ("user@images.lan", "'user@images.lan' carries a user name"),
        ("images.lan,,10.0.0.5", "an empty item: write host names separated by single commas"),
        ("images.lan,", "an empty item"),
        ("images lan", "'images lan' has whitespace inside: write one host name per item"),
        ("images_lan", "'images_lan' is not a host name: letters, digits, '-' and '.'"),
        ("images.lan.", "'images.lan.' is not a host name"),
    ],
)
def test_a_bad_url_domain_is_refused_at_load_in_one_line(value, reason):
    with pytest.raises(SettingsError) as refused:
        load_settings(None, vision=True, vision_url_domains=value)
    assert str(refused.value).startswith(f"VISION_URL_DOMAINS={json.dumps(value)}: {reason}")
    assert "\n" not in str(refused.value)


def test_url_domains_are_read_lower_cased_and_trimmed():
    settings = load_settings(None, vision=True, vision_url_domains="Images.LAN, 10.0.0.5 ,cdn-1.images.lan")
    assert settings.vision_url_domains == "images.lan,10.0.0.5,cdn-1.images.lan"


def test_a_bad_url_domain_in_the_environment_is_one_line_and_a_non_zero_exit(tmp_path):
    done = subprocess.run([*QWEN38, "settings", "show"], env=clean_env(VISION="true", VISION_URL_DOMAINS="http://x"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "qwen38: settings: VISION_URL_DOMAINS=\"http://x\": 'http://x' carries a scheme: write the host name alone "
        "(images.lan, 10.0.0.5)"]


def test_url_domains_without_vision_are_refused_in_one_line(tmp_path):
    settings = user_settings("single", models_dir=tmp_path, vision_url_domains="images.lan")
    with pytest.raises(SettingsError, match=r"^VISION_URL_DOMAINS=images.lan: vision is off for profile single; "
                                            r"set VISION=true or unset VISION_URL_DOMAINS$"):
        resolve(load_profile("single"), settings)


def test_url_domains_reach_vllm_the_api_layer_and_turn_redirects_off(tmp_path):
    from pydantic import SecretStr
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from tests.support.plans import render_resolved

    profile, key = load_profile("cpu"), SecretStr("k" * 24)
    chosen = user_settings("cpu", models_dir=tmp_path, cache_dir=tmp_path / "cache", vision=True,
                           vision_url_domains="images.lan,10.0.0.5")
    resolved = resolve(profile, chosen)
    assert resolved.vision.url_domains == ("images.lan", "10.0.0.5")
    assert engine_args(resolved)["allowed-media-domains"] == ["images.lan", "10.0.0.5"]
    inv = render_resolved(profile, chosen, key)
    assert inv.env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0" and inv.env["VLLM_MEDIA_FETCH_MAX_RETRIES"] == "1"
    assert ImageLimits.from_env(inv.env[VISION_ENV]).url_domains == ("images.lan", "10.0.0.5")
    inv.config_path.parent.mkdir(parents=True)
    inv.config_path.write_text(inv.config_yaml())
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(inv.argv[3:])
    assert args.allowed_media_domains == ["images.lan", "10.0.0.5"]  # vLLM's own check, as it reads the YAML
    unset = render_resolved(profile, user_settings("cpu", models_dir=tmp_path, cache_dir=tmp_path / "c2", vision=True),
                            key)
    assert "VLLM_MEDIA_URL_ALLOW_REDIRECTS" not in unset.env and "allowed-media-domains" not in unset.config
