"""Hugging Face accelerate's FSDP2 plugin on a small Llama, on CPU with gloo
(``torchrun --nproc_per_node 2``); ``FSDP_IMPL=fsdprs`` puts fsdp-rs in place
of FSDP2's public names first. See README.md in this directory."""

from __future__ import annotations

import hashlib
import json
import os

import torch


def substitute() -> None:
    """fsdp-rs in place of FSDP2's public names, by the supported switch
    (``FSDP_RS=1`` in the environment does the same without this call)."""
    import fsdp_rs

    fsdp_rs.patch_fsdp2()


def main() -> None:
    if os.environ.get("FSDP_IMPL") == "fsdprs":
        substitute()
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    mp = os.environ.get("MP", "no")
    accum = int(os.environ.get("ACCUM", "1"))
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT",
        activation_checkpointing=os.environ.get("AC", "0") == "1",
    )
    compile_kwargs = {}
    if os.environ.get("COMPILE"):  # a backend: accelerate compiles each decoder layer
        from accelerate.utils import TorchDynamoPlugin

        compile_kwargs["dynamo_plugin"] = TorchDynamoPlugin(
            backend=os.environ["COMPILE"], use_regional_compilation=True
        )
    acc = Accelerator(
        fsdp_plugin=plugin,
        mixed_precision=mp,
        gradient_accumulation_steps=accum,
        cpu=True,
        **compile_kwargs,
    )
    # accelerate picks FSDP for accelerator types only: on CPU it is set by hand.
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    if mp != "no":
        plugin.set_mixed_precision(mp)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=os.environ.get("TIE", "0") == "1",
    )
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model, opt = acc.prepare(model, opt)
    fsdp_classes = [c.__module__ for c in type(model).__mro__ if "fsdp" in c.__module__]
    out = {"impl": os.environ.get("FSDP_IMPL", "torch"), "fsdp_class": fsdp_classes}
    out["losses"], out["norms"] = [], []
    gen = torch.Generator().manual_seed(100 + acc.process_index)
    for _ in range(4 * accum):
        ids = torch.randint(0, 256, (2, 32), generator=gen)
        with acc.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            if acc.sync_gradients:
                out["norms"].append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            opt.zero_grad()
        out["losses"].append(loss.item())
    state = model.state_dict()
    digest = hashlib.sha256()
    for key in sorted(state):
        value = state[key]
        full = value.full_tensor() if isinstance(value, DTensor) else value  # every rank
        digest.update(key.encode())
        digest.update(full.float().numpy().tobytes())
    out["state_hash"] = digest.hexdigest()
    if acc.is_main_process:
        with open(os.environ["OUT_JSON"], "w") as f:
            json.dump(out, f)
    acc.wait_for_everyone()


if __name__ == "__main__":
    main()
