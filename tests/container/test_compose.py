"""compose.yaml, checked without a Docker daemon: Compose itself validates and renders it
(`docker compose --profile P config`), these tests check what Compose cannot: the services
each profile starts, read-only model mounts, GPU reservations, health and shutdown timing
against the settings and the rendered engine config, the secret, and the image pins."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from core.settings import Settings
from entrypoint.images import (
    IMAGES,
    PINNED_REFERENCE,
    PUBLISHED_REPOSITORY,
    compose_default,
    is_pinned,
    local_tag,
    pin_compose_image,
    project_version,
    published_tag,
    unpin_compose_image,
)
from tests.container.tools import COMPOSE_FILE, PROFILES, REPO, compose, compose_config

pytestmark = pytest.mark.container

ONE_GPU_PROFILES = ["single", "long", "huge", "batch", "spark-lora"]
IMAGE_OF = {
    "single": "rtx3090", "long": "rtx3090", "huge": "rtx3090", "batch": "rtx3090", "dual": "rtx3090",
    "spark-lora": "spark",
    "spark-pair": "spark",
    "cpu": "cpu",
}  # fmt: skip
# Host-networked servers (the hosts of `spark-pair`): no published port, no compose network.
HOST_NETWORK = {"spark-pair"}
# Engine teardown after SIGTERM (engine-core processes exit, memory is freed): seconds.


def seconds(duration: str) -> float:
    """A Compose (Go) duration such as ``1m0s`` or ``30m0s`` in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * scale[u] for n, u in parts)


@pytest.fixture(scope="module")
def configs() -> dict[str, dict]:
    return {profile: compose_config(profile) for profile in PROFILES}


def test_every_profile_file_has_a_compose_profile_and_back():
    assert sorted(IMAGE_OF) == PROFILES


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_config_validates_and_starts_the_profile_and_its_preparation(profile):
    quiet = compose("--profile", profile, "config", "-q")
    assert quiet.returncode == 0, quiet.stderr
    services = compose("--profile", profile, "config", "--services")
    assert services.returncode == 0, services.stderr
    assert sorted(services.stdout.split()) == sorted([profile, f"prepare-{profile}"])


def test_without_a_profile_nothing_starts():
    services = compose("config", "--services")
    assert services.returncode == 0 and services.stdout.split() == []


@pytest.mark.parametrize("profile", PROFILES)
def test_server_waits_for_its_preparation_and_mounts_models_read_only(configs, profile):
    services = configs[profile]["services"]
    server, prepare = services[profile], services[f"prepare-{profile}"]
    assert server["depends_on"] == {
        f"prepare-{profile}": {"condition": "service_completed_successfully", "required": True}
    }
    assert prepare["command"] == ["prepare", "--profile", profile]
    assert server["command"] == ["serve"] and server["environment"]["PROFILE"] == profile
    mounts = {v["target"]: v for v in server["volumes"]}
    assert mounts["/models"]["source"] == "models" and mounts["/models"].get("read_only") is True
    assert mounts["/var/cache/qwen38"]["type"] == "volume" and mounts["/var/cache/qwen38"]["source"] == "cache"
    assert not mounts["/var/cache/qwen38"].get("read_only")
    prepare_mounts = {v["target"]: v for v in prepare["volumes"]}
    assert prepare_mounts["/models"]["source"] == "models" and not prepare_mounts["/models"].get("read_only")
    assert "deploy" not in prepare and prepare["restart"] == "no"
    assert prepare["healthcheck"] == {"disable": True}
    assert set(configs[profile]["volumes"]) == {"models", "cache", "seed"}


@pytest.mark.parametrize("profile", ["single", "long", "cpu"])
def test_preparation_reads_the_servers_speculation_to_skip_a_drafter_it_never_reads(profile):
    for values in ({}, {"SPECULATION": "mtp"}):
        services = compose_config(profile, env=values)["services"]
        prepare, server = services[f"prepare-{profile}"], services[profile]
        assert prepare["environment"]["SPECULATION"] == server["environment"]["SPECULATION"]
        assert prepare["environment"]["SPECULATION"] == values.get("SPECULATION", "")


