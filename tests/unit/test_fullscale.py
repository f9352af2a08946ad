"""`qwen38 bench fullscale`'s pure parts: derived profiles, vLLM's log, the footprint arithmetic."""

from __future__ import annotations

import json

import pytest

from bench import fullscale_figures as figures
from bench import fullscale_steps as fs
from bench import roofline as rf
from core.errors import BenchError
from core.profiles import Profile, load_profile
from entrypoint.resolve import lookup_tokens
from prepare.synthetic import MODEL_CONFIGS

# Lines as vLLM 0.28.0 formats them (gpu_model_runner, gpu_worker, kv_cache_utils, core, monitor).
LOG = """
(EngineCore pid=77) INFO 12-01 10:00:01 [gpu_worker.py:502] Initial free memory 138.20 GiB, reserved 5.20 GiB memory for KV Cache as specified by kv_cache_memory_bytes config and skipped memory profiling.
(EngineCore pid=77) INFO 12-01 10:00:00 [gpu_model_runner.py:5524] Model loading took 15.73 GiB memory and 41.250000 seconds
(EngineCore pid=77) INFO 12-01 10:00:00 [gpu_model_runner.py:5524] Model loading took 1.11 GiB memory and 3.500000 seconds
(EngineCore pid=77) INFO 12-01 10:01:00 [monitor.py:20] torch.compile took 45.20 s in total
(EngineCore pid=77) INFO 12-01 10:02:00 [kv_cache_utils.py:1958] GPU KV cache size: 68,605 tokens, Maximum concurrency for 65,536 tokens per request: 1.05x
(EngineCore pid=77) INFO 12-01 10:05:00 [model_runner.py:949] Graph capturing finished in 208 secs, took 1.25 GiB
(EngineCore pid=77) INFO 12-01 10:05:01 [core.py:355] init engine (profile, create kv cache, warmup model) took 383.10 s
"""

TEXT = json.loads((MODEL_CONFIGS / "qwen3.8-27b-w4a16" / "config.json").read_text())["text_config"]


def test_derived_profiles_change_only_the_model_origins_and_the_memory_cap():
    for name in ("single", "long", "spark-lora", "huge"):
        real = load_profile(name)
        data = fs.derive_profile(name, cap_fraction=0.17 if name in fs.CAPPED else None)
        derived = Profile.model_validate({"name": f"{name}-full", **data})
        for slot in ("target", "drafter", "adapter"):
            mine, theirs = getattr(derived.models, slot), getattr(real.models, slot)
            assert (mine is None) == (theirs is None)
            if mine is not None:
                assert (mine.dir, mine.transform, mine.generated, mine.artifact) == (theirs.dir, theirs.transform, "tiny", None)
        same = real.engine.model_dump(exclude={"additional_config", "gpu_memory_utilization"})
        assert derived.engine.model_dump(exclude={"additional_config", "gpu_memory_utilization"}) == same
        assert derived.speculative == real.speculative and derived.lora == real.lora and derived.served == real.served
        if name in fs.CAPPED:
            assert derived.engine.gpu_memory_utilization == 0.17
            assert derived.env["PYTORCH_CUDA_ALLOC_CONF"] == "per_process_memory_fraction:0.1700"
        else:
            assert derived.engine.gpu_memory_utilization is None and "PYTORCH_CUDA_ALLOC_CONF" not in derived.env


def test_the_served_set_caps_each_copy_at_its_budget_and_adds_references_without_speculation():
    total = 150_000_000_000
    profiles = fs.profile_set(total)
    assert list(profiles) == list(fs.SERVED)
    assert profiles["single-nospec-full"]["speculative"]["enabled"] is False
    assert profiles["single-full"]["speculative"].get("enabled", True) is True
    for name, data in profiles.items():
        budget = fs.SERVED[name].budget
        if budget is None:
            assert "gpu_memory_utilization" not in data["engine"] and "PYTORCH_CUDA_ALLOC_CONF" not in data.get("env", {})
        else:
            assert data["engine"]["gpu_memory_utilization"] == round(budget / total, 4)
    # The first three fit side by side on an H200 (139.8 GiB), so their cold starts overlap.
    assert sum(fs.SERVED[n].budget for n in ("single-full", "long-full", "spark-lora-full")) < 139 * fs.GIB


def test_a_cpu_profile_derives_without_the_gpu_only_settings():
    data = fs.derive_profile("cpu")
    assert "gdn_prefill_backend" not in (data["engine"].get("additional_config") or {})
    assert all(spec["generated"] == "tiny" for spec in data["models"].values())


