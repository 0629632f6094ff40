"""Starting, stopping and removing clusters, and the small things users meet first: `irdma down`
and `destroy` act on the cluster $IRDMA_META names and refuse one with live mounts without
--force; `up` on a running cluster is no error; `up` leaves a shard started by hand alone and
names the exact command that starts it again; `down` never signals a process it did not start;
`destroy` removes the directory; status names a shard that is down; messages wrap at a
terminal's width and carry no source locations; jobs under /jobs can be listed and removed."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator

import pytest
import trio
from helpers import irdma_cli, running_cluster, wait_until
from irdma.fs.mount import spawn_mount, unmount

import irdma
from irdma.ops import cluster
from irdma.ops._proc import pid_alive
from irdma.ops.cluster import key_file_of
from irdma.wire.auth import read_key_file

MB = 1 << 20


def _env(home: str, meta: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("IRDMA_META", "IRDMA_KEY_FILE")}
    env["IRDMA_HOME"] = home
    if meta is not None:
        env["IRDMA_META"] = meta
    return env


@contextlib.contextmanager
def _clusters(*dirs: str) -> Iterator[list[str]]:
    """Local clusters of one shard each in ``dirs`` (their URLs); removed at the end."""
    urls = []
    try:
        for d in dirs:
            urls.append(cluster.up(d, 1, 64 << 20, fresh=True))
        yield urls
    finally:
        for d in dirs:
            with contextlib.suppress(Exception):
                cluster.destroy(d)


def _pids(d: str) -> list[int]:
    return [p.pid for p in cluster.read_state(d)]


@pytest.mark.long  # 36 s: make test-long (CI's time)
@pytest.mark.fuse
def test_down_and_destroy_act_on_the_cluster_irdma_meta_names(tmp_path: object) -> None:
    a, b = f"{tmp_path}/a", f"{tmp_path}/b"
    with _clusters(a, b) as (_, url_b):
        env = _env(a, meta=url_b)  # the default cluster is A; $IRDMA_META names B
        pids_a, pids_b = _pids(a), _pids(b)
        m = f"{tmp_path}/mb"
        os.makedirs(m)
        spawn_mount(url_b, m, transport="tcp", log_file=f"{tmp_path}/mb.log")
        try:
            res = irdma_cli("down", env=env, check=False)  # B has a live mount: refused, nothing stopped
            lines = res.stderr.strip().splitlines()
            assert res.returncode == 1 and len(lines) == 1, res.stderr
            assert "1 live mount of the cluster in" in lines[0] and m in lines[0] and "--force" in lines[0]
            assert all(map(pid_alive, pids_a + pids_b))
            res = irdma_cli("destroy", "--yes", env=env, check=False)
            assert res.returncode == 1 and "--force" in res.stderr and os.path.exists(f"{b}/meta.db"), res.stderr
            res = irdma_cli("down", "--force", env=env)
            assert f"cluster in {b} stopped" in res.stderr, res.stderr
            wait_until(lambda: not any(map(pid_alive, pids_b)), 20, "B's shards to exit")
            assert all(map(pid_alive, pids_a))  # the default cluster runs on
        finally:
            unmount(m)
        with open(f"{b}/notes.txt", "w") as f:  # not irdma's: the directory stays for it
            f.write("mine")
        res = irdma_cli("destroy", "--yes", env=env)
        assert "the directory stays" in res.stderr and "notes.txt" in res.stderr, res.stderr
        assert sorted(os.listdir(b)) == ["notes.txt"]
        os.unlink(f"{b}/notes.txt")
        res = irdma_cli("destroy", "--yes", "--dir", a, env=env)  # --dir wins over $IRDMA_META
        assert "removed, with its directory" in res.stderr and not os.path.exists(a), res.stderr
        assert not any(map(pid_alive, pids_a))
        res = irdma_cli("down", env=_env(a, meta="postgresql://u@h/db"), check=False)
        assert res.returncode == 1 and "no local cluster" in res.stderr, res.stderr


def test_up_on_a_running_cluster_says_so_and_exits_0(tmp_path: object) -> None:
    d = f"{tmp_path}/c"
    with _clusters(d) as (url,):
        before = _pids(d)
        res = irdma_cli("up", "--dir", d, check=False)
        assert res.returncode == 0 and res.stdout.strip() == url, res.stdout + res.stderr
        assert "already runs (its shard answers): nothing to start" in res.stderr, res.stderr
        assert _pids(d) == before and "cli.py:" not in res.stderr
        res = irdma_cli("stats", "--meta", url, "--count", "1", "--interval", "0.1", check=False)
        assert "Ctrl-C" not in res.stdout + res.stderr


def test_status_names_the_shard_that_is_down(tmp_path: object) -> None:
    d = f"{tmp_path}/c"
    with _clusters(d) as (url,):
        victim = cluster.read_state(d)[0]
        os.kill(victim.pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(victim.pid), 10, "the killed shard to exit")
        res = irdma_cli("status", "--meta", url, check=False)
        assert res.returncode == 1, res.stdout + res.stderr
        assert f"shard {victim.shard_id} at {victim.address} is down: restart it" in res.stderr, res.stderr


def _read_pty(fd: int, seconds: float) -> list[bytes]:
    """What the other side of pty ``fd`` writes until it closes it (EIO or EOF).

    Raises:
        AssertionError: it is still open after ``seconds`` (a hung child), with what came so far.
    """
    import select

    deadline, chunks = time.monotonic() + seconds, []
    while True:
        left = deadline - time.monotonic()
        ready = select.select([fd], [], [], max(left, 0))[0] if left > 0 else []
        if not ready:
            raise AssertionError(f"the pty is still open after {seconds} s; it printed: {b''.join(chunks)!r}")
        try:
            got = os.read(fd, 4096)
        except OSError:  # EIO: the child closed its side
            return chunks
        if not got:
            return chunks
        chunks.append(got)


def test_the_pty_reader_has_a_deadline() -> None:
    """A child that keeps the pty open (a hung `irdma up`) fails the reader; it does not hang it."""
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(["sh", "-c", "echo started; exec sleep 600"], stdin=secondary, stdout=secondary,
                            stderr=secondary, close_fds=True)
    os.close(secondary)
    try:
        with pytest.raises(AssertionError, match="still open after 1 s.*started"):
            _read_pty(primary, 1)
    finally:
        proc.kill()
        proc.wait(30)
        os.close(primary)


def test_messages_wrap_at_the_terminals_width(tmp_path: object) -> None:
    """At an 80-column terminal no line is longer than 80 columns; no rich source location."""
    d = f"{tmp_path}/" + "a-long-directory-name-" * 3
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "irdma.ops.cli", "up", "--dir", d, "--shards", "1",
                                 "--capacity", "64MiB"], stdin=secondary, stdout=secondary, stderr=secondary,
                                env=env, close_fds=True)
        os.close(secondary)
        try:
            chunks = _read_pty(primary, 120)
        finally:
            if proc.poll() is None:  # a hung `irdma up`: stopped, the test fails instead of hanging
                proc.kill()
        assert proc.wait(120) == 0
    finally:
        os.close(primary)
        with contextlib.suppress(Exception):
            cluster.destroy(d)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))
    lines = [ln.strip() for ln in re.split(r"[\r\n]", text) if ln.strip()]
    assert any("cluster up" in ln for ln in lines), text
    # every line of words fits (the URL on stdout is one word: a result, printed whole)
    assert max(len(ln) for ln in lines if " " in ln) <= 80, text
    assert "cli.py:" not in text


def test_jobs_are_listed_and_removed(tmp_path: object) -> None:
    d = f"{tmp_path}/c"
    with _clusters(d) as (url,):
        irdma_cli("run", "-n", "1", "--meta", url, "--job", "digits", "--", sys.executable, "-c", "pass")
        with irdma.connect(url, transport="tcp") as cl:
            cl.write("/jobs/digits/w", b"x" * 5000)
            cl.makedirs("/jobs/keep")
            cl.write("/jobs/keep/w", b"y" * 10)
        jobs = json.loads(irdma_cli("job", "list", "--meta", url, "--json").stdout)
        assert [(j["name"], j["workers"], j["files"], j["bytes"]) for j in jobs] == [("digits", "1", 1, 5000),
                                                                                     ("keep", None, 1, 10)]
        assert "digits" in irdma_cli("job", "list", "--meta", url).stdout
        res = irdma_cli("job", "remove", "digits", "--meta", url, check=False)  # asks; no answer: nothing removed
        assert res.returncode == 1
        res = irdma_cli("job", "remove", "digits", "--meta", url, "--yes")
        assert "removed job digits: /jobs/digits, 1 file" in res.stderr, res.stderr
        assert [j["name"] for j in json.loads(irdma_cli("job", "list", "--meta", url, "--json").stdout)] == ["keep"]
        with irdma.connect(url, transport="tcp") as cl:
            assert cl.listdir("/jobs") == ["keep"]


@pytest.mark.fuse
def test_a_mount_without_its_key_says_so_without_blaming_fuse(tmp_path: object) -> None:
    d, m = f"{tmp_path}/c", f"{tmp_path}/m"
    os.makedirs(m)
    with _clusters(d) as (url,):
        env = {**_env(d), "IRDMA_KEY_FILE": f"{tmp_path}/no-such-key"}
        res = irdma_cli("mount", url, m, "--transport", "tcp", env=env, check=False)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 1 and len(lines) == 1, res.stderr
        assert "no key file" in lines[0] and "/dev/fuse" not in lines[0] and lines[0].count("ERROR") == 0, lines[0]


# ---------------------------------------------------------------- processes `up` and `down` did not start
def _out(res: subprocess.CompletedProcess[str]) -> str:
    text = res.stdout + res.stderr
    assert "Traceback" not in text, text
    return text


def _start_hand_shard(tmp: str, key_file: str, port_file: str) -> subprocess.Popen[bytes]:
    if os.path.exists(port_file):
        os.unlink(port_file)
    log = open(os.path.join(tmp, "hand.log"), "ab")
    proc = subprocess.Popen([sys.executable, "-m", "irdma.ops.cli", "server", "--listen", "127.0.0.1:0", "--capacity",
                             "64MiB", "--port-file", port_file, "--transport", "tcp", "--key-file", key_file,
                             "--data-dir", os.path.join(tmp, "hand")], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    wait_until(lambda: os.path.exists(port_file) or proc.poll() is not None, 30, "the hand-started shard to listen")
    assert proc.poll() is None, "the hand-started shard exited"
    return proc


@pytest.mark.long  # 26 s: make test-long
def test_up_leaves_a_hand_added_shard_alone_and_names_the_command_for_it(tmp_path: object) -> None:
    """The README's own steps: `irdma up`, a shard started by hand and `irdma shard add`ed,
    files on it, `irdma down` (the hand-started shard keeps running), `irdma up`: it restarts
    its own shards, leaves shard 3 alone, and every file reads back. Once shard 3 is stopped
    too, `up` starts its own, never mentions --fresh, exits 1 naming the exact command that
    starts shard 3 again, and that command brings it back with its data."""
    tmp = str(tmp_path)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with running_cluster(os.path.join(tmp, "c"), shards=2, replicas=1, capacity=64 * MB) as c:
            port_file = os.path.join(tmp, "hand.port")
            procs.append(_start_hand_shard(tmp, key_file_of(c.dir), port_file))
            with open(port_file) as f:
                address = f.read().strip()
            irdma_cli("shard", "add", address, "--meta", c.meta_url)
            files = {f"/f{k}": os.urandom(300_000) for k in range(6)}  # small files start on every shard
            with irdma.connect(c.meta_url, transport="tcp") as cl:
                for path, data in files.items():
                    cl.write(path, data)
                firsts = {irdma.Layout(st.ino, st.chunk_size or 0, st.stripe).shard_of(0)
                          for st in map(cl.stat, files)}
            assert 3 in firsts, firsts  # shard 3 holds files
            irdma_cli("down", "--dir", c.dir)
            assert procs[0].poll() is None  # not ours to stop

            res = irdma_cli("up", "--dir", c.dir, check=False)
            text = _out(res)
            assert res.returncode == 0, text
            assert "restarted shard 1" in text and "restarted shard 2" in text, text
            assert "shard 3" in text and "left alone" in text and "--fresh" not in text, text
            c.shards = cluster.read_state(c.dir)
            with irdma.connect(c.meta_url, transport="tcp") as cl:
                for path, data in files.items():
                    assert bytes(cl.read(path)) == data, path

            irdma_cli("down", "--dir", c.dir)
            procs[0].terminate()
            procs[0].wait(10)
            res = irdma_cli("up", "--dir", c.dir, check=False)
            text = _out(res)
            assert res.returncode == 1 and "--fresh" not in text, text
            assert "restarted shard 1" in text and "restarted shard 2" in text, text
            c.shards = cluster.read_state(c.dir)
            command = re.search(r"shard 3: `([^`]+)`", text)
            assert command, text
            line = command.group(1)
            assert f"--listen {address}" in line and os.path.join(tmp, "hand") in line, line
            assert line.startswith("irdma server ")
            argv = [sys.executable, "-m", "irdma.ops.cli", *line.split()[1:]]
            procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            key = read_key_file(key_file_of(c.dir))

            def answers() -> bool:
                try:
                    trio.run(functools.partial(cluster.check_shard, address, 1.0, key=key))
                    return True
                except irdma.ShardUnavailable:
                    return False

            wait_until(answers, 60, "shard 3 to answer again", interval=0.1)
            assert "3 of 3" in irdma_cli("status", "--meta", c.meta_url, check=False).stdout
            with irdma.connect(c.meta_url, transport="tcp") as cl:
                for path, data in files.items():
                    assert bytes(cl.read(path)) == data, path
            res = irdma_cli("up", "--dir", c.dir, check=False)
            assert res.returncode == 0 and "already runs" in res.stderr, _out(res)  # nothing to start: no error
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(10)


def test_down_never_signals_a_pid_another_process_took(tmp_path: object) -> None:
    """cluster.json names a pid that now belongs to another process (its start time differs):
    `irdma down` leaves that process alone."""
    d = os.path.join(str(tmp_path), "c")
    os.makedirs(d)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with open(os.path.join(d, cluster.STATE_FILE), "w") as f:
            json.dump({"meta_url": "", "shards": [{"shard_id": 1, "address": "127.0.0.1:1", "pid": other.pid,
                                                   "log": "x", "create_time": time.time() - 3600}]}, f)
        res = irdma_cli("down", "--dir", d)
        assert "0 shard processes" in res.stderr, _out(res)
        assert other.poll() is None
        # nor one recorded by an older irdma (no start time) that is not an irdma shard
        with open(os.path.join(d, cluster.STATE_FILE), "w") as f:
            json.dump({"meta_url": "", "shards": [{"shard_id": 1, "address": "127.0.0.1:1", "pid": other.pid,
                                                   "log": "x"}]}, f)
        irdma_cli("down", "--dir", d)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait(10)
