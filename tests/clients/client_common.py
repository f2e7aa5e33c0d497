"""What the client tests share: each runs a real client's own code path twice
on spawned gloo ranks, with fsdp-rs in place of FSDP2 and with torch's FSDP2,
and compares the two runs bit for bit on each rank (torchtitan's in two
spawns, the others in one).

Spawned ranks import this folder as the namespace package ``clients``
(``tests/`` is on their path, ``tests/clients/`` may not be: the forkserver of
``spawned.py`` keeps the path it started with).

[Note: Both libraries in one rank]
Importing a client (transformers, torchtitan) costs seconds per rank, so both
runs share one spawn. The fsdp-rs run comes first, as in a user's program:
``fsdp_rs.patch_fsdp2()`` (the supported switch) before the client is
imported or shards anything. ``torch_fsdp2_back()`` then undoes it for the
torch run: torch's names back in ``torch.distributed.fsdp`` and wherever a
module picked fsdp-rs's up (a client that imports ``fully_shard`` at its
own import). Each run records which library sharded its modules
(``sharded_by``), so a run that silently fell back to the other library
fails the test instead of comparing a library with itself."""

from __future__ import annotations

import sys

import torch
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor

import fsdp_rs
from fsdp_rs import switch
from spawned import each_rank

assert not switch.patched(), "import client_common before switching: it keeps torch's names"
_TORCH_NAMES = {
    name: getattr(sys.modules["torch.distributed.fsdp"], name)
    for name in switch.NAMES
    if hasattr(sys.modules["torch.distributed.fsdp"], name)
}


def fsdp_rs_switched() -> None:
    """The supported switch, on this rank, checked."""
    fsdp_rs.patch_fsdp2()
    assert switch.patched(), "patch_fsdp2() did not switch"


def torch_fsdp2_back() -> None:
    """Undo the switch for the torch run ([Note: Both libraries in one rank]):
    every module outside fsdp-rs holding one of fsdp-rs's switched names gets
    torch's back."""
    ours = {id(getattr(fsdp_rs, name)): name for name in _TORCH_NAMES}
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.split(".")[0] == "fsdp_rs":
            continue
        for attr, value in list(vars(module).items()):
            name = ours.get(id(value))
            if name is not None and value is getattr(fsdp_rs, name):
                setattr(module, attr, _TORCH_NAMES[name])
    assert not switch.patched()


def sharded_by(model: torch.nn.Module) -> dict[str, int]:
    """How many of ``model``'s modules each library sharded: an fsdp-rs module
    is also torch's ``FSDPModule`` ([Note: An FSDPModule to torch])."""
    counts = {"fsdp_rs": 0, "torch": 0}
    for module in model.modules():
        if isinstance(module, fsdp_rs.FSDPModule):
            counts["fsdp_rs"] += 1
        elif isinstance(module, TorchFSDPModule):
            counts["torch"] += 1
    return counts


def full(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a DTensor)."""
    value = value.detach()
    return (value.full_tensor() if isinstance(value, DTensor) else value).clone()


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every DTensor gathered whole."""
    state = model.state_dict()
    return {key: full(state[key]) for key in sorted(state)}


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's whole gradient (those that have one)."""
    return {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def compare(rs: dict, ref: dict, prefix: str = "") -> dict[str, bool]:
    """``torch.equal`` of each tensor of two runs' records (nested dicts and
    lists of tensors, keyed alike): ``{path: equal}``; a missing entry is
    unequal."""
    out: dict[str, bool] = {}
    if isinstance(ref, dict) or isinstance(rs, dict):
        if not (isinstance(ref, dict) and isinstance(rs, dict)):
            return {prefix: False}
        for key in sorted(set(rs) | set(ref)):
            if key not in rs or key not in ref:
                out[f"{prefix}{key}"] = False
            else:
                out.update(compare(rs[key], ref[key], f"{prefix}{key}."))
        return out
    if isinstance(ref, list | tuple):
        if not isinstance(rs, list | tuple) or len(rs) != len(ref):
            return {prefix.rstrip("."): False}
        for i, (a, b) in enumerate(zip(rs, ref, strict=True)):
            out.update(compare(a, b, f"{prefix}{i}."))
        return out
    a, b = torch.as_tensor(rs), torch.as_tensor(ref)
    return {prefix.rstrip("."): a.dtype == b.dtype and torch.equal(a, b)}


def floats(values: list) -> list:
    return [torch.as_tensor(v).tolist() for v in values]


def summary(rs: dict, ref: dict) -> dict:
    """A rank's result for the test: which records differ, which library
    sharded each run's modules, and each run's losses to show."""
    equal = compare(rs["record"], ref["record"])
    return {
        "differ": sorted(k for k, same in equal.items() if not same),
        "compared": len(equal),
        "sharded_by": {"rs": rs["sharded_by"], "torch": ref["sharded_by"]},
        "losses": {"rs": floats(rs["record"]["losses"]), "torch": floats(ref["record"]["losses"])},
    }


def check(scenarios: dict, results: tuple, name: str) -> None:
    """The test's assertions on each rank's ``summary`` of scenario ``name``."""
    for rank, result in each_rank(scenarios, results, name):
        check_summary(rank, result)


def check_summary(rank: int, result: dict) -> None:
    """Each run sharded by the library it should have been, alone and as many
    modules in both, and every record bit for bit."""
    by = result["sharded_by"]
    assert by["rs"]["fsdp_rs"] > 0 and by["rs"]["torch"] == 0, (
        f"rank {rank}: the fsdp-rs run was not sharded by fsdp-rs alone: {by['rs']}"
    )
    assert by["torch"]["fsdp_rs"] == 0 and by["torch"]["torch"] > 0, (
        f"rank {rank}: the torch run was not sharded by torch's FSDP2 alone: {by['torch']}"
    )
    assert by["rs"]["fsdp_rs"] == by["torch"]["torch"], (rank, by)
    assert result["compared"] > 0, rank
    assert not result["differ"], (
        f"rank {rank}: fsdp-rs differs from FSDP2 in {result['differ']} (losses {result['losses']})"
    )
