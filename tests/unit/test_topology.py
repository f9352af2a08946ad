"""`nvidia-smi topo -m`, read in every layout drivers print it, becomes the link between the
GPUs a profile uses: NVLink only when every pair is bridged, PCIe otherwise."""

from __future__ import annotations

import pytest

from entrypoint.topology import (
    TopologyError,
    describe,
    gpu_indices,
    link_between,
    parse_topology,
    read_link,
)
from tests.support import nvidia_smi_samples as smi


@pytest.mark.parametrize(
    ("text", "gpus", "kind", "code"),
    [
        (smi.PCIE_PAIR, [0, 1], "pcie", "PHB"),
        (smi.NVLINK_PAIR, [0, 1], "nvlink", "NV4"),
        (smi.BRIDGED_AND_ONE_MORE, [0, 1], "nvlink", "NV4"),
        (smi.BRIDGED_AND_ONE_MORE, [1, 2], "pcie", "PHB"),
        (smi.OLD_DRIVER_FOUR_GPUS, [2, 3], "pcie", "NODE"),
        (smi.OLD_DRIVER_FOUR_GPUS, [0, 1], "pcie", "SYS"),
        (smi.EIGHT_NVLINK_WITH_NICS, [3, 4], "nvlink", "NV18"),
        (smi.OLD_DRIVER_MLX_COLUMNS, [0, 1], "pcie", "PIX"),
    ],
)
def test_the_link_between_two_gpus_is_read_from_every_layout(text, gpus, kind, code):
    reading = link_between(parse_topology(text), gpus)
    assert reading.kind == kind
    assert reading.pairs == ((gpus[0], gpus[1], code),)


def test_nic_columns_are_columns_not_gpus():
    eight = parse_topology(smi.EIGHT_NVLINK_WITH_NICS)
    assert eight.gpus == list(range(8)) and eight.columns[-2:] == ("NIC0", "NIC1")
    assert eight.code(0, 0) == "X" and eight.rows["GPU5"][9] == "PIX"  # GPU5's NIC1 cell
    spark = parse_topology(smi.ONE_GPU_WITH_NICS)
    assert spark.gpus == [0] and spark.columns == ("GPU0", "NIC0", "NIC1", "NIC2", "NIC3")


def test_nvlink_needs_every_pair_bridged():
    three = parse_topology(smi.BRIDGED_AND_ONE_MORE)
    reading = link_between(three, [0, 1, 2])
    assert reading.kind == "pcie"
    assert [code for _a, _b, code in reading.pairs] == ["NV4", "PHB", "PHB"]
    assert reading.summary().startswith("GPU0 <-> GPU1: NV4 = NVLink (4 bonded links); GPU0 <-> GPU2: PHB = PCIe")


def test_codes_are_described_as_the_legend_does():
    assert describe("NV1") == "NVLink (1 bonded link)"
    assert describe("PHB") == "PCIe through the CPU's host bridge"
    assert describe("SYS").startswith("PCIe across NUMA nodes")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("No devices were found\n", "not an nvidia-smi topo -m matrix"),
        ("", "not an nvidia-smi topo -m matrix"),
        ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \n", "row GPU0 has 1 of 2 cells"),
    ],
)
def test_text_that_is_not_a_matrix_is_refused(text, message):
    with pytest.raises(TopologyError, match=message):
        parse_topology(text)


def test_a_gpu_the_matrix_does_not_list_and_an_unknown_code_are_refused():
    with pytest.raises(TopologyError, match="lists no GPU2"):
        link_between(parse_topology(smi.PCIE_PAIR), [0, 2])
    odd = smi.PCIE_PAIR.replace("PHB", "QPI")
    with pytest.raises(TopologyError, match="unknown link code 'QPI'"):
        link_between(parse_topology(odd), [0, 1])


def test_devices_are_named_by_index_or_uuid():
    uuids = {"GPU-6a7c0a0e-1111-2222-3333-444455556666": 1}
    assert gpu_indices("0,1", {}) == [0, 1]
    assert gpu_indices("GPU-6a7c0a0e-1111-2222-3333-444455556666,0", uuids) == [1, 0]
    with pytest.raises(TopologyError, match="names GPU-dead, which nvidia-smi does not list"):
        gpu_indices("GPU-dead", uuids)


def test_read_link_asks_nvidia_smi_and_maps_uuids():
    calls = []

    def run(argv):
        calls.append(argv)
        if argv[1:] == ["topo", "-m"]:
            return smi.NVLINK_PAIR
        return "0, GPU-aaaa\n1, GPU-bbbb\n"

    assert read_link("GPU-bbbb,GPU-aaaa", run).pairs == ((1, 0, "NV4"),)
    assert calls[1] == ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"]
    assert read_link("0,1", lambda argv: None) is None  # no nvidia-smi: nothing read
