"""A real PostgreSQL 15 for tests: :class:`irdma.ops.testbed.PostgresServer` (Debian's binaries,
run as the postgres OS user in a temporary directory, a private socket directory and a free
port of 127.0.0.1, ``fsync=off``; superuser logins on the socket only, TCP logins with a
password as on a real deployment; stopped and removed on exit, also when the block raises).

:meth:`PgServer.new_database` gives each test a database of its own; :func:`available` says
why PostgreSQL cannot run here ("" if it can).
"""

from __future__ import annotations

from irdma.ops.testbed import PostgresServer as PgServer
from irdma.ops.testbed import postgres_available as available

#: ``with postgres_server() as server:`` starts one (about two seconds).
postgres_server = PgServer

__all__ = ["PgServer", "available", "postgres_server"]
