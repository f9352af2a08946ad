"""`qwen38 plan`: the planner's inputs come from the one resolution, its cache key covers
what a plan depends on, and impossible values are refused before vLLM is started."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.errors import PlanError, ProfileError, SettingsError
from core.profiles import load_profile
from entrypoint.model_configs import MODEL_CONFIGS_DIR, ModelConfig, config_source, read_model_configs, shape_only_copy
from entrypoint.patches import SERIES_DIR
from entrypoint.plan import PLAN_IGNORED, Tree, build_request, check_plannable, plan_cache_key
from entrypoint.resolve import resolve
from entrypoint.resolved_engine import field_paths
from tests.conftest import clean_env, run_cli
from tests.support.plans import planner_pythonpath, user_settings  # noqa: F401
from tests.support.vllm_views import child_pythonpath

TREE = Tree(Path("/installed/vllm"), SERIES_DIR, "patched")


def _inputs(name: str, models_dir: Path, **values):
    profile = load_profile(name)
    resolved = resolve(profile, user_settings(name, models_dir=models_dir, **values))
    return resolved, read_model_configs(profile, resolved, models_dir)


def test_served_config_is_preferred_over_the_config_only_copy(tmp_path):
    slot = load_profile("single").models.target
    assert config_source(slot, tmp_path) == MODEL_CONFIGS_DIR / "qwen3.8-27b-w4a16" / "config.json"
    served = tmp_path / slot.dir / "config.json"
    served.parent.mkdir(parents=True)
    served.write_text("{}")
    assert config_source(slot, tmp_path) == served


def test_generated_model_without_its_directory_is_a_plan_error(tmp_path):
    from core.profiles import ModelSlot

    with pytest.raises(PlanError, match="prepare the model first"):
        config_source(ModelSlot(dir="tiny-hybrid", generated="tiny"), tmp_path)


def test_weight_quantization_is_dropped_from_the_copy_vllm_reads(tmp_path):
    source = MODEL_CONFIGS_DIR / "qwen3.8-27b-w4a16" / "config.json"
    copy_dir = shape_only_copy(ModelConfig(source, source.read_text()), tmp_path / "t")
    copy = json.loads((Path(copy_dir) / "config.json").read_text())
    assert "quantization_config" not in copy
    assert copy["text_config"]["layer_types"] == json.loads(source.read_text())["text_config"]["layer_types"]


def test_overrides_from_settings_reach_the_request_and_an_unpinned_pool_is_refused(tmp_path):
    resolved, configs = _inputs("single", tmp_path, max_model_len=32768, prefix_caching=False)
    engine = build_request(resolved, configs, tmp_path / "w")["engine_args"]
    assert engine["max_model_len"] == 32768 and engine["max_num_seqs"] == 8
    assert engine["enable_prefix_caching"] is False
    unpinned = resolved.model_copy(update={"kv_cache_memory_bytes": None})
    with pytest.raises(PlanError, match="kv_cache_memory_bytes"):
        check_plannable(unpinned, configs)


def test_request_carries_the_drafter_and_the_gpu(tmp_path):
    resolved, configs = _inputs("long", tmp_path)
    request = build_request(resolved, configs, tmp_path / "w")
    assert request["platform"] == "cuda" and request["device_capability"] == [8, 6]
    speculative = request["engine_args"]["speculative_config"]
    assert speculative["method"] == "dflash" and speculative["num_speculative_tokens"] == 7
    assert configs.sources()["drafter"].endswith("qwen3.8-27b-dflash2-w4a16/config.json")
    resolved, configs = _inputs("long", tmp_path, speculation=False)
    assert build_request(resolved, configs, tmp_path / "x")["engine_args"].get("speculative_config") is None
    assert configs.drafter is None  # a drafter that does not run is not read either


def test_cpu_plan_has_no_drafter_unless_speculation_is_turned_on(tiny_root, tmp_path):
    """The `cpu` profile ships with speculation off: the planner must not count the drafter
    the launch leaves off (it once planned 21,425 tokens where the engine had 64,275)."""
    resolved, configs = _inputs("cpu", tiny_root)
    assert build_request(resolved, configs, tmp_path / "a")["engine_args"].get("speculative_config") is None
    resolved, configs = _inputs("cpu", tiny_root, speculation=True, prefix_caching=False)
    spec = build_request(resolved, configs, tmp_path / "b")["engine_args"]["speculative_config"]
    assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == 4


def test_attention_backend_named_by_a_profile_reaches_the_planner(tmp_path):
    profile = load_profile("spark-lora")
    pinned = profile.model_copy(
        update={"engine": profile.engine.model_copy(update={"attention_backend": "TRITON_ATTN"})}
    )
    resolved = resolve(pinned, user_settings("spark-lora", models_dir=tmp_path))
    request = build_request(resolved, read_model_configs(pinned, resolved, tmp_path), tmp_path / "w")
    assert request["attention_backend"] == "TRITON_ATTN"


def test_lookup_widens_the_speculative_width_the_planner_reserves(tiny_root, tmp_path):
    """Each slot keeps state/KV for every verify position: drafter depth + lookup tokens."""
    off = build_request(*_inputs("cpu", tiny_root, speculation=True, prefix_caching=False), tmp_path / "a")
    on = build_request(
        *_inputs("cpu", tiny_root, speculation=True, prefix_caching=False, lookup=True, verify_block=16),
        tmp_path / "b",
    )
    assert off["engine_args"]["speculative_config"]["num_speculative_tokens"] == 4
    assert on["engine_args"]["speculative_config"]["num_speculative_tokens"] == 15
    assert "lookup_tokens" not in on["engine_args"]["speculative_config"]  # stock trees plan the same width


@pytest.mark.parametrize("name", ["single", "long", "spark-lora"])
def test_lookup_on_a_dflash2_profile_is_planned_with_the_wider_block(tmp_path, name):
    """DFlash2 runs on vLLM's V2 runner, which has lookup drafting since patch 0072: the
    GPU profiles plan their verify block at VERIFY_BLOCK (16 = 1 + 7 drafter + 8 lookup)."""
    resolved, configs = _inputs(name, tmp_path, lookup=True)
    assert configs.drafter is not None and "DFlash2DraftModel" in configs.drafter.data["architectures"]
    check_plannable(resolved, configs)
    request = build_request(resolved, configs, tmp_path / "w")
    assert request["engine_args"]["speculative_config"]["num_speculative_tokens"] == 15
    narrower = build_request(*_inputs(name, tmp_path, lookup=True, verify_block=12), tmp_path / "x")
    assert narrower["engine_args"]["speculative_config"]["num_speculative_tokens"] == 11


@pytest.mark.slow
def test_the_planner_prices_the_wider_lookup_block_on_single(tmp_path, planner_pythonpath):
    """vLLM's own arithmetic for `single` with LOOKUP=true (docs/lookup.md): 16 GDN state
    copies per slot instead of 8 (plus prefix caching's one), so its 65,536-token context
    no longer fits the pinned pool: the plan refuses it and names what fits: 55,184 tokens, where
    vLLM's admission alone would take 57,120 (a request must fit while it runs: the null block,
    the 16 lookahead slots and async scheduling's extra GDN state block per group)."""
    from entrypoint.plan import plan_engines

    off, on, fitted, admitted = plan_engines(  # one planner process for the four
        [_inputs("single", tmp_path), _inputs("single", tmp_path, lookup=True),
         _inputs("single", tmp_path, lookup=True, max_model_len=55_184),
         _inputs("single", tmp_path, lookup=True, max_model_len=57_120)], compare=False)
    assert off.fits and off.pool_tokens == 68_605
    assert not on.fits and on.pool_tokens == 59_486 and on.serving.max_model_len_that_fits == 55_184
    assert on.serving.state_bytes_per_request == 6 * 17 * on.serving.bytes_per_block
    assert on.serving.slots_resident == 3 < off.serving.slots_resident == 6
    assert on.serving.stall is None  # vLLM itself refuses 65,536: the usual refusal
    assert fitted.fits and fitted.serving.slots_resident_with_max_context == 1
    assert fitted.serving.blocks_per_request_at_peak <= fitted.serving.num_blocks
    assert not admitted.fits and "would preempt itself and never be admitted again" in admitted.serving.stall
    assert "max_model_len that fits is 55,184" in admitted.refusal_line()


def test_a_context_above_the_models_positions_is_refused_in_one_line(tmp_path):
    resolved, configs = _inputs("single", tmp_path, max_model_len=10_000_000)
    with pytest.raises(SettingsError) as info:
        check_plannable(resolved, configs)
    assert str(info.value).startswith("MAX_MODEL_LEN=10000000: above the 262,144 positions the model is made for")
    assert "use at most 262,144" in str(info.value) and "\n" not in str(info.value)
    profile = load_profile("single")
    longer = profile.model_copy(update={"engine": profile.engine.model_copy(update={"max_model_len": 300_000})})
    resolved = resolve(longer, user_settings("single", models_dir=tmp_path))
    with pytest.raises(ProfileError, match="profile single: engine.max_model_len = 300000: above"):
        check_plannable(resolved, read_model_configs(longer, resolved, tmp_path))


@pytest.mark.filterwarnings("ignore::UserWarning")  # the changed values are not of the field's type
def test_plan_cache_key_covers_every_field_but_the_ignored_ones(tmp_path):
    # spark-pair: the profile with every nested part (speculative, lora, parallel; vision with VISION=true) set.
    resolved, configs = _inputs("spark-pair", tmp_path, vision=True)
    base = plan_cache_key(resolved, configs, TREE)
    assert set(PLAN_IGNORED) <= set(field_paths())
    for path in field_paths():
        parent, _, leaf = path.partition(".")
        if leaf:
            nested = getattr(resolved, parent).model_copy(update={leaf: f"changed {path}"})
            changed = resolved.model_copy(update={parent: nested})
        elif path in ("speculative", "lora", "parallel", "vision"):
            continue  # their fields are changed one by one
        else:
            changed = resolved.model_copy(update={path: f"changed {path}"})
        same = plan_cache_key(changed, configs, TREE) == base
        assert same == (path in PLAN_IGNORED), path


def test_plan_cache_key_follows_the_model_config_and_the_tree(tmp_path):
    resolved, configs = _inputs("single", tmp_path)
    base = plan_cache_key(resolved, configs, TREE)
    edited = configs.target.text.replace('"num_hidden_layers": 64', '"num_hidden_layers": 62')
    assert edited != configs.target.text
    other = type(configs)(ModelConfig(configs.target.path, edited), configs.drafter)
    assert plan_cache_key(resolved, other, TREE) != base
    assert plan_cache_key(resolved, configs, Tree(TREE.vllm_dir, TREE.series_dir, "stock")) != base


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LOOKUP": "true", "SPECULATION": "false"}, "qwen38: settings: LOOKUP=true: lookup drafting extends"),
        ({"SPECULATION": "true", "PREFIX_CACHING": "true"}, "qwen38: settings: profile cpu: the CPU build cannot"),
        ({"MAX_MODEL_LEN": "10000000"}, "qwen38: settings: MAX_MODEL_LEN=10000000: above the 32,768 positions"),
    ],
)
def test_plan_refuses_impossible_settings_at_once_like_every_command(tiny_root, tmp_path, env, message):
    env = clean_env(MODELS_DIR=str(tiny_root), CACHE_DIR=str(tmp_path / "cache"), **env)
    start = time.monotonic()
    done = run_cli("plan", "--profile", "cpu", env=env, cwd=tmp_path)
    assert time.monotonic() - start < 20  # no vLLM was imported (that alone takes longer here)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(message) and done.stderr.count("\n") == 1, done.stderr


