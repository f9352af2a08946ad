"""The `spark-lora` adapter slot under `qwen38 verify`: pinned base, imported directions, built adapter.

The fixture is the real profiles/spark-lora.toml over a tiny stand-in of each artifact:
the tiny target stored like RadixArk/Qwen3.8-27B-NVFP4 (ModelOpt FP8 + NVFP4, VL names)
pinned in a test lock as `qwen3.8-27b-nvfp4` at the lock's revision, the tiny drafter as
`qwen3.8-27b-dflash2`, a directions file pinned with `lock update --from` and imported with
`prepare download --from` (the real code paths), and the adapter built by
`qwen38 adapter build` into the slot's directory.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

import entrypoint.verify
from core.artifact_lock import LOCK_PATH, ArtifactLock, LockedFile, load_lock, write_lock
from core.checkpoint import open_checkpoint
from core.hashing import hash_files
from core.manifest import content_files, read_manifest, write_manifest
from core.profiles import Profile, load_profile
from entrypoint.verify import PatchState, VerifyFailed, verify_profile
from prepare.adapter import build_adapter, build_profile_adapter, check_profile_adapter
from prepare.directions import random_directions, target_modules
from prepare.download import default_dir, download_artifact
from prepare.pinning import pin_local_artifact
from tests.pinning_support import make_settings
from tests.support.spark_like import quantize_like_spark, with_vl_names

BASE_KEY = "qwen3.8-27b-nvfp4"
DIRECTIONS_KEY = "qwen3.8-27b-mode-b-directions"
SPARK_REVISION = "319f741cce68d7914884900c138a1fbb70a42f30"


@dataclass
class Spark:
    root: Path
    profile: Profile
    lock_path: Path

    @property
    def models(self) -> Path:
        return self.root / "models"

    def slot_dir(self, slot: str) -> Path:
        return self.models / getattr(self.profile.models, slot).dir

    @property
    def directions_dir(self) -> Path:
        return self.models / default_dir(DIRECTIONS_KEY)

    def verify(self):
        return verify_profile(self.profile, make_settings(self.root), lock_path=self.lock_path)

    def fail(self) -> VerifyFailed:
        with pytest.raises(VerifyFailed) as info:
            self.verify()
        assert "\n" not in str(info.value)
        return info.value

    def lock(self) -> ArtifactLock:
        return load_lock(self.lock_path)

    def build_adapter(self, model: Path | None = None) -> None:
        if model is None:  # what `qwen38 prepare --profile spark-lora` runs for the slot
            build_profile_adapter(self.profile, self.models)
        else:
            build_adapter(model, self.directions_dir, self.slot_dir("adapter"), force=True)

    def import_directions(self, source: Path) -> None:
        """`qwen38 lock update KEY --from FILE`, then `qwen38 prepare download KEY --from FILE`."""
        artifact = pin_local_artifact(self.lock().get(DIRECTIONS_KEY), source)
        write_lock(self.lock().with_artifact(artifact), self.lock_path)
        download_artifact(artifact, self.directions_dir, source=source, lock_path=self.lock_path, say=lambda _: None)


def pin_directory(lock: ArtifactLock, key: str, directory: Path, *, revision: str | None = None) -> ArtifactLock:
    """Pin ``key`` to ``directory``'s files (what `lock update` reads from the hub) and give the
    directory the manifest a verified download writes."""
    paths = content_files(directory)
    digests = hash_files(paths)
    files = tuple(
        LockedFile(path=p.relative_to(directory).as_posix(), size=p.stat().st_size, sha256=digests[p]) for p in paths
    )
    # Generated stand-in bytes: the public hashes (`known`) of the real files do not apply to them.
    update = {"files": files, "known": (), **({"revision": revision} if revision else {})}
    artifact = lock.get(key).model_copy(update=update)
    manifest = write_manifest(directory, artifact.identity(), files={f.path: f.sha256 for f in files})
    assert manifest == artifact.expected_manifest()
    return lock.with_artifact(artifact)


@pytest.fixture(scope="module")
def spark_template(tiny_root, tmp_path_factory) -> Spark:
    root = tmp_path_factory.mktemp("spark")
    # The patch series is not what these tests are about (and the CPU venv carries none).
    profile = load_profile("spark-lora").model_copy(update={"require_patches": False})
    spark = Spark(root, profile, root / "artifacts.lock.toml")
    vl = with_vl_names(tiny_root / "tiny" / "target", root / "work" / "vl")
    quantize_like_spark(vl, spark.slot_dir("target"), target_modules(open_checkpoint(vl)))
    shutil.copytree(tiny_root / "tiny" / "drafter", spark.slot_dir("drafter"))
    (spark.slot_dir("drafter") / "qwen38-manifest.json").unlink()
    lock = load_lock(LOCK_PATH)
    assert lock.get(BASE_KEY).revision == SPARK_REVISION
    lock = pin_directory(lock, BASE_KEY, spark.slot_dir("target"))
    lock = pin_directory(lock, "qwen3.8-27b-dflash2", spark.slot_dir("drafter"))
    write_lock(lock, spark.lock_path)
    user = root / "user"
    random_directions(spark.slot_dir("target"), user / "mode-b.safetensors", seed=1)
    spark.import_directions(user / "mode-b.safetensors")
    spark.build_adapter()
    return spark


@pytest.fixture
def spark(spark_template, tmp_path, monkeypatch) -> Spark:
    monkeypatch.setattr(
        entrypoint.verify, "delivered_patches", lambda _dir: PatchState(status="unknown", fingerprint="unknown")
    )
    root = tmp_path / "spark"
    shutil.copytree(spark_template.root, root, ignore=shutil.ignore_patterns("cache"))
    return Spark(root, spark_template.profile, root / "artifacts.lock.toml")


def test_a_correctly_built_spark_lora_adapter_verifies(spark):
    report = spark.verify()
    assert report.ok
    adapter = next(d for d in report.dirs if d.slot == "adapter")
    assert adapter.identity == f"adapter-build-v2({BASE_KEY}@{SPARK_REVISION[:12]},{DIRECTIONS_KEY}(local))"
    assert f";adapter=adapter-build-v2({BASE_KEY}@{SPARK_REVISION[:12]},{DIRECTIONS_KEY}(local))#" in report.identity
    assert read_manifest(spark.slot_dir("adapter")).identity.params == {"row_chunk": 512}
    # the launcher's cheap start-up check agrees
    assert check_profile_adapter(spark.profile, spark.models).transform == "adapter-build"


def test_an_adapter_from_a_base_at_another_revision_fails_with_one_line(spark):
    # `qwen38 lock update qwen3.8-27b-nvfp4 --revision NEW` and a new download; adapter not rebuilt
    new = "1" * 40
    target = spark.slot_dir("target")
    (target / "config.json").write_text((target / "config.json").read_text() + "\n")
    write_lock(pin_directory(spark.lock(), BASE_KEY, target, revision=new), spark.lock_path)
    error = spark.fail()
    assert len(error.report.problems) == 1
    assert f"input {BASE_KEY} revision expected {new} (lock), found {SPARK_REVISION}" in str(error)
    spark.build_adapter()
    assert spark.verify().ok


def test_an_adapter_from_another_pinned_base_fails_with_one_line(spark, tmp_path):
    # Built from another pinned checkpoint (the RadixArk BF16-lm_head variant, say): every
    # input is pinned and matches the lock, but A = r^T W came from weights not served here.
    other_key = "qwen3.8-27b-nvfp4-bf16-lmhead"
    other = tmp_path / other_key
    shutil.copytree(spark.slot_dir("target"), other)
    from safetensors.torch import load_file

    from prepare.checkpoint_writer import write_checkpoint

    tensors = load_file(str(other / "model.safetensors"))
    name = "model.language_model.layers.0.linear_attn.out_proj.weight_scale"
    tensors[name] = tensors[name] * 2
    write_checkpoint(other, {"model.safetensors": tensors})
    (other / "qwen38-manifest.json").unlink()
    lock = spark.lock()
    lock = lock.with_artifact(lock.get(BASE_KEY).model_copy(update={"key": other_key, "repo": f"RadixArk/{other_key}"}))
    write_lock(pin_directory(lock, other_key, other), spark.lock_path)
    spark.build_adapter(other)
    error = spark.fail()
    assert len(error.report.problems) == 1
    assert "qwen3.8-27b-mode-b/qwen38-manifest.json: built from " in str(error)
    assert f"the served target {spark.slot_dir('target')} is {BASE_KEY}@{SPARK_REVISION[:12]}#" in str(error)


def test_an_adapter_from_other_directions_fails_with_one_line(spark):
    # The user imports another directions file (`lock update --from`, `prepare download --from`)
    before = read_manifest(spark.directions_dir).digest
    other = spark.root / "user2" / "mode-b.safetensors"
    random_directions(spark.slot_dir("target"), other, seed=2)
    spark.import_directions(other)
    after = read_manifest(spark.directions_dir).digest
    assert after != before
    error = spark.fail()
    assert len(error.report.problems) == 1
    assert f"input {DIRECTIONS_KEY} manifest digest expected {after} (lock), found {before}" in str(error)
    spark.build_adapter()
    assert spark.verify().ok


def test_a_changed_adapter_file_fails_with_one_line(spark):
    path = spark.slot_dir("adapter") / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    error = spark.fail()
    assert len(error.report.problems) == 1
    assert f"{path}: sha256 expected" in str(error) and "(altered)" in str(error)


def test_a_directions_file_that_is_not_the_pinned_one_fails_before_any_build(spark):
    # Copied over the imported file by hand: the build refuses it (sha256 vs its manifest)
    from core.errors import AdapterError

    imported = spark.directions_dir / "mode-b.safetensors"
    random_directions(spark.slot_dir("target"), imported, seed=3)
    with pytest.raises(AdapterError, match="its qwen38-manifest.json lists"):
        spark.build_adapter()
