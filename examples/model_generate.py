"""Serve a whole DeepSeek-V4 model over the paged backend and check it against transformers.

    python examples/model_generate.py
"""

import torch

from dsv4attn.serving.model import PagedDeepseekV4, reference_generate
from dsv4attn.serving.tiny import tiny_hf_model

hf = tiny_hf_model(seed=0)  # any transformers DeepseekV4ForCausalLM (eager attention)
model = PagedDeepseekV4(hf, kv_cache_dtype="auto", max_model_len=512, max_num_batched_tokens=256)
prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 130, 17)]
new = model.generate(prompts, max_new_tokens=8)  # greedy, continuous batching
assert new == reference_generate(hf, prompts, 8)

# The per-step API underneath: begin a step for {request: new tokens}, run every layer, end it.
logits = model.step({"a": prompts[0], "b": prompts[1][:64]})  # request -> logits of its last token
logits = model.step({"a": [int(logits["a"].argmax())], "b": prompts[1][64:]})
model.free("a")
model.free("b")
print("generated:", new)
