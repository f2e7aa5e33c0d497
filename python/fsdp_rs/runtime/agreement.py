"""Which parameters got a gradient on some rank: one flag all-reduce per
backward ([Note: Gradient agreement] in gradients.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fsdp_rs.runtime.streams import CommStreams

__all__ = ["GradientAgreement"]


class GradientAgreement:
    """One per root. Groups note their local had-gradient mask when their
    reduction is assigned; ``resolve`` at the end of backward agrees on them.

    The flags of one mesh are the masks of its groups in the order they were
    noted, which is the reduce-scatter order, the same on every rank ([Note:
    Backward order]); so the all-reduce has the same size and meaning on all."""

    def __init__(self, streams: CommStreams) -> None:
        self.streams = streams
        # (shard group, replicate group) -> [(group, had, post-reduce stream)]
        self._noted: dict[tuple[Any, Any], list[tuple[Any, list[bool], Any]]] = {}

    def note(self, group: Any, had_grad: list[bool], stream: Any) -> None:
        info = group.info
        key = (
            info.shard_group if info.shard_size > 1 else None,
            info.replicate_group if info.replicate_size > 1 else None,
        )
        self._noted.setdefault(key, []).append((group, had_grad, stream))

    def discard(self) -> None:
        """Forget the reductions noted in a backward that did not finish."""
        self._noted = {}

    def resolve(self) -> None:
        """The all-reduces (every rank, every mesh that reduced), then the
        missing ``.grad``s where this rank lacked some gradient."""
        noted, self._noted = self._noted, {}
        for (shard_group, replicate_group), entries in noted.items():
            missing = [not all(had) for _, had, _ in entries]
            if shard_group is None and replicate_group is None:
                for group, _, _ in entries:
                    group._unagreed = None  # no other rank: local is agreed
                continue
            flags = torch.ones(sum(len(had) for _, had, _ in entries), dtype=torch.uint8)
            if any(missing):
                offset = 0
                for (_, had, _), m in zip(entries, missing, strict=True):
                    if m:
                        flags[offset : offset + len(had)] = torch.tensor(had, dtype=torch.uint8)
                    offset += len(had)
            flags = flags.to(entries[0][0].device)
            for pg in (shard_group, replicate_group):
                if pg is not None:
                    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=pg)
            if not any(missing):
                continue  # had every gradient: knows the answer, reads nothing
            agreed = flags.bool().tolist()
            offset = 0
            for (group, had, stream), m in zip(entries, missing, strict=True):
                n = len(had)
                if m:
                    with self.streams.on(stream):
                        group.assign_agreed(had, agreed[offset : offset + n])
                        self.streams.note_post_reduce(stream, self.streams.record(stream))
                offset += n
