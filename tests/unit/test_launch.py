"""Rendering: a profile + settings become exactly one vLLM invocation, which vLLM's own
argument parser accepts as intended; the key never appears in argv, config or output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from core.errors import SettingsError
from core.profiles import load_profile, profile_names
from core.settings import Settings
from entrypoint.asgi import API_KEY_ENV, MIDDLEWARE_PATH
from entrypoint.compile_cache import compile_cache_key
from entrypoint.drain import DRAIN_ENV, ENGINE_GRACE_S
from entrypoint.launch import ENGINE_MODULE
from entrypoint.resolve import resolve
from tests.conftest import clean_env, run_cli
from tests.support.plans import PAIR_HEAD, render_resolved

KEY = SecretStr("s3cret-" + "k" * 20)


def settings(**values) -> Settings:
    """Settings as a user has them; on a multi-host profile, the head's link knobs (PAIR_HEAD)."""
    values.setdefault("models_dir", Path("/models"))
    values.setdefault("cache_dir", Path("/cache"))
    if load_profile(values.get("profile", "cpu")).parallel.nodes > 1:
        values = {**PAIR_HEAD, **values}
    return Settings(_env_file=None, **values)


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch):
    for name in Settings.model_fields:
        monkeypatch.delenv(name.upper(), raising=False)


@pytest.mark.parametrize("name", sorted(profile_names()))
def test_every_profile_renders_one_config_file_invocation(name):
    profile = load_profile(name)
    inv = render_resolved(profile, settings(profile=name), KEY, python="/venv/bin/python")
    assert inv.argv == ["/venv/bin/python", "-m", ENGINE_MODULE, "--config", f"/cache/run/{name}.vllm.yaml"]
    assert inv.config["model"] == f"/models/{profile.models.target.dir}"
    assert inv.config["served-model-name"] == "qwen3.8-27b"
    assert inv.config["enable-prompt-tokens-details"] is True
    assert inv.env["HF_HUB_OFFLINE"] == "1"
    assert inv.env["VLLM_CACHE_ROOT"] == f"/cache/vllm/{inv.cache_key}"
    # Every compiler's cache lives under CACHE_DIR (the images' volume): only a first start compiles.
    assert {k: inv.env[k] for k in ("TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE", "CUDA_CACHE_PATH")} == {
        "TRITON_CACHE_DIR": "/cache/triton", "FLASHINFER_WORKSPACE_BASE": "/cache/flashinfer", "CUDA_CACHE_PATH": "/cache/cuda"}
    assert int(inv.env["CUDA_CACHE_MAXSIZE"]) == 4 << 30
    if profile.platform == "cuda":
        # the first GPUs of this host the profile splits its layers over, numbered as nvidia-smi does
        assert inv.env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, range(profile.parallel.gpus_per_node)))
        assert inv.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert inv.env["FLASHINFER_DISABLE_VERSION_CHECK"] == "1"
    secret = KEY.get_secret_value()
    # The key reaches our guard (entrypoint.auth) only; vLLM's narrower check is never installed.
    assert inv.env[API_KEY_ENV] == secret and "VLLM_API_KEY" not in inv.env
    assert inv.config["middleware"] == [MIDDLEWARE_PATH]
    assert inv.env[DRAIN_ENV] == str(profile.engine.shutdown_timeout)
    assert inv.config["shutdown-timeout"] == profile.engine.shutdown_timeout + ENGINE_GRACE_S
    public = json.dumps(inv.public())
    assert secret not in public and secret not in " ".join(inv.argv) and secret not in inv.config_yaml()


def test_gpu_profiles_render_dflash2_depth_7_and_the_pinned_pool():
    inv = render_resolved(load_profile("single"), settings(profile="single"), None)
    assert inv.config["speculative-config"] == {
        "method": "dflash",
        "num_speculative_tokens": 7,
        "model": "/models/artifacts/qwen3.8-27b-dflash2-w4a16",
        "draft_sample_method": "probabilistic",
    }
    assert inv.config["kv-cache-memory-bytes"] == 5_583_457_484
    assert inv.config["mamba-ssm-cache-dtype"] == "float16"
    assert inv.config["enable-flashinfer-autotune"] is False
    assert API_KEY_ENV not in inv.env and "VLLM_API_KEY" not in inv.env


