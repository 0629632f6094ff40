"""pjdfstest, the public POSIX conformance suite, through a real ``allow_other`` mount as root.

pjdfstest is built from its source release the way JuiceFS's CI builds it (``autoreconf -ifs;
./configure; make pjdfstest``), from a copy of ``../shared/vendor/pjdfstest`` in the git-ignored
``.pjdfstest-build/`` (rebuilt when the copy is missing or older than the source). Every test
file (``tests/<syscall>/<n>.t``, a TAP producer) runs in a fresh directory of its own on the
mount, a few at a time, and its TAP output is parsed here: a file passes when it exits 0, every
case it printed is ``ok`` (``# SKIP`` and ``# TODO`` count as passes, as ``prove`` counts them)
and it printed as many cases as its plan says.

``tests/pjdfstest-expected-failures.txt`` lists the files known to fail, one path per line
(relative to pjdfstest's ``tests/``, e.g. ``chmod/12.t``) with a ``# why``. The list only
shrinks: this test fails when a file fails that the list does not name, and when a file it names
now passes (delete that line). Every run writes ``.pjdfstest-build/last-run.txt`` with the
failing cases of every file, and prints the pass rate. It takes about 2 minutes on 2 cores
(238 files, 8,798 cases; building pjdfstest adds about 10 s the first time).
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from helpers import REPO, Cluster, mounted

SOURCE = os.path.join(REPO, "..", "shared", "vendor", "pjdfstest")
BUILD = os.path.join(REPO, ".pjdfstest-build")
EXPECTED = os.path.join(REPO, "tests", "pjdfstest-expected-failures.txt")
REPORT = os.path.join(BUILD, "last-run.txt")
#: Test files run at once (each is a shell script forking pjdfstest per step: latency-bound on
#: the mount's round trips more than on CPU). ``IRDMA_PJDFSTEST_JOBS`` overrides it.
JOBS = int(os.environ.get("IRDMA_PJDFSTEST_JOBS", "4"))
#: Seconds one test file may take before it is killed and counted as failed.
FILE_TIMEOUT_S = 180.0

_CASE = re.compile(r"^(not ok|ok)\b\s*(\d+)?\s*(.*)$")
_PLAN = re.compile(r"^1\.\.(\d+)")


def _newest_mtime(top: str) -> float:
    return max(os.stat(os.path.join(d, f)).st_mtime for d, _, files in os.walk(top) for f in files)


def build_pjdfstest() -> str:
    """Build pjdfstest (or reuse a build at least as new as the source).

    Returns:
        The build directory: ``pjdfstest`` (the program) and ``tests/`` are in it.

    Raises:
        AssertionError: the source is missing or a build step failed (with its output).
    """
    assert os.path.isdir(SOURCE), (f"pjdfstest's source is not at {os.path.normpath(SOURCE)}: "
                                   "the repository is checked out without ../shared beside it")
    binary = os.path.join(BUILD, "pjdfstest")
    if os.access(binary, os.X_OK) and os.stat(binary).st_mtime >= _newest_mtime(SOURCE):
        return BUILD
    for tool in ("autoreconf", "automake", "cc", "make"):
        assert shutil.which(tool), f"{tool} is missing: run `make install` (it installs autoconf and automake)"
    # built beside the final place and renamed into it: a concurrent or interrupted build never
    # leaves a half-built tree where the next run would take it for a finished one
    work = tempfile.mkdtemp(prefix=".pjdfstest-build-", dir=REPO)
    try:
        src = os.path.join(work, "src")
        shutil.copytree(SOURCE, src)
        for step in (["autoreconf", "-ifs"], ["./configure"], ["make", "pjdfstest"]):
            res = subprocess.run(step, cwd=src, capture_output=True, text=True, timeout=600)
            assert res.returncode == 0, f"building pjdfstest: {' '.join(step)} failed:\n{res.stdout}\n{res.stderr}"
        shutil.rmtree(BUILD, ignore_errors=True)
        os.rename(src, BUILD)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return BUILD


@dataclass
class FileResult:
    """The outcome of one pjdfstest file."""

    path: str  #: relative to pjdfstest's ``tests/``, e.g. ``chmod/00.t``
    planned: int = 0
    passed: int = 0
    failed: list[str] = field(default_factory=list)  #: the ``not ok`` lines
    problem: str = ""  #: what is wrong beyond failed cases: exit status, plan, timeout
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed and not self.problem

    @property
    def total(self) -> int:
        return max(self.planned, self.passed + len(self.failed))


def parse_tap(path: str, output: str, returncode: int) -> FileResult:
    """One file's result from its TAP output and exit status (``prove``'s rules)."""
    r = FileResult(path)
    seen = 0
    for line in output.splitlines():
        if m := _PLAN.match(line):
            r.planned = int(m.group(1))
        elif m := _CASE.match(line):
            seen += 1
            directive = m.group(3).upper()
            if m.group(1) == "ok" or "# TODO" in directive:
                r.passed += 1
            else:
                r.failed.append(line.strip())
    problems = []
    if returncode != 0:
        problems.append(f"exit status {returncode}")
    if not r.planned:
        problems.append("no plan")
    elif seen != r.planned:
        problems.append(f"planned {r.planned} cases, ran {seen}")
    r.problem = "; ".join(problems)
    return r


def run_file(tests_dir: str, rel: str, workdir: str) -> FileResult:
    """Run one test file in ``workdir`` (a fresh directory on the mount) as ``prove`` would."""
    os.mkdir(workdir, 0o755)
    start = time.monotonic()
    # perl runs a .t file for prove; a `#!/bin/sh` first line makes perl exec sh: run sh directly
    proc = subprocess.Popen(["/bin/sh", os.path.join(tests_dir, rel)], cwd=workdir, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=FILE_TIMEOUT_S)
        r = parse_tap(rel, out, proc.returncode)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and the pjdfstest it waits on
        out, _ = proc.communicate()
        r = parse_tap(rel, out, 0)
        r.problem = f"timed out after {FILE_TIMEOUT_S:.0f} s" + (f"; {r.problem}" if r.problem else "")
    r.seconds = time.monotonic() - start
    return r


def read_expected(path: str = EXPECTED) -> dict[str, str]:
    """The expected-failures list: ``{file: why}``; blank lines and whole-line comments skipped."""
    expected: dict[str, str] = {}
    with open(path) as f:
        for n, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, _, why = line.partition("#")
            assert why.strip(), f"{path}:{n}: {name.strip()!r} has no `# why` comment"
            expected[name.strip()] = why.strip()
    return expected


@pytest.fixture(scope="module")
def pjd_mnt(cluster: Cluster) -> Iterator[str]:
    """An ``allow_other`` mount in a directory every user may traverse: pjdfstest switches to
    other uids (``-u``/``-g``) for its permission cases, and pytest's own directories are 0700."""
    if os.geteuid() != 0:
        pytest.fail("pjdfstest checks ownership and permissions as several users: run it as root")
    if not os.path.exists("/dev/fuse"):
        pytest.fail("/dev/fuse is missing: FUSE tests cannot run (load the fuse module)")
    base = tempfile.mkdtemp(prefix="irdma-pjdfstest-")
    try:
        os.chmod(base, 0o755)
        with mounted(cluster.meta_url, os.path.join(base, "m"), allow_other=True) as m:
            yield m
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _summary(results: list[FileResult], seconds: float) -> str:
    files_ok = sum(r.ok for r in results)
    cases = sum(r.total for r in results)
    cases_ok = sum(r.passed for r in results)
    lines = [f"pjdfstest on irdma: {files_ok}/{len(results)} files passed ({100 * files_ok / len(results):.1f}%), "
             f"{cases_ok}/{cases} cases passed ({100 * cases_ok / max(cases, 1):.2f}%) in {seconds:.0f} s "
             f"with {JOBS} files at a time"]
    for r in results:
        if not r.ok:
            lines.append(f"FAIL {r.path}: {len(r.failed)} of {r.total} cases failed"
                         + (f" ({r.problem})" if r.problem else ""))
            lines += [f"    {line}" for line in r.failed[:20]]
            if len(r.failed) > 20:
                lines.append(f"    ... and {len(r.failed) - 20} more")
    return "\n".join(lines)


