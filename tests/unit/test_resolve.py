"""One resolution of profile + settings: what the launch renders is what the planner plans,
for every profile and every combination of the knobs that change the KV cache; conflicts
are the same one line for every command; the compile cache key covers every field but an
explicit, reasoned list."""

from __future__ import annotations

import itertools

import pytest
from pydantic import SecretStr

from core.errors import SettingsError
from core.profiles import load_profile, profile_names
from entrypoint.compile_cache import COMPILE_IGNORED, compile_cache_key
from entrypoint.engine_args import KV_SHAPING
from entrypoint.model_configs import max_positions, read_model_configs
from entrypoint.plan import PLAN_IGNORED, build_request, plan_profile
from entrypoint.resolve import resolve
from entrypoint.resolved_engine import field_paths
from tests.support.plans import render_resolved, user_settings

KEY = SecretStr("s3cret-" + "k" * 20)


def _combinations():
    for name in profile_names():
        spec = load_profile(name).speculative
        choices = (True, False, *(("mtp",) if spec is not None and "mtp" in spec.methods else ()))
        for speculation, prefix_caching in itertools.product(choices, (True, False)):
            if load_profile(name).platform == "cpu" and speculation and prefix_caching:
                continue  # refused, see test_conflicts_are_one_settings_error_for_render_and_plan
            if speculation and spec is None:
                continue  # refused: nothing to speculate with
            yield name, speculation, prefix_caching


@pytest.mark.parametrize(("name", "speculation", "prefix_caching"), list(_combinations()))
def test_the_planner_plans_exactly_what_the_launch_renders(name, speculation, prefix_caching, tiny_root, tmp_path):
    profile = load_profile(name)
    models = tiny_root if profile.platform == "cpu" else tmp_path
    settings = user_settings(name, models_dir=models, speculation=speculation, prefix_caching=prefix_caching)
    resolved = resolve(profile, settings)
    config = render_resolved(profile, settings, KEY).config
    request = build_request(resolved, read_model_configs(profile, resolved, models), tmp_path / "w")
    planned = request["engine_args"]
    # Both come from `engine_args`: every argument that shapes the KV cache is the rendered one,
    # but for the three the planner owns (the models' shape-only copies, the batch where vLLM's
    # default for the device decides, and lookup drafting as its width alone).
    for arg in KV_SHAPING:
        keyword = arg.replace("-", "_")
        if arg in ("model", "speculative-config"):
            continue
        if arg == "max-num-batched-tokens" and arg not in config:
            assert planned[keyword] > 0
            continue
        assert planned.get(keyword) == config.get(arg), arg
    assert set(planned) <= {arg.replace("-", "_") for arg in KV_SHAPING}
    assert planned["enable_prefix_caching"] is prefix_caching
    assert request["attention_backend"] == config.get("attention-backend")
    spec = config.get("speculative-config")
    assert (spec is None) == (planned.get("speculative_config") is None) == (not speculation)
    if spec:
        drafted = planned["speculative_config"]
        assert {k: v for k, v in spec.items() if k not in ("model", "lookup_tokens")} == {
            k: v for k, v in drafted.items() if k != "model"
        }
        assert ("model" in drafted) == ("model" in spec)


@pytest.mark.parametrize(
    ("profile", "values", "message"),
    [
        ("cpu", {"speculation": True, "prefix_caching": True}, "set SPECULATION=false or PREFIX_CACHING=false"),
        ("cpu", {"lookup": True}, "LOOKUP=true: lookup drafting extends speculative decoding, which is off"),
        ("single", {"lookup": True, "speculation": False}, "set SPECULATION=true"),
        ("single", {"verify_block": 12}, r"VERIFY_BLOCK=12: without lookup drafting"),
        ("single", {"lookup": True, "verify_block": 8}, r"VERIFY_BLOCK=8: .* must be 9\.\.16"),
        ("single", {"speculation": "mtp", "lookup": True},
         r"LOOKUP=true: lookup drafting extends a dflash drafter, not method 'mtp'; set SPECULATION=dflash"),
        ("single", {"speculation": "mtp", "verify_block": 12}, r"VERIFY_BLOCK=12: .*not method 'mtp'"),
        ("single", {"mtp_depth": 3}, r"MTP_DEPTH=3: speculation on profile single is dflash, not mtp; "
         "set SPECULATION=mtp or unset MTP_DEPTH"),
        ("single", {"speculation": False, "mtp_depth": 3}, r"MTP_DEPTH=3: .* is off, not mtp"),
        ("spark-lora", {"speculation": "mtp"}, r"SPECULATION=mtp: profile spark-lora allows dflash or off, not mtp"),
        ("batch", {"speculation": "mtp"}, r"SPECULATION=mtp: profile batch has no speculative decoding"),
    ],
)
def test_conflicts_are_one_settings_error_for_render_and_plan(profile, values, message, tmp_path):
    settings = user_settings(profile, models_dir=tmp_path, **values)
    with pytest.raises(SettingsError, match=message) as rendered:
        render_resolved(load_profile(profile), settings, KEY)
    with pytest.raises(SettingsError, match=message) as planned:
        plan_profile(load_profile(profile), settings)
    assert str(rendered.value) == str(planned.value) and "\n" not in str(planned.value)


