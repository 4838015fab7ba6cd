"""Host-side checks of deploy/docker/compose_smoke.sh, run against Envoy's published port.

    python deploy/docker/smoke_checks.py reference --out ref.json         # greedy text of a host `tandem serve`
    python deploy/docker/smoke_checks.py edge --edge HOST:PORT --reference ref.json
    python deploy/docker/smoke_checks.py failover --edge HOST:PORT --target NAME=IP --target NAME=IP

Each check prints one line `PASS|FAIL <name> (<seconds>s): <detail>`; the exit status is the number of failures.
Every wait has a deadline. Needs the project's Python environment (openai, grpcio, the tandem packages).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

MODEL = "tandem-demo-code"
PROMPT = "def fibonacci(n):"  # the README's example
MAX_TOKENS = 48
# Long enough (ignore_eos) that the stream is still running when its target container is killed.
FAILOVER_PROMPT = "import os\nimport sys\n\n\ndef main():"
FAILOVER_TOKENS = 240

_failures = 0


def report(name: str, ok: bool, started: float, detail: str) -> None:
    global _failures
    _failures += 0 if ok else 1
    print(f"{'PASS' if ok else 'FAIL'} {name} ({time.monotonic() - started:.1f}s): {detail}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def _client(base_url: str):
    import openai

    return openai.OpenAI(base_url=base_url, api_key=os.environ.get("TANDEM_API_KEY", "none"), timeout=120,
                         max_retries=0)


def _completion(base_url: str, prompt: str, max_tokens: int, **extra) -> str:
    resp = _client(base_url).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                extra_body=extra or None)
    return resp.choices[0].text


def _short(text: str, n: int = 60) -> str:
    return json.dumps(text[:n] + ("…" if len(text) > n else ""))


# ------------------------------------------------------------------------------------------------------ reference


def cmd_reference(args) -> int:
    """`tandem serve` on this host (same bundled models, STANDALONE, CPU): the greedy text the stack must match."""
    started = time.monotonic()
    port, grpc_port = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "tandem", "serve", "--speculative-algorithm", "STANDALONE", "--device", "cpu",
           "--port", str(port), "--grpc-port", str(grpc_port)]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {proc.returncode}: {''.join(lines[-20:])}")
            try:
                if _get(base + "/health", timeout=2):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"tandem serve not healthy after {args.timeout:.0f}s: {''.join(lines[-20:])}")
            time.sleep(0.5)
        text = _completion(base + "/v1", PROMPT, MAX_TOKENS)
        Path(args.out).write_text(json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "text": text}))
        report("reference", bool(text), started, f"host tandem serve greedy {MAX_TOKENS} tokens: {_short(text)}")
    except Exception as exc:  # noqa: BLE001 - one FAIL line, not a traceback
        report("reference", False, started, f"{type(exc).__name__}: {exc}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    return _failures


# ----------------------------------------------------------------------------------------------------------- edge


def _check(name: str, fn) -> None:
    started = time.monotonic()
    try:
        ok, detail = fn()
    except Exception as exc:  # noqa: BLE001
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    report(name, ok, started, detail)


def cmd_edge(args) -> int:
    import grpc

    from protos.tandem.v1 import tandem_pb2 as pb
    from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc

    ref = json.loads(Path(args.reference).read_text())
    edge = f"http://{args.edge}"
    expected = ref["text"]

    def completion():
        text = _completion(edge + "/v1", ref["prompt"], ref["max_tokens"])
        return text == expected, (f"openai client, greedy text == host tandem serve's: {_short(text)}"
                                  if text == expected else f"got {text!r}, host tandem serve gave {expected!r}")

    def streamed_chat():
        client = _client(edge + "/v1")
        messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
        plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
        whole = plain.choices[0].message.content
        pieces, finish = [], None
        for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                    stream=True):
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        text = "".join(pieces)
        ok = text == whole and len(pieces) > 1 and finish in ("stop", "length")
        return ok, (f"{len(pieces)} chunks, finish_reason={finish}, text == non-streamed chat's: {_short(text)}"
                    if ok else f"{len(pieces)} chunks, finish={finish}, streamed {text!r} vs plain {whole!r}")

    def grpc_generate():
        host, port = args.edge.rsplit(":", 1)
        with grpc.insecure_channel(f"{host}:{port}") as channel:
            responses = list(pb_grpc.GatewayStub(channel).Generate(
                pb.GenerateRequest(text=ref["prompt"], max_new_tokens=ref["max_tokens"]), timeout=120))
        text = "".join(r.text for r in responses)
        last = responses[-1]
        ok = text == expected and last.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        return ok, (f"{len(responses)} messages through Envoy's gRPC route, text == host's, "
                    f"{last.usage.completion_tokens} tokens, accept length {last.usage.mean_accept_length:.2f}"
                    if ok else f"got {text!r} (finish {last.finish_reason}), expected {expected!r}")

    def transcoded_generate():
        body = json.dumps({"text": ref["prompt"], "max_new_tokens": ref["max_tokens"]}).encode()
        req = urllib.request.Request(edge + "/v1/generate", data=body, headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, messages = resp.status, json.loads(resp.read())
        text = "".join(m.get("text", "") for m in messages)
        ok = status == 200 and text == expected and messages[-1]["finish_reason"] != "FINISH_REASON_UNSPECIFIED"
        return ok, (f"HTTP {status}, {len(messages)} JSON messages (grpc_json_transcoder), text == host's"
                    if ok else f"HTTP {status}, got {text!r}, expected {expected!r}")

    _check("completion", completion)
    _check("streamed-chat", streamed_chat)
    _check("grpc-generate", grpc_generate)
    _check("rest-generate", transcoded_generate)
    return _failures


# ------------------------------------------------------------------------------------------------------- failover


def _pods_up(edge: str) -> dict[str, set[str]]:
    """kind -> addresses the gateway routes to (tandem:pod_up == 1), from its /metrics through Envoy."""
    up: dict[str, set[str]] = {"target": set(), "draft": set()}
    for m in re.finditer(r'^tandem:pod_up\{([^}]*)\} ([0-9.]+)$', _get(f"http://{edge}/metrics"), re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if float(m.group(2)) == 1.0 and labels.get("kind") in up:
            up[labels["kind"]].add(labels["address"])
    return up


def _running_seqs(ip: str) -> float:
    text = _get(f"http://{ip}:30011/metrics", timeout=2)
    m = re.search(r'^tandem:num_running_seqs\{[^}]*\} ([0-9.]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def cmd_failover(args) -> int:
    targets = dict(t.split("=", 1) for t in args.target)  # container name -> IP
    edge = f"http://{args.edge}"

    started = time.monotonic()
    deadline = started + args.timeout
    up = {}
    while time.monotonic() < deadline:
        try:
            up = _pods_up(args.edge)
        except OSError:
            up = {}
        if up and len(up["target"]) >= 2 and len(up["draft"]) >= 2:
            break
        time.sleep(1.0)
    ok = bool(up) and len(up["target"]) >= 2 and len(up["draft"]) >= 2
    report("scale-discovered", ok, started,
           f"gateway routes to targets {sorted(up.get('target', []))} and drafts {sorted(up.get('draft', []))} "
           "(DNS re-resolution, no restart)")
    if not ok:
        return _failures

    started = time.monotonic()
    try:
        expected = _completion(edge + "/v1", FAILOVER_PROMPT, FAILOVER_TOKENS, ignore_eos=True)
        stream = _client(edge + "/v1").completions.create(model=MODEL, prompt=FAILOVER_PROMPT,
                                                          max_tokens=FAILOVER_TOKENS, temperature=0, stream=True,
                                                          extra_body={"ignore_eos": True})
        pieces: list[str] = []
        finish = None
        victim = None
        kill_at = None
        for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].text or "")
                finish = chunk.choices[0].finish_reason or finish
            if victim is None and len(pieces) >= 2 and finish is None:
                busy = [name for name, ip in targets.items() if _running_seqs(ip) > 0]
                if len(busy) == 1:
                    victim = busy[0]
                    subprocess.run([os.environ.get("DOCKER_BIN", "docker"), "kill", victim], check=True, capture_output=True, timeout=30)
                    kill_at = len(pieces)
        text = "".join(pieces)
        after = len(pieces) - (kill_at or len(pieces))
        ok = victim is not None and after > 0 and text == expected and finish == "length"
        report("failover-stream", ok, started,
               f"killed {victim} (the target holding the sequence) after {kill_at} chunks; {after} more chunks, "
               f"finish_reason={finish}, text == unkilled run's ({len(text)} chars)" if ok else
               f"victim={victim}, chunks before kill={kill_at}, after={after}, finish={finish}, "
               f"same text={text == expected}: {text[:200]!r} vs {expected[:200]!r}")
    except Exception as exc:  # noqa: BLE001
        report("failover-stream", False, started, f"{type(exc).__name__}: {exc}")
    return _failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("reference")
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=180.0)
    p = sub.add_parser("edge")
    p.add_argument("--edge", required=True, help="HOST:PORT of Envoy's listener")
    p.add_argument("--reference", required=True)
    p = sub.add_parser("failover")
    p.add_argument("--edge", required=True)
    p.add_argument("--target", action="append", required=True, help="NAME=IP of each target container")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the gateway to see the pods")
    args = parser.parse_args(argv)
    return {"reference": cmd_reference, "edge": cmd_edge, "failover": cmd_failover}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
