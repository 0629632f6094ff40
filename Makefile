# irdma: `make demo` runs the whole path end to end; `make test` runs the test suite.
# Both install what is missing first (Debian packages, a virtual environment in .venv).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo demo-hosts demo-ha test test-long test-fast chaos test-verbs vm-image bench bench-hosts bench-comm train-table lint clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	@command -v fusermount3 >/dev/null && pkg-config --exists fuse3 2>/dev/null && command -v redis-server >/dev/null \
	  && dpkg -s python3-pyverbs >/dev/null 2>&1 && test -x /usr/lib/postgresql/15/bin/pg_ctl && command -v fio >/dev/null \
	  && command -v autoreconf >/dev/null && command -v automake >/dev/null && command -v cc >/dev/null && command -v make >/dev/null && command -v prove >/dev/null \
	  && command -v patroni >/dev/null && command -v etcd >/dev/null && command -v curl >/dev/null || { \
	  echo "==> installing fuse3, libfuse3-dev, pkg-config, attr, python3-pyverbs, redis-server, postgresql-15, patroni, etcd-server, curl, iproute2, fio, and autoconf, automake, gcc, make, perl to build and run pjdfstest (apt)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 libfuse3-dev pkg-config attr python3-pyverbs redis-server postgresql-15 patroni etcd-server curl iproute2 fio autoconf automake gcc make perl >/dev/null; }
	@test -x $(PY) || { echo "==> creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "==> installing irdma and its dependencies into $(VENV) (TensorFlow takes about a minute)"
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[tf,dev,bench]'
	@touch $(STAMP)

demo: install
	$(PY) examples/demo.py

# The side-by-side benchmark suite (about 3 minutes): writes docs/benchmarks.md and plots.
bench: install
	$(PY) benchmarks/run.py

# The accuracy table of docs/training.md (about 25 minutes on 2 quiet cores, 3 seeds a row):
# examples/keras_digits.py under ASP, BSP and SSP:2 at 2 and 4 workers with SGD+momentum and Adam
# on the shards, against one process (batch N x 32 for BSP, 32 for ASP/SSP).
train-table: install
	$(PY) benchmarks/train_table.py

# Across hosts (network namespaces with shaped links, PostgreSQL metadata; root): writes
# docs/benchmarks-hosts.md and docs/bench-hosts.png (a few minutes).
bench-hosts: install
	$(PY) benchmarks/hosts.py

# Less and smarter communication on shaped links (P3 priority slicing, layer dropping, compression,
# hierarchy, the cost model; root): writes docs/communication.md, .json and .png (about 15 minutes).
# `make bench-comm ARGS=--quick` is the smoke run (about 2 minutes).
bench-comm: install
	$(PY) benchmarks/comm.py $(ARGS)

# irdma on six hosts (network namespaces; root): PostgreSQL, three shard hosts, two worker hosts
# training across them with a checkpoint saved on one and restored on the other.
demo-hosts: install
	$(PY) examples/demo_hosts.py

# The HA metadata tier (Patroni + etcd on three hosts) and its primary killed mid-training.
demo-ha: install
	$(PY) examples/demo_ha.py

test: install
	$(PY) -m pytest -v --durations=10 -m "not long" tests

# What `make test` leaves out for CI's time (about 20 min here, from the tests' times; not run whole this stop):
# nemesis schedules 4-10, more fsx seeds,
# the benchmark tools' smoke runs, and the longest training-under-faults and lifecycle tests
# (each marked `@pytest.mark.long` with its time).
test-long: install
	$(PY) -m pytest -v --durations=10 -m long tests

test-fast: install
	$(PY) -m pytest -q -m "not tf and not slow" tests

# The nemesis of issue 20 at length (tests/nemesis.py): NEMESIS_SCHEDULES seeded schedules
# (default 200) of NEMESIS_SECONDS seconds of faults each (default 10) against a 3-shard,
# 2-replica cluster; every failure prints its seed (rerun one: NEMESIS_SEED=N make chaos).
chaos: install
	NEMESIS_SCHEDULES=$${NEMESIS_SCHEDULES:-200} NEMESIS_SECONDS=$${NEMESIS_SECONDS:-10} \
	  $(PY) -m pytest -q -rf tests/test_nemesis.py -k test_nemesis_schedule

# Real RDMA verbs: build (or reuse) the Soft-RoCE VM image and run the verbs suite inside it.
vm-image:
	tests/vm/softroce-vm.sh build

test-verbs: vm-image
	@set -o pipefail; start=$$(date +%s); \
	tests/vm/softroce-vm.sh run sh tests/vm/run-verbs-tests.sh 2>&1 | tee .verbs-stage.log; rc=$$?; \
	echo "==> verbs stage: exit $$rc in $$(( $$(date +%s) - start )) s (VM boot and tests)"; \
	test $$rc -eq 0 && grep -q "VERBS STAGE PASSED" .verbs-stage.log

lint: install
	$(VENV)/bin/ruff check irdma fs server examples tests tools
	$(PY) tools/typecheck.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
