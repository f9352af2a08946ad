"""Images at full scale (issue 58): the full preset's tower, `qwen38 bench image`, and the
`single-vision-full` copy of `qwen38 bench fullscale` - served with the pool the planner names,
measured with `c1` and `image`, reported with the tower's memory."""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
from dataclasses import replace

import pytest
import tomli_w

from bench import fullscale_figures as figures
from bench import fullscale_steps as fs
from bench import workloads
from bench.commands import register
from bench.workloads import WORKLOADS, Context, params_from_args
from core.errors import BenchError
from core.settings import DEFAULT_MAX_PIXELS
from entrypoint.image_requests import check_image
from entrypoint.vision_memory import VisionMemory, config_tower_bytes
from prepare.synthetic import (
    FULL_VISION,
    MODEL_CONFIGS,
    PRESETS,
    VISUAL_PREFIX,
    processor_configs,
    stored_bytes,
    variant_tensors,
)

REAL = json.loads((MODEL_CONFIGS / "qwen3.8-27b-w4a16" / "config.json").read_text())
TOWER_BYTES = 921_460_192  # docs/vision.md: Qwen3.8-27B's tower in bf16


# ---- the full preset: a VL checkpoint, as the hub's ---------------------------------------------


def test_the_full_targets_carry_the_real_tower_in_bf16_and_a_processor_at_the_stacks_pixel_cap():
    full = PRESETS["full"]
    assert full.vision == FULL_VISION and FULL_VISION.depth == 27 and FULL_VISION.hidden_size == 1152
    for target in ("qwen3.8-27b-w4a16", "qwen3.8-27b-nvfp4"):
        tower = [t for t in variant_tensors(full, target) if t.name.startswith(VISUAL_PREFIX)]
        assert sum(t.nbytes for t in tower) == TOWER_BYTES == config_tower_bytes(REAL["vision_config"])
        assert {t.dtype for t in tower} == {"BF16"}  # both formats' configs leave `visual` unquantized
    assert "re:.*visual.*" in REAL["quantization_config"]["ignore"]
    # What generating the full set costs more: two towers of normal draws and constants, 1.84 GB.
    without = replace(full, vision=None)
    def total(p) -> int:
        return sum(t.nbytes for v in full.variants for t in variant_tensors(p, v))

    assert total(full) - total(without) == 2 * TOWER_BYTES
    assert sum(fs.bytes_by_recipe("full").values()) == total(full)
    assert stored_bytes(variant_tensors(full, "qwen3.8-27b-dflash2-w4a16")) == stored_bytes(
        variant_tensors(without, "qwen3.8-27b-dflash2-w4a16"))  # the drafters have no tower
    image = processor_configs(full.vision, min_pixels=full.min_pixels, max_pixels=full.max_pixels)
    assert image["preprocessor_config.json"]["size"] == {"shortest_edge": 32 * 32, "longest_edge": DEFAULT_MAX_PIXELS}
    assert PRESETS["tiny-vision"].max_pixels == 256 * 256  # the tiny processor's budget is unchanged


def test_the_full_targets_tokenizer_has_the_vision_tokens_and_places_an_image_text_alone_unchanged():
    from prepare.generate import DEFAULT_SEED, special_ids, tokenizer_for
    from prepare.synthetic import target_config

    tokenizer = tokenizer_for(PRESETS["full"], DEFAULT_SEED)
    ids = special_ids(tokenizer)
    vision_ids = [ids[k] for k in ("vision_start", "vision_end", "image_pad", "video_pad")]
    assert vision_ids == [248316, 248317, 248318, 248319]  # the vocabulary's last four
    config = target_config(PRESETS["full"], "w4a16", ids)
    assert (config["image_token_id"], config["vision_config"]) == (248318, REAL["vision_config"])
    turn = [{"type": "image_url", "image_url": {"url": "data:"}}, {"type": "text", "text": "hi"}]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": turn}], tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>hi" in rendered
    # A text prompt renders as the text template renders it (VISION off: served as before).
    text = [{"role": "user", "content": "hi"}]
    from prepare.tokenizer import build_tokenizer

    plain = build_tokenizer(DEFAULT_SEED)
    assert tokenizer.apply_chat_template(text, tokenize=False) == plain.apply_chat_template(text, tokenize=False)