@pytest.mark.parametrize("profile", ["single", "spark-lora", "cpu"])
def test_preparation_reaches_the_hub_with_the_owners_settings_and_a_token_only_as_a_secret(profile, tmp_path):
    token = tmp_path / "hf_token"
    token.write_text("hf_not_a_real_token\n")
    seed = tmp_path / "hf-cache"
    seed.mkdir()
    env = {
        "HF_ENDPOINT": "https://hub-mirror.example",
        "HTTPS_PROXY": "http://proxy.example:3128",
        "NO_PROXY": "localhost",
        "HF_TOKEN_FILE": str(token),
        "MODELS_SEED_DIR": str(seed),
        "ALLOW_BRANCH_HEAD": "true",
    }
    default, chosen = compose_config(profile), compose_config(profile, env=env)
    for config, values in ((default, {}), (chosen, env)):
        prepare = config["services"][f"prepare-{profile}"]
        environment = prepare["environment"]
        assert environment["HF_ENDPOINT"] == values.get("HF_ENDPOINT", "https://huggingface.co")
        assert environment["HTTPS_PROXY"] == values.get("HTTPS_PROXY", "")
        assert environment["NO_PROXY"] == values.get("NO_PROXY", "")
        assert environment["ALLOW_BRANCH_HEAD"] == values.get("ALLOW_BRANCH_HEAD", "false")
        assert environment["HF_TOKEN_PATH"] == "/run/secrets/hf_token"
        # The token is a file mounted as a secret, never a value compose renders or passes.
        assert not any("TOKEN" in name and name != "HF_TOKEN_PATH" for name in environment)
        assert [s["source"] for s in prepare["secrets"]] == ["hf_token"]
        assert config["secrets"]["hf_token"]["file"] == values.get("HF_TOKEN_FILE", "/dev/null")
        seed_mount = {v["target"]: v for v in prepare["volumes"]}["/seed"]
        assert seed_mount["read_only"] is True and environment["MODELS_SEED_DIR"] == "/seed"
        assert seed_mount["source"] == values.get("MODELS_SEED_DIR", "seed")
        assert seed_mount["type"] == ("bind" if values else "volume")
        # The server needs none of it: no token, no hub.
        server = config["services"][profile]
        assert "hf_token" not in [s["source"] for s in server.get("secrets", [])]
        assert "HF_ENDPOINT" not in server["environment"]
    assert "hf_not_a_real_token" not in json.dumps(chosen)


