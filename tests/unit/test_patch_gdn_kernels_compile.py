"""Patch 0050 without a GPU: the patched GDN speculative kernels compile with Triton
for the 3090 (sm_86) and Blackwell (sm_120) targets, as the stock ones do.

The numerical proof (bounded indexing against a torch recurrence) needs a GPU:
tests/gpu/test_patch_kernels.py::test_gdn_spec_state_indexing_is_bounded. vLLM turns
Triton off where no GPU driver is found, so the kernel source of the patched view is
compiled with Triton itself (vLLM's Triton shim swapped for the real modules), in a child
process (tests/support/gdn_kernel_compile.py): this session may run Triton's interpreter.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.support.triton_compile import run_compile_child

KERNELS = {
    "fused_recurrent.py": "fused_recurrent_gated_delta_rule_fwd_kernel",
    "fused_sigmoid_gating.py": "fused_sigmoid_gating_delta_rule_update_kernel",
}
ARCHS = (86, 120)
VIEWS = ("stock", "patched")


def _kernel_path(views, view: str, filename: str) -> str:
    return str(views[view] / "vllm" / "third_party" / "flash_linear_attention" / "ops" / filename)


@pytest.fixture(scope="module")
def compiled(vllm_views):  # noqa: F811 - the fixture imported above
    """(filename, view, arch) -> the child's result, every case compiled by one child."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    cases = [(f, v, a) for f in sorted(KERNELS) for v in VIEWS for a in ARCHS]
    request = {"cases": [[_kernel_path(vllm_views, v, f), KERNELS[f], a] for f, v, a in cases]}
    results = run_compile_child("tests.support.gdn_kernel_compile", stdin=json.dumps(request))["results"]
    return dict(zip(cases, results, strict=True))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("filename", sorted(KERNELS))
def test_gdn_spec_kernels_compile(compiled, filename, view, arch):
    result = compiled[(filename, view, arch)]
    if result["status"].startswith("skip: "):
        pytest.skip(result["status"].removeprefix("skip: "))
    assert result["status"] == "ok", result["status"]
    assert result["ttir"]
    # The patch adds the bound the indexing is checked against; stock has none.
    assert ("NUM_STATE_SLOTS" in result["arg_names"]) == (view == "patched")