def test_a_presets_pixel_budget_reaches_the_processor_config_it_writes(tmp_path):
    from prepare.generate import write_model

    p = replace(PRESETS["tiny-vision"], max_pixels=128 * 128)
    write_model(tmp_path / "t", p, "qwen3.8-27b-bf16", 1, 1)
    written = json.loads((tmp_path / "t" / "preprocessor_config.json").read_text())
    assert written["size"] == {"shortest_edge": 32 * 32, "longest_edge": 128 * 128}


# ---- `qwen38 bench image` -----------------------------------------------------------------------


class CountingTokenizer:
    """Counts a chat as the length of its JSON (an image part is long): enough to build requests."""

    def count_chat(self, messages, tools=None) -> int:
        return len(json.dumps(messages)) // 100 + 10


def _ctx(seed: int = 0, salt: str | None = "s") -> Context:
    return Context(model="m", seed=seed, tokenizer=CountingTokenizer(), cache_salt=salt, max_model_len=None)


def test_each_image_request_carries_a_png_of_its_own_then_the_same_text_alone():
    from PIL import Image

    params = workloads.ImageParams(width=48, height=32, requests=3, output_tokens=4)
    image, text = workloads.build_image(params, _ctx())
    assert (image.label, image.concurrency, text.label) == ("image 48x32", 1, "text only")
    urls = []
    for spec in image.jobs[0]:
        [part, question] = spec.body["messages"][0]["content"]
        assert question == {"type": "text", "text": workloads.IMAGE_QUESTION} and spec.body["max_tokens"] == 4
        urls.append(part["image_url"]["url"])
        check_image(urls[-1], 48 * 32)  # the stack's guard takes it (a PNG, within the cap)
    decoded = Image.open(io.BytesIO(__import__("base64").b64decode(urls[0].split(",", 1)[1])))
    assert decoded.size == (48, 32) and decoded.mode == "RGB"
    assert len(set(urls)) == 3  # no encoder or prefix cache hit between them
    assert [s.body["messages"] for s in text.jobs[0]] == [[{"role": "user", "content": workloads.IMAGE_QUESTION}]] * 3
    salts = [s.body["cache_salt"] for p in (image, text) for s in p.jobs[0]]
    assert len(set(salts)) == 6
    [warm] = workloads.warm_up_image(params, _ctx())
    assert warm.body["messages"][0]["content"][0]["image_url"]["url"] not in urls
    # Another run (another salt) sends other images: the server's encoder cache never answers it.
    again = workloads.build_image(params, _ctx(salt="t"))[0].jobs[0][0]
    assert again.body["messages"][0]["content"][0]["image_url"]["url"] != urls[0]


def test_a_noise_png_is_seeded_and_a_full_hd_one_is_within_the_stacks_cap():
    assert workloads.noise_png(8, 8, "a") == workloads.noise_png(8, 8, "a") != workloads.noise_png(8, 8, "b")
    with pytest.raises(BenchError, match="at least 1 pixel"):
        workloads.noise_png(0, 8, "a")
    defaults = params_from_args(WORKLOADS["image"], {})
    assert (defaults.width, defaults.height) == (1920, 1080) and 1920 * 1080 <= DEFAULT_MAX_PIXELS


def test_the_image_workloads_flags_parse_into_its_parameters():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    for size, workload in fs.IMAGE_WORKLOADS.items():
        args = parser.parse_args(["bench", "image", "--base-url", "http://x", "--model", "m",
                                  *workload.argv(65_536)])
        params = params_from_args(WORKLOADS["image"], vars(args))
        assert workload.bench == "image" and params.requests >= 2, size
        assert params.width * params.height <= DEFAULT_MAX_PIXELS
    assert params_from_args(WORKLOADS["image"], vars(args)) == workloads.ImageParams(64, 64, 2, 4)  # tiny


# ---- the served copy ---------------------------------------------------------------------------


