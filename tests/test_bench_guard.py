"""The regression guard of `make bench` (benchmarks/guard.py, issue 21 point 5): each ratio of a
run beside the last committed docs/benchmarks.json, FELL when it got worse by more than 15% in
its own direction. Hand-made runs only: no benchmark is run here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from helpers import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import guard  # noqa: E402


def run(*ratios: tuple[str, float, bool] | tuple[str, float, bool, str], quick: bool = False) -> dict[str, Any]:
    """A hand-made run: (what, ratio, lower_is_better[, section]) for each ratio it recorded."""
    return {"machine": {"quick": quick},
            "ratios": [{"what": r[0], "ratio": r[1], "lower_is_better": r[2], "section": r[3] if len(r) > 3 else "main",
                        "wanted": ("<= " if r[2] else ">= ") + "1"} for r in ratios]}


def by_what(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["what"]: r for r in rows}


def test_a_higher_is_better_ratio_falls_when_it_drops() -> None:
    rows = by_what(guard.compare(run(("pull", 0.8, False), ("add", 0.5, False), ("assign", 0.4, False)),
                                 run(("pull", 0.4, False), ("add", 0.6, False), ("assign", 0.36, False))))
    assert rows["pull"]["flag"] == "FELL"
    assert rows["pull"]["change"] == pytest.approx(-0.5) and rows["pull"]["worse_by"] == pytest.approx(0.5)
    assert rows["add"]["flag"] == "ok" and rows["add"]["change"] == pytest.approx(0.2)
    assert rows["add"]["worse_by"] == pytest.approx(-0.2)  # better
    assert rows["assign"]["flag"] == "ok" and rows["assign"]["change"] == pytest.approx(-0.1)  # worse, within 15%
    assert (rows["pull"]["previous"], rows["pull"]["new"]) == (0.8, 0.4)


def test_a_lower_is_better_ratio_falls_when_it_rises() -> None:
    rows = by_what(guard.compare(run(("ckpt save", 1.5, True), ("rss", 1.0, True)),
                                 run(("ckpt save", 2.0, True), ("rss", 0.5, True))))
    assert rows["ckpt save"]["flag"] == "FELL"
    assert rows["ckpt save"]["change"] == pytest.approx(1 / 3) and rows["ckpt save"]["worse_by"] == pytest.approx(1 / 3)
    assert rows["rss"]["flag"] == "ok"  # halved: much better, not a fall
    assert rows["rss"]["change"] == pytest.approx(-0.5) and rows["rss"]["worse_by"] == pytest.approx(0.5 - 1)


@pytest.mark.parametrize("prev", [1.0, 0.8, 2.0, 0.35, 4.37])
def test_exactly_15_percent_is_not_a_fall_and_a_little_more_is(prev: float) -> None:
    rows = by_what(guard.compare(
        run(("up", prev, False), ("up more", prev, False), ("down", prev, True), ("down more", prev, True)),
        run(("up", prev * 0.85, False), ("up more", prev * 0.849, False), ("down", prev * 1.15, True),
            ("down more", prev * 1.151, True))))
    assert rows["up"]["flag"] == "ok" and rows["down"]["flag"] == "ok"
    assert rows["up more"]["flag"] == "FELL" and rows["down more"]["flag"] == "FELL"
    assert rows["up"]["change"] == pytest.approx(-0.15) and rows["down"]["change"] == pytest.approx(0.15)


def test_no_previous_run_makes_every_ratio_new() -> None:
    new = run(("pull", 0.8, False), ("ckpt", 2.0, True))
    for previous in (None, {}, run()):
        rows = guard.compare(previous, new)
        assert [r["flag"] for r in rows] == ["new", "new"]
        assert all(r["previous"] is None and r["change"] is None for r in rows)
    chk = guard.check(None, None, new)
    assert "no previous run" in chk["summary"] and chk["rows"][0]["flag"] == "new"
    assert guard.markdown(chk)[:3] == ["## Regression check", "", "No previous run to compare with."]


def test_a_new_ratio_and_one_no_longer_measured() -> None:
    rows = guard.compare(run(("pull", 0.8, False), ("fio", 0.5, False, "fio")),
                         run(("pull", 0.8, False), ("rows", 0.3, False, "rows")))
    assert [(r["what"], r["flag"]) for r in rows] == [("pull", "ok"), ("rows", "new"), ("fio", "not measured")]
    gone = rows[2]
    assert gone["previous"] == 0.5 and gone["new"] is None and gone["change"] is None
    line = guard.summary(rows, "the last committed run (abc1234)")
    assert line == "no ratio fell by more than 15% against the last committed run (abc1234): 1 compared, 1 new, 1 not measured"


def test_only_compares_the_sections_measured() -> None:
    previous = run(("pull", 0.8, False), ("round", 2.0, False, "rounds"), ("fio", 0.5, False, "fio"))
    new = run(("pull", 0.1, False), ("round", 1.0, False, "rounds"), ("fio", 0.5, False, "fio"))
    rows = guard.compare(previous, new, only=["rounds"])
    assert [(r["what"], r["flag"]) for r in rows] == [("round", "FELL")]  # pull fell, but was not measured again
    assert [r["what"] for r in guard.compare(previous, run(("round", 2.0, False, "rounds")), only=["rounds"])] == ["round"]


def test_a_previous_ratio_of_zero_has_no_relative_change() -> None:
    row = guard.compare(run(("x", 0.0, False)), run(("x", 0.5, False)))[0]
    assert row["change"] is None and row["flag"] == "ok"


def test_summary_names_what_fell_and_the_run_compared_with() -> None:
    chk = guard.check(run(("native pull", 0.8, False), ("checkpoint save", 1.5, True), ("add", 0.5, False)),
                      "the last committed run (a3f9c1e)",
                      run(("native pull", 0.4, False), ("checkpoint save", 3.0, True), ("add", 0.5, False)))
    assert chk["summary"] == ("2 ratios fell by more than 15% against the last committed run (a3f9c1e):"
                              " native pull 0.80 -> 0.40 (-50.0%); checkpoint save 1.50 -> 3.00 (+100.0%) [3 compared]")
    md = "\n".join(guard.markdown(chk))
    assert "## Regression check" in md and "| native pull | >= 1 | 0.80 | 0.40 | -50.0% (worse) | **FELL** |" in md
    assert "| add | >= 1 | 0.50 | 0.50 | +0.0% (same) | ok |" in md and chk["summary"] in md
    json.dumps(chk)  # kept in benchmarks.json as it is


def test_a_quick_run_against_a_full_one_says_so() -> None:
    chk = guard.check(run(("pull", 0.8, False)), "the last committed run (a3f9c1e)",
                      run(("pull", 0.8, False), quick=True), quick=True)
    assert chk["note"] and "--quick" in chk["summary"]
    assert guard.check(run(("pull", 0.8, False)), "x", run(("pull", 0.8, False)))["note"] is None


def test_ratios_of_a_run_made_before_the_guard_come_from_its_raw_figures() -> None:
    raw = {"replication": {"r1": {"pull": 1000.0, "push-assign": 500.0, "push-add": 600.0},
                           "r2": {"pull": 900.0, "push-assign": 250.0, "push-add": 600.0}},
           "authentication": {"on": {"pull": 700.0, "push-assign": 400.0, "push-add": 500.0},
                              "off": {"pull": 1000.0, "push-assign": 500.0, "push-add": 500.0}}}
    got = {r["what"]: r for r in guard.ratios_of(raw)}  # no main targets: those figures are missing
    assert got["replication pull, 2 replicas over 1"]["ratio"] == pytest.approx(0.9)
    assert got["replication push-assign, 2 replicas over 1"]["section"] == "replication"
    assert got["authentication pull, authenticated over --no-auth"]["ratio"] == pytest.approx(0.7)
    assert len(got) == 6 and not any(r["lower_is_better"] for r in got.values())
    later = json.loads(json.dumps(raw))
    later["replication"]["r2"]["pull"] = 700.0
    rows = by_what(guard.compare(raw, {**later, "ratios": guard.compute_ratios(later)}, only=["replication"]))
    assert rows["replication pull, 2 replicas over 1"]["flag"] == "FELL" and len(rows) == 3


def test_the_committed_report_compares_with_itself_unchanged() -> None:
    path = os.path.join(REPO, "docs", "benchmarks.json")
    if not os.path.exists(path):
        pytest.skip("no docs/benchmarks.json")
    with open(path) as f:
        R = json.load(f)
    rows = guard.compare(R, R)
    names = {r["what"] for r in rows}
    pull = "native pull, over the same-work ceiling" if R.get("tcp_mac") else "native pull"  # runs before the ceiling
    assert {pull, "checkpoint save, mount over tmpfs", "FUSE process peak RSS streaming 1 GiB, MB"} <= names
    assert all(r["flag"] == "ok" and r["change"] == 0 for r in rows)
    assert by_what(rows)["checkpoint save, mount over tmpfs"]["lower_is_better"]
    assert not by_what(rows)[pull]["lower_is_better"]


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_the_previous_run_is_the_committed_one_then_the_one_on_disk(tmp_path: Any) -> None:
    repo, out = str(tmp_path / "repo"), str(tmp_path / "out")
    os.makedirs(os.path.join(repo, "docs"))
    os.makedirs(out)
    assert guard.load_previous(repo, out) == (None, None)  # not a repository, nothing on disk
    with open(os.path.join(out, "benchmarks.json"), "w") as f:
        json.dump(run(("pull", 0.3, False)), f)
    prev, against = guard.load_previous(repo, out)
    assert prev and prev["ratios"][0]["ratio"] == 0.3 and against and "on disk" in against
    _git(repo, "init", "-q")
    with open(os.path.join(repo, "docs", "benchmarks.json"), "w") as f:
        json.dump(run(("pull", 0.8, False)), f)
    _git(repo, "add", "docs/benchmarks.json")
    _git(repo, "commit", "-q", "-m", "a run")
    with open(os.path.join(repo, "docs", "benchmarks.json"), "w") as f:  # overwritten, not committed
        json.dump(run(("pull", 0.1, False)), f)
    prev, against = guard.load_previous(repo, out)
    short = _git(repo, "rev-parse", "--short=7", "HEAD")
    assert prev and prev["ratios"][0]["ratio"] == 0.8 and against == f"the last committed run ({short})"
    commit = guard.git_commit(repo)
    assert commit and commit["hash"] == _git(repo, "rev-parse", "HEAD") and commit["dirty"]
