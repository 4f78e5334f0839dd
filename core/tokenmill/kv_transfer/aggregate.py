"""One step's :class:`KVConnectorOutput` from every worker rank, as one: what the scheduler sees.

Under tensor parallelism each rank loads and sends its own slice of a request's KV (its heads),
on its own schedule. A load is done only once every rank said so (the scheduler must not hand
the blocks to the forward, or free them, while a rank still writes into them), and failed if
any rank failed (a prompt with one slice missing is computed again); kept blocks may be freed
only once every rank has sent its slice.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from tokenmill.kv_transfer.connector import KVConnectorOutput


class KVOutputAggregator:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._received: Counter[str] = Counter()  # request -> ranks that finished (or failed) its load
        self._failed: set[str] = set()  # a rank failed the load
        self._sent: Counter[str] = Counter()  # request -> ranks that sent its kept blocks

    def merge(self, outputs: Sequence[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        """The requests every rank has now reported, once each; None when there is nothing to say."""
        merged = KVConnectorOutput()
        for output in outputs:
            if output is None:
                continue
            self._failed |= output.failed_recving
            self._received.update(output.finished_recving | output.failed_recving)
            self._sent.update(output.finished_sending)
        for req_id in [r for r, n in self._received.items() if n >= self.world_size]:
            del self._received[req_id]
            if req_id in self._failed:
                self._failed.discard(req_id)
                merged.failed_recving.add(req_id)
            else:
                merged.finished_recving.add(req_id)
        for req_id in [r for r, n in self._sent.items() if n >= self.world_size]:
            del self._sent[req_id]
            merged.finished_sending.add(req_id)
        return None if merged.is_empty and all(o is None for o in outputs) else merged
