"""Bounded load generator for the OpenAI front: N concurrent streaming clients (httpx on asyncio) send a fixed number
of requests, optionally cancelling a share of them mid-stream, and report TTFT / ITL / e2e percentiles and throughput
as JSON plus a markdown table. With --launch it starts `tandem serve` itself (flags after `--`) and stops it after.

    python bench/serve.py --base-url http://127.0.0.1:30000 --concurrency 32 --num-requests 256 --max-tokens 64
    python bench/serve.py --launch --concurrency 32 --num-requests 128 -- --speculative-algorithm STANDALONE

TTFT is request sent → first chunk with text; ITL is the gap between consecutive text chunks (one chunk per
speculative step, which may carry several tokens); e2e is request sent → `[DONE]`. Speed is measured, never asserted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from tandem.launch import free_port as _free_port  # noqa: E402

DEFAULT_PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\ndef main():\n    ",
    "class Stack:\n    def __init__(self):\n        ",
    "for i in range(10):\n    print(",
    "def read_config(path):\n    with open(path) as f:\n        ",
    "# Parse command line arguments\nparser = argparse.ArgumentParser(",
    "def quicksort(items):\n    if len(items) <= 1:\n        return items\n    ",
    "try:\n    import json\nexcept ImportError:\n    ",
]


@dataclass
class LoadConfig:
    base_url: str
    concurrency: int = 8
    num_requests: int = 32
    max_tokens: int = 64
    cancel_ratio: float = 0.0  # share of requests the client abandons mid-stream
    cancel_after_chunks: int = 2  # text chunks read before abandoning
    temperature: float = 0.0
    ignore_eos: bool = True  # fixed output lengths make runs comparable
    chat: bool = False
    model: str | None = None  # default: the first model /v1/models lists
    api_key: str | None = None
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.num_requests < 1 or self.max_tokens < 1:
            raise ValueError("concurrency, num_requests and max_tokens must be >= 1")
        if not 0.0 <= self.cancel_ratio <= 1.0:
            raise ValueError("cancel_ratio must be in [0, 1]")


@dataclass
class RequestRecord:
    index: int
    planned_cancel: bool
    status: int = 0  # HTTP status, 0 = no response
    ok: bool = False  # finished with [DONE] and no error (or was cancelled as planned)
    cancelled: bool = False
    error: str = ""
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None


async def run_load(cfg: LoadConfig) -> tuple[list[RequestRecord], float]:
    """Send cfg.num_requests requests over cfg.concurrency concurrent streams; returns (records, wall seconds)."""
    # Evenly spread, exact share: request i is abandoned when the running count of cancellations steps up.
    plan = [int((i + 1) * cfg.cancel_ratio) > int(i * cfg.cancel_ratio) for i in range(cfg.num_requests)]
    headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency + 4, max_keepalive_connections=cfg.concurrency + 4)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout_s, connect=10.0)) as client:
        model = cfg.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        records = [RequestRecord(i, plan[i]) for i in range(cfg.num_requests)]
        next_index = iter(range(cfg.num_requests))

        async def worker() -> None:
            for i in next_index:
                await _one(client, cfg, model, records[i])

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
        return records, time.perf_counter() - start


async def _one(client: httpx.AsyncClient, cfg: LoadConfig, model: str, rec: RequestRecord) -> None:
    prompt = cfg.prompts[rec.index % len(cfg.prompts)]
    body = {"model": model, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": cfg.ignore_eos}
    if cfg.chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    sent = time.perf_counter()
    last = None
    num_text_chunks = 0
    done = False
    try:
        async with client.stream("POST", path, json=body) as response:
            rec.status = response.status_code
            if response.status_code != 200:
                rec.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    rec.error = f"stream error: {event['error'].get('message')}"
                    return
                if event.get("usage"):
                    rec.completion_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or []:
                    text = choice.get("text") if not cfg.chat else (choice.get("delta") or {}).get("content")
                    if choice.get("finish_reason"):
                        rec.finish_reason = choice["finish_reason"]
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            rec.ttft_s = now - sent
                        else:
                            rec.itl_s.append(now - last)
                        last = now
                        num_text_chunks += 1
                if rec.planned_cancel and num_text_chunks >= cfg.cancel_after_chunks:
                    rec.cancelled = True  # leaving the block closes the connection: the server sees a disconnect
                    break
    except (httpx.HTTPError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        return
    if rec.cancelled:
        rec.ok = True
        return
    rec.e2e_s = time.perf_counter() - sent
    rec.ok = done and rec.finish_reason is not None
    if not rec.ok:
        rec.error = "stream ended without a finish reason and [DONE]"


def percentiles(values: list[float], qs=(50, 90, 99)) -> dict[str, float | None]:
    """Linear-interpolated percentiles in milliseconds (None when there are no values)."""
    out: dict[str, float | None] = {}
    ordered = sorted(values)
    for q in qs:
        if not ordered:
            out[f"p{q}"] = None
            continue
        pos = (len(ordered) - 1) * q / 100
        lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
        out[f"p{q}"] = round((ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)) * 1e3, 3)
    return out


def summarize(records: list[RequestRecord], wall_s: float, cfg: LoadConfig | None = None) -> dict:
    completed = [r for r in records if r.ok and not r.cancelled]
    errors = [r for r in records if not r.ok]
    tokens = sum(r.completion_tokens for r in completed)
    summary = {
        "requests": len(records),
        "completed": len(completed),
        "cancelled": sum(r.cancelled for r in records),
        "errors": len(errors),
        "error_samples": [r.error for r in errors[:5]],
        "status_counts": _counts(str(r.status) for r in records),
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(completed) / wall_s, 3) if wall_s else None,
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall_s, 2) if wall_s else None,
        "ttft_ms": percentiles([r.ttft_s for r in completed if r.ttft_s is not None]),
        "itl_ms": percentiles([x for r in completed for x in r.itl_s]),
        "e2e_ms": percentiles([r.e2e_s for r in completed if r.e2e_s is not None]),
        "tokens_per_chunk": round(tokens / max(1, sum(len(r.itl_s) + 1 for r in completed)), 3),
    }
    if cfg is not None:
        summary["config"] = {k: v for k, v in asdict(cfg).items() if k not in ("prompts", "api_key")}
    return summary


def markdown(summary: dict) -> str:
    rows = ["| metric | p50 | p90 | p99 |", "|---|---|---|---|"]
    for key, label in (("ttft_ms", "TTFT (ms)"), ("itl_ms", "ITL (ms)"), ("e2e_ms", "e2e (ms)")):
        p = summary[key]
        rows.append(f"| {label} | {p['p50']} | {p['p90']} | {p['p99']} |")
    rows += ["", "| requests | completed | cancelled | errors | req/s | output tok/s | tokens/chunk |",
             "|---|---|---|---|---|---|---|",
             f"| {summary['requests']} | {summary['completed']} | {summary['cancelled']} | {summary['errors']} | "
             f"{summary['requests_per_s']} | {summary['output_tokens_per_s']} | {summary['tokens_per_chunk']} |"]
    return "\n".join(rows)


def _counts(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


# ---------------------------------------------------------------------------------------------- command line
def _launch(serve_args: list[str], timeout_s: float) -> tuple[subprocess.Popen, str]:
    port, grpc_port = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--port", str(port), "--grpc-port", str(grpc_port),
           "--log-level", "warning", *serve_args]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent.parent, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"tandem serve exited with {proc.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return proc, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    raise SystemExit("tandem serve did not become healthy")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default=None, help="gateway REST base URL (without /v1)")
    p.add_argument("--launch", action="store_true", help="start `tandem serve` (flags after --) for the run")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent streams")
    p.add_argument("--num-requests", type=int, default=32, help="total requests")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request")
    p.add_argument("--cancel-ratio", type=float, default=0.0, help="share of requests abandoned mid-stream")
    p.add_argument("--cancel-after-chunks", type=int, default=2, help="text chunks read before abandoning")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions instead of /v1/completions")
    p.add_argument("--respect-eos", action="store_true", help="stop at EOS (default: ignore_eos for fixed lengths)")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"), help="Bearer key (default: $TANDEM_API_KEY)")
    p.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    p.add_argument("--out", default=None, help="also write the JSON summary here")
    args = p.parse_args(argv)
    proc = None
    if args.launch:
        proc, base_url = _launch(serve_args, 600.0)
    elif args.base_url:
        base_url = args.base_url
    else:
        p.error("give --base-url or --launch")
    try:
        cfg = LoadConfig(base_url, args.concurrency, args.num_requests, args.max_tokens, args.cancel_ratio,
                         args.cancel_after_chunks, args.temperature, not args.respect_eos, args.chat, args.model,
                         args.api_key)
        records, wall_s = asyncio.run(run_load(cfg))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    summary = summarize(records, wall_s, cfg)
    if serve_args:
        summary["serve_args"] = serve_args
    print(json.dumps(summary, indent=2))
    print()
    print(markdown(summary))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
