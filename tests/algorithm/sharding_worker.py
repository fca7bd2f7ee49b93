"""One of the two processes of the multi-host run in ``tests/algorithm/test_sharding.py``.

``python -m tests.algorithm.sharding_worker OUT PROCESS PORT`` joins ``jax.distributed`` on
127.0.0.1:PORT as process ``PROCESS`` of 2 before anything touches the XLA backend (importing
braintrace and the test models does), then runs
:func:`tests.algorithm.sharding_script.multihost_run`.
"""

from __future__ import annotations

import sys

import jax

if __name__ == "__main__":
    jax.distributed.initialize(f"127.0.0.1:{sys.argv[3]}", num_processes=2, process_id=int(sys.argv[2]))
    from tests.algorithm.sharding_script import multihost_run

    multihost_run(sys.argv[1])
