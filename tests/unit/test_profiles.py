"""Profiles: declarative, typed, and every mistake is one line naming the file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from core.errors import ProfileError
from core.profiles import PROFILES_DIR, load_profile, profile_names

EXPECTED = {"cpu", "single", "long", "huge", "batch", "dual", "spark-lora", "spark-pair"}


def test_every_profile_of_the_design_exists_and_loads():
    assert set(profile_names()) == EXPECTED
    for name in EXPECTED:
        profile = load_profile(name)
        assert profile.served.base == "qwen3.8-27b"


def test_lora_profiles_serve_the_adapter_as_a_second_id():
    for name in ("cpu", "spark-lora", "spark-pair"):
        assert load_profile(name).model_ids == ["qwen3.8-27b", "qwen3.8-27b-mode-b"]
    assert load_profile("single").model_ids == ["qwen3.8-27b"]


def test_gpu_profiles_carry_the_figures_of_the_design():
    single, long, spark = load_profile("single"), load_profile("long"), load_profile("spark-lora")
    assert (single.engine.max_model_len, single.engine.max_num_seqs) == (65536, 8)
    assert single.engine.kv_cache_memory_bytes == 5_583_457_484 and single.engine.enable_prefix_caching
    assert (long.engine.max_model_len, long.engine.max_num_seqs, long.engine.kv_cache_dtype) == (
        131072, 4, "int8_per_token_head")
    assert spark.engine.kv_cache_memory_bytes == 16 << 30 and spark.engine.kv_cache_dtype.startswith("fp8")
    assert spark.speculative.num_speculative_tokens == 7 and spark.speculative.draft_sample_method == "probabilistic"
    assert spark.engine.enable_flashinfer_autotune is False
    assert all(p.require_patches for p in (single, long, spark))


def test_the_two_gpu_profiles_keep_their_one_gpu_siblings_engine_and_split_it():
    """`dual` is `single`'s engine (DFlash2, prefix caching, the pool per GPU) over two 3090s;
    `spark-pair` is `spark-lora`'s (both identities, fp8 KV, the drafter's Triton attention)
    over two Sparks."""
    pairs = {"dual": "single", "spark-pair": "spark-lora"}
    kept = ("kv_cache_memory_bytes", "kv_cache_dtype", "enable_prefix_caching", "mamba_ssm_cache_dtype",
            "language_model_only", "enable_flashinfer_autotune", "tool_call_parser", "reasoning_parser",
            "shutdown_timeout", "max_num_batched_tokens", "max_num_seqs")
    for two, one in pairs.items():
        a, b = load_profile(two), load_profile(one)
        assert (a.machine, a.cuda_arch, a.models, a.served, a.speculative, a.lora, a.env) == (
            b.machine, b.cuda_arch, b.models, b.served, b.speculative, b.lora, b.env)
        assert {k: getattr(a.engine, k) for k in kept} == {k: getattr(b.engine, k) for k in kept}
        assert a.parallel.tensor_parallel_size == 2 and b.parallel.tensor_parallel_size == 1
        assert a.engine.max_model_len > b.engine.max_model_len  # what the second card buys
    assert load_profile("dual").parallel.nodes == 1 and load_profile("spark-pair").parallel.gpus_per_node == 1


def test_profiles_table_names_the_gpus_and_hosts():
    from core.profiles import render_profiles_table

    table = render_profiles_table()
    assert "| `dual` | 2x rtx3090 | 131,072 | 8 |" in table
    assert "| `spark-pair` | 2x dgx-spark (2 hosts) | 262,144 | 4 |" in table
    assert "| `single` | rtx3090 | 65,536 | 8 |" in table
    assert "| `batch` | rtx3090 | 153,600 | 64 | fp8, prefix caching | none |" in table


def test_batch_serves_many_users_without_a_drafter():
    """`batch`: 64 slots, no speculation and so no drafter slot, fp8 KV in a pinned pool, fp16
    GDN state, and Marlin's int8 activations (W4A8) where 64 rows make the GEMMs compute-bound."""
    batch = load_profile("batch")
    assert batch.speculative is None and batch.models.drafter is None
    assert (batch.engine.max_num_seqs, batch.engine.kv_cache_dtype, batch.engine.mamba_ssm_cache_dtype) == (
        64, "fp8", "float16")
    assert batch.engine.enable_prefix_caching and batch.engine.kv_cache_memory_bytes == 6_979_321_856
    assert batch.env["VLLM_MARLIN_INPUT_DTYPE"] == "int8" and batch.require_patches
    assert "VLLM_MARLIN_INPUT_DTYPE" not in load_profile("single").env  # 1-8 rows stay W4A16


def test_huge_holds_the_seeds_longest_context_in_4_bit_keys_and_2_bit_values():
    """`huge`: `long`'s models and drafter, 245,760 context in 2 slots, the k4v2_g128 KV format in
    the seed's CTX=huge pool, on the Triton backend that reads it; `long` keeps its int8 KV."""
    huge, long = load_profile("huge"), load_profile("long")
    assert (huge.engine.max_model_len, huge.engine.max_num_seqs, huge.engine.kv_cache_dtype) == (
        245760, 2, "k4v2_g128")
    assert huge.engine.kv_cache_memory_bytes == 5_261_334_938 and huge.engine.enable_prefix_caching
    assert huge.engine.attention_backend == "TRITON_ATTN" and huge.engine.block_size == 128
    assert (huge.machine, huge.models, huge.speculative, huge.env) == (long.machine, long.models, long.speculative,
                                                                        long.env)
    assert huge.require_patches and long.engine.kv_cache_dtype == "int8_per_token_head"


