"""torchtitan's own trainer (``Trainer``, built from its ``llama3_debugmodel``
config) training a tiny Llama 3 for a few steps on CPU with gloo, once with
fsdp-rs in place of FSDP2 by the switch and once with torch's FSDP2, each in a
spawn of its own (``trainer_defaults``).

[Note: torchtitan on CPU]
torchtitan takes its device from ``torch._utils._get_available_device_type()``
when ``torchtitan.tools.utils`` is imported, and falls back to ``"cuda"``
where there is no accelerator. Here that function answers ``"cpu"`` for that
import only, so the trainer's device is the CPU (``torch.cpu`` its device
module). Its process group is the
test's gloo group (torchtitan skips ``init_process_group`` when one exists).
The config is torchtitan's debugmodel config with its defaults (FSDP over all
ranks, spmd_types parameters, selective activation checkpointing, AdamW
with warm-up, chunked cross-entropy, clipping at norm 1, the debugmodel's 6
layers of dim 256) except 3 steps of batch 2 by 32 tokens, a tokenizer and
text data written by the test (the debugmodel's are in torchtitan's
repository, not its wheel), validation and checkpoints off, and what a CPU
needs, each a test-side substitution that both runs share:

- torchtitan asks its device module for a name, a capacity, memory
  statistics and a device index, which ``torch.cpu`` lacks (``_CPUModule``);
- its Llama 3 attention is flex or varlen only (SDPA is refused), and
  FlexAttention has no backward on CPU in torch 2.15: ``flex_attention`` is
  replaced by SDPA over the same mask (``create_mask`` of its mask_mod), and
  its block masks are made eagerly, not compiled;
- torchtitan sets every FSDP module's gradient divide factor to 1 (it
  scales by the global token count), which makes FSDP2 reduce with
  ``ReduceOp.PREMUL_SUM``, which gloo lacks: the modules also get
  ``set_force_sum_reduction_for_comms(True)`` (a SUM, then the same factor).

torchtitan cannot run on CPU otherwise; with these, its trainer runs
unchanged: its config, parallelize_llama and apply_fsdp (torchtitan's own
``fully_shard`` calls, through the switch), its data loader, loss, optimizer
and clipping, its training loop."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import types
from pathlib import Path

import torch

from clients.client_common import fsdp_rs_switched, full_grads, full_state, sharded_by
from spawned import run_named

STEPS, BATCH, SEQ, VOCAB = 3, 2, 32, 256


class _CPUModule(types.ModuleType):
    """``torch.cpu`` with what torchtitan asks of a device module and
    ``torch.cpu`` lacks: a name, a capacity, no memory statistics (its memory
    monitor), a device index (``barrier(device_ids=...)``)."""

    def __init__(self) -> None:
        super().__init__("torch_cpu_for_torchtitan")
        own = vars(type(self))
        self.__dict__.update({k: v for k, v in vars(torch.cpu).items() if k not in own})

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_properties(device=None):
        return types.SimpleNamespace(
            total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        )

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


def _import_on_cpu() -> None:
    """torchtitan imported with the CPU as its device ([Note: torchtitan on CPU])."""
    import torch._utils

    assert "torchtitan" not in sys.modules
    available, device_module = (
        torch._utils._get_available_device_type,
        torch._utils._get_device_module,
    )
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type: _CPUModule()
    try:
        import torchtitan.tools.utils as utils
        import torchtitan.trainer  # noqa: F401
    finally:
        torch._utils._get_available_device_type = available
        torch._utils._get_device_module = device_module
    assert utils.device_type == "cpu", utils.device_type
    _eager_attention()
    _sum_reductions()


def _sum_reductions() -> None:
    """After torchtitan sets each FSDP module's gradient divide factor to 1
    (it scales by the global token count itself), reductions are a plain
    SUM: a factor makes FSDP2 reduce with ``ReduceOp.PREMUL_SUM``, which gloo
    lacks ([Note: torchtitan on CPU])."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import fsdp

    divide = fsdp.disable_fsdp_gradient_division

    def divide_then_sum(model) -> None:
        divide(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = divide_then_sum


def _eager_attention() -> None:
    """torchtitan's FlexAttention as eager SDPA over the same mask, and its
    block masks made eagerly ([Note: torchtitan on CPU])."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, create_mask
    from torchtitan.models.common import attention

    def flex_as_sdpa(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, **_):
        assert score_mod is None and not return_aux.lse, "the debugmodel uses neither"
        b, _, q_len, _ = q.shape
        mask = create_mask(block_mask.mask_mod, b, 1, q_len, k.shape[2], device=q.device)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
        return out, types.SimpleNamespace(lse=None)

    attention.FlexAttention.compiled_flex_attn = staticmethod(flex_as_sdpa)
    attention._compiled_create_block_mask = create_block_mask


def _assets(root: Path) -> tuple[str, str]:
    """A word-level tokenizer of ``VOCAB`` tokens and a text data set, the same
    on every rank: (tokenizer folder, data folder)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(VOCAB - 3)]
    vocab = {"<unk>": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2}
    vocab.update({w: i + 3 for i, w in enumerate(words)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok_dir, data_dir = root / "tokenizer", root / "data"
    tok_dir.mkdir()
    data_dir.mkdir()
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})
    )
    gen = torch.Generator().manual_seed(7)
    with open(data_dir / "train.json", "w") as f:
        for _ in range(64):
            ids = torch.randint(0, len(words), (48,), generator=gen).tolist()
            f.write(json.dumps({"text": " ".join(words[i] for i in ids)}) + "\n")
    return str(tok_dir), str(data_dir)