def test_the_cap_is_a_headless_3090s_memory_as_a_fraction_of_this_gpu():
    assert fs.cap_fraction_for(fs.HEADLESS_3090_BYTES * 4) == pytest.approx(0.25)
    assert fs.cap_fraction_for(fs.HEADLESS_3090_BYTES // 2) == 1.0
    with pytest.raises(BenchError, match="expected a positive figure"):
        fs.cap_fraction_for(0)
    with pytest.raises(BenchError, match=r"expected a value in \(0, 1\]"):
        fs.derive_profile("single", cap_fraction=1.5)


def test_the_engine_log_gives_weights_pool_graphs_and_times():
    found = figures.parse_engine_log(LOG)
    assert found["model_loading_gib"] == 15.73 and found["model_loading_all_gib"] == [15.73, 1.11]
    assert found["kv_cache_tokens"] == 68605 and found["max_concurrency"] == 1.05
    assert (found["graph_capture_s"], found["graph_capture_gib"]) == (208, 1.25)
    assert found["torch_compile_s"] == 45.2 and found["init_engine_s"] == 383.1
    assert (found["kv_reserved_gib"], found["initial_free_gib"]) == (5.2, 138.2)
    assert figures.parse_engine_log("nothing here") == {}


def test_kv_and_gdn_state_bytes_follow_the_model_config():
    assert rf.attention_kv_bytes_per_token(TEXT, "auto") == 65536  # REFERENCE.md §1
    assert rf.attention_kv_bytes_per_token(TEXT, "fp8_e4m3") == 32768
    assert rf.attention_kv_bytes_per_token(TEXT, "int8_per_token_head") == 32768 + 16 * 4 * 2 * 4
    # 48 GDN layers x (48 heads x 128 x 128 fp16 state + 10240 conv channels x 3 taps fp16)
    assert rf.gdn_state_bytes_per_slot(TEXT) == 48 * (48 * 128 * 128 * 2 + 10240 * 3 * 2)
    with pytest.raises(BenchError, match="no byte count"):
        rf.attention_kv_bytes_per_token(TEXT, "int4_per_token_head")


def test_the_footprint_leaves_what_vllm_does_not_name_as_the_residual():
    log = figures.parse_engine_log(LOG)
    fp = figures.footprint(log, peak_process=23 * fs.GIB, kv_pool=5_583_457_484, drafter=1_190_000_000, gdn_state=10)
    assert fp.weights == int((15.73 + 1.11) * fs.GIB) and fp.cuda_graphs == int(1.25 * fs.GIB)
    assert fp.residual == 23 * fs.GIB - fp.weights - 5_583_457_484 - fp.cuda_graphs
    table = fp.to_dict()
    assert table["kv_pool"]["bytes"] == 5_583_457_484 and table["of_weights_drafter"]["bytes"] == 1_190_000_000
    # Another process allocating while this one captured (2026-12-02: "took -2.38 GiB", "took
    # 7.45 GiB"): vLLM's figure is not this server's; the graphs stay in the residual.
    shared = figures.footprint(log, peak_process=23 * fs.GIB, kv_pool=5_583_457_484, drafter=0, gdn_state=10,
                               graphs_attributable=False)
    assert shared.cuda_graphs is None and shared.to_dict()["cuda_graphs"] is None
    assert shared.residual == 23 * fs.GIB - shared.weights - 5_583_457_484


def test_the_other_gpu_processes_in_a_window_are_named_with_the_most_each_held():
    samples = figures.parse_samples("1.0 10 1000\n1.0 20 300\n2.0 20 700\n2.0 30 50\n5.0 40 9000\n2.0 gpu 2000\n")
    assert figures.neighbours(samples, {10}, 0.5, 2.5) == {20: 700 << 20, 30: 50 << 20}
    assert figures.neighbours(samples, {10, 20, 30}, 0.5, 2.5) == {}
    assert figures.neighbours(samples, {10}, 3.0, 6.0) == {40: 9000 << 20}


def test_the_peak_is_the_process_trees_sum_at_one_instant():
    samples = figures.parse_samples("1.0 10 1000\n1.0 11 500\n1.0 gpu 1600\n2.0 10 1200\n2.0 99 9000\nbad line\n3.0 11 100\n")
    assert samples.apps[0] == (1.0, 10, 1000 << 20) and samples.device == [(1.0, 1600 << 20)]
    assert figures.peak_of(samples.apps, {10, 11}) == 1500 << 20  # 1.0: 1500 MiB beats 2.0: 1200 MiB (pid 99 not ours)
    found = figures.attributed_peak(samples, {10, 11}, baseline=0, exclusive=False)
    assert found == {"bytes": 1500 << 20, "method": "process tree (nvidia-smi compute apps)"}


def test_unlisted_processes_are_attributed_by_the_device_total_only_when_no_other_server_ran():
    samples = figures.parse_samples("1.0 gpu 900\n2.0 gpu 23000\n3.0 gpu 22000\n")
    alone = figures.attributed_peak(samples, {10}, baseline=900 << 20, exclusive=True)
    assert alone["bytes"] == (23000 - 900) << 20 and "no other server" in alone["method"]
    beside = figures.attributed_peak(samples, {10}, baseline=900 << 20, exclusive=False)
    assert beside["bytes"] is None and beside["method"].startswith("unattributed")
    nothing = figures.attributed_peak(figures.parse_samples(""), {10}, baseline=0, exclusive=True)
    assert nothing["bytes"] is None and "no memory samples" in nothing["method"]


def test_the_verdict_says_by_how_much_a_peak_missed_or_met_its_budget():
    assert figures.fit_verdict(fs.HEADLESS_3090_BYTES - fs.GIB, fs.HEADLESS_3090_BYTES) == {
        "cap_held": True, "margin_bytes": fs.GIB, "margin_gib": 1.0}
    over = figures.fit_verdict(fs.HEADLESS_3090_BYTES + 2 * fs.GIB, fs.HEADLESS_3090_BYTES)
    assert over["cap_held"] is False and over["margin_gib"] == -2.0
    assert figures.fit_verdict(None, fs.HEADLESS_3090_BYTES)["cap_held"] is None


def test_an_out_of_memory_in_the_log_says_what_it_tried_to_allocate():
    line = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.25 GiB. GPU 0 has a total capacity "
            "of 139.80 GiB of which 100.00 GiB is free.")
    found = figures.out_of_memory("INFO start\n" + line + "\n")
    assert found["tried_to_allocate_bytes"] == int(1.25 * fs.GIB)
    assert figures.out_of_memory("ERROR RuntimeError: out of memory")["tried_to_allocate_bytes"] is None
    assert figures.out_of_memory("INFO all good") is None