def test_a_cpu_profile_cannot_take_the_k4v2_format(profiles_copy):
    _edit(profiles_copy, "cpu", "max_num_seqs = 4", 'max_num_seqs = 4\nkv_cache_dtype = "k4v2_g128"')
    with pytest.raises(ProfileError, match="k4v2_g128: its kernels are Triton kernels for CUDA GPUs.*use kv_cache_dtype auto"):
        load_profile("cpu", profiles_copy)


@pytest.fixture
def profiles_copy(tmp_path) -> Path:
    for path in PROFILES_DIR.glob("*.toml"):
        shutil.copy(path, tmp_path)
    return tmp_path


def _edit(directory: Path, name: str, old: str, new: str) -> None:
    path = directory / f"{name}.toml"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("max_num_seqs = 4", "max_num_seqs = 4\nmax_num_sequences = 4", r"engine\.max_num_sequences: Extra inputs"),
        ("max_num_seqs = 4", "max_num_seqs = 0", r"engine\.max_num_seqs: Input should be greater than or equal to 1"),
        ('dir = "tiny/target"', 'dir = "../outside"', "dir must be a relative path inside MODELS_DIR"),
        ('adapter = "qwen3.8-27b-mode-b"', 'adapter = "qwen3.8-27b"', "the adapter id must differ"),
        ("[lora]\nmax_lora_rank = 1\nmax_loras = 1\n", "", "`models.adapter`, `served.adapter` and `lora` go together"),
        ('kv_cache_dtype', 'kv_cache_dtype', None),
    ],
)
def test_a_bad_profile_is_one_line_naming_the_file(profiles_copy, old, new, message):
    if message is None:  # the cpu profile has no kv_cache_dtype line: add a wrong one instead
        _edit(profiles_copy, "cpu", "max_num_seqs = 4", 'max_num_seqs = 4\nkv_cache_dtype = "int3"')
        message = r"engine\.kv_cache_dtype: Input should be"
    else:
        _edit(profiles_copy, "cpu", old, new)
    with pytest.raises(ProfileError, match=message) as info:
        load_profile("cpu", profiles_copy)
    assert str(profiles_copy / "cpu.toml") in str(info.value)
    assert "\n" not in str(info.value)


def test_a_split_that_is_not_even_over_the_hosts_is_refused(profiles_copy):
    _edit(profiles_copy, "spark-pair", "tensor_parallel_size = 2\nnodes = 2", "tensor_parallel_size = 3\nnodes = 2")
    with pytest.raises(ProfileError, match="tensor_parallel_size 3 cannot be split evenly over 2 nodes"):
        load_profile("spark-pair", profiles_copy)
    _edit(profiles_copy, "dual", "tensor_parallel_size = 2", "tensor_parallel_size = 2\npipeline_parallel_size = 2")
    with pytest.raises(ProfileError, match=r"parallel\.pipeline_parallel_size: Extra inputs"):
        load_profile("dual", profiles_copy)


def test_extra_engine_arguments_may_not_repeat_a_typed_one(profiles_copy):
    _edit(profiles_copy, "cpu", "[speculative]", "extra = { max-model-len = 8 }\n\n[speculative]")
    with pytest.raises(ProfileError, match="engine.extra.max-model-len repeats the typed field"):
        load_profile("cpu", profiles_copy)


def test_a_drafter_needs_a_drafting_method(profiles_copy):
    _edit(profiles_copy, "single", 'method = "dflash"', 'method = "ngram"')
    with pytest.raises(ProfileError, match="go together"):
        load_profile("single", profiles_copy)


def test_invalid_toml_and_unknown_profile(profiles_copy):
    (profiles_copy / "broken.toml").write_text("engine = [\n")
    with pytest.raises(ProfileError, match="not valid TOML"):
        load_profile("broken", profiles_copy)
    with pytest.raises(ProfileError, match="unknown profile 'nope'.*known profiles: batch, broken, cpu"):
        load_profile("nope", profiles_copy)


def test_the_3090_profiles_and_cpu_allow_mtp_at_the_seeds_depth_beside_their_drafter():
    for name in ("single", "long", "dual", "cpu"):
        spec = load_profile(name).speculative
        assert spec.methods == ("dflash", "mtp") and spec.depth("mtp") == 4 and spec.depth("dflash") > 0
    for name in ("spark-lora", "spark-pair"):
        assert load_profile(name).speculative.methods == ("dflash",)
    with pytest.raises(ValueError, match="not one of this profile's"):
        load_profile("spark-lora").speculative.depth("mtp")


@pytest.mark.parametrize(
    ("new", "message"),
    [
        ("num_speculative_tokens = 0", r"speculative\.mtp\.num_speculative_tokens: Input should be greater than or"),
        ("num_speculative_tokens = 16", r"speculative\.mtp\.num_speculative_tokens: Input should be less than or"),
        ("depth = 4", r"speculative\.mtp\.depth: Extra inputs"),
    ],
)
def test_a_bad_mtp_table_is_one_line_naming_the_file(profiles_copy, new, message):
    _edit(profiles_copy, "cpu", "[speculative.mtp]                   # SPECULATION=mtp: the target's own MTP head, "
          "no drafter\nnum_speculative_tokens = 4", f"[speculative.mtp]\n{new}")
    with pytest.raises(ProfileError, match=message) as info:
        load_profile("cpu", profiles_copy)
    assert str(profiles_copy / "cpu.toml") in str(info.value)


def test_mtp_as_the_profiles_own_method_takes_no_second_depth(profiles_copy):
    _edit(profiles_copy, "cpu", 'method = "dflash"', 'method = "mtp"')
    with pytest.raises(ProfileError, match=r"method mtp takes its depth from num_speculative_tokens"):
        load_profile("cpu", profiles_copy)
