"""Check results shared by the validators: a table for people, JSON for machines."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

Outcome = Literal["pass", "fail", "skip"]
# What a failing check raises (besides what a validator adds): a failed row, not a crash.
CHECK_ERRORS: tuple[type[BaseException], ...] = (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError)


@dataclass
class Check:
    name: str
    model: str
    outcome: Outcome
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    validator: str
    base_url: str
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, model: str, ok: bool, detail: str = "", **data: Any) -> Check:
        check = Check(name, model, "pass" if ok else "fail", detail, data)
        self.checks.append(check)
        return check

    def run(self, name: str, model: str, check: Callable[[], str],
            errors: tuple[type[BaseException], ...] = ()) -> Check:
        """Run one check: its return value is the detail; an assertion or an expected
        error (``CHECK_ERRORS`` + ``errors``) becomes a failed row."""
        try:
            detail = check()
        except AssertionError as exc:
            return self.add(name, model, False, str(exc))
        except CHECK_ERRORS + errors as exc:
            return self.add(name, model, False, f"{type(exc).__name__}: {exc}"[:300])
        return self.add(name, model, True, detail)

    def skip(self, name: str, model: str, detail: str) -> None:
        self.checks.append(Check(name, model, "skip", detail))

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.outcome == "fail"]

    def to_json(self) -> str:
        summary = {o: sum(c.outcome == o for c in self.checks) for o in ("pass", "fail", "skip")}
        return json.dumps(
            {
                "validator": self.validator,
                "base_url": self.base_url,
                "ok": not self.failed,
                "summary": summary,
                "checks": [asdict(c) for c in self.checks],
            },
            indent=2,
        )

    def to_table(self) -> str:
        rows = [("RESULT", "CHECK", "MODEL", "DETAIL")]
        rows += [(c.outcome.upper(), c.name, c.model, c.detail) for c in self.checks]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
        passed = sum(c.outcome == "pass" for c in self.checks)
        lines.append(f"{self.validator}: {passed} passed, {len(self.failed)} failed, "
                     f"{sum(c.outcome == 'skip' for c in self.checks)} skipped")
        return "\n".join(lines)
