"""The bundled model's sampling defaults: a new conversion has them, an older one is patched in
place rather than converted again, and a directory stamped by this script stays valid for an
older copy of it (checkouts share one model cache)."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "convert_default_model.py"
OLD_STAMP_KEYS = ("format", "source", "gguf", "gguf_bytes")  # what the script checked before


@pytest.fixture
def convert() -> Iterator[ModuleType]:
    """The script as a module (it runs in the engine venv; these parts need no transformers)."""
    saved = dict(os.environ)  # importing it forces the hub offline for its own process
    spec = importlib.util.spec_from_file_location("convert_default_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    path = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


def converted_before_sampling_defaults(convert: ModuleType, out: Path, gguf: Path) -> None:
    """A directory as the previous version of the script left it."""
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (out / "model.safetensors").write_bytes(b"weights")
    (out / "tokenizer.json").write_text("{}")
    (out / "chat_template.jinja").write_text("{{ messages }}")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}))
    stamp = convert.expected_stamp(gguf, "0.1.2") | {"transformers": "5.19.0"}
    (out / convert.STAMP_NAME).write_text(json.dumps(stamp))


def test_the_defaults_are_the_model_cards(convert: ModuleType) -> None:
    assert convert.SAMPLING_DEFAULTS == {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def test_an_older_conversion_is_patched_in_place_keeping_its_token_ids(
    convert: ModuleType, gguf: Path, tmp_path: Path,
) -> None:
    out = tmp_path / "SmolLM2-135M-Instruct"
    converted_before_sampling_defaults(convert, out, gguf)
    stamp = convert.expected_stamp(gguf, "0.1.2")
    assert convert.state_of(out, stamp) == convert.LACKS_SAMPLING_DEFAULTS

    convert.add_sampling_defaults(out)

    assert convert.state_of(out, stamp) == convert.CURRENT
    config = json.loads((out / "generation_config.json").read_text())
    assert config == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
                      "do_sample": True, "temperature": 0.2, "top_p": 0.9}
    recorded = json.loads((out / convert.STAMP_NAME).read_text())
    assert recorded["sampling_defaults"] == convert.SAMPLING_DEFAULTS
    assert all(recorded[key] == stamp[key] for key in OLD_STAMP_KEYS), "older checkouts accept it"
    assert sorted(path.name for path in out.iterdir() if path.name.startswith(".")) == [
        convert.STAMP_NAME], "no draft file is left behind"


def test_edited_away_defaults_are_put_back(convert: ModuleType, gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "SmolLM2-135M-Instruct"
    converted_before_sampling_defaults(convert, out, gguf)
    convert.add_sampling_defaults(out)
    config = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps(config | {"temperature": 1.0}))
    assert convert.state_of(out, convert.expected_stamp(gguf, "0.1.2")) == (
        convert.LACKS_SAMPLING_DEFAULTS)


def test_a_different_source_still_means_a_new_conversion(
    convert: ModuleType, gguf: Path, tmp_path: Path,
) -> None:
    out = tmp_path / "SmolLM2-135M-Instruct"
    converted_before_sampling_defaults(convert, out, gguf)
    assert convert.state_of(out, convert.expected_stamp(gguf, "0.2.0")) == convert.STALE
    assert convert.state_of(tmp_path / "absent", convert.expected_stamp(gguf, "0.1.2")) == (
        convert.STALE)


def test_check_exit_codes_tell_install_sh_what_to_do(convert: ModuleType) -> None:
    assert (convert.CURRENT, convert.STALE, convert.LACKS_SAMPLING_DEFAULTS) == (0, 3, 4)
    assert "((state == 4))" in (SCRIPT.parents[1] / "install.sh").read_text()