@pytest.mark.parametrize("profile", ONE_GPU_PROFILES)
def test_gpu_servers_reserve_one_gpu_chosen_by_gpu_device_and_share_host_ipc(profile):
    default = compose_config(profile)["services"][profile]
    chosen = compose_config(profile, env={"GPU_DEVICE": "3"})["services"][profile]
    for service, device in ((default, "0"), (chosen, "3")):
        (reservation,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert reservation == {"driver": "nvidia", "device_ids": [device], "capabilities": ["gpu"]}
        assert service["environment"]["CUDA_VISIBLE_DEVICES"] == "0"  # the reserved GPU, inside
        assert service["ipc"] == "host"


def test_cpu_server_reserves_no_gpu_and_has_its_own_shared_memory(configs):
    cpu = configs["cpu"]["services"]["cpu"]
    assert "deploy" not in cpu and "ipc" not in cpu
    assert int(cpu["shm_size"]) >= 1 << 30


@pytest.mark.parametrize("profile", PROFILES)
def test_healthcheck_is_the_readiness_gate_and_waits_as_long_as_a_first_start(configs, profile):
    server = configs[profile]["services"][profile]
    check = server["healthcheck"]
    assert check["test"] == ["CMD", "qwen38", "ready", "--quick"]
    ready_timeout = float(server["environment"]["READY_TIMEOUT"])
    # The gate stops the server when it has not passed within READY_TIMEOUT: judging health
    # before that would restart a server in the middle of its first compile.
    assert seconds(check["start_period"]) >= ready_timeout
    assert ready_timeout >= (600 if profile == "cpu" else Settings.model_fields["ready_timeout"].default)
    assert seconds(check["timeout"]) < seconds(check["interval"])


@pytest.mark.parametrize("profile", PROFILES)
def test_stop_grace_period_outlasts_the_servers_drain(configs, profile, tmp_path):
    from core.profiles import MAX_SHUTDOWN_TIMEOUT_S, SHUTDOWN_MARGIN_S, load_profile
    from core.settings import load_settings
    from entrypoint.drain import DRAIN_ENV
    from tests.support.plans import render_resolved

    server = configs[profile]["services"][profile]
    settings = load_settings(env_file=None, profile=profile, models_dir=tmp_path, cache_dir=tmp_path)
    key = None
    if load_profile(profile).require_api_key:
        from pydantic import SecretStr

        key = SecretStr("k" * 32)
    if load_profile(profile).parallel.nodes > 1:
        from tests.support.plans import PAIR_HEAD

        settings = settings.model_copy(update=PAIR_HEAD)
    drain = float(render_resolved(load_profile(profile), settings, key).env[DRAIN_ENV])
    # `qwen38 serve` kills what is left at drain + SHUTDOWN_MARGIN_S (entrypoint.supervise),
    # also for the longest drain SHUTDOWN_TIMEOUT accepts: Docker's SIGKILL never comes first.
    grace = seconds(server["stop_grace_period"])
    assert grace > drain + SHUTDOWN_MARGIN_S and grace >= MAX_SHUTDOWN_TIMEOUT_S + SHUTDOWN_MARGIN_S + 10
    assert server.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert server["init"] is False  # tini in the image is PID 1; a second init would wrap it


@pytest.mark.parametrize("profile", PROFILES)
def test_api_key_is_a_docker_secret_and_never_in_the_environment(configs, profile):
    config = configs[profile]
    server = config["services"][profile]
    assert set(config["secrets"]) == {"api_key", "hf_token"}  # hf_token: prepare's, never a server's
    assert config["secrets"]["api_key"] == {"name": "qwen38-stack_api_key", "file": str(REPO / "secrets" / "api_key")}
    assert server["secrets"] == [{"source": "api_key", "target": "/run/secrets/api_key"}]
    assert server["environment"]["API_KEY_FILE"] == "/run/secrets/api_key"
    for service in config["services"].values():
        assert "VLLM_API_KEY" not in service.get("environment", {})
        assert "env_file" not in service  # .env feeds interpolation only, never a container


def test_dual_reserves_the_two_gpus_gpu_devices_names_and_sees_them_as_0_and_1():
    default = compose_config("dual")["services"]["dual"]
    chosen = compose_config("dual", env={"GPU_DEVICES": "GPU-aaaa,GPU-bbbb"})["services"]["dual"]
    for service, devices in ((default, "0,1"), (chosen, "GPU-aaaa,GPU-bbbb")):
        (reservation,) = service["deploy"]["resources"]["reservations"]["devices"]
        # Docker's nvidia driver joins the ids into NVIDIA_VISIBLE_DEVICES: one entry, both GPUs.
        assert reservation == {"driver": "nvidia", "device_ids": [devices], "capabilities": ["gpu"]}
        assert service["environment"]["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert service["ipc"] == "host"


def test_multi_gpu_servers_read_the_link_knobs_and_one_gpu_servers_do_not(configs):
    link = {"GPU_LINK", "CUSTOM_ALL_REDUCE", "NCCL_P2P", "NCCL_LOG_LEVEL"}
    pair = {"HEAD_ADDRESS", "HEAD_PORT", "NODE_ADDRESS", "NETWORK_INTERFACE", "RDMA_DEVICES", "NODE_RANK"}
    assert link <= set(configs["dual"]["services"]["dual"]["environment"])
    assert link | pair <= set(configs["spark-pair"]["services"]["spark-pair"]["environment"])
    for profile in ("single", "long", "spark-lora", "cpu"):
        assert not (link | pair) & set(configs[profile]["services"][profile]["environment"]), profile
    forced = compose_config("dual", env={"GPU_LINK": "nvlink", "CUSTOM_ALL_REDUCE": "false"})["services"]["dual"]
    assert (forced["environment"]["GPU_LINK"], forced["environment"]["CUSTOM_ALL_REDUCE"]) == ("nvlink", "false")


# One .env per host: the same but for NODE_ADDRESS, which only the worker sets.
PAIR_ENV = {
    "HEAD_ADDRESS": "192.168.100.10", "NETWORK_INTERFACE": "enp1s0f1np1", "RDMA_DEVICES": "rocep1s0f1,roceP2p1s0f1"
}  # fmt: skip
WORKER_ENV = {**PAIR_ENV, "NODE_ADDRESS": "192.168.100.11"}


def test_the_pair_is_a_head_and_a_worker_profile_on_host_networks_with_the_rdma_devices():
    head = compose_config("spark-pair", env=PAIR_ENV)["services"]["spark-pair"]
    worker_config = compose_config("spark-pair-worker", env=WORKER_ENV)
    worker = worker_config["services"]["spark-pair-worker"]
    assert sorted(worker_config["services"]) == ["prepare-spark-pair-worker", "spark-pair-worker"]
    prepare = worker_config["services"]["prepare-spark-pair-worker"]
    assert prepare["command"] == ["prepare", "--profile", "spark-pair"]  # each host prepares its own copy
    assert worker["depends_on"] == {
        "prepare-spark-pair-worker": {"condition": "service_completed_successfully", "required": True}
    }
    for service, rank in ((head, "0"), (worker, "1")):
        env = service["environment"]
        assert env["PROFILE"] == "spark-pair" and env["NODE_RANK"] == rank
        assert (env["HEAD_ADDRESS"], env["NETWORK_INTERFACE"], env["RDMA_DEVICES"]) == (
            "192.168.100.10", "enp1s0f1np1", "rocep1s0f1,roceP2p1s0f1")
        assert service["network_mode"] == "host" and "ports" not in service and "networks" not in service
        assert service["ipc"] == "host" and service["ulimits"] == {"memlock": -1} and service["cap_add"] == ["IPC_LOCK"]
        assert service["devices"] == [{"source": "/dev/infiniband", "target": "/dev/infiniband", "permissions": "rwm"}]
        (reservation,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert reservation["device_ids"] == ["0"] and env["CUDA_VISIBLE_DEVICES"] == "0"
        assert service["command"] == ["serve"]
        assert service["healthcheck"]["test"] == ["CMD", "qwen38", "ready", "--quick"]
        assert service["image"].split("@")[0].endswith("-spark") and service["platform"] == "linux/arm64"
        mounts = {v["target"]: v for v in service["volumes"]}
        assert mounts["/models"].get("read_only") is True
    # Without a published port, the head's API listens where a port would have been published.
    assert (head["environment"]["HOST"], head["environment"]["PORT"]) == ("127.0.0.1", "18020")
    moved = compose_config("spark-pair", env={**PAIR_ENV, "PUBLISH_ADDRESS": "0.0.0.0", "PUBLISH_PORT": "18555"})
    assert (moved["services"]["spark-pair"]["environment"]["HOST"],
            moved["services"]["spark-pair"]["environment"]["PORT"]) == ("0.0.0.0", "18555")


def test_the_pair_services_render_what_the_hosts_run(tmp_path):
    """The environment compose gives each host resolves to vLLM's multi-node flags: the head
    rank 0 with the API, the worker rank 1 headless with its own address."""
    from pydantic import SecretStr

    from core.profiles import load_profile
    from core.settings import load_settings
    from tests.support.plans import render_resolved

    for name, rank, dotenv in (("spark-pair", 0, PAIR_ENV), ("spark-pair-worker", 1, WORKER_ENV)):
        env = compose_config(name, env=dotenv)["services"][name]["environment"]
        knobs = {key.lower(): value for key, value in env.items() if value != ""}
        knobs.update(models_dir=tmp_path, cache_dir=tmp_path, api_key_file=tmp_path / "api_key")
        settings = load_settings(env_file=None, **knobs)
        inv = render_resolved(load_profile("spark-pair"), settings, SecretStr("k" * 32))
        assert inv.config["node-rank"] == rank and ("--headless" in inv.argv) == (rank == 1)
        assert inv.env["VLLM_HOST_IP"] == ("192.168.100.10" if rank == 0 else "192.168.100.11")


def test_api_is_published_on_loopback_unless_asked(configs):
    (port,) = configs["cpu"]["services"]["cpu"]["ports"]
    assert (port["host_ip"], port["published"], port["target"]) == ("127.0.0.1", "18020", 18020)
    moved = compose_config("single", env={"PUBLISH_ADDRESS": "0.0.0.0", "PUBLISH_PORT": "18555"})
    (port,) = moved["services"]["single"]["ports"]
    assert (port["host_ip"], port["published"]) == ("0.0.0.0", "18555")


@pytest.mark.parametrize("profile", PROFILES)
def test_servers_read_every_override_and_runtime_setting_from_dotenv(configs, profile):
    environment = configs[profile]["services"][profile]["environment"]
    wanted = {
        name.upper()
        for name, info in Settings.model_fields.items()
        if (info.json_schema_extra or {}).get("section") in ("overrides", "runtime")
    }
    assert wanted <= set(environment)
    overridden = compose_config(profile, env={"MAX_NUM_SEQS": "2", "LOG_LEVEL": "debug"})["services"][profile]
    assert overridden["environment"]["MAX_NUM_SEQS"] == "2" and overridden["environment"]["LOG_LEVEL"] == "debug"


def test_every_variable_compose_reads_is_a_documented_setting():
    used = set(re.findall(r"\$\{([A-Z0-9_]+)", COMPOSE_FILE.read_text()))
    documented = {name.upper() for name in Settings.model_fields}
    assert used - documented == set()
    compose_knobs = {
        name.upper()
        for name, info in Settings.model_fields.items()
        if (info.json_schema_extra or {}).get("section") == "compose"
    }
    assert compose_knobs <= used
    env_example = (REPO / ".env.example").read_text()
    for name in used:
        assert re.search(rf"^{name}=", env_example, re.M), name


@pytest.mark.parametrize("profile", PROFILES)
def test_images_default_to_a_pinned_published_image_or_a_local_tag_compose_builds(configs, profile):
    """Each image's default is either the pushed image by digest (after `qwen38 image pin`) or,
    until then, the plain local tag compose builds from `build:` when its pull fails: never a
    digest nobody pushed (compose can neither pull nor build-and-tag one)."""
    spec = IMAGES[IMAGE_OF[profile]]
    default = compose_default(COMPOSE_FILE.read_text(), spec)
    for name in (profile, f"prepare-{profile}"):
        service = configs[profile]["services"][name]
        assert service["image"] == default
        if is_pinned(default):
            published = f"{PUBLISHED_REPOSITORY}:{project_version()}-{spec.name}"
            assert default.split("@")[0] == published_tag(spec) == published
            assert not re.search(r"@sha256:0{64}$", default), "a zero digest is not a published image"
        else:
            assert default == local_tag(spec) == f"qwen38-stack:{project_version()}-{spec.name}"
        # compose's default pull policy (`missing`): pull what is pinned, build what is not.
        assert "pull_policy" not in service
        assert service["build"]["dockerfile"] == spec.dockerfile
        assert (Path(service["build"]["context"]) / spec.dockerfile).is_file()
        assert service["build"]["platforms"] == [spec.platform] and service["platform"] == spec.platform
    local = compose_config(profile, env={spec.compose_variable: f"qwen38-stack:{spec.name}"})
    assert local["services"][profile]["image"] == f"qwen38-stack:{spec.name}"
    pulled = f"registry.example:5000/team/qwen38-stack:{spec.name}@sha256:" + "ef" * 32
    assert compose_config(profile, env={spec.compose_variable: pulled})["services"][profile]["image"] == pulled


def test_pinning_rewrites_only_that_images_default_and_unpinning_restores_the_local_tag():
    text = unpin_compose_image(COMPOSE_FILE.read_text(), IMAGES["spark"])  # as before the first publish
    assert compose_default(text, IMAGES["spark"]) == local_tag(IMAGES["spark"])
    reference = "ghcr.io/qwen38-stack/qwen38-stack:0.1.0-spark@sha256:" + "ab" * 32
    pinned = pin_compose_image(text, IMAGES["spark"], reference)
    assert compose_default(pinned, IMAGES["spark"]) == reference
    assert compose_default(pinned, IMAGES["rtx3090"]) == compose_default(text, IMAGES["rtx3090"])
    assert len(pinned.splitlines()) == len(text.splitlines())
    repinned = pin_compose_image(pinned, IMAGES["spark"], reference.replace("ab" * 32, "12" * 32))
    assert compose_default(repinned, IMAGES["spark"]).endswith("12" * 32)  # the next release replaces the pin
    assert unpin_compose_image(pinned, IMAGES["spark"]) == text
    from core.errors import ImageError

    for wrong in ("ghcr.io/qwen38-stack/qwen38-stack:latest", "qwen38-stack:0.1.0-spark"):
        with pytest.raises(ImageError, match="REPOSITORY:TAG@sha256"):
            pin_compose_image(text, IMAGES["spark"], wrong)


def test_pin_command_rewrites_a_copy_and_says_what_changed(tmp_path):
    import subprocess
    import sys

    copy = tmp_path / "compose.yaml"
    copy.write_text(unpin_compose_image(COMPOSE_FILE.read_text(), IMAGES["cpu"]))
    reference = "127.0.0.1:5000/qwen38-stack:0.1.0-cpu@sha256:" + "cd" * 32
    argv = [sys.executable, "-m", "entrypoint.cli", "image", "pin", "cpu", reference, "--compose", str(copy)]
    first = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == (
        f"compose.yaml: cpu now pulls {reference} (was: built locally as {local_tag(IMAGES['cpu'])})"
    )
    assert compose_default(copy.read_text(), IMAGES["cpu"]) == reference
    again = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout.strip() == f"compose.yaml: cpu already pins {reference}"
    bad = subprocess.run([*argv[:-3], "qwen38-stack:mine", "--compose", str(copy)], cwd=REPO, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert bad.returncode != 0 and bad.stderr.strip().count("\n") == 0 and "REPOSITORY:TAG@sha256" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_pinned_compose_file_still_validates(tmp_path):
    reference = "registry.example:5000/team/qwen38-stack:0.1.0-cpu@sha256:" + "cd" * 32
    pinned = tmp_path / "compose.yaml"
    pinned.write_text(pin_compose_image(COMPOSE_FILE.read_text(), IMAGES["cpu"], reference))
    config = compose_config("cpu", files=(pinned,), project_directory=tmp_path)
    assert config["services"]["cpu"]["image"] == reference


# ---- the monitoring profiles (docs/monitoring.md) ----------------------------------------------

MONITORING = ["prometheus", "grafana"]


@pytest.fixture(scope="module")
def monitored() -> dict[str, dict]:
    return {profile: compose_config(profile, extra_profiles=("monitoring",)) for profile in PROFILES}


@pytest.mark.parametrize("profile", PROFILES)
def test_monitoring_starts_prometheus_and_grafana_beside_any_serving_profile(profile):
    quiet = compose("--profile", profile, "--profile", "monitoring", "config", "-q")
    assert quiet.returncode == 0, quiet.stderr
    services = compose("--profile", profile, "--profile", "monitoring", "config", "--services")
    assert sorted(services.stdout.split()) == sorted([profile, f"prepare-{profile}", *MONITORING])


def test_monitoring_alone_starts_no_server_and_no_gpu_exporter():
    services = compose("--profile", "monitoring", "config", "--services")
    assert services.returncode == 0 and sorted(services.stdout.split()) == sorted(MONITORING)


def test_prometheus_scrapes_every_server_by_one_alias_with_the_key_secret(monitored):
    import yaml

    config = yaml.safe_load((REPO / "docker" / "monitoring" / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "qwen38"]
    (target,) = job["static_configs"][0]["targets"]
    host, port = target.split(":")
    for profile, rendered in monitored.items():
        server = rendered["services"][profile]
        if profile in HOST_NETWORK:  # Prometheus cannot reach a host-networked server by name (docs/dual.md)
            assert server["network_mode"] == "host"
            continue
        assert host in server["networks"]["default"]["aliases"]
        assert int(port) == int(server["environment"]["PORT"])
        prometheus = rendered["services"]["prometheus"]
        (secret,) = prometheus["secrets"]
        assert secret == {"source": "api_key", "target": job["authorization"]["credentials_file"]}
        assert rendered["secrets"]["api_key"]["file"] == str(REPO / "secrets" / "api_key")
    assert job["authorization"]["type"] == "Bearer" and "credentials" not in job["authorization"]


def test_monitoring_is_published_on_loopback_unless_asked(monitored):
    for name, port in (("prometheus", 9090), ("grafana", 3000)):
        (published,) = monitored["cpu"]["services"][name]["ports"]
        assert (published["host_ip"], published["published"], published["target"]) == ("127.0.0.1", str(port), port)
    moved = compose_config(
        "cpu", extra_profiles=("monitoring",),
        env={"MONITORING_ADDRESS": "0.0.0.0", "PROMETHEUS_PORT": "19090", "GRAFANA_PORT": "13000"},
    )  # fmt: skip
    assert [(p["host_ip"], p["published"]) for p in moved["services"]["prometheus"]["ports"]] == [("0.0.0.0", "19090")]
    assert [(p["host_ip"], p["published"]) for p in moved["services"]["grafana"]["ports"]] == [("0.0.0.0", "13000")]
    # the API's own address does not move them
    api_moved = compose_config("cpu", extra_profiles=("monitoring",), env={"PUBLISH_ADDRESS": "0.0.0.0"})
    assert api_moved["services"]["grafana"]["ports"][0]["host_ip"] == "127.0.0.1"


def test_grafana_has_no_credential_in_a_file_and_anonymous_viewers_only(monitored):
    grafana = monitored["cpu"]["services"]["grafana"]
    environment = grafana["environment"]
    assert environment["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert grafana["secrets"] == [{"source": "grafana_admin_password", "target": "/run/secrets/grafana_admin_password"}]
    assert monitored["cpu"]["secrets"]["grafana_admin_password"]["file"] == str(REPO / "secrets" / "grafana_admin_password")
    assert environment["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer" and environment["GF_USERS_ALLOW_SIGN_UP"] == "false"
    assert not {k for k in environment if "PASSWORD" in k or "TOKEN" in k or "KEY" in k} - {
        "GF_SECURITY_ADMIN_PASSWORD__FILE"
    }


def test_monitoring_mounts_exist_and_grafana_finds_the_dashboard_and_datasource(monitored):
    import json

    import yaml

    from entrypoint.dashboard import DASHBOARD_PATH, DATASOURCE_UID

    for name in MONITORING:
        for mount in monitored["cpu"]["services"][name]["volumes"]:
            if mount["type"] == "bind":
                assert Path(mount["source"]).exists(), mount["source"]  # compose does not check bind sources
                assert mount.get("read_only") is True
    grafana = {m["target"]: Path(m["source"]) for m in monitored["cpu"]["services"]["grafana"]["volumes"] if m["type"] == "bind"}
    provisioning = grafana["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["uid"] == DATASOURCE_UID and source["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "qwen38.yml").read_text())["providers"]
    assert grafana[provider["options"]["path"]] == DASHBOARD_PATH.parent
    home = monitored["cpu"]["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert grafana[str(Path(home).parent)] / Path(home).name == DASHBOARD_PATH
    assert json.loads(DASHBOARD_PATH.read_text())["uid"]


def test_monitoring_images_are_pinned_by_digest(monitored):
    images = {name: monitored["cpu"]["services"][name]["image"] for name in MONITORING}
    gpu = compose_config("single", extra_profiles=("monitoring", "monitoring-gpu"))["services"]["gpu-metrics"]
    images["gpu-metrics"] = gpu["image"]
    for name, image in images.items():
        assert PINNED_REFERENCE.fullmatch(image), (name, image)


def test_the_gpu_exporter_is_its_own_profile_reserving_the_servers_gpu_and_publishing_nothing():
    rendered = compose_config("single", extra_profiles=("monitoring", "monitoring-gpu"), env={"GPU_DEVICE": "2"})
    exporter = rendered["services"]["gpu-metrics"]
    (reservation,) = exporter["deploy"]["resources"]["reservations"]["devices"]
    assert reservation == {"driver": "nvidia", "device_ids": ["2"], "capabilities": ["gpu"]}
    assert rendered["services"]["single"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["2"]
    assert "ports" not in exporter  # read by Prometheus on the compose network only
    import yaml

    config = yaml.safe_load((REPO / "docker" / "monitoring" / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "gpu"]
    assert job["dns_sd_configs"][0]["names"] == ["gpu-metrics"]
