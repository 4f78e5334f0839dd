"""Tiny PEFT LoRA adapters for the tiny Llama, and transformers + peft as their reference.

Each adapter is made with peft itself (``get_peft_model`` -> ``save_pretrained``), so the
folder is exactly what a fine-tune leaves: ``adapter_config.json`` and
``adapter_model.safetensors``. PEFT starts B at zero (an adapter that changes nothing); the
weights are redrawn so that every adapter moves the greedy output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# name -> LoraConfig arguments: different ranks and targets, one on the MLP too, one rsLoRA
ADAPTERS: dict[str, dict[str, Any]] = {
    "attn-r4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "all-r8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"]},
    "mlp-rs16": {"r": 16, "lora_alpha": 4, "use_rslora": True, "target_modules": ["o_proj", "gate_proj", "down_proj"]},
}


def build_adapter(base: Path, folder: Path, seed: int = 0, **lora_args: Any) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **lora_args))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.25)
    peft_model.save_pretrained(folder)
    return folder


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]],
                max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and chosen-token logprobs of the base model with ``adapter`` (None: the base alone)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    model.generation_config.eos_token_id = None
    results = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                return_dict_in_generate=True, pad_token_id=2,
            )
            tokens = out.sequences[0, len(prompt):].tolist()
            logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                        for step, t in zip(out.logits, tokens, strict=True)]
            results.append((tokens, logprobs))
    return results


def build_adapter_for_other_base(folder: Path, **lora_args: Any) -> Path:
    """An adapter trained on another (narrower) Llama: its shapes fit no layer of the tiny one."""
    import torch
    from peft import LoraConfig, get_peft_model
    from tiny_models import COMMON
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    other = LlamaForCausalLM(LlamaConfig(**{**COMMON, "hidden_size": 32, "intermediate_size": 48}))
    get_peft_model(other, LoraConfig(task_type="CAUSAL_LM", **lora_args)).save_pretrained(folder)
    return folder