def test_step_latency_and_prefill_speed():
    assert figures.step_latency_ms(100.0, 4.0) == pytest.approx(40.0)
    assert figures.prefill_tok_s(10240, 2.0) == 5120.0
    with pytest.raises(BenchError):
        figures.step_latency_ms(0.0, 1.0)
    with pytest.raises(BenchError):
        figures.prefill_tok_s(1024, 0.0)


def test_without_cuda_the_allocator_cap_cannot_be_asked():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine answers the question (the GPU run records it)")
    assert fs.allocator_cap_honoured(0.5) is None


def test_generation_time_is_the_slower_of_drawing_and_writing_then_hashing():
    by_kind = {"int4": 4_000_000_000, "normal": 1_000_000_000}
    rates = {"int4": 100.0, "normal": 50.0, "const": 1000.0}
    got = fs.generation_projection(by_kind, rates, cores=4, disk_write_mb_s=1000.0, sha256_mb_s=500.0)
    assert got["projection"] is True
    assert got["draw_s"] == pytest.approx((40 + 20) / 4)  # 15 s on 4 cores
    assert got["write_s"] == pytest.approx(5.0) and got["hash_s"] == pytest.approx(2.5)
    assert got["projected_s"] == pytest.approx(15 + 2.5)


def test_the_full_size_bytes_by_recipe_add_up_to_the_four_artifacts():
    from prepare.synthetic import PRESETS, variant_tensors

    full = PRESETS["full"]
    total = sum(t.nbytes for v in full.variants for t in variant_tensors(full, v))
    by_kind = fs.bytes_by_recipe("full")
    assert sum(by_kind.values()) == total and by_kind["int4"] > by_kind["e2m1"] > 0


def test_the_cpu_steps_run_at_small_size_and_write_their_results(tmp_path):
    """The lent GPU's first four steps, dry-run here on the `small` preset."""
    root = tmp_path / "run"
    generated = fs.step_generate(root, "small", workers=1, disk_bytes=32 << 20)
    assert generated["disk"]["write_mb_s"] > 0 and set(generated["generated"]["models"]) >= {
        "qwen3.8-27b-w4a16", "qwen3.8-27b-nvfp4", "qwen3.8-27b-dflash2", "qwen3.8-27b-dflash2-w4a16"}
    assert generated["done"] is True
    again = fs.step_generate(root, "small", workers=1, disk_bytes=32 << 20)  # a resumed run keeps what is whole
    assert all(m["kept"] for m in again["generated"]["models"].values()) and again["generated"]["bytes"] == 0
    requantized = fs.step_requantize(root)
    assert requantized["exit"] == 0 and requantized["peak_rss_bytes"] > 0
    assert requantized["largest_tensor"]["name"].endswith(("embed_tokens.weight", "lm_head.weight"))
    assert "fraction_of_disk_bound" in requantized
    assert fs.step_adapter(root)["exit"] == 0
    profiles = fs.step_profiles(root, total_bytes=4 * fs.HEADLESS_3090_BYTES)
    assert profiles["cap_fraction"] == pytest.approx(0.25) and list(profiles["profiles"]) == list(fs.SERVED)
    written = sorted(p.name for p in (root / fs.RESULTS).iterdir())
    assert written == ["adapter.json", "generate.json", "profiles.json", "requantize.json"]
    assert (root / "models" / "prepared" / "qwen3.8-27b-w4a16-int8" / "qwen38-manifest.json").exists()


