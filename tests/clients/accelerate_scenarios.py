"""Hugging Face accelerate's FSDP2 plugin preparing a PEFT LoRA model (a tiny
Llama of transformers) and training it with gradient accumulation, on CPU with
gloo: first with fsdp-rs in place of FSDP2 by the switch, then with torch's
FSDP2 ([Note: Both libraries in one rank] in ``client_common.py``).

accelerate selects FSDP only on accelerators: on CPU its distributed type is
set by hand, as a CPU user would (the rest is accelerate's own path:
``prepare`` shards the decoder layers, the embedding, the ``[norm, lm_head]``
tail and the root with its ``fully_shard``; ``accumulate`` skips the
gradient sync of the non-final micro-steps; ``clip_grad_norm_`` and
``get_state_dict`` are its FSDP2 ones)."""

from __future__ import annotations

import os

import torch

from clients.client_common import (
    fsdp_rs_switched,
    full,
    full_grads,
    full_state,
    sharded_by,
    summary,
    torch_fsdp2_back,
)
from spawned import run_named

ACCUM, STEPS = 2, 2  # micro-steps per optimizer step, optimizer steps
VOCAB, SEQ, BATCH = 128, 16, 2


def _train(rank: int) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    AcceleratorState._reset_state(reset_partial_state=True)  # each run its own Accelerator
    GradientState._reset_state()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT",
    )
    acc = Accelerator(fsdp_plugin=plugin, gradient_accumulation_steps=ACCUM, cpu=True)
    # accelerate picks FSDP for accelerator types only: on CPU it is set by hand.
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(LlamaForCausalLM(config), lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = acc.prepare(model, opt)
    record: dict = {"losses": [], "norms": [], "grads": []}
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS * ACCUM):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        with acc.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            if acc.sync_gradients:
                record["grads"].append(full_grads(model))
                record["norms"].append(full(acc.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            opt.zero_grad()
        record["losses"].append(loss.detach())
    record["state"] = full_state(model)
    record["accelerate_state"] = acc.get_state_dict(model)  # full on rank 0, {} elsewhere
    acc.wait_for_everyone()
    return {"record": record, "sharded_by": sharded_by(model)}


def lora_accumulation(world_size: int, rank: int) -> dict:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing from the network (CI reaches none)
    fsdp_rs_switched()
    rs = _train(rank)
    torch_fsdp2_back()
    ref = _train(rank)
    return summary(rs, ref)


SCENARIOS = {"lora_accumulation": (lora_accumulation, {})}


def run(world_size: int, rank: int, name: str) -> dict:
    return run_named(SCENARIOS, world_size, rank, name)
