"""Work split over the ranks of a launch, with no rank parked in a collective while another works.

Rank-0-only work inside a barrier (`main_process_first`, a final `wait_for_everyone`) makes the
other ranks wait as long as that work takes, and a process group fails a collective after its
timeout (`dist_timeout_minutes`). So long data work is split: every rank answers or caches its
share of the same batches one process would form (so the result is identical to one process), and
the barriers between phases only wait for ranks that are doing equal work at the same time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


@dataclass
class Shard:
    rank: int = 0
    world: int = 1
    barrier: Callable[[], None] = field(default=lambda: None, repr=False)
    """Wait for every rank (accelerate's wait_for_everyone); only between phases of equal work."""

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mine(self, items: list) -> list:
        """This rank's items: every world-th one, starting at its rank (batches keep their contents)."""
        return items[self.rank :: self.world]

    def wait_for(self, path: Path, poll_s: float = 2.0) -> None:
        """Wait for `path` to appear, written by the main rank alone (e.g. answers from one vLLM server).
        A file, not a collective: no process-group timeout; a launcher stops every rank if rank 0 fails."""
        while not Path(path).exists():
            time.sleep(poll_s)
