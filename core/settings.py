"""Settings: every user-facing knob, defined once.

Read from the environment and a ``.env`` file (pydantic-settings). The field definitions
below are the single source of truth: ``.env.example`` and the settings table of docs/settings.md are
generated from them (``qwen38 settings example|table``) and a test fails when they drift.
Unknown keys in ``.env``, out-of-range values and conflicting knobs fail with one line.
"""

from __future__ import annotations

import difflib
import io
import ipaddress
import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from core.errors import SettingsError
from core.profiles import (
    MAX_MTP_DEPTH,
    MAX_SHUTDOWN_TIMEOUT_S,
    PROFILES_DIR,
    SEED_MTP_DEPTH,
    SHUTDOWN_MARGIN_S,
    load_profile,
    profile_names,
)

SECTIONS = {
    "serving": "What to serve and where",
    "security": "Authentication (vLLM accepts anyone without a key)",
    "paths": "Where models and caches live",
    "overrides": "Per-deployment overrides of the profile (empty: the profile decides)",
    "runtime": "Start-up behaviour",
    "hub": "Downloads (prepare): the Hugging Face hub and models you already have",
    "parallel": "Several GPUs or hosts (`dual`, `spark-pair`: docs/dual.md); single-GPU profiles ignore these",
    "compose": "Containers: read by docker compose (compose.yaml), not by the server",
}

