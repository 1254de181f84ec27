"""Pipeline stages. Each stage is one module with one job and exposes:

    available(device: torch.device) -> tuple[bool, str]     # can it run here; if not, why
    apply(model, **options) -> StageResult                   # do the work in place, report what was done
    revert(model) -> None                                    # undo (where the stage patches modules)

A stage never reports success for work it did not do: `detail` carries measured facts (layers converted, ms, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Status = Literal["applied", "skipped", "fallback"]


@dataclass
class StageResult:
    name: str
    status: Status
    detail: str
    data: dict = field(default_factory=dict)

    @classmethod
    def skipped(cls, name: str, why: str, **data) -> "StageResult":
        return cls(name, "skipped", why, dict(data))

    def line(self) -> str:
        mark = {"applied": "✓", "skipped": "–", "fallback": "↩"}[self.status]
        return f"{mark} {self.name}: {self.status if self.status != 'applied' else ''}{' — ' if self.status != 'applied' else ''}{self.detail}"
