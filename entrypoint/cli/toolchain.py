"""`qwen38 toolchain`: the CUDA JIT toolchain from the pip wheels (`entrypoint.toolchain`): lay it
out as a toolkit, check it, prebuild FlashInfer's kernels."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from core.errors import ToolchainError
from entrypoint import toolchain


def _cmd_link(args: argparse.Namespace) -> int:
    tree = Path(args.tree) if args.tree else toolchain.site_packages() / toolchain.WHEEL_TREE
    driver_dir = Path(args.driver_dir) if args.driver_dir else toolchain.driver_library_dir()
    links = toolchain.link_toolkit(Path(args.cuda_home), tree, driver_dir)
    print(f"qwen38: CUDA toolkit at {args.cuda_home}: {len(links)} links into {tree}")
    return 0


def _cmd_prebuild(args: argparse.Namespace) -> int:
    start = time.monotonic()
    driver_dir = Path(args.driver_dir) if args.driver_dir else toolchain.driver_library_dir()
    # Before FlashInfer's JIT modules are first imported (by the look below): they read their
    # workspace once, and the builds' scratch must go there, not into the home directory.
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(args.workspace)
    try:
        missing = toolchain.prebuilt_missing()
    except ImportError as exc:
        raise ToolchainError(f"FlashInfer is not importable here ({exc}): install flashinfer-python "
                             "(the CUDA images carry it)") from None
    present = [name for name in toolchain.PREBUILT_MODULES if name not in missing]
    if present:
        print(f"qwen38: FlashInfer {', '.join(present)} already prebuilt")
    if not missing:
        return 0
    built = toolchain.prebuild_flashinfer_modules(driver_dir, Path(args.workspace), missing)
    archs = os.environ.get("FLASHINFER_CUDA_ARCH_LIST", "the visible GPUs")
    print(f"qwen38: FlashInfer {', '.join(built)} modules for {archs} built in {time.monotonic() - start:.0f} s: "
          + ", ".join(str(path) for path in built.values()))
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    cuda_home = Path(args.cuda_home) if args.cuda_home else toolchain.jit_cuda_home(dict(os.environ))
    checks = toolchain.check_toolchain(cuda_home, torch_cuda=toolchain.torch_cuda_version())
    for check in checks:
        print(f"{'OK' if check.ok else 'MISSING':7} {check.name:14} {check.detail}")
    failed = [c for c in checks if not c.ok]
    if failed:
        raise ToolchainError(
            f"{len(failed)} piece(s) of the CUDA JIT toolchain missing under {cuda_home}: "
            f"{failed[0].name}: {failed[0].detail}"
        )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "toolchain",
        help="the CUDA JIT toolchain from the pip wheels: lay it out as a toolkit, check it, prebuild kernels",
        description="Lay out the pip CUDA wheels (site-packages/nvidia/cu13) as a CUDA toolkit at "
        "CUDA_HOME; check that a FlashInfer JIT build finds nvcc, the headers, cudart, C and C++ "
        "compilers, Python's headers and ninja where it looks for them; or build FlashInfer's "
        "sampling and top-k modules ahead of time (the images do all three when they are built).",
    )
    actions = parser.add_subparsers(dest="toolchain_action", metavar="ACTION", required=True)
    link = actions.add_parser("link", help="write the toolkit of symlinks at --cuda-home (image build)")
    link.add_argument("--cuda-home", required=True, help="where the toolkit goes (the image's CUDA_HOME)")
    link.add_argument("--tree", help=f"the wheel tree (default: site-packages/{toolchain.WHEEL_TREE})")
    link.add_argument("--driver-dir", help="where the driver's libcuda.so.1 is mounted (default: /usr/lib/<multiarch>)")
    link.set_defaults(func=_cmd_link)
    prebuild = actions.add_parser(
        "prebuild", help="build the FlashInfer modules an engine loads at start (sampling, top-k) into its "
        "AOT directory, those not there yet (image build)")
    prebuild.add_argument("--workspace", default="/tmp/qwen38-flashinfer-prebuild",
                          help="scratch directory for the build (removed afterwards)")
    prebuild.add_argument("--driver-dir", help="where libcuda.so.1 is looked for (default: /usr/lib/<multiarch>)")
    prebuild.set_defaults(func=_cmd_prebuild)
    check = actions.add_parser("check", help="prove each piece a JIT build needs is there (exit 2 if not)")
    check.add_argument("--cuda-home", help="check this directory (default: where FlashInfer looks)")
    check.set_defaults(func=_cmd_check)
