"""``irdma run`` (N workers of a training job) and ``irdma job`` (the jobs under /jobs)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import click
import trio
from rich.markup import escape
from rich.table import Table

from ..._errors import InvalidArgument, IrdmaError
from ...units import format_size
from ._common import META_OPTION, _redact, _size, console, friendly, out
from .health import _count


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-n", "--np", "workers", type=int, required=True, help="Number of worker processes.")
@click.option("--meta", "meta_url", envvar="IRDMA_META", default=None, show_default="$IRDMA_META",
              help="Metadata URL of a running namespace; without it a local cluster is started for the job"
                   " and removed after it.")
@click.option("--job", default=None, help="Job name: its directory is /jobs/NAME; with --meta, a run again of the"
                                          " job resumes from the weights its shards hold. [default: a new name]")
@click.option("--consistency", default=None, metavar="bsp|ssp:K|asp",
              help="The job's consistency model (user.irdma.consistency). [default: the namespace's, asp]")
@click.option("--shards", default=2, show_default=True, help="Shards of the local cluster (without --meta).")
@click.option("--capacity", default="1GiB", show_default=True, callback=_size,
              help="Memory region per shard of the local cluster (without --meta).")
@click.option("--grace", default=10.0, show_default=True, type=click.FloatRange(0, 3600),
              help="Seconds the other workers get to stop (SIGTERM) after one failed, before SIGKILL.")
@click.option("--elastic", default=None, metavar="MIN:MAX",
              help="An elastic job: it goes on with MIN to MAX live workers; a failed worker is restarted and"
                   " rejoins at the job's current clock and weights.")
@click.option("--max-restarts", default=3, show_default=True, type=click.IntRange(0, 1000),
              help="With --elastic: restarts of failed workers, in all.")
@click.option("-H", "--hosts", default=None, metavar="HOST:SLOTS,...",
              help="Where the workers run: ranks fill the hosts in order (needs --meta with a PostgreSQL URL"
                   " that every host reaches). [default: all on this host]")
@click.option("--rsh", type=click.Choice(["ssh", "netns"]), default="ssh", show_default=True,
              help="How a worker starts on another host: ssh HOST, or nsenter into network namespace HOST"
                   " (the test bed's hosts).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
@friendly
def run(workers: int, meta_url: str | None, job: str | None, consistency: str | None, shards: int, capacity: int,
        grace: float, elastic: str | None, max_restarts: int, hosts: str | None, rsh: str,
        command: tuple[str, ...]) -> None:
    """Run N workers of COMMAND on one training job (as horovodrun and torchrun do).

    \b
    irdma run -n 4 -- python train.py --epochs 5
    irdma run -n 2 --meta $URL --job digits --consistency ssp:2 -- python train.py
    irdma run -n 4 --elastic 2:4 --consistency bsp -- python train.py
    irdma run -n 4 -H node1:2,node2:2 --meta postgresql://... -- python train.py

    Each worker gets IRDMA_RANK, IRDMA_SIZE, IRDMA_META and IRDMA_JOB (the job's directory in
    the namespace) in its environment; its output lines are prefixed with [RANK]. Ctrl-C and
    SIGTERM reach every worker; when one fails the others are stopped and `irdma run` exits
    with its status, naming its rank (with --elastic: it is restarted and the others go on).
    """
    from .. import launch

    bounds = launch.check_args(workers, command, consistency, elastic)
    where = launch.parse_hosts(hosts, workers)
    remote = sorted({h for h in where if h not in launch.LOCALHOSTS})
    if remote and meta_url is None:
        raise InvalidArgument(f"--hosts {hosts}: workers on {', '.join(remote)} cannot reach a local cluster",
                              "start a cluster with PostgreSQL metadata that every host reaches and pass"
                              " --meta postgresql://... (docs/deploy.md)")
    name = job or launch.new_job_name()
    with contextlib.ExitStack() as stack:
        if meta_url is None:
            with console.status(f"starting a local cluster of {shards} shards") as status:
                def progress(msg: str) -> None:
                    status.update(msg)

                local = stack.enter_context(launch.local_cluster(shards, capacity, progress))
            meta_url, key_file = local.meta_url, local.key_file
        else:
            key_file = os.environ.get("IRDMA_KEY_FILE")
        the_job = launch.prepare_job(meta_url, name, workers, consistency, key_file, bounds)
        console.print(f"job {the_job.path} on {_redact(meta_url)}: {workers} worker(s)"
                      f"{f', elastic {elastic}' if bounds else ''}", highlight=False)
        status_code = launch.supervise(the_job, workers, command, grace=grace, log=lambda m: console.print(
            f"irdma run: {m}", highlight=False, soft_wrap=True), elastic=bounds is not None, max_restarts=max_restarts,
            hosts=where, rsh=rsh)
    if status_code:
        sys.exit(status_code)


# ---------------------------------------------------------------- jobs under /jobs
@click.group()
def job() -> None:
    """The jobs `irdma run` made: their directories /jobs/NAME in the namespace (weights,
    optimizer state, clocks), kept after a run so that a run again of the job resumes."""


async def _jobs(meta_url: str) -> list[dict[str, Any]]:
    from ..._errors import NoAttribute, NotFound
    from ...client.native import Client
    from ...train.coord import XATTR_CONSISTENCY, XATTR_ELASTIC, XATTR_WORKERS
    from ..launch import JOBS_DIR

    async with Client.open(meta_url, transport="tcp") as client:
        try:
            top = await client.meta.resolve(JOBS_DIR)
        except NotFound:
            return []
        found = []
        for name, inode in sorted(await client.meta.readdir(top.ino)):
            if not inode.is_dir:
                continue
            got: dict[str, Any] = {"name": name.decode(errors="replace"), "path": f"{JOBS_DIR}/{name.decode()}",
                                   "mtime_ns": inode.mtime_ns}
            for key_, xattr in (("workers", XATTR_WORKERS), ("consistency", XATTR_CONSISTENCY),
                                ("elastic", XATTR_ELASTIC)):
                try:
                    got[key_] = (await client.meta.getxattr(inode.ino, xattr)).decode(errors="replace")
                except NoAttribute:
                    got[key_] = None
            files = size = 0
            todo = [inode.ino]
            while todo:
                with contextlib.suppress(NotFound):
                    for _, child in await client.meta.readdir(todo.pop()):
                        if child.is_dir:
                            todo.append(child.ino)
                        else:
                            files, size = files + 1, size + child.size
            got.update(files=files, bytes=size)
            found.append(got)
        return found


@job.command("list")
@META_OPTION
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout (sizes in bytes, times in ns).")
@friendly
def job_list(meta_url: str, as_json: bool) -> None:
    """The jobs under /jobs: name, workers, consistency, files, bytes, last change."""
    import json
    from datetime import datetime

    jobs = trio.run(_jobs, meta_url)
    if as_json:
        out.print_json(json.dumps(jobs))
        return
    if not jobs:
        console.print(f"no jobs in {_redact(meta_url)} (`irdma run --job NAME` makes /jobs/NAME)", highlight=False)
        return
    table = Table(title=f"jobs of {_redact(meta_url)}")
    for col in ("name", "workers", "consistency", "files", "size", "changed"):
        table.add_column(col, justify="right" if col in ("workers", "files", "size") else "left")
    for j in jobs:
        workers = j["workers"] or "-"
        table.add_row(escape(j["name"]), workers + (f" ({j['elastic']})" if j["elastic"] else ""),
                      escape(j["consistency"] or "asp"), str(j["files"]), format_size(j["bytes"]),
                      datetime.fromtimestamp(j["mtime_ns"] / 1e9).strftime("%Y-%m-%d %H:%M:%S"))
    out.print(table)


async def _remove_job(meta_url: str, name: str) -> tuple[int, int]:
    """Remove /jobs/NAME and everything in it (files' chunks freed now, as `rm -r` through a
    mount does); returns (files, directories) removed."""
    from ..._errors import NotEmpty
    from ...client.native import Client
    from ..launch import JOBS_DIR

    async with Client.open(meta_url, transport="tcp") as client:
        top = await client.meta.resolve(JOBS_DIR)
        job_dir = await client.meta.resolve(f"{JOBS_DIR}/{name}")
        if not job_dir.is_dir:
            raise InvalidArgument(f"{JOBS_DIR}/{name} is no job directory", "`irdma job list` names the jobs")
        counts = [0, 0]

        async def remove(parent: int, entry: bytes, ino: int) -> None:
            for child_name, child in await client.meta.readdir(ino):
                if child.is_dir:
                    await remove(ino, child_name, child.ino)
                else:
                    gone = await client.meta.unlink(ino, child_name)
                    counts[0] += 1
                    if gone.nlink <= 0:
                        await client.destroy_if_unused(gone.ino, grace=False)
            try:
                await client.meta.rmdir(parent, entry)
            except NotEmpty:
                raise IrdmaError(f"{JOBS_DIR}/{name}: a directory in it is not empty after its entries were removed"
                                 " (snapshots of it?)", f"`irdma snapshot list {JOBS_DIR}/{name}` lists them; delete"
                                 " them, then run this again") from None
            counts[1] += 1

        await remove(top.ino, name.encode(), job_dir.ino)
        return counts[0], counts[1]


@job.command("remove")
@click.argument("name")
@META_OPTION
@click.option("--yes", is_flag=True, help="Do not ask.")
@friendly
def job_remove(name: str, meta_url: str, yes: bool) -> None:
    """Remove job NAME: its directory /jobs/NAME and every file in it (their chunks are freed).
    Stop its workers first: a run of the job after this starts afresh."""
    if not name or "/" in name or name in (".", ".."):
        raise InvalidArgument(f"{name!r} is no job name (one path component)", "`irdma job list` names the jobs")
    if not yes and not click.confirm(f"remove /jobs/{name} and every file in it?", err=True):
        raise IrdmaError("nothing removed", "pass --yes to remove without asking")
    files, dirs = trio.run(_remove_job, meta_url, name)
    console.print(f"removed job {name}: /jobs/{name}, {_count(files, 'file')} and {dirs} director{'y' if dirs == 1 else 'ies'}",
                  highlight=False)