def test_spark_profile_serves_the_adapter_as_a_native_lora_module():
    inv = render_resolved(load_profile("spark-lora"), settings(profile="spark-lora"), KEY)
    assert inv.config["enable-lora"] is True and inv.config["max-lora-rank"] == 1 and inv.config["max-loras"] == 1
    (module,) = [json.loads(m) for m in inv.config["lora-modules"]]
    assert module == {
        "name": "qwen3.8-27b-mode-b",
        "path": "/models/prepared/qwen3.8-27b-mode-b",
        "base_model_name": "qwen3.8-27b",
    }
    assert inv.config["kv-cache-memory-bytes"] == 16 << 30


def test_overrides_replace_profile_values():
    inv = render_resolved(
        load_profile("single"),
        settings(profile="single", max_model_len=32768, max_num_seqs=2, kv_cache_memory_bytes=1 << 30,
                 speculation=False, prefix_caching=False, enable_thinking=False, port=19000, cuda_visible_devices="1"),
        None,
    )
    c = inv.config
    assert (c["max-model-len"], c["max-num-seqs"], c["kv-cache-memory-bytes"], c["port"]) == (32768, 2, 1 << 30, 19000)
    assert "speculative-config" not in c and c["enable-prefix-caching"] is False
    assert c["default-chat-template-kwargs"] == {"enable_thinking": False}
    assert inv.env["CUDA_VISIBLE_DEVICES"] == "1"


def test_cpu_profile_refuses_speculation_with_prefix_caching_and_says_how_to_choose():
    profile = load_profile("cpu")
    assert resolve(profile, settings()).speculative is None
    with pytest.raises(SettingsError, match="set SPECULATION=false or PREFIX_CACHING=false"):
        render_resolved(profile, settings(speculation=True), KEY)
    inv = render_resolved(profile, settings(speculation=True, prefix_caching=False), KEY)
    assert inv.config["speculative-config"]["model"] == "/models/tiny/drafter"


def test_speculation_cannot_be_forced_on_a_profile_without_a_drafter():
    profile = load_profile("cpu").model_copy(update={"speculative": None, "models": load_profile("cpu").models.model_copy(update={"drafter": None})})
    with pytest.raises(SettingsError, match="SPECULATION=true: profile cpu has no speculative decoding"):
        render_resolved(profile, settings(speculation=True, prefix_caching=False), KEY)


def test_a_profile_that_requires_a_key_refuses_to_render_without_one():
    with pytest.raises(SettingsError, match="requires an API key"):
        render_resolved(load_profile("cpu"), settings(), None)


def test_compile_cache_is_keyed_by_what_shapes_the_graphs():
    profile = load_profile("single")
    base = compile_cache_key(resolve(profile, settings(profile="single")))
    assert base == compile_cache_key(resolve(profile, settings(profile="single", port=1234)))
    deeper = profile.model_copy(update={"speculative": profile.speculative.model_copy(update={"num_speculative_tokens": 5})})
    assert compile_cache_key(resolve(deeper, settings(profile="single"))) != base
    assert compile_cache_key(resolve(profile, settings(profile="single", speculation=False))) != base
    assert compile_cache_key(resolve(profile, settings(profile="single", max_num_seqs=4))) != base
    # The pool's size shapes no graph: a bigger pool reuses the compiled artifacts.
    assert compile_cache_key(resolve(profile, settings(profile="single", kv_cache_memory_bytes=6 << 30))) == base


