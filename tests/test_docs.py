"""Every shell and Python snippet of the docs runs (issue 24): the ```sh, ```bash, ```console and
```python blocks of README.md and docs/*.md (not the generated benchmark, communication and
training reports) are extracted and run, in order, one shell session per file, on a fresh real
cluster with a real FUSE mount.

The docs assume the local cluster of the README: ``irdma up`` (metadata
``sqlite://$HOME/.irdma/meta.db``, exported as ``IRDMA_META``) mounted on ``~/ps``. So each file
runs with ``HOME`` a fresh temporary directory: the README's blocks start that cluster and mount
themselves; the other files get it from ``irdma up`` and :func:`helpers.mounted`
(one cluster for all of them, operations.md last, since it drains and restarts shards). Each file
runs in an empty working directory of its own.

A block that cannot run here (another machine, apt-get, systemd, PostgreSQL elsewhere) says so in
its info string: ```sh no-test: WHY (the reason is required). Output is ```text. A fence with no
language is refused, so that nothing runnable hides in an untagged block.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from helpers import REPO, assert_clean_log, irdma_cli, mounted

#: Written by the benchmark tools (`make bench`, `make bench-hosts`, `make bench-comm`, `make
#: train-table`): their commands are in the Makefile, not for hand-editing.
GENERATED = {"benchmarks.md", "benchmarks-hosts.md", "communication.md", "training.md"}
RUN = {"sh", "bash", "console", "python"}
FENCE = re.compile(r"^(```+)(.*)$")
#: operations.md drains, restarts and remounts: it runs last on the shared cluster.
ORDER = ("user-guide.md", "internals.md", "keras.md", "deploy.md", "snapshots.md", "cache.md", "operations.md")
TIMEOUT = 120  # seconds for one file's blocks (about 20 s for the longest here)


@dataclass
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    tags: str  # the rest of the info string
    text: str


def doc_files() -> list[str]:
    names = [n for n in os.listdir(os.path.join(REPO, "docs")) if n.endswith(".md") and n not in GENERATED]
    ranked = sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else ORDER.index("operations.md") - 0.5, n))
    return [os.path.join("docs", n) for n in ranked]


def blocks(path: str) -> list[Block]:
    """Every fenced block of ``path`` (relative to the repository), in order."""
    with open(os.path.join(REPO, path)) as f:
        lines = f.read().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(1), m.group(2).strip()
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{path}:{start + 1}: a fence that is never closed"
        lang, _, tags = info.partition(" ")
        out.append(Block(path, start + 1, lang, tags.strip(), "\n".join(body) + "\n"))
        i += 1
    return out


def _commands(block: Block) -> str:
    """The shell text of a block: a ```console block's `$ ` lines (and their continuations)."""
    if block.lang != "console":
        return block.text
    keep: list[str] = []
    going = False
    for line in block.text.splitlines():
        if line.startswith("$ "):
            keep.append(line[2:])
        elif going:
            keep.append(line)
        else:
            continue
        going = line.rstrip().endswith("\\")
    return "\n".join(keep) + "\n"


def script(path: str) -> str:
    """One bash script running every runnable block of ``path`` in order; each block announces
    itself (FILE:LINE) so that a failure names the block."""
    parts = ["set -euo pipefail", "trap 'echo \"!! failed in $DOC_BLOCK\" >&2' ERR"]
    if os.environ.get("IRDMA_DOCS_VERBOSE") == "2":  # every command with the second it started at
        parts.append("PS4='+ [$SECONDS s] '; set -x")
    for b in blocks(path):
        if b.lang not in RUN or b.tags.startswith("no-test"):
            continue
        where = f"{b.path}:{b.line}"
        parts.append(f"DOC_BLOCK={where}; echo \"==> {where} (at $SECONDS s)\" >&2")
        if b.lang == "python":
            assert "__DOC_PY__" not in b.text
            parts.append(f'"$DOC_PYTHON" - <<\'__DOC_PY__\'\n{b.text}__DOC_PY__')
        else:
            parts.append(_commands(b))
    return "\n".join(parts) + "\n"


def run_doc(path: str, home: str, work: str) -> None:
    """Run ``path``'s blocks with HOME=``home`` in ``work``; fail with the output and the block."""
    os.makedirs(work, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("IRDMA_HOME", "IRDMA_KEY_FILE", "IRDMA_META")}
    bin_dir = os.path.dirname(sys.executable)
    env.update(HOME=home, IRDMA_META=f"sqlite://{home}/.irdma/meta.db", DOC_PYTHON=sys.executable,
               PATH=bin_dir + os.pathsep + env.get("PATH", ""), COLUMNS="100")
    if os.path.basename(path) == "README.md":
        del env["IRDMA_META"]  # the README exports it itself
    text = script(path)
    try:
        res = subprocess.run(["bash", "-c", text], cwd=work, env=env, capture_output=True, text=True,
                             timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        out = [(x or b"").decode(errors="replace")[-4000:] for x in (exc.stdout, exc.stderr)]
        raise AssertionError(f"{path}: its blocks took more than {TIMEOUT} s:\n{out[0]}\n{out[1]}") from None
    if os.environ.get("IRDMA_DOCS_VERBOSE"):  # pytest -s: see what each block printed
        print(res.stdout, res.stderr, f"{path}: {res.stderr.count('==> ')} blocks", sep="\n")
    assert res.returncode == 0, f"{path}: a block failed ({res.returncode}):\n{res.stdout[-6000:]}\n{res.stderr[-6000:]}"
    # what a reader sees: no library log lines on stderr (pyverbs' basicConfig once made every
    # irdma.connect print "[INFO] ... transport auto: picked tcp")
    stray = [line for line in res.stderr.splitlines() if line.startswith(("[INFO]", "INFO:", "DEBUG:"))]
    assert not stray, f"{path}: log lines on stderr:\n" + "\n".join(stray[:5])


def _cleanup(home: str) -> None:
    """Unmount what the blocks mounted under ``home`` and stop the cluster in ``home/.irdma``."""
    with open("/proc/mounts") as f:
        mounts = [line.split()[1] for line in f if line.split()[1].startswith(home)]
    for mnt in mounts:
        subprocess.run([sys.executable, "-m", "irdma.ops.cli", "umount", mnt], capture_output=True, timeout=60)
    if os.path.isdir(os.path.join(home, ".irdma")):
        subprocess.run([sys.executable, "-m", "irdma.ops.cli", "down", "--dir", os.path.join(home, ".irdma")],
                       capture_output=True, timeout=60)


# ------------------------------------------------------------------------------------- the checks
def test_every_fence_names_its_language_and_every_skip_its_reason() -> None:
    """A bare ``` fence could hide a command nothing runs; a no-test tag must say why."""
    for path in ["README.md", *doc_files()]:
        for b in blocks(path):
            assert b.lang, f"{path}:{b.line}: a fence without a language (```text for output)"
            if b.tags.startswith("no-test"):
                assert re.match(r"no-test:\s*\S", b.tags), f"{path}:{b.line}: `no-test: WHY` (the reason)"


#: Linked before they exist: written on other branches of issue 24's merge. Remove a name once its
#: file lands (the test fails while a pending file exists, so the list cannot go stale).
PENDING: set[str] = set()
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_and_anchor_resolves() -> None:
    for path in ["README.md", *doc_files()]:
        with open(os.path.join(REPO, path)) as f:
            text = f.read()
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            file, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(REPO, os.path.dirname(path), file)) if file else os.path.join(REPO, path)
            rel = os.path.relpath(full, REPO)
            if rel in PENDING:
                assert not os.path.exists(full), f"{rel} exists now: take it out of PENDING"
                continue
            assert os.path.exists(full), f"{path}: link to {target}: no such file"
            if anchor and full.endswith(".md"):
                with open(full) as f:
                    slugs = {_slug(line.lstrip("#")) for line in f if line.startswith("#")}
                assert anchor in slugs, f"{path}: link to {target}: no such heading in {rel}"


def test_readme_is_short_and_links_every_guide() -> None:
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    assert len(text.splitlines()) <= 200
    for doc in ("docs/user-guide.md", "docs/operations.md", "docs/internals.md", "docs/deploy.md",
                "docs/keras.md", "docs/snapshots.md", "SECURITY.md"):
        assert f"]({doc})" in text, doc
    # the test command CI runs (.ci/run) is the one the README gives
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = f.read()
    for target in ("make test", "make demo-ha", "make test-verbs"):
        assert target in ci and target in text, target


def test_readme_blocks_run(tmp_path: object) -> None:
    """The README's own commands start the cluster and mount it (as a reader would)."""
    home = os.path.join(str(tmp_path), "home")
    os.makedirs(home)
    try:
        run_doc("README.md", home, os.path.join(str(tmp_path), "work"))
    finally:
        _cleanup(home)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The cluster the guides assume: ~/.irdma (3 shards: operations.md drains one) on ~/ps.

    Started by the `irdma up` command, as a reader does, not in this process: shards that are
    children of pytest would stay zombies after the docs' own `irdma down` (nothing here reaps
    them), and `down` would wait its 15 s for them to go."""
    home = str(tmp_path_factory.mktemp("home"))
    cluster_dir = os.path.join(home, ".irdma")
    irdma_cli("up", "--dir", cluster_dir, "--shards", "3", "--capacity", "256MiB", "--transport", "tcp")
    try:
        with mounted(f"sqlite://{cluster_dir}/meta.db", os.path.join(home, "ps")):
            yield home
    finally:
        _cleanup(home)  # operations.md mounts ~/ps again by itself
        logs = glob.glob(os.path.join(cluster_dir, "logs", "*.log")) + glob.glob(os.path.join(cluster_dir, "*.log"))
        for log in logs:
            assert_clean_log(log)


@pytest.mark.parametrize("path", doc_files())
def test_doc_blocks_run(path: str, shared: str, tmp_path: object) -> None:
    home = shared
    if not any(b.lang in RUN and not b.tags.startswith("no-test") for b in blocks(path)):
        return  # nothing to run (every block is output, configuration or tagged)
    run_doc(path, home, os.path.join(str(tmp_path), "work"))