MIN_API_KEY_LENGTH = 16
# SPECULATION: the methods by name, and the words pydantic read as booleans before it took names.
SPECULATION_METHODS = ("dflash", "mtp")
TRUE_WORDS = frozenset({"1", "true", "yes", "on", "t", "y"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", "f", "n"})
BOTH_KEYS_SET = "VLLM_API_KEY and API_KEY_FILE are both set; set one of them"
# An image reference: [registry/]name[:tag][@sha256:digest], lower-case name components.
# A CUDA device as CUDA_VISIBLE_DEVICES and Docker name it: an index, a GPU UUID or a MIG UUID.
GPU_ID = r"(\d+|GPU-[0-9a-fA-F-]+|MIG-[0-9a-fA-F-/]+)"
# VISION: the 3090 seed's successor's limits (one image a prompt, at most 2,097,152 pixels), and
# the smallest pixel cap that still gives one image token (a 32 x 32 tile: patch 16, merged 2 x 2).
DEFAULT_IMAGES_PER_PROMPT = 1
DEFAULT_MAX_PIXELS = 2_097_152
MIN_MAX_PIXELS = 32 * 32
MAX_IMAGES_PER_PROMPT = 16
# A VISION_URL_DOMAINS item: DNS labels or an IPv4 address, as urllib3 gives a URL's hostname
# (lower-cased; vLLM compares that string exactly, so a trailing dot would match nothing).
URL_DOMAIN = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*"
IMAGE_REFERENCE = r"^[a-z0-9]+([._/:-][a-z0-9]+)*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?$"


def _knob(
    default: Any, section: str, description: str, example: str | None = None, shown: str | None = None, **kw: Any
):
    """A settings field with its documentation; `example` is the value shown in .env.example,
    `shown` the default docs/settings.md shows where the real one depends on the machine."""
    extra = {"section": section}
    if example is not None:
        extra["example"] = example
    if shown is not None:
        extra["shown"] = shown
    return Field(default, description=description, json_schema_extra=extra, **kw)


class Settings(BaseSettings):
    """The knobs a user sets in the environment or in `.env`."""

    model_config = SettingsConfigDict(
        env_file=".env",
        env_file_encoding="utf-8",
        extra="forbid",
        case_sensitive=False,
        env_ignore_empty=True,
        frozen=True,
    )

    profile: str = _knob("cpu", "serving", "Profile to serve: a file name in profiles/ (without .toml).")
    host: str = _knob(
        "127.0.0.1",
        "serving",
        "Address to listen on. Anything but a loopback address needs an API key.",
        example="127.0.0.1",
    )
    port: int = _knob(18020, "serving", "TCP port of the OpenAI/Anthropic-compatible API.", ge=1, le=65535)

    vllm_api_key: SecretStr | None = _knob(
        None,
        "security",
        "API key clients send as `Authorization: Bearer <key>` or `x-api-key: <key>`. Prefer API_KEY_FILE.",
        example="",
    )
    api_key_file: Path | None = _knob(
        None,
        "security",
        "File holding the API key (e.g. a Docker secret at /run/secrets/api_key).",
        example="",
    )

    models_dir: Path = _knob(Path("models"), "paths", "Root of downloaded, prepared and generated models.")
    profiles_dir: Path = _knob(
        PROFILES_DIR, "paths", "Directory of profile files (the repository's profiles/ unless you keep your own).",
        example="", shown="profiles/ of the checkout",
    )
    cache_dir: Path = _knob(
        Path(".cache/qwen38"),
        "paths",
        "Compile caches (vLLM, Triton, FlashInfer JIT), run files and the readiness status.",
    )

    cuda_visible_devices: str | None = _knob(
        None,
        "serving",
        "GPU(s) vLLM may use (GPU profiles), numbered as nvidia-smi numbers them (the server sets "
        "CUDA_DEVICE_ORDER=PCI_BUS_ID). Empty: the first the profile needs (0; 0,1 for `dual`). Always passed "
        "explicitly: vLLM otherwise picks by free memory.",
        example="",
        shown="`0` (`0,1` for `dual`)",
        pattern=rf"^{GPU_ID}(,{GPU_ID})*$",
    )

    max_model_len: int | None = _knob(
        None, "overrides", "Longest request in tokens (the planner refuses what cannot fit).", example="", ge=256
    )
    max_num_seqs: int | None = _knob(None, "overrides", "Concurrent request slots.", example="", ge=1, le=1024)
    kv_cache_memory_bytes: int | None = _knob(
        None, "overrides", "KV-cache pool size in bytes.", example="", ge=1 << 20
    )
    speculation: bool | Literal["dflash", "mtp"] | None = _knob(
        None,
        "overrides",
        "Speculative decoding: `dflash` (the profile's drafter), `mtp` (the target's own MTP head, no drafter), "
        "`off`; `true` is the profile's own method, `false` the same as `off`. `qwen38 plan --concurrency N` "
        "says which keeps N requests resident (docs/speculation.md).",
        example="",
    )
    mtp_depth: int | None = _knob(
        None,
        "overrides",
        f"Draft tokens per step with SPECULATION=mtp (empty: the profile's, the 3090 seed's {SEED_MTP_DEPTH}); "
        f"1..{MAX_MTP_DEPTH}, each verify step checks 1 + this many.",
        example="",
        ge=1,
        le=MAX_MTP_DEPTH,
    )
    lookup: bool | None = _knob(
        None,
        "overrides",
        "Lookup drafting on/off (reproduction mode): verify positions past the drafter's are filled with the "
        "continuation of the longest recent match in the request's own tokens. Lossless; needs speculation "
        "(dflash). Pays off when answers copy their prompt (editing, quoting, rewriting code).",
        example="",
    )
    verify_block: int | None = _knob(
        None,
        "overrides",
        "Tokens verified per step with LOOKUP on: 1 + drafter depth + lookup tokens (16 = 1 + 7 + 8). "
        "Each slot reserves state for the wider block.",
        example="",
        ge=8,
        le=16,
    )
    prefix_caching: bool | None = _knob(None, "overrides", "Automatic prefix caching on/off.", example="")
    enable_thinking: bool | None = _knob(
        None, "overrides", "Server-wide default for the chat template's `enable_thinking`.", example=""
    )
    vision: bool | None = _knob(
        None,
        "overrides",
        "Images in: load the checkpoint's vision tower and accept images (OpenAI `image_url` parts as data URLs, "
        "Anthropic base64 `image` blocks; http(s) URLs only from VISION_URL_DOMAINS' hosts). Empty or "
        "false: text only (every shipped profile's default). The target must carry a tower "
        "(`vision_config` in its config.json). docs/vision.md.",
        example="",
    )
    vision_images_per_prompt: int | None = _knob(
        None,
        "overrides",
        f"With VISION on: most images one request may carry (more: a 400); 1..{MAX_IMAGES_PER_PROMPT}.",
        example="",
        shown=f"`{DEFAULT_IMAGES_PER_PROMPT}`",
        ge=1,
        le=MAX_IMAGES_PER_PROMPT,
    )
    vision_max_pixels: int | None = _knob(
        None,
        "overrides",
        "With VISION on: most pixels (width x height) an image may have (more: a 400); also the image "
        f"processor's cap, which sizes the encoder's start-up profiling. At least {MIN_MAX_PIXELS} (one image "
        "token).",
        example="",
        shown=f"`{DEFAULT_MAX_PIXELS}`",
        ge=MIN_MAX_PIXELS,
        le=1 << 26,
    )
    vision_tower: Literal["gpu", "host"] | None = _knob(
        None,
        "overrides",
        "With VISION on: where the vision tower's weights live. `host`: pinned host memory, each block "
        "copied to the GPU for its own forward (0.92 GB less on the GPU for ~90 MB while an image is "
        "encoded, patch 0087); `gpu`: all on the GPU. docs/vision.md.",
        example="",
        shown="`host` on RTX 3090 profiles, else `gpu`",
    )
    vision_url_domains: str | None = _knob(
        None,
        "overrides",
        "With VISION on: hosts the server may fetch http(s) image URLs from, comma-separated names or IPv4 "
        "addresses matched exactly (no subdomains, no wildcards, no ports), redirects not followed. Empty: "
        "it fetches nothing, images come inline. docs/vision.md.",
        example="",
    )
    shutdown_timeout: int | None = _knob(
        None,
        "overrides",
        "Seconds SIGTERM lets in-flight requests finish before they are ended with an error event "
        f"(0: at once). Every process is gone at most {SHUTDOWN_MARGIN_S} s after that.",
        example="",
        ge=0,
        le=MAX_SHUTDOWN_TIMEOUT_S,
    )

    ready_timeout: float = _knob(
        1800.0, "runtime", "Seconds the readiness gate waits for a first start (compile + graphs).", ge=10, le=86400
    )
    log_level: Literal["debug", "info", "warning", "error"] = _knob(
        "info",
        "runtime",
        "Log level of vLLM and of our own lines: at warning or error our progress and status lines (download, "
        "sha256 and requantize progress, verified/planned/serving/ready, the start-up heartbeat, what prepare "
        "did) are left out too; warnings and errors always print.",
    )

    allow_branch_head: bool = _knob(
        False,
        "hub",
        "Let prepare pin a hub artifact whose lock entry names no revision: its main branch is resolved once, the "
        "commit printed and recorded in MODELS_DIR/artifacts.local.toml (off: such an artifact is refused; a "
        "branch is not a pin).",
    )
    models_seed_dir: Path | None = _knob(
        None,
        "hub",
        "Models you already downloaded, read by prepare before the hub: a Hugging Face cache (e.g. "
        "~/.cache/huggingface) or a folder of files (one per artifact, named like the repo); a file is used only "
        "when its sha256 is the pinned one. In compose, the host folder mounted read-only into `prepare-*`.",
        example="",
    )
    hf_endpoint: str | None = _knob(
        None,
        "hub",
        "Hub endpoint prepare downloads from (a mirror; empty: https://huggingface.co). huggingface_hub reads it.",
        example="",
        pattern=r"^https?://\S+$",
    )
    # Proxy URLs may carry a password: held as secrets, never shown (huggingface_hub reads the environment).
    https_proxy: SecretStr | None = _knob(
        None, "hub", "Proxy for HTTPS downloads (prepare), passed into `prepare-*`.", example=""
    )
    http_proxy: SecretStr | None = _knob(None, "hub", "Proxy for plain-HTTP downloads (prepare).", example="")
    no_proxy: str | None = _knob(None, "hub", "Hosts reached without the proxy (comma-separated).", example="")
    hf_token_file: Path | None = _knob(
        None,
        "hub",
        "Host file holding a Hugging Face token, for gated or private repos (compose mounts it into `prepare-*` "
        "as the secret hf_token; empty: no token, enough for the pinned public models). Never put the token in "
        ".env.",
        example="",
    )

    torch_profile_dir: Path | None = _knob(
        None,
        "runtime",
        "Directory for torch-profiler traces (empty: profiling off). Set, `qwen38 serve` turns on vLLM's torch "
        "profiler (its /start_profile and /stop_profile routes, without Python stacks) and its per-step "
        "record_function scopes; `qwen38 bench steps` drives it (docs/step-profile.md). For measurement only: "
        "never on a server people use.",
        example="",
    )

    watchdog_stall_timeout: float = _knob(
        120.0,
        "runtime",
        "Watchdog: seconds with requests running or waiting and no engine progress (no token generated or prefilled, "
        "no KV-cache change) before the server is declared stalled (0: off).",
        ge=0,
        le=3600,
    )
    watchdog_canary_interval: float = _knob(
        60.0,
        "runtime",
        "Watchdog: seconds between canary requests (a 12-token greedy answer), sent only after a quiet poll "
        "interval, never beside users' requests (0: off).",
        ge=0,
        le=86400,
    )
    watchdog_canary_timeout: float = _knob(
        60.0, "runtime", "Watchdog: seconds a canary may take before it counts as failed.", ge=1, le=3600
    )
    watchdog_acceptance_floor: float = _knob(
        1.5,
        "runtime",
        "Watchdog (speculative profiles): warn when the acceptance length (1 + accepted / drafts) over the "
        "last 200 drafts falls below this (0: off). A warning only: the output stays exact, only slower.",
        ge=0,
        le=17,
    )
    watchdog_action: Literal["stop", "mark"] = _knob(
        "stop",
        "runtime",
        "Watchdog: what a stall or a failed canary does. `stop`: mark the server unhealthy, stop the engine and "
        "exit non-zero, so compose's `restart: unless-stopped` starts it again (Docker restarts on exit, not on "
        "an unhealthy check); `mark`: only mark it unhealthy (`qwen38 ready --quick` fails) until it recovers.",
    )

    gpu_link: Literal["auto", "pcie", "nvlink"] = _knob(
        "auto",
        "parallel",
        "How the GPUs of a one-host multi-GPU profile are linked; it picks the all-reduce defaults below. "
        "`auto`: what `nvidia-smi topo -m` reports between them (PCIe when it cannot tell).",
    )
    custom_all_reduce: bool | None = _knob(
        None,
        "parallel",
        "vLLM's custom all-reduce kernel between the GPUs (empty: on over NVLink, off over PCIe and between "
        "hosts: over PCIe it trusts the driver's peer-to-peer report, and patched-P2P drivers are reported "
        "to return wrong sums or hang).",
        example="",
    )
    nccl_p2p: bool | None = _knob(
        None,
        "parallel",
        "NCCL's direct GPU-to-GPU transport inside one host (empty: on over NVLink, off over PCIe, which sets "
        "NCCL_P2P_DISABLE=1: NCCL then copies through host memory).",
        example="",
    )
    node_rank: int = _knob(
        0,
        "parallel",
        "This host's place in a multi-host profile: 0 the head (serves the API), 1.. a worker (no API).",
        ge=0,
        le=7,
    )
    head_address: str | None = _knob(
        None,
        "parallel",
        "Multi-host: the head's IP address on the link between the hosts (vLLM --master-addr), the same "
        "on every host.",
        example="",
    )
    head_port: int = _knob(
        29501,
        "parallel",
        "Multi-host: the head's TCP port for torch.distributed's rendezvous (vLLM --master-port).",
        ge=1024,
        le=65535,
    )
    node_address: str | None = _knob(
        None,
        "parallel",
        "Multi-host: this host's IP address on the link (VLLM_HOST_IP; empty on the head: HEAD_ADDRESS). "
        "vLLM otherwise takes the address of the default route, often the slower LAN port.",
        example="",
    )
    network_interface: str | None = _knob(
        None,
        "parallel",
        "Multi-host: the network interface of the link, e.g. enp1s0f1np1 on a DGX Spark "
        "(NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME: NCCL's bootstrap and vLLM's CPU groups).",
        example="",
        pattern=r"^[A-Za-z0-9_.:-]{1,15}$",
    )
    rdma_devices: str | None = _knob(
        None,
        "parallel",
        "Multi-host: the RDMA devices NCCL sends over (sets NCCL_IB_HCA), e.g. rocep1s0f1,roceP2p1s0f1 for "
        "both halves of a Spark's port. Empty: NCCL picks.",
        example="",
        pattern=r"^\^?=?[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*$",
    )
    nccl_log_level: Literal["VERSION", "WARN", "INFO", "TRACE"] | None = _knob(
        None,
        "parallel",
        "NCCL's log level (sets NCCL_DEBUG); INFO shows the transport each link uses (`Using network IB`).",
        example="",
    )

    image_rtx3090: str | None = _knob(
        None,
        "compose",
        "Image of `single`/`long`/`dual`/`batch`. Empty: compose.yaml's default, the published image by digest once "
        "`qwen38 image pin` has pinned one, until then a local tag that `up` builds from this checkout. "
        "A plain tag of your own (e.g. qwen38-stack:rtx3090) builds locally; REPOSITORY:TAG@sha256:DIGEST pulls.",
        example="",
        pattern=IMAGE_REFERENCE,
    )
    image_spark: str | None = _knob(
        None,
        "compose",
        "Image of `spark-lora`/`spark-pair`, as IMAGE_RTX3090 (empty: compose.yaml's default, pulled by digest "
        "once published, built locally until then).",
        example="",
        pattern=IMAGE_REFERENCE,
    )
    image_cpu: str | None = _knob(
        None,
        "compose",
        "Image of `cpu`, as IMAGE_RTX3090 (empty: compose.yaml's default, pulled by digest once published, "
        "built locally until then).",
        example="",
        pattern=IMAGE_REFERENCE,
    )
    gpu_device: str = _knob(
        "0",
        "compose",
        "Host GPU a one-GPU serving container reserves (index or GPU-UUID; each host of `spark-pair` too); "
        "inside the container it is device 0.",
        pattern=rf"^{GPU_ID}$",
    )
    gpu_devices: str = _knob(
        "0,1",
        "compose",
        "Host GPUs the `dual` container reserves: two indices or GPU-UUIDs, comma-separated, as nvidia-smi "
        "numbers them; inside the container they are devices 0 and 1.",
        pattern=rf"^{GPU_ID},{GPU_ID}$",
    )
    publish_address: str = _knob(
        "127.0.0.1",
        "compose",
        "Host address the API port is published on (0.0.0.0: every interface; the API key guards every "
        "route but /health and /ping).",
    )
    publish_port: int = _knob(18020, "compose", "Host port the API is published on.", ge=1, le=65535)
    monitoring_address: str = _knob(
        "127.0.0.1",
        "compose",
        "Host address Prometheus and Grafana (`--profile monitoring`) are published on. Neither asks for a "
        "login to read the metrics: publish them beyond loopback only on a network you trust.",
    )
    prometheus_port: int = _knob(9090, "compose", "Host port of Prometheus (`--profile monitoring`).", ge=1, le=65535)
    grafana_port: int = _knob(3000, "compose", "Host port of Grafana (`--profile monitoring`).", ge=1, le=65535)

    @field_validator("speculation", mode="before")
    @classmethod
    def _speculation_choice(cls, value: Any) -> Any:
        """dflash, mtp or off; the booleans pydantic always took keep their meaning (true: the
        profile's own method, false: off)."""
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        word = str(value).strip().lower()
        if word in SPECULATION_METHODS:
            return word
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return word in TRUE_WORDS
        raise ValueError("expected dflash, mtp or off (true: the profile's own method; false: off)")

    @field_validator("host")
    @classmethod
    def _valid_host(cls, value: str) -> str:
        if value == "localhost":
            return value
        try:
            ipaddress.ip_address(value)
        except ValueError:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.-]*", value):
                raise ValueError(f"not an IP address or host name: {value!r}") from None
        return value

    @field_validator("vision_url_domains")
    @classmethod
    def _valid_url_domains(cls, value: str | None) -> str | None:
        """Host names as vLLM's allow-list compares them (urllib3's lower-cased hostname), in one
        canonical spelling; anything a URL carries beside the host is refused, not stripped."""
        if value is None:
            return value
        return ",".join(url_domain(item) for item in value.split(","))

    @field_validator("publish_address", "monitoring_address", "head_address", "node_address")
    @classmethod
    def _valid_publish_address(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"not an IP address: {value!r}") from None
        return value

    @model_validator(mode="after")
    def _known_profile(self) -> Settings:
        names = profile_names(self.profiles_dir)
        if self.profile not in names:
            raise ValueError(
                f"PROFILE={self.profile}: no profile {self.profile!r} in {self.profiles_dir}; "
                f"known profiles: {', '.join(names)}"
            )
        return self

    @model_validator(mode="after")
    def _no_conflicts(self) -> Settings:
        if self.vllm_api_key is not None and self.api_key_file is not None:
            raise ValueError(BOTH_KEYS_SET)
        if not self.has_api_key and not is_loopback(self.host):
            raise ValueError(
                f"HOST={self.host} would expose the API without a key: "
                "set API_KEY_FILE (or VLLM_API_KEY), or listen on 127.0.0.1"
            )
        return self

    @property
    def has_api_key(self) -> bool:
        return self.vllm_api_key is not None or self.api_key_file is not None

    def api_key_source(self) -> str | None:
        """Where the key comes from, for people (never the key itself)."""
        if self.api_key_file is not None:
            return f"file {self.api_key_file}"
        if self.vllm_api_key is not None:
            return "environment variable VLLM_API_KEY"
        return None


def url_domain(item: str) -> str:
    """One VISION_URL_DOMAINS item, lower-cased; ValueError naming what is wrong with it."""
    name = item.strip().lower()
    if not name:
        raise ValueError("an empty item: write host names separated by single commas, e.g. images.lan,10.0.0.5")
    for found, what in (("://", "a scheme"), ("/", "a path"), ("*", "a wildcard"), ("@", "a user name"),
                        (":", "a port or an IPv6 address")):
        if found in name:
            raise ValueError(f"{name!r} carries {what}: write the host name alone (images.lan, 10.0.0.5)")
    if re.search(r"\s", name):
        raise ValueError(f"{name!r} has whitespace inside: write one host name per item")
    if not re.fullmatch(URL_DOMAIN, name):
        raise ValueError(f"{name!r} is not a host name: letters, digits, '-' and '.' (images.lan, 10.0.0.5)")
    return name


def url_domains(value: str | None) -> tuple[str, ...]:
    """The hosts of a validated VISION_URL_DOMAINS (none when unset)."""
    return tuple(value.split(",")) if value else ()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _env_name(field: str) -> str:
    return field.upper()


def _describe(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = err["loc"]
    if err["type"] == "extra_forbidden":
        key = str(loc[0]).upper()
        if key == "HF_TOKEN":
            return (
                "HF_TOKEN does not belong in .env (a file every container and log helper may read): write the "
                "token to secrets/hf_token and set HF_TOKEN_FILE=./secrets/hf_token"
            )
        known = [_env_name(f) for f in Settings.model_fields]
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"; did you mean {close[0]}?" if close else f"; known settings: {', '.join(known)}"
        return f"unknown setting {key} in .env{hint}"
    if not loc:
        return err["msg"].removeprefix("Value error, ")
    field = str(loc[0])
    found = err.get("input")
    shown = "<secret>" if field == "vllm_api_key" else json.dumps(found, default=str)
    msg = err["msg"].removeprefix("Value error, ")
    return f"{_env_name(field)}={shown}: {msg}"


def check_env_file(env_file: str | os.PathLike | None) -> None:
    """Refuse a ``.env`` that python-dotenv would half-read: it skips a line it cannot parse
    with only a warning, and a file that is not UTF-8 ends in a traceback."""
    from dotenv.parser import parse_stream

    if env_file is None:
        return
    path = Path(env_file)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise SettingsError(f"{path}: cannot be read ({exc.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise SettingsError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); save the file as UTF-8"
        ) from None
    for binding in parse_stream(io.StringIO(text)):
        if binding.error:
            name = binding.original.string.split("=", 1)[0].strip()
            # The value is never shown: it may be a key.
            what = f"`{name}=...`" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) else "this line"
            raise SettingsError(
                f"{path}:{binding.original.line}: cannot parse {what}; write NAME=value, with any quote "
                "closed on the same line"
            )


def load_settings(env_file: str | os.PathLike | None = ".env", **overrides: Any) -> Settings:
    """Read settings (explicit overrides > environment > .env > defaults); one-line errors."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    check_env_file(env_file)
    try:
        return Settings(_env_file=env_file, **overrides)
    except ValidationError as exc:
        raise SettingsError(_describe(exc)) from None


def load_settings_profile(settings: Settings):
    """The profile the settings name, from the settings' profiles directory."""

    return load_profile(settings.profile, settings.profiles_dir)


DOCKER_SECRETS_DIR = Path("/run/secrets")


def check_key_file_mode(path: Path, source: str | None = None) -> None:
    """Refuse a key file other users can write; warn when every user can read it.

    Owner read/write and group read are fine. World-readable is only warned about: a Docker
    secret from compose's ``file:`` keeps the host file's mode, and the server's non-root user
    must read it (the host directory, secrets/, is what stays private); under /run/secrets
    the container is the boundary, so no warning there.
    """
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return  # reading it reports what is wrong
    source = source or f"API_KEY_FILE={path}"
    if mode & 0o022:
        raise SettingsError(
            f"{source}: mode {mode:04o} lets other users replace the key; run `chmod go-w {path}`"
        )
    if mode & 0o004 and DOCKER_SECRETS_DIR not in path.absolute().parents:
        print(
            f"qwen38: settings: {source} is readable by every user (mode {mode:04o}); "
            f"run `chmod o-r {path}` unless a container's user must read it",
            file=sys.stderr,
        )


# ---- the API key: the one place that reads it -------------------------------------------
#
# Precedence, for every command: an explicit flag (--api-key or --api-key-file; both: refused)
# wins over the settings; else VLLM_API_KEY or API_KEY_FILE, from the environment, then .env
# (both set: refused), exactly as `qwen38 serve` reads them. A key is one word of at least
# MIN_API_KEY_LENGTH characters wherever it comes from, and is never printed.
# tests/unit/test_api_key_home.py fails when another module reads these variables or files.


class _KeySettings(BaseSettings):
    """Only the two key settings, read as Settings reads them: for clients of a server
    (validate, bench), which need no valid serving configuration."""

    model_config = SettingsConfigDict(
        env_file=".env", env_file_encoding="utf-8", extra="ignore", case_sensitive=False, env_ignore_empty=True,
    )

    vllm_api_key: SecretStr | None = None
    api_key_file: Path | None = None

    @model_validator(mode="after")
    def _not_both(self) -> _KeySettings:
        if self.vllm_api_key is not None and self.api_key_file is not None:
            raise ValueError(BOTH_KEYS_SET)
        return self


def _key_from_file(path: Path, source: str) -> str:
    check_key_file_mode(path, source)
    try:
        return path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise SettingsError(f"{source}: no such file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise SettingsError(f"{source}: cannot read the key ({type(exc).__name__})") from None


def _checked_key(key: str, source: str) -> SecretStr:
    if len(key) < MIN_API_KEY_LENGTH or any(c.isspace() for c in key):
        raise SettingsError(
            f"{source}: the key must be one word of at least {MIN_API_KEY_LENGTH} characters "
            "(e.g. `openssl rand -hex 24`)"
        )
    return SecretStr(key)


def read_api_key(settings: Settings | _KeySettings) -> SecretStr | None:
    """The configured API key, from VLLM_API_KEY or API_KEY_FILE (never printed; both set: refused)."""
    if settings.vllm_api_key is not None and settings.api_key_file is not None:
        raise SettingsError(BOTH_KEYS_SET)
    if settings.vllm_api_key is not None:
        return _checked_key(settings.vllm_api_key.get_secret_value().strip(), "VLLM_API_KEY")
    if settings.api_key_file is not None:
        source = f"API_KEY_FILE={settings.api_key_file}"
        return _checked_key(_key_from_file(settings.api_key_file, source), source)
    return None


def load_serving(profile: str | None = None):
    """What a command about one served profile starts from: the profile (``profile``, or the
    PROFILE setting), the settings and the API key (`read_api_key`)."""
    settings = load_settings(profile=profile)
    return load_settings_profile(settings), settings, read_api_key(settings)


def client_api_key(
    key: str | None = None,
    key_file: str | os.PathLike | None = None,
    *,
    env_file: str | os.PathLike | None = ".env",
) -> str | None:
    """The key a client of the server sends (None: an open server); the precedence is above.

    ``key`` and ``key_file`` are the command's --api-key and --api-key-file.
    """
    if key and key_file:
        raise SettingsError("--api-key and --api-key-file are both given; use one")
    if key:
        return _checked_key(key.strip(), "--api-key").get_secret_value()
    if key_file:
        source = f"--api-key-file {key_file}"
        return _checked_key(_key_from_file(Path(key_file), source), source).get_secret_value()
    check_env_file(env_file)
    try:
        sources = _KeySettings(_env_file=env_file)
    except ValidationError as exc:
        raise SettingsError(_describe(exc)) from None
    secret = read_api_key(sources)
    return secret.get_secret_value() if secret else None


# ---- documentation generated from the fields ------------------------------------------


def _example_value(name: str, info: Any) -> str:
    extra = info.json_schema_extra or {}
    if "example" in extra:
        return extra["example"]
    default = info.default
    return "" if default is None else str(default)


def render_env_example() -> str:
    """The content of `.env.example`, generated from the field definitions."""
    lines = [
        "# qwen38-stack settings. Generated by `qwen38 settings example` from core/settings.py;",
        "# edit that file, not this one. Copy to .env and change what you need.",
        "# Empty values mean: the profile (or the default) decides.",
    ]
    by_section: dict[str, list[str]] = {s: [] for s in SECTIONS}
    for name, info in Settings.model_fields.items():
        section = (info.json_schema_extra or {})["section"]
        by_section[section].append(f"# {info.description}\n{_env_name(name)}={_example_value(name, info)}")
    for section, entries in by_section.items():
        if entries:
            lines.append("")
            lines.append(f"## {SECTIONS[section]}")
            lines.extend(entries)
    return "\n".join(lines) + "\n"


def render_settings_table() -> str:
    """A Markdown table of every setting, generated from the field definitions."""
    rows = ["| Setting | Default | What it does |", "|---|---|---|"]
    for name, info in Settings.model_fields.items():
        shown = (info.json_schema_extra or {}).get("shown")
        default = shown or ("" if info.default is None else f"`{info.default}`")
        rows.append(f"| `{_env_name(name)}` | {default} | {info.description} |")
    return "\n".join(rows) + "\n"


def masked(settings: Settings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in Settings.model_fields:
        value = getattr(settings, name)
        if isinstance(value, SecretStr):
            value = "********"
        elif isinstance(value, Path):
            value = str(value)
        out[_env_name(name)] = value
    return out
