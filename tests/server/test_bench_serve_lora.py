"""``tokenmill bench serve --lora NAME ...`` against ``tokenmill serve --enable-lora``: the
requests are spread over the named adapters (in ``model``), and an adapter the server does not
have fails every request sent to it."""

from __future__ import annotations

import json

from conftest import MODEL
from lora_models import build_adapter
from typer.testing import CliRunner

from tokenmill_cli.main import app


def _bench(tmp_path, url: str, tokenizer: str, *extra: str) -> dict:
    out = tmp_path / "serve.json"
    result = CliRunner().invoke(app, ["bench", "serve", "--base-url", url, "--model", tokenizer,
                                      "--served-model-name", MODEL, "--num-prompts", "6", "--random-input-len", "8",
                                      "--random-output-len", "5", "--ignore-eos", "--disable-tqdm", *extra,
                                      "--output-json", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_bench_serve_spreads_requests_over_adapters(start_server, tiny_args, llama_path, tmp_path_factory,
                                                    tmp_path):
    # small adapters (alpha 1): the tiny model's tokens must keep decoding to text, which is what
    # bench serve counts as output
    folders = {name: build_adapter(llama_path, tmp_path_factory.mktemp(name), seed=i, r=4, lora_alpha=1,
                                   target_modules=["q_proj", "v_proj"]) for i, name in enumerate(("one", "two"))}
    modules = [arg for name, folder in folders.items() for arg in ("--lora-modules", f"{name}={folder}")]
    server = start_server(tiny_args("--enable-lora", "--max-lora-rank", "8", *modules))
    r = _bench(tmp_path, server.url, str(llama_path), "--lora", "one", "--lora", "two")
    assert (r["completed"], r["failed"], r["lora_models"]) == (6, 0, ["one", "two"]), r.get("errors")
    assert r["total_output_tokens"] == 30
    missing = _bench(tmp_path, server.url, str(llama_path), "--lora", "one", "--lora", "absent")
    assert (missing["completed"], missing["failed"]) == (3, 3)  # every other request names the absent one
    assert all("absent" in error for error in missing["errors"]), missing["errors"]
