"""The printed tables: one shape's (or a sweep's) paths, and the stages alone."""

_STAGE_COLS = (f"{'stage':<10} {'pipeline':<10} {'implementation':<24} {'time ms':>9} {'/first':>7} {'GFLOP':>8} "
               f"{'GFLOP/s':>8} {'%mm':>5} {'MB':>8} {'GB/s':>6}")
STAGE_HEAD = _STAGE_COLS + "\n" + "-" * len(_STAGE_COLS)


def format_stage_row(r: dict, first: dict, matmul_gflops: float = None) -> str:
    """One line of the stage table; ``first`` maps stage -> the first pipeline's time.
    FLOPs: the FLOP model's (``model_flops``, as the main table's) where the stage is matmul
    work, else XLA's count for the stage's program; bytes: XLA's count (both of XLA's count a
    loop's body once); ``%mm`` the FLOP rate against a large float32 matmul measured in the
    same run (``matmul_gflops``)."""
    if r["time_s"] is None:
        return f"{r['stage']:<10} {r['pipeline']:<10} {r['impl']:<24} FAILED: {r['error'][:110]}"
    base = first.setdefault(r["stage"], r["time_s"])
    line = f"{r['stage']:<10} {r['pipeline']:<10} {r['impl']:<24} {1e3 * r['time_s']:>9.2f} {r['time_s'] / base:>7.2f}"
    fl, by, t = r.get("model_flops") or r.get("flops"), r.get("bytes"), r["time_s"]
    if fl is None or t <= 0:
        return line
    rate = fl / t / 1e9
    mm = f"{100 * rate / matmul_gflops:>5.0f}" if matmul_gflops else f"{'':>5}"
    return line + f" {fl / 1e9:>8.3f} {rate:>8.1f} {mm} {by / 1e6:>8.1f} {by / t / 1e9:>6.1f}"


def format_stage_table(rows: list) -> str:
    first = {}
    return "\n".join([STAGE_HEAD] + [format_stage_row(r, first) for r in rows])


def with_ratios(rows: list) -> list:
    """``rows`` with ``vs_<baseline>`` (time) and ``mem_vs_<baseline>`` (peak memory)
    ratios against the scan, autodiff and plain-scan rows of the same T and pass."""
    by = {(r["T"], r["name"], r["kind"]): r for r in rows}
    for r in rows:
        for base, kind in (("scan", r["kind"]), ("autodiff_chunk", "fwd+bwd"), ("plain_scan", r["kind"])):
            b = by.get((r["T"], base, kind))
            if b is not None and r["kind"] == kind and r["name"] != base:
                r[f"vs_{base}"] = r["time_s"] / b["time_s"]
                if r["peak_bytes"] and b["peak_bytes"]:
                    r[f"mem_vs_{base}"] = r["peak_bytes"] / b["peak_bytes"]
    return rows


def format_table(rows: list, matmul: float) -> str:
    """The results table; ``%mm``: GFLOP/s as a percentage of ``matmul`` (GFLOP/s)."""
    head = (f"{'T':>6} {'path':<22} {'pass':<8} {'time ms':>9} {'reps':>4} {'/scan':>7} {'/plain':>7} "
            f"{'/autodiff':>9} {'GFLOP/s':>8} {'%mm':>5} {'peak MiB':>9} {'max err':>9} {'compile s':>9}")
    out = [head, "-" * len(head)]
    fmt = lambda v, f: ("-" if v is None else format(v, f))
    for r in rows:
        if r["time_s"] is None:
            out.append(f"{r['T']:>6} {r['name']:<22} FAILED: {r['error'][:120]}")
            continue
        pct = None if r["gflops"] is None else 100 * r["gflops"] / matmul
        mem = None if r["peak_bytes"] is None else r["peak_bytes"] / 2**20
        out.append(
            f"{r['T']:>6} {r['name']:<22} {r['kind']:<8} {1e3 * r['time_s']:>9.1f} {fmt(r.get('reps'), '4d'):>4} "
            f"{fmt(r.get('vs_scan'), '7.3f'):>7} "
            f"{fmt(r.get('vs_plain_scan'), '7.3f'):>7} "
            f"{fmt(r.get('vs_autodiff_chunk'), '9.3f'):>9} {fmt(r['gflops'], '8.1f'):>8} {fmt(pct, '5.1f'):>5} "
            f"{fmt(mem, '9.1f'):>9} {fmt(r['max_err'], '9.2e'):>9} {fmt(r.get('compile_s'), '9.1f'):>9}"
        )
    kinds = {(r["name"], r["kind"]) for r in rows}
    if ("scan", "fwd") in kinds and ("scan", "fwd+bwd") not in kinds:
        out.append("(scan fwd+bwd, the readable oracle's gradient, 8 s a call at T=4096: run with --slow-baselines; "
                   "/plain is the honest baseline)")
    return "\n".join(out)
