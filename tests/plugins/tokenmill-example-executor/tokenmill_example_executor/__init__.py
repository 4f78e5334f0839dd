"""Registers two executors (no torch at import time):

- ``recording``: the in-process executor, keeping the name of every call it forwards;
- ``in-process-ranks``: two ranks in this process, each worker built only from a
  pickled copy of its spec, as a worker process would be (rank 1 gets half the KV
  memory, as a device with less free memory would).
"""

from tokenmill.plugin_api import hookimpl

TOKENMILL_PLUGIN_API = 1


@hookimpl
def tokenmill_register_executors() -> dict[str, str]:
    return {
        "recording": "tokenmill_example_executor.executors:RecordingExecutor",
        "in-process-ranks": "tokenmill_example_executor.executors:InProcessRanksExecutor",
    }