def test_the_vision_copy_is_single_as_served_with_vision_on_measuring_c1_and_an_image():
    copy = fs.SERVED["single-vision-full"]
    assert (copy.base, copy.budget, dict(copy.settings)) == ("single", fs.HEADLESS_3090_BYTES, {"VISION": "true"})
    assert copy.workloads == ("c1", "image") and copy.speculation and fs.vision_on(copy)
    profiles = fs.profile_set(150_000_000_000)
    assert profiles["single-vision-full"] == profiles["single-full"]  # VISION is `qwen38 serve`'s setting
    assert fs.text_only_copy("single-vision-full", copy) == "single-full"
    # The same with the whole tower on the GPU: the other side of the tower's place, for an image.
    gpu = fs.SERVED["single-vision-gpu-full"]
    assert dict(gpu.settings) == {"VISION": "true", "VISION_TOWER": "gpu"} and gpu.workloads == ("image",)
    assert profiles["single-vision-gpu-full"] == profiles["single-full"]
    assert fs.text_only_copy("single-vision-gpu-full", gpu) == "single-full"
    for size in ("full", "quick", "tiny"):
        assert fs.MEASURE_SIZES[size]["image"].bench == "image"
    assert fs.workload_argv(None, "single-vision-full", copy, "image", 53_752) == [
        "--requests", "4", "--width", "1920", "--height", "1080", "--output-tokens", "8"]
    for name in ("single-full", "single-mtp-full"):
        assert fs.workload_argv(None, name, fs.SERVED[name], "image", 65_536).startswith("served without VISION=true")
    assert [n for n, s in fs.SERVED.items() if fs.vision_on(s)] == [
        "single-vision-full", "single-vision-gpu-full", "spark-lora-vision-full"]
    # The Spark's: its tower on the device (the profile's machine keeps it there), beside spark-lora-full.
    spark = fs.SERVED["spark-lora-vision-full"]
    assert (spark.base, spark.budget) == ("spark-lora", fs.SPARK_STANDIN_BYTES)
    assert dict(spark.settings) == {"VISION": "true"}
    assert spark.workloads == ("c1", "image") and profiles["spark-lora-vision-full"] == profiles["spark-lora-full"]
    assert fs.text_only_copy("spark-lora-vision-full", spark) == "spark-lora-full"


def _profiles(root, served) -> None:
    """The copies' profiles, and config-only model directories (the planner reads the configs)."""
    (root / "profiles").mkdir(parents=True)
    for name, data in fs.profile_set(4 * fs.HEADLESS_3090_BYTES, served).items():
        (root / "profiles" / f"{name}.toml").write_bytes(tomli_w.dumps(data).encode())
    for directory, key in (("prepared/qwen3.8-27b-w4a16-int8", "qwen3.8-27b-w4a16"),
                           ("artifacts/qwen3.8-27b-dflash2-w4a16", "qwen3.8-27b-dflash2-w4a16"),
                           ("artifacts/qwen3.8-27b-nvfp4", "qwen3.8-27b-nvfp4"),
                           ("artifacts/qwen3.8-27b-dflash2", "qwen3.8-27b-dflash2")):
        (root / "models" / directory).mkdir(parents=True)
        shutil.copy(MODEL_CONFIGS / key / "config.json", root / "models" / directory / "config.json")


def test_the_copy_is_served_with_the_pool_qwen38_plan_names_for_the_tower(tmp_path, monkeypatch):
    """The real planner (vLLM's layout in its child, ~20 s here): single's own pool is refused with
    VISION=true, and the pool and context it names (docs/vision.md's) become the copy's settings,
    kept for the start and the measurement's plan."""
    root = tmp_path / "run"
    served = {"single-vision-full": fs.SERVED["single-vision-full"]}
    _profiles(root, served)
    settings = fs.vision_settings(root, "single-vision-full", served["single-vision-full"])
    kept = fs.read_result(root, "single-vision-full.vision")
    assert kept["vision"]["tower_bytes"] == TOWER_BYTES and kept["profile_pool_bytes"] == 5_583_457_484
    # The pool less what the planner puts on the device for the tower (all of it, or with the
    # tower in host memory its resident part) and the 2,048-token encoder cache.
    on_device = kept["vision"].get("device_tower_bytes", TOWER_BYTES)
    assert settings["KV_CACHE_MEMORY_BYTES"] == str(5_583_457_484 - on_device - 2048 * 5120 * 2)
    assert kept["refusal"].startswith("VISION=true: profile single-vision-full's KV pool (5,583,457,484 bytes)")
    # A context is named only where the smaller pool holds less than single's 65,536 tokens.
    assert ("MAX_MODEL_LEN" in settings) == ("set MAX_MODEL_LEN=" in kept["refusal"])
    assert on_device < TOWER_BYTES  # single's default: the tower in host memory (patch 0087)

    def no_second_plan(*args, **kwargs):
        raise AssertionError("the named pool is read once")

    monkeypatch.setattr(fs, "_cli", no_second_plan)
    assert fs.vision_settings(root, "single-vision-full", served["single-vision-full"]) == settings
    assert fs.vision_settings(root, "single-full", fs.SERVED["single-full"]) == {}  # text only: the profile's pool


