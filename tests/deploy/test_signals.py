"""A service stops on SIGTERM while it is still starting (loading weights). As PID 1 of a container the kernel
ignores SIGTERM unless the process installed a handler, so `docker stop` during start-up used to wait for SIGKILL
(found by deploy/docker/compose_smoke.sh: exit 137 after the full timeout)."""
from __future__ import annotations

import subprocess
import sys
import time

from tests.deploy.conftest import REPO_ROOT

_STARTING_SERVICE = """
import argparse, os, signal, time
from tandem.services import main_async

async def loading(args):
    os.kill(os.getpid(), signal.SIGTERM)  # docker stop, while the service is still loading (synchronous work)
    time.sleep(30)

main_async(loading, argparse.Namespace(log_level="info", log_format="text"))
"""


def test_sigterm_during_startup_exits_with_143():
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _STARTING_SERVICE], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 128 + 15, proc.stderr  # a handler ran (no handler: -15 here, ignored as PID 1)
    assert time.monotonic() - started < 20