# ---- speed figures from real benchmark documents (docs/benchmarks: the CPU runs' own files) ----

BENCHMARKS = MODEL_CONFIGS.parent.parent / "docs" / "benchmarks"


def _doc(name: str) -> dict:
    return json.loads((BENCHMARKS / name).read_text())


def test_a_speculative_c1_gives_its_step_time_and_labels_the_projected_speed():
    doc = _doc("cpu-spec-c1.json")
    got = figures.decode_figures(doc, speculative_tokens=4)
    tau, decode = doc["points"][0]["acceptance_length"], doc["points"][0]["decode_tok_s"]
    assert got["tokens_per_step"] == tau and got["step_ms"] == pytest.approx(1000 * tau / decode)
    assert got["projection"] is True
    projected = got["projected_tok_s_per_stream"]["clean base (Spark article)"]
    assert projected["tok_s"] == pytest.approx(5.15 * 1000 / got["step_ms"])
    assert got["mean_context_tokens"] == pytest.approx(doc["points"][0]["summary"]["prompt_tokens"]["mean"] + 1024)


def test_a_c8_sweep_is_read_at_its_most_concurrent_point_one_token_a_step_without_speculation():
    got = figures.decode_figures(_doc("cpu-c8.json"), speculative_tokens=0, max_num_seqs=4)
    assert got["concurrency"] == 8 and got["batch"] == 4  # the cpu profile's 4 slots: 4 decode, 4 wait
    assert got["tokens_per_step"] == 1.0 and "projection" not in got
    assert got["step_ms"] == pytest.approx(1000 / got["decode_tok_s_per_stream_p50"])


def test_prefill_speed_is_prompt_tokens_over_time_to_first_token_per_depth():
    doc = _doc("cpu-depth.json")
    rows = figures.prefill_figures(doc)
    assert [r["label"] for r in rows] == [p["label"] for p in doc["points"]]
    last = doc["points"][-1]
    assert rows[-1]["prefill_tok_s"] == pytest.approx(last["summary"]["prompt_tokens"]["mean"] / last["ttft_s"], rel=1e-3)


def test_the_measured_step_is_set_against_the_time_its_bytes_need():
    single = rf.servings()["single"]
    decode = {"c1": {"mean_context_tokens": 640, "concurrency": 1, "batch": 1, "step_ms": 10.0}}
    row = figures.roofline_rows(single, 4e12, decode, speculative=True)["c1"]
    assert row["bytes_per_step"] == single.step_bytes(640, 1, True)
    assert row["fraction_of_limit"] == pytest.approx(single.step_bytes(640, 1, True) / 4e12 / 0.010)


def test_the_summary_table_has_a_row_per_served_copy():
    summary = {"date": "d", "gpu": "H200", "bandwidth": {"gb_s": 4100.0, "method": "copy"},
               "profiles": {"single-full": {"ready_s": 300.0, "pool": {"engine_tokens": 68605, "plan_tokens": 68605,
                                                                       "seed_tokens": 68605},
                                            "peak": {"bytes": 23 * fs.GIB}, "cap_held": True,
                                            "decode": {"c1": {"step_ms": 12.5, "tokens_per_step": 1.0}},
                                            "measured_alone": False,
                                            "gpu_neighbours_while_measured": {"8826": 1 << 30, "8859": 1 << 30}},
                            "long-full": {"failed": "the server exited before its gate"}}}
    # A copy that started beside another: its graphs are not its own to name (None), the rest is.
    log = figures.parse_engine_log(LOG)
    beside = figures.footprint(log, peak_process=23 * fs.GIB, kv_pool=5 * fs.GIB, drafter=0, gdn_state=10,
                               graphs_attributable=False)
    summary["profiles"]["spark-lora-full"] = {"ready_s": 241.6, "footprint": beside.to_dict()}
    text = figures.summary_markdown(summary)
    assert "4100 GB/s" in text and "| single-full | 300.0 | 68605 / 68605 / 68605 | 23.00 | True |" in text
    assert f"| {beside.weights / fs.GIB:.2f} | 5.00 | - | {beside.residual / fs.GIB:.2f} |" in text
    assert "12.5 (1.00)" in text and "long-full: failed" in text
    assert "| no: 2 other GPU processes |" in text


