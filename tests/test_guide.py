"""docs/speculative_decoding.md runs as written: every fenced block carries a `<!-- guide-test: KIND -->` note and is
run by its kind. `launch`: `tandem serve` as written (on free ports) until its ready line, then the `client` snippets
that follow it against that stack, then Ctrl-C; `setup`: bash run before the next launch; `refused "TEXT"`: the
command exits 1 at start-up with TEXT on one line; `gpu`: a CUDA command, checked by the CLI's start-up checks
(parse, refusals, speculative shape) without a GPU; `parse`: a command for models or hosts CI does not have, parsed.
A guide that drifts from the code fails here.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tandem.cli import build_parser, prepare
from tests.e2e.helpers import free_port

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "speculative_decoding.md"
NOTE = re.compile(r'<!-- guide-test: (\w+)(?: "([^"]*)")? -->\n```(\w+)\n(.*?)^```$', re.S | re.M)
KINDS = {"launch", "client", "setup", "refused", "gpu", "parse"}


@dataclass
class Block:
    kind: str
    arg: str | None
    lang: str
    code: str
    line: int


@dataclass
class Launch:
    block: Block
    setups: list[Block] = field(default_factory=list)
    clients: list[Block] = field(default_factory=list)


def _blocks() -> list[Block]:
    text = GUIDE.read_text()
    return [Block(m[1], m[2], m[3], m[4], text[:m.start()].count("\n") + 2) for m in NOTE.finditer(text)]


def _launches() -> list[Launch]:
    launches, setups = [], []
    for block in _blocks():
        if block.kind == "setup":
            setups.append(block)
        elif block.kind == "launch":
            launches.append(Launch(block, setups))
            setups = []
        elif block.kind == "client":
            assert launches, f"line {block.line}: a client snippet before any launch command"
            launches[-1].clients.append(block)
    return launches


def _argv(block: Block) -> list[str]:
    """The tandem command of a bash block, continuation lines joined, without `tandem`."""
    argv = shlex.split(block.code.replace("\\\n", " "), comments=True)
    assert argv[:1] == ["tandem"], f"line {block.line}: expected one tandem command, got {block.code!r}"
    return argv[1:]


def _ids(item: Block | Launch) -> str:
    return f"line{(item.block if isinstance(item, Launch) else item).line}"


def test_every_fenced_block_of_the_guide_is_tested():
    text = GUIDE.read_text()
    opening = len(re.findall(r"^```\w+$", text, re.M))
    blocks = _blocks()
    assert len(blocks) == opening, "a fenced block without a <!-- guide-test: KIND --> note"
    assert {b.kind for b in blocks} <= KINDS
    assert {"launch", "client", "refused", "gpu"} <= {b.kind for b in blocks}
    for b in blocks:
        assert b.lang == ("python" if b.kind == "client" else "bash"), f"line {b.line}"


@pytest.mark.parametrize("block", [b for b in _blocks() if b.kind in ("gpu", "parse")], ids=_ids)
def test_gpu_and_external_model_commands_parse(block):
    parser = build_parser()
    args = parser.parse_args(_argv(block))  # no "unrecognized arguments"
    if block.kind == "gpu":  # everything but the device: refusals, speculative shape, warnings
        assert args.device.startswith("cuda"), f"line {block.line}: a gpu block names --device cuda"
        prepare(args, parser)


@pytest.mark.parametrize("block", [b for b in _blocks() if b.kind == "refused"], ids=_ids)
def test_refused_commands_stop_at_start_up_with_one_line(block):
    done = subprocess.run([sys.executable, "-m", "tandem.cli", *_argv(block)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 1 and block.arg in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("launch", _launches(), ids=_ids)
def test_launch_command_serves_the_snippets_that_follow_it(launch, tmp_path):
    for setup in launch.setups:
        subprocess.run(["bash", "-euo", "pipefail", "-c", setup.code], cwd=REPO, check=True, timeout=120)
    http, grpc_port = free_port(), free_port()
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    cmd = [sys.executable, "-m", "tandem.cli", *_argv(launch.block), "--port", str(http), "--grpc-port",
           str(grpc_port)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=stderr)
    try:
        deadline = time.monotonic() + 240
        while "tandem serve: ready" not in out.read_text():
            assert proc.poll() is None, f"line {launch.block.line}: exited {proc.returncode}\n{err.read_text()}"
            assert time.monotonic() < deadline, f"line {launch.block.line}: not ready\n{err.read_text()}"
            time.sleep(0.2)
        warnings = [line for line in err.read_text().splitlines() if line.startswith("warning:")]
        assert warnings == [], f"line {launch.block.line}: the guide's command warns: {warnings}"
        for client in launch.clients:
            code = client.code.replace("localhost:30000", f"localhost:{http}").replace(
                "localhost:30001", f"localhost:{grpc_port}")
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=180,
                                  env=dict(os.environ, PYTHONPATH=str(REPO)))
            assert done.returncode == 0, f"snippet at line {client.line}:\n{done.stderr}"
            assert done.stdout.strip(), f"snippet at line {client.line} printed nothing"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    assert code == 0, f"line {launch.block.line}: Ctrl-C gave exit code {code}\n{err.read_text()}"
