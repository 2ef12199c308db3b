"""When a strategy's workers meet (MLX-free): its sync schedule, the one place the sync rule
`(step - offset) % H == 0` is written. A strategy gives its schedule (`Strategy.schedule`); the
fragments, pacing, the membership timeline and the launcher ask it."""

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncSchedule:
    every: int = 0          # H: inner steps between a fragment's syncs (0: no periodic sync)
    offsets: tuple = (0,)   # the steps mod H at which the model's fragments sync (one: 0)
    delay: int = 0          # steps an exchange takes to land after it starts (overlapped exchanges)

    def syncs(self, step: int, offset: int = None) -> bool:
        """Whether the fragment at `offset` (default: any fragment) syncs at `step`."""
        offsets = self.offsets if offset is None else (offset,)
        return bool(self.every) and any((step - o) % self.every == 0 for o in offsets)

    def exchanges_at(self, step: int) -> bool:
        """Whether an exchange starts or lands at `step` (every step, without a periodic sync)."""
        return not self.every or any(self.syncs(step - lag) for lag in (0, self.delay))

    def last_sync(self, offset: int, step: int) -> int:
        """The last step before `step` at which the fragment at `offset` synced (0: the start)."""
        last = step - 1 - (step - 1 - offset) % self.every
        return last if last >= 1 else 0

    def next_sync(self, step: int) -> int:
        """The first step >= `step` at which a fragment syncs."""
        return min(step + (o - step) % self.every for o in self.offsets)

    def round_length(self, offset: int, step: int) -> int:
        """Inner steps since the fragment at `offset` last synced (or since the start), as of `step`."""
        return (step - offset - 1) % self.every + 1 if step > offset else step