def _config(tok_dir: str, data_dir: str, dump: str):
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    spec = model_registry("debugmodel")
    config.model_spec = spec
    config.hf_assets_path = tok_dir
    config.dataloader.dataset_path = data_dir
    config.dump_folder = dump
    config.training.steps = STEPS
    config.training.local_batch_size = BATCH
    config.training.seq_len = SEQ
    config.validator.enable = False
    config.checkpoint.enable = False
    config.debug.seed = 0
    return config


def _train(rank: int, assets: tuple[str, str], dump: str) -> dict:
    from torchtitan.trainer import Trainer

    config = _config(*assets, dump)
    trainer: Trainer = config.build()
    record: dict = {"losses": [], "norms": [], "grads": []}
    log = trainer.metrics_processor.log

    def logged(step, global_avg_loss, global_max_loss, grad_norm, **kwargs):
        record["losses"].append(
            torch.tensor([global_avg_loss, global_max_loss], dtype=torch.float64)
        )
        record["norms"].append(torch.tensor(grad_norm, dtype=torch.float64))
        return log(step, global_avg_loss, global_max_loss, grad_norm, **kwargs)

    trainer.metrics_processor.log = logged
    step = trainer.optimizers.step

    def stepped(*args, **kwargs):
        record["grads"].append(
            {k: v for m in trainer.model_parts for k, v in full_grads(m).items()}
        )
        return step(*args, **kwargs)

    trainer.optimizers.step = stepped
    trainer.train()
    (model,) = trainer.model_parts
    record["state"] = full_state(model)
    out = {"record": record, "sharded_by": sharded_by(model)}
    trainer.close()
    return out


def trainer_defaults(world_size: int, rank: int, lib: str) -> dict:
    """One library's run (``lib``: ``rs`` or ``torch``); its record goes to
    ``$FSDP_RS_CLIENT_RECORDS/{lib}{rank}.pt``, compared by the test: the two
    runs take two spawns, as torchtitan's trainer is built once per process
    (a second one in the same process finds the first one's meshes on the
    parameters its spmd_types annotations create)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    root = Path(tempfile.mkdtemp(prefix=f"titan{rank}_"))
    # the data set's cache; nothing from the network (CI reaches none)
    os.environ.update(HF_HOME=str(root / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    assets = _assets(root)
    if lib == "rs":
        fsdp_rs_switched()
    _import_on_cpu()
    out = _train(rank, assets, str(root / "run"))
    torch.save(out["record"], Path(os.environ["FSDP_RS_CLIENT_RECORDS"], f"{lib}{rank}.pt"))
    return {"sharded_by": out["sharded_by"]}


SCENARIOS = {
    "trainer_rs": (trainer_defaults, {"lib": "rs"}),
    "trainer_torch": (trainer_defaults, {"lib": "torch"}),
}


def run(world_size: int, rank: int, name: str) -> dict:
    return run_named(SCENARIOS, world_size, rank, name)
