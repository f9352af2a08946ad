"""Run vLLM 0.28.0 offline on model directories and print what it answered.

One model:   python vllm_offline_probe.py MODEL_DIR [--reference-int8-kernel] [--mtp K] [--score FILE]
Many models: python vllm_offline_probe.py --runs RUNS.json [--reference-int8-kernel]

Prints one JSON line (``PROBE {...}``): per prompt its token ids, the greedy token ids and top
logprobs, the prompt logprobs, and (with the reference kernel) what the int8 layers loaded.
With ``--score FILE`` (a JSON list of token-id lists) those are the prompts, scored by their
prompt logprobs. Runs the engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so a kernel
registered here is the one the engine uses.

``--runs``: a JSON list of {"name", "model", "mtp" (0), "score_from" (a run named before)}: the
engines run one after another in this one process, so vLLM is imported once for all of them
(the CPU build; on a GPU use one model per process). ``score_from`` scores that run's prompts
plus its answers. Prints ``PROBE {name: result}``; a run that raised has ``{"error": ...}`` and
the runs after it still run.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

PROMPTS = ["Hello world, the quick brown", "def main():\n    print("]


def answer(model: str, dtype: str = "auto", mtp: int = 0, score: list[list[int]] | None = None,
           max_tokens: int = 12, additional_config: dict | None = None) -> dict:
    """One engine on ``model``: greedy answers to PROMPTS (or, with ``score``, those token-id
    prompts scored), with what the reference kernel loaded and the speculation counters."""
    import gc

    from vllm import LLM, SamplingParams

    from tests.support.gpu_share import gpu_share

    seen_before = len(_seen())
    extra = {}
    if additional_config:
        extra["additional_config"] = additional_config
    if mtp:
        extra["speculative_config"] = {"method": "mtp", "num_speculative_tokens": mtp}
    llm = LLM(
        model=model,
        dtype=dtype,
        kv_cache_memory_bytes=64 << 20,
        mamba_ssm_cache_dtype="float32",
        max_model_len=512,
        max_num_seqs=2,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        enable_prefix_caching=False,  # CPU: hybrid + speculation + prefix caching dies in a Triton copy kernel
        **gpu_share(),
        **extra,
    )
    prompts: list = PROMPTS
    if score is not None:
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in score]
    params = SamplingParams(temperature=0.0, max_tokens=1 if score is not None else max_tokens, logprobs=2,
                            prompt_logprobs=2)
    result: dict = {"outputs": []}
    for out in llm.generate(prompts, params, use_tqdm=False):
        completion = out.outputs[0]
        result["outputs"].append(
            {
                "prompt_token_ids": list(out.prompt_token_ids),
                "token_ids": list(completion.token_ids),
                "logprobs": [{str(k): v.logprob for k, v in step.items()} for step in completion.logprobs],
                "prompt_logprobs": [
                    None if s is None else {str(k): v.logprob for k, v in s.items()} for s in out.prompt_logprobs
                ],
            }
        )
    result["int8_layers"] = _seen()[seen_before:]
    if mtp:
        result["draft_head"] = llm.collective_rpc(_draft_head)[0]
    result["spec_metrics"] = {
        metric.name: getattr(metric, "value", None)
        for metric in llm.get_metrics()
        if metric.name.startswith("vllm:spec_decode_num_")
    }
    del llm
    gc.collect()
    return result


def _draft_head(worker) -> dict | None:
    """Inside the engine: the MTP model's reduced head (qwen38 patch 0012), or None. Its row
    count, the columns a full-vocabulary logits row leaves finite for random hidden states, and
    how far those logits are from the full head's (the target's, shared by the proposer)."""
    import torch

    model = worker.model_runner.drafter.model
    if getattr(model, "qwen38_draft_head", None) is None:
        return None
    ids = model.qwen38_draft_ids
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(device=ids.device, dtype=model.vllm_config.model_config.dtype)
    with torch.inference_mode():
        drafted = model.compute_logits(hidden)
        full = model.logits_processor(model.lm_head, hidden)
    finite = torch.isfinite(drafted)
    return {
        "rows": int(ids.numel()),
        "vocab": int(drafted.shape[-1]),
        "finite_columns": [sorted(torch.nonzero(row).flatten().tolist()) for row in finite],
        "ids": ids.tolist(),
        "max_diff_at_ids": float((drafted[:, ids].float() - full[:, ids].float()).abs().max()),
        "full_head_rows": int(full.shape[-1]),
    }


def _seen() -> list[dict]:
    """What the reference int8 kernel loaded so far in this process (empty where not registered)."""
    import sys

    kernel = sys.modules.get("tests.integration.int8_reference_kernel")
    return list(kernel.SEEN) if kernel else []


def run_all(runs: list[dict]) -> dict[str, dict]:
    """Each run's `answer`, one engine after another; a failed run is recorded, not fatal."""
    results: dict[str, dict] = {}
    for run in runs:
        score = None
        if run.get("score_from"):
            source = results[run["score_from"]]
            score = [o["prompt_token_ids"] + o["token_ids"] for o in source.get("outputs", [])]
        try:
            results[run["name"]] = answer(run["model"], mtp=run.get("mtp", 0), score=score)
        except Exception:  # noqa: BLE001 - the test reads which run failed and why
            results[run["name"]] = {"error": traceback.format_exc()[-4000:]}
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?")
    parser.add_argument("--runs", default=None, help="JSON file: engines to run one after another")
    parser.add_argument("--reference-int8-kernel", action="store_true")
    parser.add_argument("--mtp", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--score", default=None)
    parser.add_argument("--additional-config", default=None, help="JSON for LLM(additional_config=...)")
    args = parser.parse_args()
    if (args.model is None) == (args.runs is None):
        parser.error("name one model, or give --runs")
    if args.reference_int8_kernel:
        from tests.integration import int8_reference_kernel

        int8_reference_kernel.register()
    if args.runs:
        with open(args.runs) as handle:
            print("PROBE " + json.dumps(run_all(json.load(handle))))
        return
    score = None
    if args.score:
        with open(args.score) as handle:
            score = json.load(handle)
    additional = json.loads(args.additional_config) if args.additional_config else None
    result = answer(args.model, args.dtype, args.mtp, score, args.max_tokens, additional)
    if not args.reference_int8_kernel:
        del result["int8_layers"]
    print("PROBE " + json.dumps(result))


if __name__ == "__main__":
    main()