@pytest.mark.parametrize("name", sorted(profile_names()))
def test_vllms_own_parser_reads_the_rendered_config_as_intended(name, tmp_path):
    """The YAML goes through vLLM 0.28.0's FlexibleArgumentParser exactly as at serve time."""
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    profile = load_profile(name)
    inv = render_resolved(profile, settings(profile=name, cache_dir=tmp_path), KEY)
    inv.config_path.parent.mkdir(parents=True)
    inv.config_path.write_text(inv.config_yaml())
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(inv.argv[3:])
    assert args.model == inv.config["model"]
    assert args.served_model_name == ["qwen3.8-27b"]
    assert args.max_model_len == profile.engine.max_model_len
    assert args.enable_prefix_caching is profile.engine.enable_prefix_caching
    assert args.kv_cache_memory_bytes == profile.engine.kv_cache_memory_bytes
    assert args.enable_prompt_tokens_details is True
    assert args.api_key is None  # the key is in the environment only
    assert args.middleware == [MIDDLEWARE_PATH]  # one --middleware flag, as vLLM's append action takes it
    assert args.shutdown_timeout == profile.engine.shutdown_timeout + ENGINE_GRACE_S
    spec = profile.speculative if (profile.speculative and profile.speculative.enabled) else None
    if spec:
        assert args.speculative_config["num_speculative_tokens"] == spec.num_speculative_tokens
    else:
        assert args.speculative_config is None
    if profile.lora:
        assert args.enable_lora is True and args.max_lora_rank == 1
        (module,) = args.lora_modules
        assert (module.name, module.base_model_name) == ("qwen3.8-27b-mode-b", "qwen3.8-27b")
    if profile.engine.enable_flashinfer_autotune is False:
        assert args.enable_flashinfer_autotune is False
    assert args.tensor_parallel_size == profile.parallel.tensor_parallel_size
    assert args.nnodes == profile.parallel.nodes and args.node_rank == 0 and args.headless is False
    if profile.parallel.tensor_parallel_size > 1:
        assert args.distributed_executor_backend == "mp"  # vLLM's own executor, never Ray


@pytest.mark.parametrize(
    "name", sorted(n for n in profile_names() if (s := load_profile(n).speculative) and "mtp" in s.methods)
)
def test_vllms_own_parser_reads_the_rendered_mtp_config(name, tmp_path):
    """SPECULATION=mtp renders vLLM 0.28.0's `{"method": "mtp", "num_speculative_tokens": N}` (no
    drafter model: vLLM takes the target's own head) and its parser takes the YAML as meant."""
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    profile = load_profile(name)
    chosen = settings(profile=name, cache_dir=tmp_path, speculation="mtp", mtp_depth=3, prefix_caching=False)
    inv = render_resolved(profile, chosen, KEY)
    inv.config_path.parent.mkdir(parents=True)
    inv.config_path.write_text(inv.config_yaml())
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(inv.argv[3:])
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 3}
    if profile.platform == "cuda":
        assert args.compilation_config.max_cudagraph_capture_size == profile.engine.max_num_seqs * 4


def test_render_json_on_the_cli_masks_the_key():
    secret = KEY.get_secret_value()
    result = run_cli("render", "--profile", "spark-lora", "--json", env=clean_env(VLLM_API_KEY=secret))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) >= {"argv", "env", "config"}
    assert data["env"][API_KEY_ENV] == "********"
    assert secret not in result.stdout


def test_lookup_is_off_by_default_and_renders_nothing_new():
    for name in profile_names():
        profile = load_profile(name)
        if profile.speculative is None:
            continue
        resolved = resolve(profile, settings(profile=name, speculation=True, prefix_caching=False))
        assert resolved.speculative.lookup_tokens == 0
        inv = render_resolved(profile, settings(profile=name, speculation=True, prefix_caching=False), KEY)
        assert "lookup_tokens" not in inv.config["speculative-config"]
        assert inv.config["speculative-config"]["num_speculative_tokens"] == profile.speculative.num_speculative_tokens


def test_lookup_widens_the_verify_block_past_the_drafter_depth():
    single = load_profile("single")
    spec = render_resolved(single, settings(profile="single", lookup=True), KEY).config["speculative-config"]
    assert (spec["num_speculative_tokens"], spec["lookup_tokens"]) == (15, 8)  # 16 = 1 + 7 drafter + 8 lookup
    spec = render_resolved(single, settings(profile="single", lookup=True, verify_block=12), KEY).config[
        "speculative-config"]
    assert (spec["num_speculative_tokens"], spec["lookup_tokens"]) == (11, 4)
    cpu = render_resolved(load_profile("cpu"), settings(lookup=True, speculation=True, prefix_caching=False), KEY)
    assert (cpu.config["speculative-config"]["num_speculative_tokens"],
            cpu.config["speculative-config"]["lookup_tokens"]) == (15, 11)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"profile": "cpu", "lookup": True}, "LOOKUP=true: lookup drafting extends speculative decoding, which is off"),
        ({"profile": "single", "lookup": True, "speculation": False}, "set SPECULATION=true"),
        ({"profile": "single", "verify_block": 12}, "VERIFY_BLOCK=12: without lookup drafting the verify block is 1 "
                                                    r"\+ the drafter depth \(8\)"),
        ({"profile": "single", "lookup": True, "verify_block": 8}, r"VERIFY_BLOCK=8: .* must be 9\.\.16"),
    ],
)
def test_lookup_conflicts_fail_with_one_line(values, message):
    with pytest.raises(SettingsError, match=message) as info:
        render_resolved(load_profile(values["profile"]), settings(**values), KEY)
    assert "\n" not in str(info.value)


