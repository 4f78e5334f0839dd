"""A checkpoint for the fault-injection model plugin (tests/plugins/tokenmill-fault-injection):
the tiny Llama's weights under the ``FaultInjectionForCausalLM`` architecture.

The poison ids lie in the model's vocabulary but past the tokenizer's (376 tokens),
so no text prompt holds them; the plugin masks them out of the logits, so no
request samples them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

RAISE_TOKEN = 380  # the forward raises: the engine dies
NAN_TOKEN = 381  # that position's logits are NaN: its request fails alone
SLEEP_TOKEN = 382  # the forward sleeps SLEEP_S: the loop stalls
SLEEP_S = 4.0


def build_fault_model(source: Path, folder: Path) -> Path:
    shutil.copytree(source, folder, dirs_exist_ok=True)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["FaultInjectionForCausalLM"]
    config["fault_injection"] = {"inner_architecture": "LlamaForCausalLM", "raise_token": RAISE_TOKEN,
                                 "nan_token": NAN_TOKEN, "sleep_token": SLEEP_TOKEN, "sleep_s": SLEEP_S}
    config_path.write_text(json.dumps(config, indent=2))
    return folder
