"""The publish workflow builds every image natively on its own architecture, with provenance
and SBOM, pushes to the repository compose.yaml pulls from, and pins what it pushed."""

from __future__ import annotations

import pytest
import yaml

from entrypoint.images import IMAGES, PUBLISHED_REPOSITORY
from tests.container.tools import REPO

pytestmark = pytest.mark.container

WORKFLOW = REPO / ".github" / "workflows" / "images.yml"


@pytest.fixture(scope="module")
def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def test_every_image_is_built_natively_on_its_architecture(workflow):
    matrix = workflow["jobs"]["build"]["strategy"]["matrix"]["include"]
    assert {entry["image"] for entry in matrix} == set(IMAGES)
    for entry in matrix:
        assert entry["platform"] == IMAGES[entry["image"]].platform
        arm = entry["platform"] == "linux/arm64"
        assert entry["runner"].endswith("-arm") == arm, entry  # no emulation
    steps = workflow["jobs"]["build"]["steps"]
    assert not any("setup-qemu" in str(step.get("uses", "")) for step in steps)


def test_builds_push_with_provenance_sbom_and_derived_labels(workflow):
    assert workflow["env"]["IMAGE_REPOSITORY"] == PUBLISHED_REPOSITORY
    steps = {step.get("id"): step for step in workflow["jobs"]["build"]["steps"] if step.get("id")}
    build = steps["build"]["with"]
    assert build["push"] is True and build["provenance"] == "mode=max" and build["sbom"] is True
    assert build["file"] == "docker/Dockerfile.${{ matrix.image }}"
    assert build["build-args"] == "${{ steps.labels.outputs.args }}"
    assert "qwen38 image build-args ${{ matrix.image }}" in steps["labels"]["run"]


def test_pushed_digests_are_pinned_in_compose_and_rechecked(workflow):
    job = workflow["jobs"]["pin-compose"]
    assert job["needs"] == "build"
    runs = "\n".join(step.get("run", "") for step in job["steps"])
    assert 'qwen38 image pin "${image}"' in runs
    assert "tests/container/test_compose.py" in runs
    assert any("create-pull-request" in str(step.get("uses", "")) for step in job["steps"])
