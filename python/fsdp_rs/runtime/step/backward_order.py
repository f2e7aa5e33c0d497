"""The order of the per-group backward events, the same on every rank.

[Note: Backward order]
A group's backward collectives (the all-gather that unshards it and the ones
it prefetches, at its pre-backward; its reduce-scatter, at its post-backward)
are triggered by autograd reaching the group's outputs and inputs: a local
observation. When a group's forward ran on every rank but its output reaches
the loss on some ranks only (an auxiliary head some ranks use, say), its
hooks never fire on the others. Left alone, those ranks would issue the next
group's collectives while the rest issue this group's: collectives paired
across groups, which gloo aborts on when sizes differ, NCCL hangs on or reads
garbage from, and which sum two groups' gradients when sizes agree.

fsdp-rs keeps every rank on one sequence instead. Each module call whose
outputs registered a pre-backward hook in forward is a slot; backward visits
the slots in the reverse order of those calls (the order autograd fires them
in: it runs the most recently created nodes first). When a group's
pre-backward fires, every slot before its own that did not fire is replayed
first: its pre-backward (unshard, prefetch), then, if its call registered a
post-backward, its post-backward, which reduces zeros for this rank ([Note:
Gradient agreement]). At the end of backward the slots
left are replayed the same way. So every rank issues the collectives a rank
whose hooks all fired issues, in the same order, and the group is reduced
with the contributions of the ranks that used it.

Limits: a slot's pre-backward is replayed when a later slot fires, so a group
whose output gradient arrives after that of a module that ran later in
forward (outside the reverse order) is unsharded again when it does fire, and
reduced a second time; on a rank where every hook fires this never happens,
because autograd fires them in slot order.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BackwardOrder"]


class BackwardOrder:
    """The slots of one backward: ``(state, has post-backward hook)`` per
    module call, in the order backward visits them, and how far it got."""

    def __init__(self, slots: list[tuple[Any, bool]]) -> None:
        self.slots = slots[::-1]
        self.cursor = 0
        # Per state, the indices of its slots, last first (so pop() gives the next).
        self._positions: dict[int, list[int]] = {}
        for k in range(len(self.slots) - 1, -1, -1):
            self._positions.setdefault(id(self.slots[k][0]), []).append(k)

    def skipped_before(self, state: Any) -> list[tuple[Any, bool]]:
        """The slots that did not fire before ``state``'s next one, to replay
        before its pre-backward runs; moves past it. None skipped (the common
        case) or ``state`` has no slot left: an empty list."""
        positions = self._positions.get(id(state))
        cursor = self.cursor
        while positions and positions[-1] < cursor:
            positions.pop()
        if not positions:
            return []
        k = positions.pop()
        self.cursor = k + 1
        return self.slots[cursor:k]

    def pending(self, state: Any) -> bool:
        """Whether ``state`` has slots backward has not reached yet: its module
        ran more than once in forward, and this is not its last visit."""
        positions = self._positions.get(id(state))
        return bool(positions) and positions[0] >= self.cursor  # [0]: its slot visited last

    def rest(self) -> list[tuple[Any, bool]]:
        """The slots that never fired, at the end of backward."""
        rest = self.slots[self.cursor :]
        self.cursor = len(self.slots)
        return rest
