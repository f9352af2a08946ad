"""`dual` and `spark-pair`: vLLM's own tensor parallelism, resolved once and rendered into
exactly the flags and environment vLLM, NCCL and gloo read, with the all-reduce defaults the
link between the GPUs calls for and every conflicting knob refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import SecretStr

from core.errors import SettingsError
from core.profiles import load_profile
from core.settings import Settings
from entrypoint.compile_cache import compile_cache_key
from entrypoint.launch import ENGINE_MODULE, check_allocator, render_invocation
from entrypoint.resolve import resolve
from entrypoint.topology import link_between, parse_topology
from tests.conftest import clean_env, run_cli
from tests.support import nvidia_smi_samples as smi
from tests.support.plans import PAIR_HEAD, PAIR_WORKER, render_resolved

KEY = SecretStr("s3cret-" + "k" * 20)


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch):
    for name in Settings.model_fields:
        monkeypatch.delenv(name.upper(), raising=False)


def settings(profile: str, **values) -> Settings:
    return Settings(_env_file=None, profile=profile, models_dir=Path("/models"), cache_dir=Path("/cache"), **values)


def render(profile: str, detected=None, **values):
    resolved = resolve(load_profile(profile), settings(profile, **values), detected)
    return resolved, render_invocation(load_profile(profile), settings(profile, **values), KEY, resolved=resolved)


# ---- dual: two GPUs of one host ---------------------------------------------------------


def test_dual_splits_every_layer_over_the_first_two_gpus_in_pci_bus_order():
    resolved, inv = render("dual")
    assert resolved.devices == "0,1" and inv.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert inv.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert inv.config["tensor-parallel-size"] == 2 and inv.config["distributed-executor-backend"] == "mp"
    assert "nnodes" not in inv.config and "--headless" not in inv.argv
    assert inv.config["kv-cache-memory-bytes"] == 5_583_457_484  # per GPU, as `single` pins it on one


def test_without_a_reading_the_link_counts_as_pcie_and_both_peer_paths_stay_off():
    resolved, inv = render("dual")
    assert resolved.parallel.link == "pcie" and "assumed PCIe" in resolved.parallel.link_origin
    assert inv.config["disable-custom-all-reduce"] is True
    assert inv.env["NCCL_P2P_DISABLE"] == "1"


def test_a_pcie_matrix_keeps_them_off_and_an_nvlink_matrix_turns_them_on():
    pcie = link_between(parse_topology(smi.PCIE_PAIR), [0, 1])
    resolved, inv = render("dual", pcie)
    origin = "nvidia-smi topo -m: GPU0 <-> GPU1: PHB = PCIe through the CPU's host bridge"
    assert resolved.parallel.link_origin == origin
    assert inv.config["disable-custom-all-reduce"] is True and inv.env["NCCL_P2P_DISABLE"] == "1"
    nvlink = link_between(parse_topology(smi.NVLINK_PAIR), [0, 1])
    resolved, inv = render("dual", nvlink)
    assert resolved.parallel.link == "nvlink" and resolved.parallel.custom_all_reduce
    assert "disable-custom-all-reduce" not in inv.config and "NCCL_P2P_DISABLE" not in inv.env


def test_gpu_link_says_what_the_matrix_would_and_wins_over_it():
    pcie = link_between(parse_topology(smi.PCIE_PAIR), [0, 1])
    resolved, inv = render("dual", pcie, gpu_link="nvlink")
    assert resolved.parallel.link == "nvlink" and resolved.parallel.link_origin == "GPU_LINK=nvlink"
    assert "disable-custom-all-reduce" not in inv.config


def test_the_all_reduce_knobs_override_the_links_defaults():
    _, inv = render("dual", custom_all_reduce=True, nccl_p2p=True)
    assert "disable-custom-all-reduce" not in inv.config and "NCCL_P2P_DISABLE" not in inv.env
    nvlink = link_between(parse_topology(smi.NVLINK_PAIR), [0, 1])
    _, inv = render("dual", nvlink, custom_all_reduce=False)
    assert inv.config["disable-custom-all-reduce"] is True and "NCCL_P2P_DISABLE" not in inv.env


def test_the_devices_are_the_users_and_fewer_than_two_are_refused():
    _, inv = render("dual", cuda_visible_devices="2,3")
    assert inv.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    with pytest.raises(SettingsError) as info:
        render("dual", cuda_visible_devices="1")
    assert str(info.value) == (
        "CUDA_VISIBLE_DEVICES=1: profile dual splits every layer over 2 GPUs of this host (tensor_parallel_size 2); "
        "name 2, e.g. CUDA_VISIBLE_DEVICES=0,1, or leave it empty"
    )


def test_expandable_segments_beside_the_custom_all_reduce_are_refused():
    nvlink = link_between(parse_topology(smi.NVLINK_PAIR), [0, 1])
    resolved, _ = render("dual", nvlink)
    with pytest.raises(SettingsError, match="drop expandable_segments:True or set CUSTOM_ALL_REDUCE=false"):
        check_allocator(resolved, "expandable_segments:True,max_split_size_mb:512")
    check_allocator(resolved, "max_split_size_mb:512")  # anything else is fine
    pcie_resolved, _ = render("dual")
    check_allocator(pcie_resolved, "expandable_segments:True")  # NCCL alone does not mind


def test_one_gpu_profiles_ignore_the_parallel_knobs_but_not_a_node_rank():
    plain = render("single")[1]
    knobs = render("single", custom_all_reduce=True, nccl_p2p=False, gpu_link="nvlink")[1]
    assert plain.config == knobs.config and plain.env == knobs.env
    assert "tensor-parallel-size" not in plain.config and plain.env["CUDA_VISIBLE_DEVICES"] == "0"
    with pytest.raises(SettingsError, match="NODE_RANK=1: profile single runs on one host; set NODE_RANK=0"):
        render("single", node_rank=1)


def test_the_link_and_the_all_reduce_choice_key_the_compile_cache_and_the_devices_do_not():
    base = compile_cache_key(render("dual")[0])
    assert compile_cache_key(render("dual", cuda_visible_devices="2,3")[0]) == base
    assert compile_cache_key(render("dual", gpu_link="nvlink")[0]) != base  # custom all-reduce captures differently
    assert compile_cache_key(render("single")[0]) == compile_cache_key(render("single", cuda_visible_devices="1")[0])


# ---- spark-pair: two hosts ---------------------------------------------------------------


def test_the_head_runs_rank_0_with_the_api_and_names_the_link():
    resolved, inv = render("spark-pair", **PAIR_HEAD)
    c = inv.config
    assert (c["tensor-parallel-size"], c["nnodes"], c["node-rank"]) == (2, 2, 0)
    assert (c["master-addr"], c["master-port"]) == ("192.168.100.10", 29501)
    assert c["distributed-executor-backend"] == "mp" and c["disable-custom-all-reduce"] is True
    assert inv.argv[-3:] == [ENGINE_MODULE, "--config", "/cache/run/spark-pair.vllm.yaml"]
    assert inv.env["CUDA_VISIBLE_DEVICES"] == "0"  # one GPU per host
    assert inv.env["VLLM_HOST_IP"] == "192.168.100.10"  # the head's own address is the head address
    assert inv.env["NCCL_SOCKET_IFNAME"] == inv.env["GLOO_SOCKET_IFNAME"] == "enp1s0f1np1"
    assert "NCCL_IB_HCA" not in inv.env and "NCCL_P2P_DISABLE" not in inv.env
    assert resolved.parallel.link == "network"


def test_the_worker_runs_rank_1_headless_with_its_own_address_and_the_lora_identity():
    resolved, inv = render("spark-pair", **PAIR_WORKER, rdma_devices="rocep1s0f1,roceP2p1s0f1", nccl_log_level="INFO")
    assert inv.argv[-4:] == [ENGINE_MODULE, "--headless", "--config", "/cache/run/spark-pair.vllm.yaml"]
    assert inv.config["node-rank"] == 1 and inv.config["master-addr"] == "192.168.100.10"
    assert inv.env["VLLM_HOST_IP"] == "192.168.100.11"
    assert inv.env["NCCL_IB_HCA"] == "rocep1s0f1,roceP2p1s0f1" and inv.env["NCCL_DEBUG"] == "INFO"
    assert inv.config["enable-lora"] is True and inv.model_ids == ["qwen3.8-27b", "qwen3.8-27b-mode-b"]
    head = render("spark-pair", **PAIR_HEAD)[0]
    assert compile_cache_key(resolved) == compile_cache_key(head)  # where a host is does not recompile


def test_vllms_parser_reads_the_workers_flags_as_a_headless_rank_1(tmp_path):
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    profile = load_profile("spark-pair")
    inv = render_resolved(profile, Settings(_env_file=None, profile="spark-pair", cache_dir=tmp_path, **PAIR_WORKER),
                            KEY)
    inv.config_path.parent.mkdir(parents=True)
    inv.config_path.write_text(inv.config_yaml())
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(inv.argv[3:])
    assert args.headless is True and (args.nnodes, args.node_rank) == (2, 1)
    assert (args.master_addr, args.master_port) == ("192.168.100.10", 29501)
    assert args.tensor_parallel_size == 2 and args.disable_custom_all_reduce is True


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({}, "profile spark-pair runs on 2 hosts: set HEAD_ADDRESS, NETWORK_INTERFACE on the head "),
        ({"node_rank": 1, **PAIR_HEAD}, "set NODE_ADDRESS on this worker"),
        ({"node_rank": 2, **PAIR_HEAD}, r"NODE_RANK=2: profile spark-pair runs on 2 hosts \(ranks 0..1\)"),
        ({"custom_all_reduce": True, **PAIR_HEAD}, "CUSTOM_ALL_REDUCE=true: profile spark-pair's GPUs are in 2 hosts"),
        ({**PAIR_WORKER, "node_rank": 0}, "NODE_ADDRESS=192.168.100.11 on the head .*unset NODE_ADDRESS here"),
        ({**PAIR_WORKER, "node_address": "192.168.100.10"}, "on worker host 1 is the head's address"),
    ],
)
def test_a_pair_without_its_link_or_with_a_wrong_rank_is_refused_in_one_line(values, message):
    with pytest.raises(SettingsError, match=message) as info:
        render("spark-pair", **values)
    assert "\n" not in str(info.value)


def test_a_pair_plans_without_its_link_knobs(tmp_path):
    """The KV arithmetic does not depend on where the hosts are: `qwen38 plan` needs no address."""
    from entrypoint.model_configs import read_model_configs
    from entrypoint.plan import build_request

    profile = load_profile("spark-pair")
    resolved = resolve(profile, settings("spark-pair"))
    request = build_request(resolved, read_model_configs(profile, resolved, Path("/models")), tmp_path)
    assert request["engine_args"]["tensor_parallel_size"] == 2


def test_render_on_a_host_without_nvidia_smi_says_pcie_and_keeps_it_safe():
    result = run_cli("render", "--profile", "dual", "--json", env=clean_env(PATH="/nonexistent"))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["config"]["disable-custom-all-reduce"] is True and data["env"]["NCCL_P2P_DISABLE"] == "1"
    assert data["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"
