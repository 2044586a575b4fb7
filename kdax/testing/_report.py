"""What a check found: ``Check`` (one row), ``Report`` (the rows, printed as a table), and
the collector the checks add their rows to."""

from collections.abc import Sequence
from typing import NamedTuple, Optional


class Check(NamedTuple):
    """One row of a report: ``passed`` True, False, or None (skipped: ``detail`` says why)."""

    name: str
    case: str
    passed: Optional[bool]
    detail: str


class Report:
    """What ``check_stage`` / ``check_pipeline`` found: ``checks`` (one ``Check`` per
    check and case), ``ok`` (none failed), ``failed``, ``names_failed``; ``str(report)``
    is a table."""

    def __init__(self, subject: str, checks: Sequence[Check]):
        self.subject = subject
        self.checks = tuple(checks)

    @property
    def ok(self) -> bool:
        return all(c.passed is not False for c in self.checks)

    @property
    def failed(self) -> tuple:
        return tuple(c for c in self.checks if c.passed is False)

    @property
    def names_failed(self) -> set:
        return {c.name for c in self.failed}

    def __str__(self) -> str:
        rows = [("check", "case", "result", "detail")]
        for c in self.checks:
            rows.append((c.name, c.case, {True: "pass", False: "FAIL", None: "skip"}[c.passed], c.detail))
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"{self.subject}: {'ok' if self.ok else f'{len(self.failed)} FAILED'}"]
        lines += ["  ".join(r[i].ljust(w[i]) for i in range(3)) + "  " + r[3] for r in rows]
        return "\n".join(lines)

    __repr__ = __str__


class _Collector:
    """The rows of a report in the making; ``add`` returns ``passed``."""

    def __init__(self):
        self.rows: list = []

    def add(self, name, case, passed, detail=""):
        self.rows.append(Check(name, case, passed, detail))
        return passed


def _error(e: Exception) -> str:
    """An exception as one line of a report's detail column (at most 300 characters)."""
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) < 300 else text[:297] + "..."
