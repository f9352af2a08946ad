"""The GPU tier's tiny profiles (tests/gpu/tiny_profiles.py) are valid profiles whose rendered
configs vLLM 0.28.0's own parser reads with the real profiles' engine settings - checked here
on CPU, so a GPU run is not spent on a configuration mistake."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from core.profiles import load_profile
from core.settings import Settings
from tests.gpu.tiny_profiles import TINY_KV_BYTES, TINY_MAX_MODEL_LEN, derive, write_profiles
from tests.support.plans import render_resolved

KEY = SecretStr("s3cret-" + "k" * 20)
SLOTS = {"target": "tiny/target", "drafter": "tiny/drafter2"}


@pytest.mark.parametrize("name", ["single", "long", "spark-lora"])
def test_tiny_gpu_profile_keeps_the_engine_settings_and_vllm_parses_it(name, tmp_path):
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    slots = dict(SLOTS, adapter="tiny/adapter") if name == "spark-lora" else SLOTS
    data = derive(name, slots, extra_engine={"gpu_memory_utilization": 0.15})
    directory = write_profiles(tmp_path / "profiles", {f"{name}-tiny": data})
    tiny, real = load_profile(f"{name}-tiny", directory), load_profile(name)

    for field in ("kv_cache_dtype", "enable_prefix_caching", "mamba_ssm_cache_dtype", "enforce_eager",
                  "enable_flashinfer_autotune", "max_num_seqs"):
        assert getattr(tiny.engine, field) == getattr(real.engine, field), field
    assert tiny.speculative == real.speculative and tiny.lora == real.lora and tiny.served == real.served
    assert all(slot["generated"] == "tiny" for slot in tiny.models.model_dump(exclude_none=True).values())

    settings = Settings(_env_file=None, profile=f"{name}-tiny", profiles_dir=directory, models_dir=tmp_path / "m",
                        cache_dir=tmp_path / "cache")
    inv = render_resolved(tiny, settings, KEY)
    inv.config_path.parent.mkdir(parents=True)
    inv.config_path.write_text(inv.config_yaml())
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(inv.argv[3:])
    assert args.model == str(tmp_path / "m" / "tiny" / "target")
    assert args.max_model_len == TINY_MAX_MODEL_LEN and args.kv_cache_memory_bytes == TINY_KV_BYTES
    assert args.gpu_memory_utilization == 0.15
    assert args.kv_cache_dtype == real.engine.kv_cache_dtype
    assert args.speculative_config["model"] == str(tmp_path / "m" / "tiny" / "drafter2")
    assert args.speculative_config["num_speculative_tokens"] == 7
    assert args.speculative_config["draft_sample_method"] == "probabilistic"
    assert args.additional_config == {"gdn_prefill_backend": "triton"}
    # tool calls as the `cpu` profile serves the same tiny model (its hermes-style template)
    assert args.tool_call_parser == load_profile("cpu").engine.tool_call_parser
    assert inv.env["VLLM_ENFORCE_STRICT_TOOL_CALLING"] == "0"
    # The drafter's backend is the profile's, never a test-only override (docs/gpu.md).
    assert args.speculative_config.get("attention_backend") == real.speculative.attention_backend
    assert args.attention_backend is None
    if name == "spark-lora":
        assert args.speculative_config["attention_backend"] == "TRITON_ATTN"
        (module,) = args.lora_modules
        assert (module.name, module.path) == ("qwen3.8-27b-mode-b", str(tmp_path / "m" / "tiny" / "adapter"))


def test_the_tier_writes_four_profiles_and_its_reference_serves_without_the_drafter(tmp_path):
    from tests.gpu.test_profiles_gpu import KEYS, tier_profiles
    from tests.gpu.tiny_profiles import write_profiles

    directory = write_profiles(tmp_path / "profiles", tier_profiles())
    assert sorted(p.stem for p in directory.glob("*.toml")) == sorted(KEYS.values())
    settings = Settings(_env_file=None, profile="single-nospec-tiny", profiles_dir=directory,
                        models_dir=tmp_path / "m", cache_dir=tmp_path / "cache")
    plain = render_resolved(load_profile("single-nospec-tiny", directory), settings, KEY)
    spec = render_resolved(load_profile("single-tiny", directory), settings.model_copy(update={"profile": "single-tiny"}), KEY)
    assert "speculative-config" not in plain.config and spec.config["speculative-config"]["num_speculative_tokens"] == 7
    # the same engine otherwise: the lossless comparison compares the drafter alone
    same = {k: v for k, v in plain.config.items() if k != "compilation-config"}
    assert same == {k: v for k, v in spec.config.items() if k not in ("speculative-config", "compilation-config")}


def test_tiny_batch_profile_keeps_its_64_slots_fp8_kv_and_w4a8_and_vllm_parses_it(tmp_path):
    """`batch` has no drafter slot: its tiny copy serves the tiny target alone with the real
    profile's 64 slots, fp8 KV, prefix caching, fp16 state, CUDA graphs to 64 and the W4A8 switch
    (a no-op for the tiny bf16 target: only Marlin layers read it)."""
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    data = derive("batch", {"target": "tiny/target"}, extra_engine={"gpu_memory_utilization": 0.15})
    directory = write_profiles(tmp_path / "profiles", {"batch-tiny": data})
    tiny = load_profile("batch-tiny", directory)
    assert tiny.speculative is None and tiny.models.drafter is None
    settings = Settings(_env_file=None, profile="batch-tiny", profiles_dir=directory, models_dir=tmp_path / "m",
                        cache_dir=tmp_path / "cache")
    inv = render_resolved(tiny, settings, KEY)
    inv.config_path.parent.mkdir(parents=True)
    inv.config_path.write_text(inv.config_yaml())
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(inv.argv[3:])
    assert (args.max_num_seqs, args.kv_cache_dtype, args.mamba_ssm_cache_dtype) == (64, "fp8", "float16")
    assert args.enable_prefix_caching and args.speculative_config is None
    assert args.max_model_len == TINY_MAX_MODEL_LEN and args.kv_cache_memory_bytes == TINY_KV_BYTES
    assert args.compilation_config.max_cudagraph_capture_size == 64
    assert inv.env["VLLM_MARLIN_INPUT_DTYPE"] == "int8" and inv.env["QWEN38_W4A8_LAYERS"] == "mlp"