def test_verify_block_outside_8_to_16_is_refused_by_the_settings():
    from core.settings import load_settings

    for value in (7, 17):
        with pytest.raises(SettingsError, match=f"VERIFY_BLOCK={value}"):
            load_settings(None, verify_block=value)


def test_lookup_changes_the_compile_cache_key_with_the_verify_width():
    profile = load_profile("single")
    base = compile_cache_key(resolve(profile, settings(profile="single")))
    wide = compile_cache_key(resolve(profile, settings(profile="single", lookup=True)))
    assert wide != base
    assert base == compile_cache_key(resolve(profile, settings(profile="single", lookup=False)))


def test_vllms_own_parser_accepts_the_lookup_speculative_config(tmp_path):
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    inv = render_resolved(load_profile("single"), settings(profile="single", lookup=True, cache_dir=tmp_path), KEY)
    inv.config_path.parent.mkdir(parents=True)
    inv.config_path.write_text(inv.config_yaml())
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(inv.argv[3:])
    assert args.speculative_config["lookup_tokens"] == 8
    assert args.speculative_config["num_speculative_tokens"] == 15


def test_gpu_profiles_capture_cuda_graphs_only_up_to_a_full_verify_step():
    """8 slots x (1 + 7) = 64 tokens for `single` (vLLM's default would capture to 128);
    the wider lookup block and speculation off move it; CPU profiles capture nothing."""
    def limit(name, **env):
        inv = render_resolved(load_profile(name), settings(profile=name, **env), KEY)
        return (inv.config.get("compilation-config") or {}).get("max_cudagraph_capture_size")

    assert limit("single") == 64 and limit("long") == 32 and limit("spark-lora") == 32
    assert limit("single", speculation=False) == 8
    assert limit("single", max_num_seqs=4) == 32
    assert limit("cpu") is None


def test_the_drain_is_the_profiles_unless_overridden_and_vllm_drains_a_little_longer():
    assert render_resolved(load_profile("single"), settings(profile="single"), KEY).env[DRAIN_ENV] == "20"
    assert render_resolved(load_profile("cpu"), settings(), KEY).env[DRAIN_ENV] == "0"
    inv = render_resolved(load_profile("cpu"), settings(shutdown_timeout=7), KEY)
    assert inv.env[DRAIN_ENV] == "7" and inv.config["shutdown-timeout"] == 7 + ENGINE_GRACE_S
    with pytest.raises(ValidationError):
        settings(shutdown_timeout=31)  # past the bound that keeps the stop inside compose's grace period


@pytest.mark.parametrize("name", sorted(profile_names()))
def test_torch_profile_dir_is_off_by_default_and_renders_vllms_profiler_when_set(name, tmp_path):
    """Issue 57: TORCH_PROFILE_DIR unset renders nothing of the profiler (every profile's
    invocation as before); set, vLLM's torch profiler into that directory without Python
    stacks, read by vLLM's own parser as a ProfilerConfig, and its record_function scopes on."""
    from vllm.config import ProfilerConfig
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    profile = load_profile(name)
    plain = render_resolved(profile, settings(profile=name), KEY)
    assert "profiler-config" not in plain.config and "VLLM_CUSTOM_SCOPES_FOR_PROFILING" not in plain.env
    assert "profiler" not in plain.config_yaml()
    traces = tmp_path / "traces"
    inv = render_resolved(profile, settings(profile=name, cache_dir=tmp_path, torch_profile_dir=traces), KEY)
    assert inv.config["profiler-config"] == {
        "profiler": "torch", "torch_profiler_dir": str(traces), "torch_profiler_with_stack": False}
    assert inv.env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] == "1"
    assert {k: v for k, v in inv.config.items() if k != "profiler-config"} == plain.config
    inv.config_path.parent.mkdir(parents=True)
    inv.config_path.write_text(inv.config_yaml())
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(inv.argv[3:])
    config = args.profiler_config
    config = config if isinstance(config, ProfilerConfig) else ProfilerConfig(**config)
    assert config.profiler == "torch" and config.torch_profiler_dir == str(traces)
    assert config.torch_profiler_with_stack is False