def test_with_the_whole_tower_on_the_gpu_the_planner_names_a_smaller_pool_and_context(tmp_path):
    """`single-vision-gpu-full` (VISION_TOWER=gpu): docs/vision.md's figures, the whole tower and
    the encoder cache out of single's pool, and the context that pool holds."""
    gpu = {"single-vision-gpu-full": fs.SERVED["single-vision-gpu-full"]}
    _profiles(tmp_path, gpu)
    assert fs.vision_settings(tmp_path, "single-vision-gpu-full", gpu["single-vision-gpu-full"]) == {
        "KV_CACHE_MEMORY_BYTES": "4641025772", "MAX_MODEL_LEN": "53752"}


def test_the_spark_copy_keeps_its_pool_and_context_with_the_tower_on_the_device(tmp_path):
    """`spark-lora-vision-full`: the tower (all of it, on the device) and the 8,192-token encoder
    cache come out of the 16 GiB pool, and what is left still holds the profile's 131,072 tokens
    (docs/vision.md): the copy is served with the pool the plan names and its own context."""
    spark = {"spark-lora-vision-full": fs.SERVED["spark-lora-vision-full"]}
    _profiles(tmp_path, spark)
    assert fs.vision_settings(tmp_path, "spark-lora-vision-full", spark["spark-lora-vision-full"]) == {
        "KV_CACHE_MEMORY_BYTES": str((16 << 30) - TOWER_BYTES - 8192 * 5120 * 2)}  # 16,174,522,912
    kept = fs.read_result(tmp_path, "spark-lora-vision-full.vision")
    assert "set MAX_MODEL_LEN" not in kept["refusal"] and kept["profile_pool_bytes"] == 16 << 30
    assert kept["vision"]["tower_bytes"] == TOWER_BYTES
    assert kept["vision"].get("device_tower_bytes", TOWER_BYTES) == TOWER_BYTES  # the Spark's tower: on the device


def test_a_plan_line_is_read_only_where_it_names_a_pool_its_own_parts_give(tmp_path, monkeypatch):
    line = ("VISION=true: profile x's KV pool (5,000 bytes) is sized for the text model alone; ...: set "
            "KV_CACHE_MEMORY_BYTES={pool} ({holds})")
    memory = {"tower_bytes": 900, "tower_source": "t", "image_tokens": 1, "encoder_cache_tokens": 1,
              "encoder_cache_bytes": 200}
    if "device_tower_bytes" in VisionMemory.model_fields:  # the tower's place (VISION_TOWER), where counted
        memory.update(tower_place="gpu", device_tower_bytes=900)

    def planner(refusal: str, code: int = 1):
        plan = {"vision_refusal": refusal, "pool_bytes": 5000, "vision": memory}
        monkeypatch.setattr(fs, "_cli", lambda *a, **k: subprocess.CompletedProcess([], code, json.dumps(plan), ""))

    copy = fs.SERVED["single-vision-full"]
    planner(line.format(pool=3900, holds="it holds requests of up to 1,234 tokens at this layout, so set "
                                         "MAX_MODEL_LEN=1,234 too"))
    assert fs.vision_settings(tmp_path, "a", copy) == {"KV_CACHE_MEMORY_BYTES": "3900", "MAX_MODEL_LEN": "1234"}
    planner(line.format(pool=3900, holds="it holds requests of up to 70,000 tokens at this layout"))
    assert fs.vision_settings(tmp_path, "b", copy) == {"KV_CACHE_MEMORY_BYTES": "3900"}
    planner(line.format(pool=3800, holds="it holds requests of up to 1,234 tokens at this layout"))
    with pytest.raises(BenchError, match="whose parts give 3900"):  # the line misread: 5,000 - 900 - 200
        fs.vision_settings(tmp_path, "c", copy)
    planner(line.format(pool=3900, holds="too small for any request: leave VISION off on this profile"))
    with pytest.raises(BenchError, match="too small for any request"):
        fs.vision_settings(tmp_path, "d", copy)
    monkeypatch.setattr(fs, "_cli", lambda *a, **k: subprocess.CompletedProcess([], 2, "", "qwen38: plan: boom"))
    with pytest.raises(BenchError, match="gave no plan: qwen38: plan: boom"):
        fs.vision_settings(tmp_path, "e", copy)
    assert sorted(p.name for p in (tmp_path / fs.RESULTS).iterdir()) == ["a.vision.json", "b.vision.json"]


