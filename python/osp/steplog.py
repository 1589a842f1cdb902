"""The per-step records behind ``DistributedOptimizer.stats()`` and ``last_step()``."""
from __future__ import annotations

from typing import List, Optional

_KEEP = 100000  # records kept; the oldest half goes beyond
MEANS = ("critical_fraction", "bytes_stage1", "bytes_stage2", "stage1_s", "stage2_wait_s", "replay_s",
         "compute_s", "step_s")


class StepLog:
    def __init__(self):
        self.history: List[dict] = []
        self.steps = 0
        self.skipped = 0

    def record(self, rec: dict) -> None:
        self.steps += 1
        self.skipped += int(rec.get("skipped", False))
        self.history.append(rec)
        if len(self.history) > _KEEP:
            del self.history[:_KEEP // 2]

    def last(self) -> Optional[dict]:
        return dict(self.history[-1]) if self.history else None

    def stats(self, mode: str) -> dict:
        hist = list(self.history)

        def mean(k):
            vals = [h[k] for h in hist if k in h]
            return sum(vals) / len(vals) if vals else 0.0
        return {"steps": self.steps, "skipped_steps": self.skipped, "mode": mode, "history": hist,
                "mean": {k: mean(k) for k in MEANS}}
