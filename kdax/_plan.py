"""``KDAPipeline.plan``'s answer: which implementation runs each stage, why it differs,
the layout, the tiles and the resolved configuration."""

from typing import NamedTuple, Optional


class PlanRow(NamedTuple):
    """One stage of a ``KDAPlan``: the field, its step (F1..B5), the implementation in the
    pipeline, the one that runs (None: the stage does not run) and why it differs."""

    field: str
    step: str
    requested: str
    runs: Optional[str]
    reason: Optional[str]


class KDAPlan(NamedTuple):
    """What ``KDAPipeline.plan`` found. ``rows``: one ``PlanRow`` per stage; ``tile``: the
    forward's tile size when ``chunk_kda`` runs without gradients (None: whole);
    ``not_tile_safe``: the forward stages that keep the forward whole; ``layout``: how the
    tokens sit in chunks: "dense" (one sequence per row), "per-sequence" (packed varlen,
    each sequence from a chunk boundary) or "shared" (packed varlen, sequences sharing
    chunks: ``KDAPipeline.share_chunks``)."""

    rows: tuple
    tile: Optional[int]
    not_tile_safe: tuple
    layout: Optional[str] = None
    notes: tuple = ()
    # KDAPipeline.resolved_config: every platform-dependent choice, resolved
    config: Optional[dict] = None

    @property
    def fallbacks(self) -> dict:
        """Stage field -> reason, for every stage that falls back."""
        return {r.field: r.reason for r in self.rows if r.runs is not None and r.reason}

    def __str__(self) -> str:
        head = f"{'step':<5}{'field':<11}{'implementation':<24}{'runs':<24}note"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            runs = "-" if r.runs is None else ("same" if r.runs == r.requested and not r.reason else r.runs)
            lines.append(f"{r.step:<5}{r.field:<11}{r.requested:<24}{runs:<24}{r.reason or ''}")
        if self.not_tile_safe:
            lines.append(f"forward: whole (not tile-safe: {', '.join(self.not_tile_safe)})")
        else:
            lines.append("forward: " + ("whole" if self.tile is None else f"tiles of ~{self.tile} blocks without gradients, whole under one"))
        if self.layout is not None:
            what = {"dense": "one sequence per row", "per-sequence": "each packed sequence from a chunk boundary",
                    "shared": "packed sequences share chunks, NC = ceil(T / C)"}[self.layout]
            lines.append(f"layout: {self.layout}: {what}")
        lines += list(self.notes)
        if self.config:
            top = {n: v for n, v in self.config.items() if not isinstance(v, dict)}
            lines.append("config: " + ", ".join(f"{n}={v}" for n, v in top.items()))
            for n, v in self.config.items():
                if isinstance(v, dict):
                    lines.append(f"  {n}: " + ", ".join(f"{a}={b}" for a, b in v.items()))
        return "\n".join(lines)