# ---- the figures and the report -----------------------------------------------------------------


def _point(label: str, prompt: float, ttfts: list[float]) -> dict:
    return {"label": label, "summary": {"requests": len(ttfts), "prompt_tokens": {"mean": prompt},
                                        "ttft_s": {"min": min(ttfts), "p50": sorted(ttfts)[len(ttfts) // 2],
                                                   "max": max(ttfts)}}}


DOC = {"workload": "image", "parameters": {"width": 1920, "height": 1080},
       "points": [_point("image 1920x1080", 2058.0, [0.61, 0.52, 0.55]), _point("text only", 18.0, [0.05, 0.04, 0.04])]}
ENGINE_LOG = """
(EngineCore pid=7) INFO 12-08 10:00:00 [gpu_model_runner.py:5524] Model loading took 16.59 GiB memory and 41.2 seconds
(EngineCore pid=7) INFO 12-08 10:00:00 [gpu_model_runner.py:5524] Model loading took 1.11 GiB memory and 3.5 seconds
"""


def test_an_image_document_gives_the_images_and_the_texts_first_tokens_and_the_image_tokens():
    got = figures.image_figures(DOC)
    assert got["image_tokens"] == 2040 and (got["width"], got["height"]) == (1920, 1080)
    assert got["image"]["ttft_s"] == {"min": 0.52, "p50": 0.55, "max": 0.61}
    assert got["text"]["ttft_s"]["p50"] == 0.04 and got["image_adds_ttft_s_p50"] == pytest.approx(0.51)
    with pytest.raises(ValueError, match="an image point and a text-only point"):
        figures.image_figures({**DOC, "points": DOC["points"][:1]})


def test_the_towers_share_is_the_model_loading_beside_the_text_only_copys_and_the_checkpoints_bytes():
    log = figures.parse_engine_log(ENGINE_LOG)
    text = {"model_loading_gib": 15.73}
    got = figures.tower_share(log, text, TOWER_BYTES)
    assert got["tower_from_log_gib"] == pytest.approx(0.86) and got["tower_checkpoint_bytes"] == TOWER_BYTES
    assert "tower_from_log_gib" not in figures.tower_share(log, None, None)


def test_the_report_has_a_row_for_the_copy_served_with_images(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "single-vision-full.log").write_text(ENGINE_LOG)
    fs._write(tmp_path, "single-vision-full.vision", {"settings": {"KV_CACHE_MEMORY_BYTES": "4641025772",
                                                                    "MAX_MODEL_LEN": "53752"},
                                                       "vision": {"tower_bytes": TOWER_BYTES}})
    fs._write(tmp_path, "single-full.ready", {"ready": True, "ready_s": 1.0, "log": {"model_loading_gib": 15.73}})
    served = fs.derive_profile("single")
    from core.profiles import Profile

    profile = Profile.model_validate({"name": "single-vision-full", **served})
    vision = fs.vision_footprint(tmp_path, "single-vision-full", profile, fs.SERVED["single-vision-full"])
    assert vision["text_only_copy"] == "single-full" and vision["tower"]["tower_from_log_gib"] == pytest.approx(0.86)
    assert vision["tower"]["tower_checkpoint_bytes"] is None  # no weights under this ROOT
    results = {"single-vision-full.start": {},
               "single-vision-full.measure": {"image": figures.image_figures(DOC), "vision": vision}}
    row = fs.summarize(results)["profiles"]["single-vision-full"]
    assert row["image"]["image_tokens"] == 2040 and row["vision"]["settings"]["MAX_MODEL_LEN"] == "53752"
    text = figures.summary_markdown(fs.summarize(results))
    line = next(x for x in text.splitlines() if x.startswith("| single-vision-full | 4.32 GiB"))
    assert line == ("| single-vision-full | 4.32 GiB (53752) | - / 0.86 / 0.86 | 1920 x 1080 | 2040 | "
                    "0.520 / 0.550 / 0.610 | 0.040 / 0.040 / 0.050 |")