def test_depths_that_do_not_fit_the_served_context_are_measured_at_the_deepest_that_does():
    verify = fs.MEASURE_SIZES["quick"]["verify"]
    assert verify.argv(131_072) == [*fs.DEEP, "--depths", "25000,128000", "--output-tokens", "48"]
    # `single` (65,536) and `long` with lookup (109,488): 128k is measured where it fits.
    assert verify.argv(65_536) == [*fs.DEEP, "--depths", "25000,65000", "--output-tokens", "48"]
    assert verify.argv(fs.LOOKUP_LONG_CONTEXT) == [*fs.DEEP, "--depths", "25000,109000", "--output-tokens", "48"]
    assert verify.argv(16_384) == [*fs.DEEP, "--depths", "16000", "--output-tokens", "48"]
    prefill = fs.MEASURE_SIZES["quick"]["prefill"]
    assert prefill.argv(16_384) == [*fs.DEEP, "--depths", "1000,10000", "--output-tokens", "16"]
    # The CPU dry run's depths are dropped, never deepened (a 30k prefill there takes minutes).
    assert fs.MEASURE_SIZES["tiny"]["verify"].argv(4096) == ["--depths", "1024", "--output-tokens", "16"]
    assert fs.MEASURE_SIZES["tiny"]["verify"].argv(512) is None
    assert fs.MEASURE_SIZES["quick"]["c1"].argv(4096) == ["--requests", "2", "--output-tokens", "256"]


def test_a_depth_document_gives_a_decode_step_per_context():
    doc = _doc("cpu-depth.json")
    rows = figures.depth_decode_figures(doc, speculative_tokens=0)
    assert [r["label"] for r in rows] == [p["label"] for p in doc["points"]]
    assert rows[1]["step_ms"] == pytest.approx(1000 / doc["points"][1]["decode_tok_s"])
    assert rows[1]["context_tokens"] == int(doc["points"][1]["summary"]["prompt_tokens"]["mean"])


def test_the_split_kv_reference_differs_from_long_only_by_the_patch_switch():
    profiles = fs.profile_set(150_000_000_000)
    plain, nosplit = profiles["long-full"], profiles["long-nosplit-full"]
    assert nosplit["env"].pop("QWEN38_SPLIT_KV") == "0" and nosplit == plain


def test_the_lookup_copy_is_long_in_reproduction_mode_at_the_context_its_pool_holds():
    from core.profiles import Profile

    profiles = fs.profile_set(150_000_000_000)
    spec = Profile.model_validate({"name": "long-lookup-full", **profiles["long-lookup-full"]}).speculative
    assert spec.num_speculative_tokens + lookup_tokens(spec, None, None) == 15  # the 16-token block
    plain, lookup = profiles["long-full"], profiles["long-lookup-full"]
    assert (lookup["speculative"].pop("lookup"), plain["speculative"].pop("lookup")) == (True, False)
    assert lookup["engine"].pop("max_model_len") == fs.LOOKUP_LONG_CONTEXT
    plain["engine"].pop("max_model_len")
    assert lookup == plain
    with pytest.raises(BenchError, match="speculation off"):
        fs.derive_profile("long", speculation=False, lookup=True)


def test_served_copies_are_chosen_by_name_in_their_start_order():
    from bench.fullscale import served_subset

    assert list(served_subset("long-full,single-full")) == ["single-full", "long-full"]
    assert served_subset(None) is None
    with pytest.raises(BenchError, match="--served nope: unknown"):
        served_subset("single-full,nope")


def test_without_a_spark_lora_copy_only_the_3090_artifacts_are_generated_and_no_adapter_built(tmp_path):
    """`--served single-full,long-full` writes 19.8 GB instead of 46.5; a later call that serves
    `spark-lora` finds generate not done for it (the rest is written then) and wants the adapter."""
    from bench.fullscale import served_subset
    from bench.fullscale_run import read_state

    rtx = served_subset("single-full,long-full")
    assert fs.generated_variants("full", rtx) == ["qwen3.8-27b-w4a16", "qwen3.8-27b-dflash2-w4a16"]
    assert fs.generated_variants("full", None) is None and fs.generated_variants("tiny", rtx) is None
    root = tmp_path / "run"
    generated = fs.step_generate(root, "small", workers=1, disk_bytes=8 << 20, only=fs.generated_variants("small", rtx))
    assert sorted(generated["generated"]["models"]) == ["qwen3.8-27b-dflash2-w4a16", "qwen3.8-27b-w4a16"]
    assert not (root / "models" / "artifacts" / "qwen3.8-27b-nvfp4").exists()
    assert read_state(root, rtx).prepared == ("generate", "adapter")
    assert read_state(root, None).prepared == ()