@pytest.mark.parametrize("name", ["single", "long", "spark-lora"])
def test_lookup_on_a_gpu_profile_renders_and_plans_the_same_wider_block(name, tmp_path):
    """DFlash2 (V2 runner, patch 0072): LOOKUP=true keeps the drafter's 7 and adds 8 lookup
    positions; the launch, the planner and the CUDA-graph sizes all see the 16-token block."""
    profile = load_profile(name)
    settings = user_settings(name, models_dir=tmp_path, lookup=True)
    resolved = resolve(profile, settings)
    spec = resolved.speculative
    assert (spec.drafter_tokens, spec.lookup_tokens, spec.num_speculative_tokens) == (7, 8, 15)
    config = render_resolved(profile, settings, KEY).config
    assert config["speculative-config"]["num_speculative_tokens"] == 15
    assert config["speculative-config"]["lookup_tokens"] == 8
    request = build_request(resolved, read_model_configs(profile, resolved, tmp_path), tmp_path / "w")
    assert request["engine_args"]["speculative_config"]["num_speculative_tokens"] == 15
    assert resolved.cudagraph_capture_limit == resolved.max_num_seqs * 16
    assert config["compilation-config"]["max_cudagraph_capture_size"] == resolved.max_num_seqs * 16


def test_profile_values_and_overrides_are_told_apart_in_messages(tmp_path):
    single = load_profile("single")
    assert resolve(single, user_settings("single", models_dir=tmp_path)).origin("max_model_len") == (
        "profile single: engine.max_model_len = 65536"
    )
    overridden = resolve(single, user_settings("single", models_dir=tmp_path, max_model_len=4096))
    assert overridden.origin("max_model_len") == "MAX_MODEL_LEN=4096"


