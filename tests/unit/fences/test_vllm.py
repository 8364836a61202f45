"""The vLLM contract's test: what appliance/fences/vllm.py assumes, checked against the engine venv.

vLLM lives in its own venv, not in this one, so the facts are read there: once, by the venv's own
interpreter (its version, its server's flags, its environment variables, its request models'
fields, the template's modules), and by reading its source (the metric names). The engine venv
is a prerequisite, as it is for the integration tests: without it this fails and says how to
get it, it never skips (CI always has it; a skipped contract would pass any vLLM).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
import pytest

from appliance.core.sections import CHECKOUT_ROOT, default_engine_python
from appliance.fences import vllm
from appliance.policy import fields
from tests.unit.fences.contract import Fence

# What the engine venv's interpreter reports about the vLLM installed there.
FACTS = """
import importlib, importlib.metadata, importlib.util, json, sys
contract = json.loads(sys.argv[1])
facts = {"versions": {}, "modules": {}, "fields": {}}
for name in contract["distributions"]:
    try:
        facts["versions"][name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
for name in contract["modules"]:
    try:
        facts["modules"][name] = importlib.util.find_spec(name) is not None
    except ImportError:
        facts["modules"][name] = False
from vllm.entrypoints.launchers.cli_args import create_parser_for_docs
facts["flags"] = sorted(o for a in create_parser_for_docs()._actions for o in a.option_strings)
import vllm.envs
facts["env"] = sorted(vllm.envs.environment_variables)
for ours, where in contract["requests"].items():
    module, name = where.split(":")
    model = getattr(importlib.import_module(module), name)
    facts["fields"][ours] = sorted({n for n, f in model.model_fields.items()}
                                   | {f.alias for f in model.model_fields.values() if f.alias})
system_utils = importlib.import_module(contract["mp_module"])
facts["mp_function"] = callable(getattr(system_utils, contract["mp_function"], None))
platform = importlib.import_module(contract["platforms"]).current_platform
facts["is_cpu"] = callable(getattr(platform, "is_cpu", None))
# The Anthropic stream's reading of the chat stream's error event for a dead engine core, as its
# converter reads it (a chunk) and writes the failure (sanitized).
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse
from vllm.entrypoints.serve.exception_handling.utils import sanitize_message
from vllm.v1.engine.exceptions import EngineDeadError
dead = json.dumps({"error": {"message": str(EngineDeadError()), "type": "InternalServerError",
                             "param": None, "code": 500}})
facts["dead_event"] = dead
try:
    ChatCompletionStreamResponse.model_validate_json(dead)
    facts["anthropic_dead"] = None
except Exception as e:
    facts["anthropic_dead"] = sanitize_message(str(e))
# And of the chat stream's refusal of a request (a 400 error event, as the serving's error
# response builds it).
refused = json.dumps({"error": {"message": "Grammar error: regex parse error: unclosed group",
                                "type": "BadRequestError", "param": None, "code": 400}})
try:
    ChatCompletionStreamResponse.model_validate_json(refused)
    facts["anthropic_refused"] = None
except Exception as e:
    facts["anthropic_refused"] = sanitize_message(str(e))
print(json.dumps(facts))
"""


class VllmFence(Fence):
    """The contract's fence: the dependency is read in the engine venv, not in this one."""

    @property
    def installed(self) -> str:
        versions = engine_facts()["versions"]
        return ", ".join(f"{name} {version}" for name, version in versions.items()) or "none"


VLLM = VllmFence("appliance/fences/vllm.py", "vLLM (engine venv)",
                 pinned_in="install.sh (VLLM_VERSION) and appliance/fences/vllm.py (VERSION)")


def engine_python() -> Path:
    python = default_engine_python()
    if not python.exists():
        pytest.fail(f"FENCE appliance/fences/vllm.py cannot be checked: no engine venv at "
                    f"{python}. Run `bash install.sh` (it installs vLLM {vllm.VERSION}).",
                    pytrace=False)
    return python


@cache
def engine_facts() -> dict[str, Any]:
    contract = {
        "distributions": vllm.DISTRIBUTIONS, "requests": vllm.REQUEST_MODELS,
        "modules": [vllm.SERVER_MODULE, *vllm.API_PRELOADS, *vllm.API_WARM,
                    *vllm.CPU_ENGINE_WARM, vllm.MP_CONTEXT_MODULE, vllm.PLATFORMS_MODULE],
        "mp_module": vllm.MP_CONTEXT_MODULE, "mp_function": vllm.MP_CONTEXT_FUNCTION,
        "platforms": vllm.PLATFORMS_MODULE,
    }
    result = subprocess.run([str(engine_python()), "-c", FACTS, json.dumps(contract)],
                            capture_output=True, text=True, timeout=600,
                            env=os.environ | {"HF_HUB_OFFLINE": "1"})
    if result.returncode != 0:
        pytest.fail(f"FENCE appliance/fences/vllm.py: the engine venv could not report its "
                    f"vLLM:\n{result.stderr[-3000:]}", pytrace=False)
    return dict(json.loads(result.stdout.splitlines()[-1]))


def test_the_engine_venv_holds_the_pinned_version_and_install_sh_pins_the_same() -> None:
    versions = engine_facts()["versions"]
    VLLM.require(list(versions.values()) == [vllm.VERSION],
                 f"one of {vllm.DISTRIBUTIONS} is installed, at {vllm.VERSION}", versions)
    pinned = re.search(r"^readonly VLLM_VERSION=(\S+)$", (CHECKOUT_ROOT / "install.sh").read_text(),
                       re.MULTILINE)
    VLLM.require(pinned is not None and pinned.group(1) == vllm.VERSION,
                 f"install.sh installs vLLM {vllm.VERSION}", pinned and pinned.group(1))


def test_the_server_takes_every_flag_we_pass() -> None:
    known = set(engine_facts()["flags"])
    VLLM.require(set(vllm.Flag) <= known, "vLLM's server takes each flag of Flag",
                 sorted(set(vllm.Flag) - known))


def test_vllm_reads_every_environment_variable_we_set() -> None:
    known = set(engine_facts()["env"])
    VLLM.require(set(vllm.Env) <= known, "vllm/envs.py reads each variable of Env",
                 sorted(set(vllm.Env) - known))


def test_the_template_finds_its_modules_and_the_function_it_patches() -> None:
    facts = engine_facts()
    required = [vllm.SERVER_MODULE, *vllm.API_PRELOADS, vllm.MP_CONTEXT_MODULE,
                vllm.PLATFORMS_MODULE]
    missing = [name for name in required if not facts["modules"][name]]
    VLLM.require(not missing, "the server module and the template's required preloads exist",
                 missing)
    # The warm lists are best effort by design, but a name that went is time lost at each fork.
    gone = [name for name in (*vllm.API_WARM, *vllm.CPU_ENGINE_WARM) if not facts["modules"][name]]
    VLLM.require(not gone, "every module the template warms exists", gone)
    VLLM.require(facts["mp_function"],
                 f"{vllm.MP_CONTEXT_MODULE}.{vllm.MP_CONTEXT_FUNCTION} is a function")
    VLLM.require(facts["is_cpu"], f"{vllm.PLATFORMS_MODULE}.current_platform.is_cpu() exists")


def test_every_field_the_gate_vets_is_one_vllm_reads() -> None:
    """A field of ours that vLLM no longer reads is vetted for nothing and passed to be ignored."""
    for ours, where in vllm.REQUEST_MODELS.items():
        declared = {field.encode_name for field in msgspec.structs.fields(getattr(fields, ours))}
        theirs = set(engine_facts()["fields"][ours])
        VLLM.require(declared - vllm.VETTED_THOUGH_UNREAD <= theirs,
                     f"{where} has each field of policy/fields.py's {ours}",
                     sorted(declared - vllm.VETTED_THOUGH_UNREAD - theirs))
        VLLM.require(not vllm.VETTED_THOUGH_UNREAD & theirs,
                     f"{where} still reads none of VETTED_THOUGH_UNREAD (if it does, drop it "
                     "from that list)", sorted(vllm.VETTED_THOUGH_UNREAD & theirs))


def engine_sources(pattern: str) -> str:
    """The engine venv's source files under site-packages that match `pattern`, as one text."""
    lib = engine_python().parent.parent / "lib"
    return "\n".join(path.read_text(errors="replace")
                     for path in lib.glob(f"python3*/site-packages/{pattern}"))


def test_the_metrics_we_read_are_ones_vllm_exports() -> None:
    """Read from the source: the metrics are registered when an engine runs, not on import."""
    sources = engine_sources("vllm/v1/metrics/*.py")
    for name in vllm.Metric:
        base = re.sub(r"_(total|count|sum|bucket)$", "", name)
        VLLM.require(f'"{name}"' in sources or f'"{base}"' in sources,
                     f"vllm/v1/metrics registers {name}")


def test_the_metrics_path_reaches_the_app_that_renders_only_the_series_named() -> None:
    """METRICS_PATH passes vLLM's FastAPI /metrics route (the whole page) for its mount of
    prometheus_client's app, which renders only the `name[]` series (a real worker answers it:
    tests/integration/test_running_path.py)."""
    mount = engine_sources("vllm/entrypoints/serve/instrumentator/metrics.py")
    VLLM.require('Mount("/metrics", make_asgi_app(' in mount
                 and 're.compile("^/metrics(?P<path>.*)$")' in mount,
                 "vLLM mounts prometheus_client's app at /metrics, for every path under it")
    exposition = engine_sources("prometheus_client/exposition.py")
    VLLM.require("if 'name[]' in params:" in exposition and ".restricted_registry(" in exposition,
                 "prometheus_client's app renders only the series named by name[]")


def test_each_boot_phase_opens_on_a_line_the_worker_still_logs() -> None:
    """A reworded line costs a phase of the boot display, never the boot: said here, not there."""
    sources = engine_sources("vllm/**/*.py") + engine_sources("uvicorn/**/*.py")
    for phase, lines in vllm.BOOT_LINES:
        VLLM.require(re.search(lines, sources) is not None,
                     f"vLLM or uvicorn logs a line that opens the boot phase {phase!r}", lines)


def test_a_dead_engine_core_is_answered_with_the_message_recovery_looks_for() -> None:
    """appliance/recovery/replay.py tells an engine death from another 500 by this message."""
    sources = engine_sources("vllm/v1/engine/exceptions.py")
    VLLM.require(vllm.ENGINE_DEAD_MESSAGE in sources,
                 "EngineDeadError's message starts as ENGINE_DEAD_MESSAGE", vllm.ENGINE_DEAD_MESSAGE)


def test_chat_and_completions_streams_can_carry_their_token_ids() -> None:
    """What a resumed stream is continued from (appliance/apis/openai/resume.py)."""
    for ours in ("ChatFields", "CompletionFields"):
        VLLM.require(vllm.TokenIds.REQUEST in engine_facts()["fields"][ours],
                     f"{vllm.REQUEST_MODELS[ours]} reads {vllm.TokenIds.REQUEST}")
    sources = engine_sources("vllm/entrypoints/openai/*/protocol.py")
    for name in (vllm.TokenIds.PROMPT, vllm.TokenIds.GENERATED):
        VLLM.require(re.search(rf"^\s+{name}: ", sources, re.MULTILINE) is not None,
                     f"vLLM's stream events declare {name}")


def test_an_anthropic_stream_tells_of_its_dead_engine_core_in_the_words_recovery_looks_for() -> None:
    """The relay reads this event as the engine's death (appliance/proxy/relay.py), never relays it."""
    converter = engine_sources("vllm/entrypoints/anthropic/serving.py")
    VLLM.require("ChatCompletionStreamResponse.model_validate_json" in converter
                 and 'type="internal_error", message=sanitize_message(str(e))' in converter,
                 "the Anthropic stream converter writes a chunk it cannot read as internal_error")
    said = engine_facts()["anthropic_dead"]
    VLLM.require(said is not None and vllm.ANTHROPIC_ENGINE_DEAD in said,
                 "the converter's message for a dead engine's error event holds "
                 "ANTHROPIC_ENGINE_DEAD", said)


def test_generation_bodies_render_as_generating_them_would() -> None:
    """What a resumed Responses or Anthropic stream continues from (appliance/recovery/text.py),
    and where a chat or completions stream without a budget finds the one it resolved to
    (appliance/apis/openai/resume.py)."""
    routes = engine_sources("vllm/entrypoints/scale_out/render/api_router.py")
    for path in (vllm.RESPONSES_RENDER, vllm.MESSAGES_RENDER, vllm.CHAT_RENDER,
                 vllm.COMPLETIONS_RENDER):
        VLLM.require(f'"{path}"' in routes, f"vLLM's render router serves {path}")


def test_a_read_ending_with_a_token_event_holds_no_death_of_the_engine() -> None:
    """The relay searches a chat or completions read for the death's error event only where it
    does not end with a token event (appliance/proxy/relay.py, TOKEN_EVENT_END): the generators write
    that error as their last event but [DONE], and it ends otherwise."""
    for route in ("chat_completion", "completion"):
        serving = engine_sources(f"vllm/entrypoints/openai/{route}/serving.py")
        VLLM.require(re.search(r'data = self\.create_streaming_error_response\(e\)\n\s+'
                               r'yield f"data: \{data\}\\n\\n"\n(\s+#.*\n)*\s+'
                               r'yield "data: \[DONE\]\\n\\n"', serving) is not None,
                     f"{route}'s stream writes the error event, then only [DONE]")
    dead = "data: " + str(engine_facts()["dead_event"]) + "\n\n"
    VLLM.require(not dead.encode().endswith(vllm.TOKEN_EVENT_END),
                 "the death's error event does not end as a token event", dead[-40:])
    recorded = Path(__file__).parents[1] / "appliance" / "admission" / "recorded"
    for stream in sorted(recorded.glob("*.sse")):
        events = [event + b"\n\n" for event in stream.read_bytes().split(b"\n\n") if event]
        # Every event with choices, but a chat stream's first (its prompt's fields follow its
        # choices) and the last token's (its fingerprint does, unless usage was asked).
        read = [(e, json.loads(e[6:])) for e in events if e.startswith(b"data: {")]
        tokens = [e for e, data in read if data["choices"]
                  and not {"system_fingerprint", "prompt_token_ids"} & data.keys()]
        assert tokens, stream
        VLLM.require(all(e.endswith(vllm.TOKEN_EVENT_END) for e in tokens),
                     f"vLLM's token events (as recorded in {stream.name}) end as TOKEN_EVENT_END")


def test_the_death_event_is_read_where_and_as_vllm_writes_it_and_nowhere_else() -> None:
    """The relay's hint of a dead engine core (StreamEnding): vLLM's own events, as its chat stream
    and its Anthropic converter build them in the engine venv, are told; the same words in a
    token event, an echoed prompt, a quoted error or an event that is not the stream's last
    are not (a client's text must never look like a death)."""
    dead = b"data: " + str(engine_facts()["dead_event"]).encode() + b"\n\n"
    VLLM.require(vllm.OPENAI_DEATH.told(dead) and vllm.OPENAI_DEATH.told(dead + b"data: [DONE]\n\n"),
                 "the chat stream's error event for a dead engine reads as OPENAI_DEATH", dead)
    converted = json.dumps({"type": "error", "error": {
        "type": "internal_error", "message": engine_facts()["anthropic_dead"]}})
    anthropic = f"event: error\ndata: {converted}\n\n".encode()
    VLLM.require(vllm.ANTHROPIC_DEATH.told(anthropic),
                 "the Anthropic converter's event for a dead engine reads as ANTHROPIC_DEATH",
                 anthropic)
    words = vllm.ENGINE_DEAD_MESSAGE + ". See stack trace (above) for the root cause."
    token = json.dumps({"choices": [{"index": 0, "delta": {"content": words}}]})
    echoed = json.dumps({"error": {"message": words, "code": 500}, "echo": True})
    bad = json.dumps({"error": {"message": "bad: " + words, "code": 400}})
    refused = json.dumps({"type": "error", "error": {"type": "internal_error", "message": (
        "input_value={'error': {'message': 'En...am': None, 'code': 400}}")}})
    for read in (f"data: {token}\n\n", f"data: {echoed}\n\n", f"data: {bad}\n\n",
                 dead.decode() + f"data: {token}\n\n", f"event: x\ndata: {token}\n\n"):
        assert not vllm.OPENAI_DEATH.told(read.encode()), read
    assert not vllm.ANTHROPIC_DEATH.told(f"event: error\ndata: {refused}\n\n".encode())


def test_an_anthropic_stream_tells_of_a_refusal_in_words_the_relay_reads_as_one() -> None:
    """The converter turns the chat stream's 400 into an internal_error whose excerpt keeps the
    code: the relay reads it as vLLM's refusal (ANTHROPIC_REFUSAL) and asks for the reason; a
    death's excerpt, or a client's text quoting the excerpt in a token event, is not one."""
    said = engine_facts()["anthropic_refused"]

    def event(message: str, kind: str = "internal_error") -> bytes:
        data = json.dumps({"type": "error", "error": {"type": kind, "message": message}})
        return f"event: error\ndata: {data}\n\n".encode()

    VLLM.require(said is not None and vllm.ANTHROPIC_REFUSAL.told(event(said)),
                 "the converter's message for a refusal reads as ANTHROPIC_REFUSAL", said)
    assert not vllm.ANTHROPIC_REFUSAL.told(event(str(engine_facts()["anthropic_dead"])))
    assert not vllm.ANTHROPIC_REFUSAL.told(event(said, kind="invalid_request_error"))
    delta = json.dumps({"type": "content_block_delta", "delta": {"type": "text_delta", "text": said}})
    assert not vllm.ANTHROPIC_REFUSAL.told(f"event: content_block_delta\ndata: {delta}\n\n".encode())


def test_the_sleep_mode_routes_answer_what_supervisor_engine_sleep_reads() -> None:
    """Read from the source (no CPU worker has a sleep mode): the dev routes SLEEP_PATH and
    WAKE_UP_PATH reach, their answers' `status`, the level and mode SLEEP_PATH asks for, and
    that only VLLM_SERVER_DEV_MODE registers them."""
    router = engine_sources("vllm/entrypoints/serve/dev/sleep/api_router.py")
    routes = set(re.findall(r'@router\.(?:post|get)\("(/[a-z_]+)"\)', router))
    VLLM.require({vllm.SLEEP_PATH.split("?")[0], vllm.WAKE_UP_PATH, vllm.IS_SLEEPING_PATH}
                 <= routes <= set(vllm.DEV_PATHS), "vLLM's sleep router serves the paths named",
                 sorted(routes))
    VLLM.require('{"status": "sleeping", "level": level}' in router
                 and '"status": "awake" if fully_awake else "sleeping"' in router,
                 "/sleep answers status 'sleeping', /wake_up 'awake' once fully awake")
    VLLM.require("Query(ge=0, le=2)" in router and "PauseMode" in router,
                 "/sleep takes a level 0 to 2 and a PauseMode")
    modes = engine_sources("vllm/v1/engine/__init__.py")
    VLLM.require('PauseMode = Literal["abort", "wait", "keep"]' in modes,
                 "PauseMode still has 'wait' (requests in flight finish)")
    server = engine_sources("vllm/entrypoints/launchers/api_server/routers.py")
    VLLM.require("if envs.VLLM_SERVER_DEV_MODE:" in server
                 and "register_vllm_dev_api_routers(app)" in server,
                 "the dev routes are registered only under VLLM_SERVER_DEV_MODE")