def test_generate_refuses_before_writing_when_the_artifacts_do_not_fit_the_disk(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64 << 30, 30 << 30, 34 << 30))
    with pytest.raises(BenchError) as refused:
        fs.step_generate(tmp_path / "run", "full", workers=1, disk_bytes=8 << 20)
    message = str(refused.value)
    assert "48.3 GB of artifacts" in message and "36.5 GB free" in message  # the two towers included
    assert f"qwen38 bench fullscale run --root {tmp_path / 'run'} --served single-full,long-full" in message
    assert not (tmp_path / "run" / "models" / "artifacts" / "qwen3.8-27b-w4a16").exists()
    fs.check_disk_room(tmp_path, "full", list(fs.RTX3090_VARIANTS))  # 20.7 GB + room fits 36.5
    # Where not even the 3090's artifacts fit, the hint is the disk itself.
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64 << 30, 50 << 30, 14 << 30))
    with pytest.raises(BenchError, match="free space there or give --root a larger disk$"):
        fs.check_disk_room(tmp_path / "models" / "artifacts", "full", None)


def test_the_flashinfer_prebuild_step_is_recorded_and_never_stops_the_run(tmp_path):
    """Where FlashInfer is not importable (this CPU machine) the step says so and counts as
    done; on the GPU machine it builds the sampling kernels as the images do (timed)."""
    import importlib.util

    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("FlashInfer is importable here: the step would build its kernels")
    result = fs.step_prebuild(tmp_path)
    assert result["done"] is True and "FlashInfer is not importable" in result["skipped"]
    assert fs.read_result(tmp_path, "prebuild") == result


def test_the_lookup_split_kv_reference_differs_from_the_lookup_copy_only_by_the_patch_switch():
    profiles = fs.profile_set(150_000_000_000)
    lookup, nosplit = profiles["long-lookup-full"], profiles["long-lookup-nosplit-full"]
    assert nosplit["env"].pop("QWEN38_SPLIT_KV") == "0" and nosplit == lookup


def test_the_generate_step_alone_writes_what_its_served_copies_need(tmp_path, capsys):
    """`bench fullscale generate --served ...` (run beside other work on the lent GPU) writes
    the 3090's set when no `spark-lora` copy is named, as `run` would."""
    from entrypoint.cli import main

    root = tmp_path / "run"
    assert main(["bench", "fullscale", "generate", "--root", str(root), "--size", "small", "--workers", "1",
                 "--disk-bytes", str(8 << 20), "--served", "long-lookup-full,long-nosplit-full"]) == 0
    capsys.readouterr()
    written = fs.read_result(root, "generate")
    assert written["only"] == list(fs.RTX3090_VARIANTS) and written["done"] is True
    assert not (root / "models" / "artifacts" / "qwen3.8-27b-nvfp4").exists()


# ---- many users (issue 55): the method as an owner chooses it, C1 / C8 / C64 -----------------


def test_the_many_users_copies_differ_from_their_profile_only_where_they_say():
    profiles = fs.profile_set(150_000_000_000)
    # MTP is a setting of `qwen38 serve` (SPECULATION=mtp), not a different profile.
    assert profiles["single-mtp-full"] == profiles["single-full"]
    assert dict(fs.SERVED["single-mtp-full"].settings) == {"SPECULATION": "mtp"}
    batch, w4a16 = profiles["batch-full"], profiles["batch-w4a16-full"]
    assert batch["env"].pop("VLLM_MARLIN_INPUT_DTYPE") == "int8" and batch == w4a16
    assert batch["engine"]["max_num_seqs"] == 64 and "batch" in fs.CAPPED
    with pytest.raises(BenchError, match="does not set it in \\[env\\]"):
        fs.derive_profile("single", drop_env=("VLLM_MARLIN_INPUT_DTYPE",))


