#!/usr/bin/env python3
"""Batch-1 greedy decode on the random 100M model, prompts that repeat a random 32-token text
three times; output tok/s with and without speculation (argv[2]: a speculative_config as JSON)."""
import json
import sys
import time

import numpy as np

from tokenmill import LLM, SamplingParams

path, spec = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else None
rng = np.random.default_rng(0)
prompts = []
for _ in range(4):
    text = rng.integers(100, 30000, 32).tolist()
    prompts.append(text * 3)
llm = LLM(path, dtype="float32", max_model_len=1024, kv_cache_memory="256MiB", speculative_config=spec)
params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
llm.generate([{"prompt_token_ids": prompts[0]}], params)  # warm-up
tokens, seconds = 0, 0.0
outs = []
for p in prompts:
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": p}], params)[0]
    seconds += time.perf_counter() - start
    tokens += len(out.outputs[0].token_ids)
    outs.append(out.outputs[0].token_ids)
s = llm.engine.core.make_stats()
print(json.dumps({"spec": spec, "output_tok_s": tokens / seconds, "drafted": s.spec_decode_num_draft_tokens,
                  "accepted": s.spec_decode_num_accepted_tokens, "mean_accepted_length": s.spec_decode_mean_accepted_length,
                  "paused_requests": s.spec_decode_num_paused_requests, "paused_steps": s.spec_decode_num_paused_steps,
                  "first_tokens": outs[0][:12]}))