def test_plan_reads_the_profile_from_profiles_dir(tmp_path):
    """A profile that exists only in PROFILES_DIR is the one planned (refused here, cheaply,
    for a context its model cannot take: the refusal names it)."""
    mine = tmp_path / "profiles"
    mine.mkdir()
    text = (MODEL_CONFIGS_DIR.parent / "single.toml").read_text().replace("max_model_len = 65536",
                                                                         "max_model_len = 300000")
    (mine / "mine.toml").write_text(text)
    env = clean_env(PROFILES_DIR=str(mine), MODELS_DIR=str(tmp_path / "m"), CACHE_DIR=str(tmp_path / "c"))
    done = run_cli("plan", "--profile", "mine", env=env, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("qwen38: profile: profile mine: engine.max_model_len = 300000: above"), done.stderr


@pytest.mark.slow
def test_plan_json_has_the_fields_the_launcher_reads(seed_plans):
    data = json.loads(seed_plans[("single", True)].model_dump_json())
    assert isinstance(data["pool_tokens"], int)
    assert isinstance(data["max_concurrency"], float)
    assert isinstance(data["fits"], bool) and isinstance(data["patched"], bool)
    assert set(data["variants"]) == {"patched", "stock"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["single", "long", "batch", "dual"])
def test_profile_capacity_records_what_the_planner_finds(seed_plans, name):
    capacity = load_profile(name).capacity
    assert seed_plans[(name, False)].pool_tokens == capacity.pool_tokens
    assert seed_plans[(name, True)].pool_tokens == capacity.pool_tokens_prefix_caching


@pytest.mark.slow
def test_all_slots_busy_is_reported_not_assumed(seed_plans):
    """With DFlash2 K=7 every slot holds 8 GDN state copies (9 with prefix caching):
    ~0.7 GB per slot, so the 5.2 GiB pool cannot keep 8 slots resident at once."""
    single = seed_plans[("single", True)].serving
    assert single.state_bytes_per_request == 6 * 9 * single.bytes_per_block
    assert single.slots_resident < 8 and not single.fits_with_all_slots_busy
    assert single.slots_resident_with_max_context == 1


@pytest.mark.slow
def test_batch_keeps_its_64_slots_resident_only_without_prefix_caching(seed_plans):
    """No drafter: one fp16 GDN state copy per request, two in prefix caching's align mode
    (150 MiB), so the 6.5 GiB fp8 pool keeps all 64 slots only with prefix caching off."""
    off, on = seed_plans[("batch", False)].serving, seed_plans[("batch", True)].serving
    assert off.fits and on.fits and on.max_model_len == 153600
    assert on.state_bytes_per_request == 2 * off.state_bytes_per_request == 6 * on.bytes_per_block
    assert (off.slots_resident, on.slots_resident) == (64, 38)
    assert off.context_bytes_per_token == 16 * 4 * 256 * 2  # fp8: one byte per K/V element


@pytest.mark.slow
def test_spark_lora_fits_its_16_gib_fp8_pool(seed_plans):
    plan = seed_plans[("spark-lora", None)]
    assert plan.fits and plan.max_model_len == 131072
    assert plan.serving.block_size % 16 == 0
    # the drafter's layers are planned with the backend the profile pins for them
    assert plan.serving.drafter_backend == "TRITON_ATTN"


@pytest.mark.slow
@pytest.mark.parametrize(("two", "one"), [("dual", ("single", True)), ("spark-pair", ("spark-lora", None))])
def test_tensor_parallel_halves_what_each_gpu_keeps(seed_plans, two, one):
    """At TP=2 vLLM gives each GPU half of the KV heads and half of every GDN and drafter
    state: per GPU, a context token, a slot's state and the drafter's window take half the
    bytes, so the same pool per GPU holds more than twice the tokens (the fixed per-slot state
    halves too)."""
    pair = seed_plans[(two, True if two == "dual" else None)]
    single = seed_plans[one]
    a, b = pair.serving, single.serving
    assert a.context_bytes_per_token * 2 == b.context_bytes_per_token
    assert a.state_bytes_per_request * 2 == b.state_bytes_per_request
    assert a.window_bytes_per_request * 2 == b.window_bytes_per_request
    assert pair.tensor_parallel_size == 2 and pair.pool_bytes == single.pool_bytes  # the pool is per GPU
    assert pair.pool_tokens > 2 * single.pool_tokens and pair.fits


@pytest.mark.slow
def test_spark_pair_fits_the_models_whole_context_in_every_slot(seed_plans):
    plan = seed_plans[("spark-pair", None)]
    assert plan.max_model_len == 262_144 and plan.fits and plan.fits_with_all_slots_busy
    assert plan.serving.drafter_backend == "TRITON_ATTN"
    assert "on each of its GPUs" in plan.refusal_line()


@pytest.mark.slow
def test_refusal_line_names_context_pool_and_what_fits(seed_plans):
    plan = seed_plans[("long", False)]
    refused = plan.model_copy(update={"patched": False, "fits": False, "serving": plan.variants["stock"]})
    line = refused.refusal_line()
    assert "131,072-token request does not fit" in line and "5,583,457,484-byte" in line
    assert f"{plan.variants['stock'].max_model_len_that_fits:,}" in line and "\n" not in line


@pytest.mark.slow
def test_cli_refuses_a_context_that_does_not_fit(tmp_path):
    env = clean_env(MODELS_DIR=str(tmp_path), CACHE_DIR=str(tmp_path / "cache"), MAX_MODEL_LEN="262144")
    env["PYTHONPATH"] = child_pythonpath()
    done = subprocess.run(
        [sys.executable, "-m", "entrypoint.cli", "plan", "--profile", "long", "--json", "--no-compare"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=900,
        check=False,
    )
    assert done.returncode != 0
    plan = json.loads(done.stdout[done.stdout.index("{") :])
    assert plan["fits"] is False and plan["patched"] is True and list(plan["variants"]) == ["patched"]
    assert "262,144-token request does not fit" in done.stderr and "Traceback" not in done.stderr


def test_a_validation_error_from_vllm_is_passed_on_as_one_line():
    from pydantic import BaseModel, ValidationError, field_validator

    from entrypoint.plan import _one_line

    class ModelConfig(BaseModel):  # the shape of vLLM's config errors (pydantic dataclasses)
        max_model_len: int

        @field_validator("max_model_len")
        @classmethod
        def _fits(cls, value):
            raise ValueError(f"User-specified max_model_len ({value}) is greater than the derived max_model_len")

    with pytest.raises(ValidationError) as info:
        ModelConfig(max_model_len=10)
    line = _one_line(f"ValidationError: {info.value}")
    assert "\n" not in line and "User-specified max_model_len (10) is greater" in line
    assert "For further information" not in line


def test_a_planner_of_an_engine_being_planned_waits_and_reads_that_answer(tiny_root, tmp_path):
    """Another process holds the engine's plan lock (it is asking vLLM): this planner waits
    instead of starting vLLM too, and returns the answer the other one leaves in the cache."""
    import threading

    from entrypoint.plan import Capacity, _cache_path, _lock_path, installed_tree, plan_engines

    resolved, configs = _inputs("cpu", tiny_root)
    tree = installed_tree()
    key = plan_cache_key(resolved, configs, tree)
    cache = tmp_path / "cache"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from entrypoint.plan import _one_planner_per_key\n"
         f"with _one_planner_per_key([Path({str(_lock_path(cache, resolved, key))!r})]):\n"
         "    print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert holder.stdout.readline() == "held\n"
        planned = []
        waiter = threading.Thread(target=lambda: planned.extend(
            plan_engines([(resolved, configs)], compare=False, cache_dir=cache, tree=tree)))
        waiter.start()
        waiter.join(2)
        assert waiter.is_alive()  # waiting on the lock, not planning
        answer = Capacity(fits=True, pool_tokens=123_456, max_concurrency=3.5, max_model_len=resolved.max_model_len)
        _cache_path(cache, resolved, key, tree.serving(resolved)).write_text(answer.model_dump_json())
        holder.stdin.close()  # the other planner is done
        waiter.join(30)
        assert not waiter.is_alive()
    finally:
        holder.kill()
        holder.wait()
    (plan,) = planned
    assert plan.reused and plan.pool_tokens == 123_456 and plan.serving == answer
