#!/bin/sh
# Inside the Soft-RoCE VM: the transport conformance suite on verbs, then the end-to-end
# verbs checks (shards, a FUSE mount and the client API on transport verbs).
# Prints "VERBS STAGE PASSED" and exits 0 only if both ran with no test skipped.
set -u
SITE=/tmp/site
mkdir -p $SITE/irdma
for f in /host/irdma/*; do ln -sf "$f" $SITE/irdma/; done
ln -sfn /host/fs $SITE/irdma/fs
ln -sfn /host/server $SITE/irdma/server
export PYTHONPATH=$SITE:/host/tests PYTHONDONTWRITEBYTECODE=1
cd /tmp
python3 -c 'import irdma, pyverbs, trio, pyfuse3, numpy; from irdma.transport import verbs_status; print("guest:", verbs_status(), "trio", trio.__version__, "pyfuse3", pyfuse3.__version__)'
status=0
for suite in test_conformance.py test_verbs.py; do
  echo "== pytest $suite --transport verbs"
  python3 -m pytest -c /host/setup.cfg --rootdir /host -p no:cacheprovider -v -rs --transport verbs \
    /host/tests/$suite > /tmp/pytest.out 2>&1
  rc=$?
  cat /tmp/pytest.out
  if [ $rc -ne 0 ]; then status=1; fi
  if grep -qE "[0-9]+ skipped" /tmp/pytest.out; then echo "== $suite skipped tests on verbs: failing the stage"; status=1; fi
  if ! grep -qE "[0-9]+ passed" /tmp/pytest.out; then echo "== $suite ran no test"; status=1; fi
done
if [ $status -eq 0 ]; then echo "VERBS STAGE PASSED"; else echo "VERBS STAGE FAILED"; fi
exit $status