def compare(failing: set[str], expected: dict[str, str]) -> str:
    """What is wrong with a run against the expected-failures list ("" when nothing is)."""
    new = sorted(failing - set(expected))
    fixed = sorted(set(expected) - failing)
    name = os.path.relpath(EXPECTED, REPO)
    msg = []
    if new:
        msg.append(f"pjdfstest files fail that {name} does not list (fix the filesystem, or list them with "
                   f"a `# why`): {new}")
    if fixed:
        msg.append(f"pjdfstest files now pass that {name} lists as failing: delete their lines (the list "
                   f"only shrinks): {fixed}")
    return "\n".join(msg)


def test_parse_tap_counts_as_prove_does() -> None:
    out = "1..5\nok 1\nnot ok 2 - tried 'mkdir x 0755', expected 0, got EACCES\nok 3 # SKIP no chflags\n" \
          "not ok 4 # TODO later\nok 5\n"
    r = parse_tap("mkdir/00.t", out, 0)
    assert (r.planned, r.passed, r.total, r.ok) == (5, 4, 5, False)
    assert r.failed == ["not ok 2 - tried 'mkdir x 0755', expected 0, got EACCES"] and not r.problem
    assert parse_tap("a.t", "1..2\nok 1\nok 2\n", 0).ok
    assert parse_tap("a.t", "1..3\nok 1\nok 2\n", 0).problem == "planned 3 cases, ran 2"
    assert parse_tap("a.t", "1..1\nok 1\n", 1).problem == "exit status 1"
    assert parse_tap("a.t", "not ok - could not find pjdfstest app\n", 1).problem == "exit status 1; no plan"


