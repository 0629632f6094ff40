"""The regression guard of ``make bench`` (issue 21, point 5): every target ratio of this run
beside the same ratio in the last committed ``docs/benchmarks.json``, flagged FELL when it got
worse by more than 15%.

Direction-aware: a ">=" ratio (higher is better: bandwidth over a baseline, "x faster") falls
when it drops; a "<=" ratio (lower is better: checkpoint time over tmpfs, RSS) falls when it
rises. The change shown is always this run's ratio over the previous one, minus 1. Benchmarks
never fail the build: the guard prints, writes its section into docs/benchmarks.md and returns.
The ratios and what each is wanted at are benchmarks/targets.py's (the report's too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

from targets import AUTHENTICATION_WANTED, REPLICATION_WANTED, _section, targets

THRESHOLD = 0.15  # a ratio FELL when it got worse by more than this (relative)
_EPS = 1e-9  # "exactly 15%" computed in floating point is not "more than 15%"
COMMITTED = "docs/benchmarks.json"


def compute_ratios(R: dict[str, Any]) -> list[dict[str, Any]]:
    """Every guarded ratio of a run, from its raw figures: the targets of docs/benchmarks.md, the
    replication ratios (2 replicas over 1) and authentication's (authenticated over --no-auth).
    Each: what, section (what ``--only`` measures it again), ratio, wanted, lower_is_better.
    A part whose figures a run lacks gives nothing."""
    out: list[dict[str, Any]] = []
    try:
        for t in targets(R):
            out.append({"what": t["what"], "section": t["section"], "ratio": float(t["ratio"]),
                        "wanted": f"{'<=' if t['lower_is_better'] else '>='} {t['target']:g}",
                        "lower_is_better": bool(t["lower_is_better"])})
    except (KeyError, TypeError, ValueError, ZeroDivisionError, StopIteration):
        pass  # a partial run (--only replication) or an old layout: no main targets
    rep = R.get("replication") or {}
    for test, want in REPLICATION_WANTED:
        try:
            ratio = rep["r2"][test] / rep["r1"][test]
        except (KeyError, TypeError, ZeroDivisionError):
            continue
        out.append({"what": f"replication {test}, 2 replicas over 1", "section": "replication", "ratio": ratio,
                    "wanted": f">= {want:g}", "lower_is_better": False})
    au = R.get("authentication") or {}
    for test in ("pull", "push-assign", "push-add"):
        try:
            ratio = au["on"][test] / au["off"][test]
        except (KeyError, TypeError, ZeroDivisionError):
            continue
        out.append({"what": f"authentication {test}, authenticated over --no-auth", "section": "authentication",
                    "ratio": ratio, "wanted": f">= {AUTHENTICATION_WANTED:g}", "lower_is_better": False})
    return out


def ratios_of(R: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The ratios a run recorded (``R["ratios"]``), or, for a run made before the guard, the
    ratios computed from its raw figures."""
    if not R:
        return []
    if isinstance(R.get("ratios"), list):
        return list(R["ratios"])
    return compute_ratios(R)


