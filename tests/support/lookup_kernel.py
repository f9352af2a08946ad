"""Patch 0072's lookup-drafting kernel (patches/src/.../qwen38_lookup.py) outside the engine.

`load_lookup_module` imports the kernel file for Triton's interpreter; `expected_fill`
is the rule it implements, patch 0070's NumPy `fill_lookup_drafts` (which tokens, and which
positions lookup decides); `python -m tests.support.lookup_kernel` compiles the kernel with
real Triton for GPU targets in a process of its own (this session may run the interpreter,
see tests/support/triton_compile.py) and prints ``{"results": {arch: "ok" | "skip: ..."}}``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.support.lookup_rule import load_lookup_rule
from tests.support.triton_compile import compile_for_cuda

REPO = Path(__file__).resolve().parents[2]
LOOKUP_KERNEL_FILE = REPO / "patches" / "src" / "v1" / "worker" / "gpu" / "spec_decode" / "qwen38_lookup.py"
ARCHS = (86, 90, 120)


def load_lookup_module(*, interpret: bool):
    from tests.split_kv_support import load_triton_file

    return load_triton_file(LOOKUP_KERNEL_FILE, "qwen38_lookup", interpret=interpret)


def expected_fill(history: np.ndarray, drafts: np.ndarray, num_drafter: int, window: int):
    """(tokens, lookup_positions) for one request, by patch 0070's NumPy rule.

    Both are `fill_lookup_drafts`' (the rule as this checkout's series makes it,
    tests/support/lookup_rule.py): the tokens, and the positions lookup decides, which are
    point masses whether or not the drafter proposed the same token there.
    """
    return load_lookup_rule().fill_lookup_drafts(history, drafts, num_drafter, window=window)


def compile_for(arch: int) -> str:
    module = load_lookup_module(interpret=False)
    kernel = module._lookup_fill_kernel
    pointers = {
        "draft_tokens_ptr": "*i64", "lookup_positions_ptr": "*i8", "idx_mapping_ptr": "*i32",
        "num_sampled_ptr": "*i32", "all_token_ids_ptr": "*i32", "total_len_ptr": "*i32",
        "draft_logits_ptr": "*fp32", "candidate_ids_ptr": "*i64",
    }
    # The `single` profile with LOOKUP=true: K = 15 (7 drafter + 8 lookup), DFlash2's top 16.
    constants = dict(
        K=15, NUM_DRAFTER=7, TOP_K=16, MIN_MATCH=2, MAX_MATCH=8, WINDOW=32768, END_BITS=32,
        BLOCK=module.LOOKUP_SCAN_BLOCK, BLOCK_K=16, BLOCK_TOP_K=16, HAS_DRAFT_LOGITS=True,
    )
    signature = {name: pointers.get(name, "i64") for name in kernel.arg_names if name not in constants}
    compiled = compile_for_cuda(kernel, signature, constants, arch, {"num_warps": 4})
    return compiled if isinstance(compiled, str) else "ok"


if __name__ == "__main__":
    print(json.dumps({"results": {str(arch): compile_for(arch) for arch in ARCHS}}))
