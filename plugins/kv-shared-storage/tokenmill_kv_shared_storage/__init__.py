"""The ``kv_shared_storage`` KV connector: KV blocks in a folder, one file per block.

``kv_transfer_config={"kv_connector": "kv_shared_storage", "kv_role": ...,
"kv_connector_extra_config": {"shared_storage_path": FOLDER}}``. A producer writes every
full block it computes as ``FOLDER/<block hash>.kvb``; a consumer loads the blocks of a
prompt's prefix it finds there instead of computing them. The prefix-cache hashes chain every
earlier token (and the LoRA adapter, multimodal content and cache salt), so a file stands for
exactly one prefix. One folder serves one model: a block of another layout or dtype is refused
when read, and every payload carries a checksum, so a corrupt or truncated one is detected and
its request's prompt computed instead.
"""

from __future__ import annotations

from tokenmill.plugin_api import KVConnectorSpec, hookimpl

TOKENMILL_PLUGIN_API = 1


@hookimpl
def tokenmill_register_kv_connectors() -> list[KVConnectorSpec]:
    return [KVConnectorSpec(
        name="kv_shared_storage",
        scheduler_qualname="tokenmill_kv_shared_storage.scheduler:SharedStorageScheduler",
        worker_qualname="tokenmill_kv_shared_storage.worker:SharedStorageWorker",
        tensor_parallel=True,  # each rank writes and reads its own file of a block (its KV heads)
    )]
