"""vLLM's test tree from its sdist: only the test files come out, and only a verified download."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from tests.compat import environment, sdist

MEMBERS = {
    "vllm-9.9.9/setup.py": "import torch\n",
    "vllm-9.9.9/vllm/__init__.py": "",
    "vllm-9.9.9/pyproject.toml": "[tool.pytest.ini_options]\n",
    "vllm-9.9.9/tests/utils.py": "class RemoteOpenAIServer: ...\n",
    "vllm-9.9.9/tests/entrypoints/test_x.py": "def test_x(): ...\n",
    "vllm-9.9.9/requirements/common.txt": "torch\n",
    "vllm-9.9.9/requirements/test/cpu.txt": "pytest==9.1.0\n  # via x\npytest-asyncio==1.4.0\n"
                                            "pytest-timeout==2.3.1\ntblib==3.1.0\ntorch==2.0\n",
}


def make_sdist(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in MEMBERS.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_unpack_takes_the_tests_and_what_pytest_reads_beside_them(tmp_path: Path) -> None:
    tree = sdist.unpack_tests(make_sdist(tmp_path / "vllm.tar.gz"), tmp_path / "tree")
    files = sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file())
    assert files == ["pyproject.toml", "requirements/test/cpu.txt", "tests/entrypoints/test_x.py",
                     "tests/utils.py"]


def test_a_download_whose_digest_differs_from_the_index_leaves_nothing(tmp_path: Path) -> None:
    archive = make_sdist(tmp_path / "source.tar.gz")
    dest = tmp_path / "cache" / "vllm.tar.gz"
    with pytest.raises(sdist.SdistError, match="sha256 mismatch"):
        sdist.download(archive.as_uri(), "0" * 64, dest)
    assert list(dest.parent.iterdir()) == []
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    assert sdist.download(archive.as_uri(), digest, dest).read_bytes() == archive.read_bytes()


def test_a_warm_cache_is_used_without_the_index(tmp_path: Path) -> None:
    sdist.unpack_tests(make_sdist(tmp_path / "vllm.tar.gz"), tmp_path / "vllm-9.9.9-tests")
    tree = sdist.ensure_tree(tmp_path, "9.9.9", index="http://127.0.0.1:9/unreachable")
    assert (tree / "tests" / "utils.py").is_file()


def test_the_added_test_tools_are_pinned_as_vllm_pins_them(tmp_path: Path) -> None:
    tree = sdist.unpack_tests(make_sdist(tmp_path / "vllm.tar.gz"), tmp_path / "tree")
    assert environment.pinned(tree) == ["pytest==9.1.0", "pytest-asyncio==1.4.0",
                                        "pytest-timeout==2.3.1", "tblib==3.1.0"]
