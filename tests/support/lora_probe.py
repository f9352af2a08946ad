"""Load a model in vLLM (offline `LLM`), optionally with a LoRA, and record its outputs.

Run as a child process, one model per process on a GPU (vLLM does not release a GPU
reliably within one process):

    python -m tests.support.lora_probe MODEL OUT.json [--lora DIR]

Writes {"base": {...}, "mode-b": {...}} with, per identity, the greedy token ids of each
prompt and the per-position log-probs of a fixed sequence. On the CPU build several engines
run one after the other in one process (one import of vLLM for all of them):

    python -m tests.support.lora_probe --runs RUNS.json OUT.json

RUNS.json: a list of {"name", "model", "lora" (or null), "compile"}; OUT.json: {name: probe}.
``compile`` is "eager" (enforce_eager, the GPU tests' setting), "default" (vLLM's own choice:
the CPU platform turns graph compilation off when LoRA is enabled, after choosing the native
ops for a compiled graph) or "native" (uncompiled with the native ops: what a LoRA engine
gets on CPU, for engines without LoRA compared against it). Same prompts and sequence as the
CPU end-to-end test (which imports them from here), so results compare across machines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tests.support.gpu_share import gpu_share

# Prompts for the tiny models of `qwen38 tiny` (byte-level BPE: any text tokenizes).
PROMPTS = [
    "The cache holds",
    "def verify(slot):",
    "Speculative decoding drafts tokens that the target",
    '{"name": "weather", "arguments": {"city":',
]
# A fixed sequence whose per-position log-probs compare whole next-token distributions.
SEQUENCE = (
    "The server reads the model from the cache, drafts four tokens and verifies them; "
    "def plan(slots, memory):\n    return memory // slots"
)
MAX_TOKENS = 8


COMPILE = {
    "eager": {"enforce_eager": True},
    "default": {},
    "native": {"compilation_config": {"mode": 0, "custom_ops": ["none"]}},
}


def probe(model: str, lora: str | None, compile: str = "eager") -> dict[str, dict]:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    kwargs: dict = {
        "model": model,
        "dtype": "bfloat16",
        "max_model_len": 1024,
        "max_num_seqs": 4,
        "kv_cache_memory_bytes": 256 << 20,
        "mamba_ssm_cache_dtype": "float32",
        "seed": 0,
        **COMPILE[compile],
    }
    kwargs.update(gpu_share())
    if torch.cuda.is_available():
        # FlashInfer's GDN prefill needs the CUTLASS DSL (CI-NOTES); the Spark uses Triton anyway
        kwargs["additional_config"] = {"gdn_prefill_backend": "triton"}
    if lora:
        kwargs.update(enable_lora=True, max_lora_rank=1, max_loras=1)
    llm = LLM(**kwargs)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    ids = llm.get_tokenizer()(SEQUENCE)["input_ids"]
    requests = {"base": None}
    if lora:
        requests["mode-b"] = LoRARequest("mode-b", 1, lora)
    seen = {}
    for name, request in requests.items():
        outs = llm.generate(PROMPTS, greedy, lora_request=request, use_tqdm=False)
        scored = llm.generate([SEQUENCE], scoring, lora_request=request, use_tqdm=False)[0]
        logprobs = [row[token].logprob for row, token in zip(scored.prompt_logprobs[1:], ids[1:], strict=True)]
        seen[name] = {"greedy": [list(o.outputs[0].token_ids) for o in outs], "logprobs": logprobs}
    del llm
    return seen


def main() -> None:
    import gc

    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", help="the model (without --runs)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--lora")
    parser.add_argument("--runs", type=Path, help="JSON list of runs, one engine after another (CPU build)")
    args = parser.parse_args()
    if args.runs is None:
        if args.model is None:
            parser.error("name the model, or give --runs")
        args.out.write_text(json.dumps(probe(args.model, args.lora)))
        return
    seen = {}
    for run in json.loads(args.runs.read_text()):
        seen[run["name"]] = probe(run["model"], run.get("lora"), run["compile"])
        gc.collect()
    args.out.write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