@pytest.mark.parametrize("settings, expected", [
    ({}, ("dflash", 7)), ({"SPECULATION": "mtp"}, ("mtp", 4)), ({"SPECULATION": "mtp", "MTP_DEPTH": "2"}, ("mtp", 2)),
    ({"SPECULATION": "false"}, (None, 0)), ({"SPECULATION": "true"}, ("dflash", 7)),
])
def test_a_copy_drafts_what_its_settings_choose(settings, expected):
    assert fs.drafted_per_step(load_profile("single"), settings) == expected
    assert fs.drafted_per_step(load_profile("batch"), {}) == (None, 0)


def test_the_served_copys_settings_reach_serve_and_plan_and_nothing_else_does(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULATION", "false")  # the caller's own stack setting is not the copy's
    key = tmp_path / "key"
    key.write_text("k")
    env = fs._serve_env(tmp_path, key, copy=fs.SERVED["single-mtp-full"])
    assert env["SPECULATION"] == "mtp" and env["PROFILES_DIR"] == str(tmp_path / "profiles")
    assert "SPECULATION" not in fs._serve_env(tmp_path, key, copy=fs.SERVED["single-full"])


def test_a_users_document_gives_a_row_per_concurrency_without_a_dflash_projection_for_mtp():
    doc = _doc("cpu-mtp-users.json")  # `cpu` with SPECULATION=mtp, `bench fullscale run --sizes tiny --workloads users`
    rows = figures.users_figures(doc, speculative_tokens=4, max_num_seqs=4, project=False)
    assert [r["concurrency"] for r in rows] == [p["concurrency"] for p in doc["points"]] == [1, 4]
    for row, point in zip(rows, doc["points"]):
        tau = point["acceptance_length"] or 1.0
        assert row["step_ms"] == pytest.approx(1000 * tau / point["decode_tok_s"])
        assert row["ttft_s"]["p90"] == point["summary"]["ttft_s"]["p90"] and row["preemptions"] == point["preemptions"]
        assert "projected_tok_s_per_stream" not in row
    projected = figures.users_figures(doc, speculative_tokens=7, project=True)
    assert all(r["projection"] for r in projected)
    text = figures.summary_markdown({"profiles": {"single-mtp-full": {"users": rows}}})
    assert "| single-mtp-full | 4 |" in text and "| preempted |" in text


def test_a_workload_no_size_has_is_refused_before_anything_runs(tmp_path):
    from bench.fullscale_run import run

    for call in (lambda w: fs.step_measure(tmp_path, "single-full", "quick", w),
                 lambda w: run(tmp_path, budget_s=10, workloads=w)):
        with pytest.raises(BenchError,
                           match="--workloads c64: expected a comma list of c1, deep, c8, prefill, verify, steps, users, image"):
            call(("users", "c64"))
    assert not (tmp_path / fs.RESULTS).exists()  # nothing was prepared, started or written
    with pytest.raises(BenchError, match="not ready"):
        fs.step_measure(tmp_path, "single-full", "quick", ("users",))
    assert set(fs.MEASURE_SIZES["quick"]) == set(fs.MEASURE_SIZES["full"]) == set(fs.MEASURE_SIZES["tiny"])


# ---- the step by part (issue 57): profiled copies, `qwen38 bench steps` in the run ---------------


def test_a_profiled_copy_serves_with_its_own_trace_directory_and_others_without_one(tmp_path):
    key = tmp_path / "key"
    key.write_text("k")
    env = fs._serve_env(tmp_path, key, copy=fs.SERVED["single-steps-full"], profile="single-steps-full")
    assert env["TORCH_PROFILE_DIR"] == str(fs.trace_dir(tmp_path, "single-steps-full"))
    assert "TORCH_PROFILE_DIR" not in fs._serve_env(tmp_path, key, copy=fs.SERVED["single-full"], profile="single-full")
    # `qwen38 plan` (no profile name) gets no trace directory: the planner never profiles.
    assert "TORCH_PROFILE_DIR" not in fs._serve_env(tmp_path, key, copy=fs.SERVED["single-steps-full"])
    # The profiled copies are `single` as served, differing only in the method.
    profiles = fs.profile_set(150_000_000_000)
    assert profiles["single-steps-full"] == profiles["single-full"]
    assert profiles["single-nospec-steps-full"] == profiles["single-nospec-full"]
    assert [n for n, s in fs.SERVED.items() if "steps" in (s.workloads or ())] == [
        n for n, s in fs.SERVED.items() if s.profiled]


def test_a_steps_document_becomes_parts_that_sum_to_the_step_and_one_table():
    doc = _doc("cpu-step-profile.json")  # a real `qwen38 bench steps` document
    points = figures.step_parts(doc)
    assert [p["concurrency"] for p in points] == [p["concurrency"] for p in doc["points"]]
    for point, raw in zip(points, doc["points"]):
        assert sum(r["ms"] for r in point["rows"]) == pytest.approx(point["step_ms"], abs=1e-4)
        assert point["step_ms"] == raw["step_us"] / 1000 and point["kind"] == "cpu"
    text = figures.summary_markdown({"profiles": {"a-full": {"steps": points}, "b-full": {"steps": points[:1]}}})
    header = next(line for line in text.splitlines() if line.startswith("| ms per steady step"))
    assert header.count("| a-full C") == len(points) and "| b-full C1 |" in header
    gdn = next(line for line in text.splitlines() if line.startswith("| GDN: causal conv update |"))
    assert gdn.count("|") == 2 + len(points) + 1


def test_steps_on_a_copy_served_without_the_profiler_is_skipped_with_the_reason(tmp_path):
    """An unprofiled copy's `steps` is recorded as skipped, never sent (its server would answer
    404 to /start_profile); a profiled one reads the trace directory its server writes to."""
    for name in ("single-full", "single-nospec-full", "batch-full"):
        assert fs.workload_argv(tmp_path, name, fs.SERVED[name], "steps", 65_536) == (
            "served without TORCH_PROFILE_DIR (Served.profiled)")
    argv = fs.workload_argv(tmp_path, "single-steps-full", fs.SERVED["single-steps-full"], "steps", 65_536)
    assert argv[:4] == ["--concurrency", "1,8", "--steps", "32"]
    assert argv[argv.index("--trace-dir") + 1] == str(fs.trace_dir(tmp_path, "single-steps-full"))
    assert fs.workload_argv(tmp_path, "x", None, "verify", 1_000) == "no depth fits max_model_len 1000"


def test_the_roofline_row_follows_the_method_the_copy_served_with():
    """A copy measured with MTP gets no roofline (its bytes per step are not DFlash2's); one
    without speculation is set against the no-speculation bytes, whatever its profile says."""
    decode = {"c1": {"mean_context_tokens": 640, "concurrency": 1, "batch": 1, "step_ms": 10.0}}
    results = {"bandwidth": {"bytes_per_s": 4e12, "gb_s": 4000.0, "method": "copy"}}
    for name, method in (("single-full", "dflash"), ("single-mtp-full", "mtp"), ("single-nospec-full", None)):
        results[f"{name}.start"] = {}
        results[f"{name}.measure"] = {"decode": decode, "speculation": method}
    rows = fs.summarize(results)["profiles"]
    single = rf.servings()["single"]
    assert rows["single-full"]["roofline"]["c1"]["bytes_per_step"] == single.step_bytes(640, 1, True)
    assert rows["single-nospec-full"]["roofline"]["c1"]["bytes_per_step"] == single.step_bytes(640, 1, False)
    assert "roofline" not in rows["single-mtp-full"]


def test_huge_runs_one_request_over_its_whole_context_and_the_report_shows_its_prefill_decode_and_peak():
    huge = load_profile("huge")
    assert "deep" in fs.SERVED["huge-full"].workloads
    # The deepest depth its max_model_len takes with the output and the bench's margin, with
    # a request timeout that outlasts minutes of prefill.
    deep = fs.MEASURE_SIZES["quick"]["deep"]
    assert deep.argv(huge.engine.max_model_len) == [*fs.DEEPEST, "--depths", "245000", "--output-tokens", "32"]
    assert deep.argv(65_536) == [*fs.DEEPEST, "--depths", "65000", "--output-tokens", "32"]
    doc = _doc("cpu-depth.json")
    row = {"peak": {"bytes": 22 * fs.GIB}, "verify": figures.depth_decode_figures(doc, 7),
           "verify_prefill": figures.prefill_figures(doc),
           "deep": {"decode": figures.depth_decode_figures(doc, 7), "prefill": figures.prefill_figures(doc)}}
    text = figures.summary_markdown({"profiles": {"huge-full": row}})
    first = doc["points"][0]
    tokens = int(first["summary"]["prompt_tokens"]["mean"])
    rows = [line for line in text.splitlines() if line.startswith("| huge-full |")]
    # Each depth's first token and prefill speed, the verify workload's then the deepest
    # request's, beside the copy's peak; and the decode step at each of those contexts.
    first_token = f"{tokens:,}: {first['ttft_s']:.1f} ({figures.prefill_tok_s(tokens, first['ttft_s']):,.0f})"
    assert [line.count(first_token) for line in rows] == [0, 0, 2]
    assert rows[2].endswith("| 22.00 |")
    step = figures.step_latency_ms(first["decode_tok_s"], first.get("acceptance_length") or 1.0)
    assert rows[1].count(f"{tokens:,}: {step:.1f}") == 2