def test_expected_failures_only_shrink(tmp_path: pathlib.Path) -> None:
    listed = {"chmod/12.t": "why"}
    assert compare({"chmod/12.t"}, listed) == ""
    assert "does not list" in compare({"chmod/12.t", "open/00.t"}, listed)
    assert "delete their lines" in compare(set(), listed)
    p = os.path.join(str(tmp_path), "x.txt")
    with open(p, "w") as f:
        f.write("# header\n\nchmod/12.t  # the kernel does it\n")
    assert read_expected(p) == {"chmod/12.t": "the kernel does it"}
    with open(p, "w") as f:
        f.write("chmod/12.t\n")
    with pytest.raises(AssertionError, match="no `# why`"):
        read_expected(p)
    read_expected()  # the checked-in list parses


@pytest.mark.fuse
@pytest.mark.slow
def test_pjdfstest(pjd_mnt: str, capsys: pytest.CaptureFixture[str]) -> None:
    build = build_pjdfstest()
    tests_dir = os.path.join(build, "tests")
    files = sorted(os.path.relpath(os.path.join(d, f), tests_dir)
                   for d, _, names in os.walk(tests_dir) for f in names if f.endswith(".t"))
    assert len(files) > 200, f"only {len(files)} test files under {tests_dir}"
    expected = read_expected()
    unknown = sorted(set(expected) - set(files))
    assert not unknown, f"{EXPECTED} names files pjdfstest does not have: {unknown}"

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(JOBS) as pool:
        futures = [pool.submit(run_file, tests_dir, rel, os.path.join(pjd_mnt, rel.replace("/", "-")))
                   for rel in files]
        results = [f.result() for f in futures]
    summary = _summary(results, time.monotonic() - start)
    with open(REPORT, "w") as f:
        f.write(summary + "\n")
    with capsys.disabled():
        print("\n" + summary)

    msg = compare({r.path for r in results if not r.ok}, expected)
    assert not msg, msg + f"\n(each failing case is in {REPORT})\n" + summary