def compare(previous: dict[str, Any] | None, new: dict[str, Any],
            only: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """One row per ratio (matched by name): what, section, wanted, lower_is_better, previous,
    new, change (new / previous - 1, None when either is missing or previous <= 0), worse_by
    (the change in the ratio's bad direction: > 0 is worse) and flag: "FELL" (worse by more than
    THRESHOLD), "ok", "new" (no previous value) or "not measured" (a previous ratio this run
    lacks). ``only``: the sections measured (``--only``): other ratios are left out."""
    sections = None if only is None else set(only)

    def section(r: dict[str, Any]) -> str:  # a run recorded before a target had its section: named again
        sec = str(r.get("section", "main"))
        return _section(r["what"]) if sec == "main" else sec

    def wanted(rs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return {r["what"]: r for r in rs if sections is None or section(r) in sections}

    old, cur = wanted(ratios_of(previous)), wanted(ratios_of(new))
    rows = []
    for what, r in cur.items():
        p = old.get(what)
        prev = None if p is None else float(p["ratio"])
        row = {"what": what, "section": r.get("section", "main"), "wanted": r.get("wanted", ""),
               "lower_is_better": bool(r.get("lower_is_better")), "previous": prev, "new": float(r["ratio"]),
               "change": None, "worse_by": None, "flag": "new" if p is None else "ok"}
        if prev is not None and prev > 0:
            change = row["new"] / prev - 1
            worse = change if row["lower_is_better"] else -change
            row.update(change=change, worse_by=worse, flag="FELL" if worse > THRESHOLD + _EPS else "ok")
        rows.append(row)
    if sections is None:  # a full run: say which ratios it no longer measures
        for what, p in old.items():
            if what not in cur:
                rows.append({"what": what, "section": p.get("section", "main"), "wanted": p.get("wanted", ""),
                             "lower_is_better": bool(p.get("lower_is_better")), "previous": float(p["ratio"]),
                             "new": None, "change": None, "worse_by": None, "flag": "not measured"})
    return rows


def summary(rows: list[dict[str, Any]], against: str | None) -> str:
    """One line: how many ratios fell, against what, and which."""
    if against is None:
        return "regression check: no previous run to compare with (no docs/benchmarks.json committed or on disk)"
    fell = [r for r in rows if r["flag"] == "FELL"]
    compared = sum(r["change"] is not None for r in rows)
    extra = "".join(f", {n} {flag}" for flag in ("new", "not measured")
                    if (n := sum(r["flag"] == flag for r in rows)))
    if not fell:
        return f"no ratio fell by more than {THRESHOLD:.0%} against {against}: {compared} compared{extra}"
    which = "; ".join(f"{r['what']} {r['previous']:.2f} -> {r['new']:.2f} ({r['change']:+.1%})" for r in fell)
    return (f"{len(fell)} {'ratio' if len(fell) == 1 else 'ratios'} fell by more than {THRESHOLD:.0%} against"
            f" {against}: {which} [{compared} compared{extra}]")


def check(previous: dict[str, Any] | None, against: str | None, new: dict[str, Any],
          only: Iterable[str] | None = None, quick: bool = False) -> dict[str, Any]:
    """The record kept as ``benchmarks.json["regression_check"]`` and rendered by markdown() and
    show(): the rows, the summary line and what was compared with what."""
    rows = compare(previous, new, only)
    note = None
    prev_quick = bool(((previous or {}).get("machine") or {}).get("quick"))
    if previous is not None and prev_quick != quick:
        note = (f"this run {'is' if quick else 'is not'} a --quick one and the previous "
                f"{'is' if prev_quick else 'is not'}: sizes differ, so the comparison says little")
    made_on = ((previous or {}).get("machine") or {}).get("commit")
    return {"against": against, "previous_made_on": made_on["hash"] if made_on else None,
            "only": None if only is None else sorted(only), "threshold": THRESHOLD, "note": note, "rows": rows,
            "summary": summary(rows, against) + (f"; note: {note}" if note else "")}


# ---------------------------------------------------------------- the previous run, this commit
def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=True,
                          timeout=60).stdout


def git_commit(repo: str) -> dict[str, Any] | None:
    """The commit a run is made on: {"hash": full hash, "dirty": tracked files changed}, or None."""
    try:
        head = _git(repo, "rev-parse", "HEAD").strip()
        dirty = bool(_git(repo, "status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.SubprocessError):
        return None
    return {"hash": head, "dirty": dirty}


def load_previous(repo: str, out: str) -> tuple[dict[str, Any] | None, str | None]:
    """The run to compare with, read before this one overwrites anything: docs/benchmarks.json
    as committed at HEAD, else ``out``'s benchmarks.json on disk, else none. Returns the run
    and the words naming it ("the last committed run (bb5c1a6)")."""
    try:
        text = _git(repo, "show", f"HEAD:{COMMITTED}")
        commit = _git(repo, "log", "-1", "--format=%h", "HEAD", "--", COMMITTED).strip()
        return json.loads(text), f"the last committed run ({commit})"
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    path = os.path.join(out, "benchmarks.json")
    try:
        with open(path) as f:
            return json.load(f), f"the previous run on disk ({path}, not committed)"
    except (OSError, ValueError):
        return None, None


# ---------------------------------------------------------------- showing it
def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _change(r: dict[str, Any]) -> str:
    if r["change"] is None:
        return "-"
    word = "same" if abs(r["change"]) < 0.005 else ("worse" if r["worse_by"] > 0 else "better")
    return f"{r['change']:+.1%} ({word})"


def markdown(chk: dict[str, Any]) -> list[str]:
    """The "Regression check" section of docs/benchmarks.md."""
    L = ["## Regression check", ""]
    if chk["against"] is None:
        return [*L, "No previous run to compare with.", ""]
    made_on = f", a run made on {chk['previous_made_on'][:7]}" if chk.get("previous_made_on") else ""
    L += [f"Each ratio of this run beside {chk['against']}{made_on}"
          + (f", only the ratios `--only {', '.join(chk['only'])}` measured" if chk.get("only") else "")
          + ". The change is this ratio over the previous one; **FELL**: worse by more than"
          f" {chk['threshold']:.0%} (a `>=` ratio that dropped, a `<=` ratio that rose)."
          " `make bench` prints the same table; closing notes that touch the data path quote it.", ""]
    if chk.get("note"):
        L += [f"Note: {chk['note']}.", ""]
    L += ["| ratio | wanted | previous | this run | change | flag |", "|---|---|---|---|---|---|"]
    for r in chk["rows"]:
        flag = "**FELL**" if r["flag"] == "FELL" else r["flag"]
        L.append(f"| {r['what']} | {r['wanted']} | {_num(r['previous'])} | {_num(r['new'])} | {_change(r)} | {flag} |")
    return [*L, "", chk["summary"] + ".", ""]


def show(chk: dict[str, Any]) -> None:
    """Print the table (rich) and the summary line."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    if chk["against"] is not None:
        table = Table(title=f"Regression check against {chk['against']}", title_justify="left")
        for col, justify in (("ratio", "left"), ("wanted", "left"), ("previous", "right"), ("this run", "right"),
                             ("change", "right"), ("flag", "left")):
            table.add_column(col, justify=justify)  # type: ignore[arg-type]
        for r in chk["rows"]:
            style = "bold red" if r["flag"] == "FELL" else ("green" if (r["worse_by"] or 0) < -THRESHOLD else None)
            table.add_row(r["what"], r["wanted"], _num(r["previous"]), _num(r["new"]), _change(r), r["flag"],
                          style=style)
        console.print(table)
    fell = any(r["flag"] == "FELL" for r in chk["rows"])
    console.print(chk["summary"], style="bold red" if fell else "bold", markup=False, highlight=False, soft_wrap=True)
