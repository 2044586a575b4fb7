"""What a check found: ``Check`` (one row), ``Report`` (the rows, printed as a table), and
the collector the checks add their rows to."""

from collections.abc import Sequence
from typing import NamedTuple, Optional

from .._runner.contracts import STAGES
from .._runner.routes import reference_is_exact


class Check(NamedTuple):
    """One row of a report: ``passed`` True, False, or None (skipped: ``detail`` says why)."""

    name: str
    case: str
    passed: Optional[bool]
    detail: str


class Report:
    """What ``check_stage`` / ``check_pipeline`` found: ``checks`` (one ``Check`` per
    check and case), ``ok``, ``failed``, ``names_failed``, ``not_compared``, ``cases``
    (case name -> what it gives the stages); ``str(report)`` is a table with a legend of
    the cases.

    ``ok`` means **no check failed**: every row passed or was skipped for the reason it
    gives. It is not a statement that the stage computes its family's formula unless its
    values were compared: a stage whose math is not KDA's (``math`` undeclared or named
    otherwise; a backward stage not transposing KDA's) has ``reference`` rows that say
    "not compared" (``not_compared``), and the header says so."""

    def __init__(self, subject: str, checks: Sequence[Check], cases: Optional[dict] = None):
        self.subject = subject
        self.checks = tuple(checks)
        self.cases = dict(cases or {})

    @property
    def ok(self) -> bool:
        """No check failed (skipped and "not compared" rows do not fail)."""
        return all(c.passed is not False for c in self.checks)

    @property
    def not_compared(self) -> tuple:
        """The rows saying a case's values were never compared with the reference."""
        return tuple(c for c in self.checks if c.passed is None and c.detail.startswith(NOT_COMPARED))

    @property
    def failed(self) -> tuple:
        return tuple(c for c in self.checks if c.passed is False)

    @property
    def names_failed(self) -> set:
        return {c.name for c in self.failed}

    def __str__(self) -> str:
        rows = [("check", "case", "result", "detail")]
        for c in self.checks:
            result = {True: "pass", False: "FAIL", None: "skip"}[c.passed]
            if c.passed is None and c.detail.startswith(NOT_COMPARED):
                result = "n/c"
            rows.append((c.name, c.case, result, c.detail))
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        n, s = len(self.checks), sum(c.passed is None for c in self.checks)
        nc = sum(c.passed is None and c.detail.startswith(NOT_COMPARED) for c in self.checks)
        head = (f"ok: no check failed ({n - s} passed, {s - nc} skipped" + (f", {nc} not compared" if nc else "") + ")"
                if self.ok else f"{len(self.failed)} FAILED of {n}")
        if self.not_compared:
            head += (f"; values NOT compared with the reference in {len(self.not_compared)} cases "
                     f"(rows 'n/c': the stage does not declare KDA's math)")
        lines = [f"{self.subject}: {head}"]
        lines += ["  ".join(r[i].ljust(w[i]) for i in range(3)) + "  " + r[3] for r in rows]
        if self.cases:
            lines.append("cases:")
            wc = max(len(k) for k in self.cases)
            lines += [f"  {k.ljust(wc)}  {v}" for k, v in self.cases.items()]
        return "\n".join(lines)

    __repr__ = __str__


# How a row saying a case's values were never compared with the reference begins.
NOT_COMPARED = "not compared"


class _Collector:
    """The rows of a report in the making; ``add`` returns ``passed``."""

    def __init__(self):
        self.rows: list = []

    def add(self, name, case, passed, detail=""):
        self.rows.append(Check(name, case, passed, detail))
        return passed


def _unsupported(col, check: str, case: str, field: str, stage, e: Exception):
    """The row of a check where ``stage`` (in ``field``) raised ``UnsupportedCase``: a
    skip where a pipeline with ``fallback`` runs the reference stage instead (a stage of
    KDA's math), a failure where no pipeline does and ``chunk_kda`` raises (other math:
    the reference stage computes something else)."""

    ref = STAGES[field].reference.__qualname__
    if reference_is_exact(field, stage):
        return col.add(check, case, None, f"UnsupportedCase ({e}): a pipeline with fallback=True (pallas(), "
                                          f"mixed()) runs {ref} here; with fallback=False chunk_kda raises")
    what = (f"math={getattr(stage, 'math', None)!r}" if STAGES[field].forward
            else f"transposes={dict(getattr(stage, 'transposes', {}))}")
    return col.add(check, case, False, f"raises UnsupportedCase ({e}) on arguments a pipeline gives it, and no "
                                       f"pipeline falls back for a stage of other math ({what}; {ref} computes "
                                       f"KDA's): chunk_kda raises here")


def _error(e: Exception) -> str:
    """An exception as one line of a report's detail column (at most 300 characters)."""
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) < 300 else text[:297] + "..."
