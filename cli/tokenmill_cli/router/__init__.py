"""``tokenmill router``: an OpenAI-compatible front for disaggregated prefill and decode.

Each request goes to a prefill server (``max_tokens`` 1: it computes the prompt and its KV
connector offers the KV), then to a decode server, which loads that KV instead of computing the
prompt and generates; the decode server's answer (streamed or not) is the client's.
"""
