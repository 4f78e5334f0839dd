"""From what the user typed (hub id, folder, file, nothing) to a local path."""

from __future__ import annotations

import os
from pathlib import Path

from tokenmill.errors import ModelNotFoundError

# What a model folder needs; weights in other formats are not fetched.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local folder or file as is; otherwise a Hugging Face Hub id.

    Hub downloads go through ``huggingface_hub.snapshot_download``, which
    honours ``HF_HUB_OFFLINE`` (then only the local cache is used) and
    ``HF_HOME``. A missing model is a :class:`ModelNotFoundError` either way.
    """
    local = Path(model).expanduser()
    if local.exists():
        return local
    if _looks_like_path(model):
        raise ModelNotFoundError(f"model path {model!r} does not exist")
    return _download(model, revision)


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or model.endswith(".gguf") or model.count("/") > 1 or os.sep + os.sep in model


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS))
    except (HFValidationError, RepositoryNotFoundError) as exc:
        raise ModelNotFoundError(f"model {repo_id!r} is neither a local path nor a Hub repository: {exc}") from exc
    except LocalEntryNotFoundError as exc:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local path and is not in the Hugging Face cache "
            f"(offline: HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}, or the Hub is unreachable)"
        ) from exc
    except OSError as exc:
        raise ModelNotFoundError(f"could not fetch model {repo_id!r}: {exc}") from exc
