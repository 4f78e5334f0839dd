"""``tokenmill tokenizer export`` writes a tokenizer folder transformers reloads with the same ids and
chat template; ``GET /tokenizer_info`` (behind --enable-tokenizer-info-endpoint and the key) says
what that folder's tokenizer_config.json would."""

from __future__ import annotations

import subprocess

import httpx
import pytest
from conftest import API_KEY, tokenmill_command

TEXTS = ["The quick brown fox", "Paged attention, again!", "  spaces\tand\nnewlines "]


def _export(model: str, folder) -> None:
    done = subprocess.run([*tokenmill_command(), "tokenizer", "export", model, str(folder)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def _same_tokenizer(folder, engine_tokenizer) -> None:
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert reloaded(text).input_ids == engine_tokenizer(text).input_ids
    assert reloaded.chat_template == engine_tokenizer.chat_template
    assert reloaded.eos_token == engine_tokenizer.eos_token


def test_export_of_a_tiny_model_reloads_with_the_same_ids(llama_path, tmp_path):
    from tokenmill_cli.tokenizer import load_tokenizer

    _export(str(llama_path), tmp_path / "tok")
    _same_tokenizer(tmp_path / "tok", load_tokenizer(str(llama_path)))


@pytest.mark.slow
def test_export_of_the_default_gguf_model(tmp_path):
    from tokenmill_cli.tokenizer import load_tokenizer

    _export("default", tmp_path / "smollm")
    _same_tokenizer(tmp_path / "smollm", load_tokenizer("default"))


def test_export_of_a_missing_model_is_a_clear_error(tmp_path):
    done = subprocess.run([*tokenmill_command(), "tokenizer", "export", str(tmp_path / "nothing"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "error" in done.stderr


@pytest.fixture(scope="module")
def info_server(start_server, tiny_args):
    return start_server(tiny_args("--enable-tokenizer-info-endpoint", "--api-key", API_KEY))


def test_tokenizer_info_is_the_tokenizer_config(info_server, llama_path):
    from transformers import AutoTokenizer

    assert httpx.get(f"{info_server.url}/tokenizer_info").status_code == 401
    info = httpx.get(f"{info_server.url}/tokenizer_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["chat_template"] == tokenizer.chat_template
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == ("<s>", "</s>", "<pad>")
    assert {v["content"] for v in info["added_tokens_decoder"].values()} >= {"<s>", "</s>", "<pad>"}


def test_tokenizer_info_is_off_by_default(http):
    assert http.get("/tokenizer_info").status_code == 404
