"""Run vLLM 0.28.0 (CPU build) offline on a model directory and print what it answered.

Usage: python vllm_offline_probe.py MODEL_DIR [--reference-int8-kernel] [--mtp K] [--score FILE]
Prints one JSON line: per prompt its token ids, the greedy token ids and top logprobs,
the prompt logprobs, and (with the reference kernel) what the int8 layers loaded. With
``--score FILE`` (a JSON list of token-id lists) those are the prompts, scored by their
prompt logprobs. Runs the engine in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so a kernel registered here is the one the engine uses.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

PROMPTS = ["Hello world, the quick brown", "def main():\n    print("]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--reference-int8-kernel", action="store_true")
    parser.add_argument("--mtp", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--score", default=None)
    parser.add_argument("--additional-config", default=None, help="JSON for LLM(additional_config=...)")
    args = parser.parse_args()
    if args.reference_int8_kernel:
        from tests.integration import int8_reference_kernel

        int8_reference_kernel.register()
    from vllm import LLM, SamplingParams

    from tests.support.gpu_share import gpu_share

    extra = {}
    if args.additional_config:
        extra["additional_config"] = json.loads(args.additional_config)
    if args.mtp:
        extra["speculative_config"] = {"method": "mtp", "num_speculative_tokens": args.mtp}
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
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
    if args.score:
        from vllm.inputs import TokensPrompt

        with open(args.score) as handle:
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.load(handle)]
    params = SamplingParams(
        temperature=0.0, max_tokens=1 if args.score else args.max_tokens, logprobs=2, prompt_logprobs=2
    )
    outputs = llm.generate(prompts, params)
    result = {"outputs": []}
    for out in outputs:
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
    if args.reference_int8_kernel:
        from tests.integration import int8_reference_kernel

        result["int8_layers"] = int8_reference_kernel.SEEN
    metrics = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_"):
            metrics[metric.name] = getattr(metric, "value", None)
    result["spec_metrics"] = metrics
    print("PROBE " + json.dumps(result))


if __name__ == "__main__":
    main()