def test_the_positions_limit_includes_rope_scaling():
    assert max_positions({"text_config": {"max_position_embeddings": 262144}}) == 262144
    yarn = {"max_position_embeddings": 131072,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert max_positions(yarn) == 524288
    assert max_positions({"hidden_size": 8}) is None


@pytest.mark.filterwarnings("ignore::UserWarning")  # the changed values are not of the field's type
def test_compile_cache_key_covers_every_field_but_the_ignored_ones(tmp_path):
    # spark-pair: the profile with every nested part (speculative, lora, parallel; vision with VISION=true) set.
    resolved = resolve(load_profile("spark-pair"), user_settings("spark-pair", models_dir=tmp_path, vision=True))
    base = compile_cache_key(resolved)
    assert set(COMPILE_IGNORED) <= set(field_paths()) and set(PLAN_IGNORED) <= set(field_paths())
    for path in field_paths():
        parent, _, leaf = path.partition(".")
        if leaf:
            changed = resolved.model_copy(
                update={parent: getattr(resolved, parent).model_copy(update={leaf: f"changed {path}"})}
            )
        elif path in ("speculative", "lora", "parallel", "vision"):
            continue  # their fields are changed one by one
        else:
            changed = resolved.model_copy(update={path: f"changed {path}"})
        assert (compile_cache_key(changed) == base) == (path in COMPILE_IGNORED), path


def test_an_ignore_list_naming_no_field_is_refused(tmp_path):
    resolved = resolve(load_profile("cpu"), user_settings("cpu", models_dir=tmp_path))
    with pytest.raises(ValueError, match="names no field"):
        resolved.digest({"max_model_length"})


def test_every_nested_model_of_the_resolution_is_walked_by_the_digest():
    """`field_paths` names the nested models explicitly: one added later must be added there."""
    from pydantic import BaseModel

    from entrypoint.resolved_engine import ResolvedEngine

    models = {
        name for name, info in ResolvedEngine.model_fields.items()
        if any(isinstance(t, type) and issubclass(t, BaseModel) for t in getattr(info.annotation, "__args__", ()))
    }
    assert models == {p.split(".")[0] for p in field_paths() if "." in p}


@pytest.mark.parametrize("name", ["single", "long", "dual", "cpu"])
def test_mtp_resolves_to_the_targets_head_with_the_seeds_depth_and_no_drafter(name, tmp_path):
    profile = load_profile(name)
    settings = user_settings(name, models_dir=tmp_path, speculation="mtp", prefix_caching=False)
    spec = resolve(profile, settings).speculative
    assert (spec.method, spec.num_speculative_tokens, spec.lookup_tokens, spec.drafter_dir) == ("mtp", 4, 0, None)
    assert spec.draft_sample_method is None  # the drafter's probabilistic sampling is not the head's
    config = render_resolved(profile, settings, KEY).config
    assert config["speculative-config"] == {"method": "mtp", "num_speculative_tokens": 4}


def test_true_keeps_the_profiles_own_method_and_false_turns_it_off(tmp_path):
    single = load_profile("single")
    assert resolve(single, user_settings("single", models_dir=tmp_path)).speculative.method == "dflash"
    assert resolve(single, user_settings("single", models_dir=tmp_path, speculation=True)).speculative.method == "dflash"
    assert resolve(single, user_settings("single", models_dir=tmp_path, speculation="dflash")).speculative.method == (
        "dflash"
    )
    assert resolve(single, user_settings("single", models_dir=tmp_path, speculation=False)).speculative is None
    cpu = load_profile("cpu")  # speculation off by default: true turns its own method (dflash) on
    assert resolve(cpu, user_settings("cpu", models_dir=tmp_path)).speculative is None
    on = resolve(cpu, user_settings("cpu", models_dir=tmp_path, speculation=True, prefix_caching=False))
    assert on.speculative.method == "dflash"


def test_mtp_depth_sets_the_verify_block_the_cuda_graphs_and_the_compile_cache_key(tmp_path):
    single = load_profile("single")
    dflash = resolve(single, user_settings("single", models_dir=tmp_path))
    mtp = resolve(single, user_settings("single", models_dir=tmp_path, speculation="mtp"))
    deeper = resolve(single, user_settings("single", models_dir=tmp_path, speculation="mtp", mtp_depth=6))
    assert deeper.speculative.num_speculative_tokens == 6
    assert (dflash.cudagraph_capture_limit, mtp.cudagraph_capture_limit, deeper.cudagraph_capture_limit) == (
        8 * 8, 8 * 5, 8 * 7
    )
    assert len({compile_cache_key(dflash), compile_cache_key(mtp), compile_cache_key(deeper)}) == 3
    assert render_resolved(single, user_settings("single", models_dir=tmp_path, speculation="mtp", mtp_depth=6),
                           KEY).config["speculative-config"]["num_speculative_tokens"] == 6


def test_mtp_plans_the_target_as_its_own_drafter(tmp_path):
    """The planner's request for mtp names no drafter: vLLM takes the head from the target."""
    single = load_profile("single")
    resolved = resolve(single, user_settings("single", models_dir=tmp_path, speculation="mtp"))
    configs = read_model_configs(single, resolved, tmp_path)
    assert configs.drafter is None
    request = build_request(resolved, configs, tmp_path / "w")
    assert request["engine_args"]["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 4}


def test_mtp_on_a_target_without_an_mtp_head_is_refused_before_planning(tmp_path):
    from entrypoint.model_configs import check_model_limits

    resolved = resolve(load_profile("single"), user_settings("single", models_dir=tmp_path, speculation="mtp"))
    with pytest.raises(SettingsError, match="speculation mtp needs the target's MTP head"):
        check_model_limits(resolved, {"text_config": {"max_position_embeddings": 262144}})
    check_model_limits(resolved, {"text_config": {"max_position_embeddings": 262144, "mtp_num_hidden_layers": 1}})
