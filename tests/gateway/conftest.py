"""Fixtures for the gateway front-end tests: a tiny real tokenizer (byte-level BPE + ChatML, saved as an HF folder),
a deterministic FakeBackend, and a real uvicorn server on a free loopback port in a background thread.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher
from gateway.tokenizer import Tokenizer
from gateway.types import FinishReason, GatewayError, GenerateChunk, GenerateParams, Usage
from tandem.launch import free_port  # noqa: F401 (the tests' port helper)

EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML = ("{%- for message in messages -%}"
          "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
          "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and verifies them with the target model.",
    "def add(a, b):\n    return a + b\n",
    "Héllo wörld, café crème, naïve résumé.",
    "日本語のテキストと中文文本。",
    "Emoji: 🙂🚀✨ and symbols € £ ¥.",
    "hello world hello there general kenobi",
] * 4
MODEL_NAME = "tiny-test"


def build_tiny_tokenizer(folder: Path, with_chat_template: bool = True) -> Path:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOT, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(SENTENCES, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=EOT, eos_token=EOT, pad_token=EOT,
                                 additional_special_tokens=[IM_START, IM_END], clean_up_tokenization_spaces=False)
    if with_chat_template:
        hf.chat_template = CHATML
    hf.save_pretrained(folder)
    # The model's generation config lists <|im_end|> as a second EOS (as chat models do).
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return folder


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir) -> Tokenizer:
    return Tokenizer(tokenizer_dir)


class FakeBackend:
    """Deterministic GenerationBackend: emits the prompt's tokens reversed (cycled) in chunks of 1, 2, 3, 1, 2, 3...
    tokens, detokenized and stop-string-checked like the scheduler does; stops at EOS / stop_token_ids unless
    ignore_eos. Records every request, every early close and every abort (thread-safe: uvicorn runs it in its own
    thread). Knobs: `hang_after_chunks` (then wait until closed or aborted), `abort_after_chunks`, `admission_error`,
    `mid_stream_error`.
    """

    def __init__(self, tokenizer: Tokenizer | None, max_context_len: int = 256, eos_token_ids=(0, 2)):
        self.tokenizer = tokenizer
        self.model_name = MODEL_NAME
        self.max_context_len = max_context_len
        self.eos_token_ids = list(eos_token_ids)
        self.requests: list[GenerateParams] = []
        self.closed_early: list[str] = []  # request ids whose iterator was closed before finishing
        self.aborted: list[str] = []
        self.closed_event = threading.Event()
        self.hang_after_chunks: int | None = None
        self.admission_error: GatewayError | None = None
        self.mid_stream_error: GatewayError | None = None
        self.abort_after_chunks: int | None = None  # then finish with ABORT as a server-side abort would
        self.healthy = True
        self._abort_events: dict[str, asyncio.Event] = {}

    def health(self) -> bool:
        return self.healthy

    def output_ids(self, params: GenerateParams) -> list[int]:
        """The token ids this backend generates for `params`, ignoring stops (for expected values in tests)."""
        rev = params.prompt_token_ids[::-1]
        return [rev[i % len(rev)] for i in range(params.max_new_tokens)]

    @staticmethod
    def fake_logprob(token: int, k: int) -> tuple[float, list[int], list[float]]:
        """Deterministic (logprob, top ids, top logprobs) of a token, as a target would return them."""
        return -0.01 * (token % 97), [token, (token + 1) % 256][:k], [-0.01 * (token % 97), -5.0][:k]

    async def abort(self, request_id: str) -> bool:
        event = self._abort_events.get(request_id)
        if event is None:
            return False
        self.aborted.append(request_id)
        event.set()
        return True

    async def generate(self, params: GenerateParams) -> AsyncIterator[GenerateChunk]:
        if self.admission_error is not None:
            raise self.admission_error
        self.requests.append(params)
        abort_event = self._abort_events.setdefault(params.request_id, asyncio.Event())
        detok = IncrementalDetokenizer(self.tokenizer) if params.detokenize else None
        stops = StopStringMatcher(params.stop) if params.detokenize and params.stop else None
        out = self.output_ids(params)
        stop_ids = set() if params.ignore_eos else {*self.eos_token_ids, *params.stop_token_ids}
        finished, pos, num_chunks = False, 0, 0
        try:
            while True:
                if self.hang_after_chunks is not None and num_chunks >= self.hang_after_chunks:
                    await abort_event.wait()
                if abort_event.is_set() or num_chunks == self.abort_after_chunks:
                    finished = True
                    yield GenerateChunk([], finish_reason=FinishReason.ABORT, usage=self._usage(params, pos, 0))
                    return
                if self.mid_stream_error is not None and num_chunks == 1:
                    raise self.mid_stream_error
                await asyncio.sleep(0)  # a scheduler step
                size = num_chunks % 3 + 1
                ids = out[pos:pos + size]
                finish = None
                for j, t in enumerate(ids):
                    if t in stop_ids:
                        ids, finish = ids[: j + 1], FinishReason.STOP
                        break
                pos += len(ids)
                num_chunks += 1
                if finish is None and pos >= len(out):
                    finish = FinishReason.LENGTH
                text, matched = "", None
                if detok is not None:
                    text = detok.push(ids)
                    if finish is not None:
                        text += detok.flush()
                    if stops is not None:
                        text, matched = stops.push(text)
                        if matched is not None:
                            finish = FinishReason.STOP
                        elif finish is not None:
                            text += stops.flush()
                lps = None if params.logprobs is None else [self.fake_logprob(t, params.logprobs) for t in ids]
                if finish is not None:
                    finished = True
                    yield GenerateChunk(ids, text, finish, self._usage(params, pos, num_chunks), matched, lps)
                    return
                yield GenerateChunk(ids, text, logprobs=lps)
        finally:
            if not finished:
                self.closed_early.append(params.request_id)
                self.closed_event.set()
            self._abort_events.pop(params.request_id, None)

    @staticmethod
    def _usage(params: GenerateParams, num_tokens: int, num_chunks: int) -> Usage:
        steps = max(num_chunks - 1, 0)
        return Usage(prompt_tokens=len(params.prompt_token_ids), completion_tokens=num_tokens, verify_steps=steps,
                     accepted_draft_tokens=max(num_tokens - num_chunks, 0), proposed_draft_tokens=3 * steps)


@pytest.fixture
def backend(tokenizer) -> FakeBackend:
    return FakeBackend(tokenizer)


class ServerThread:
    """A real uvicorn server for `app` on a free loopback port, in a background thread."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, timeout_s: float = 20.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.thread.is_alive(), "uvicorn exited during startup"
            try:
                if httpx.get(f"{self.base_url}/v1/models", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.02)  # poll interval while waiting for the health endpoint
        raise TimeoutError("uvicorn did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def make_server():
    servers: list[ServerThread] = []

    def make(app) -> ServerThread:
        servers.append(ServerThread(app).start())
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


@pytest.fixture
def server(make_server, backend, tokenizer):
    from gateway.openai_api import build_app

    return make_server(build_app(backend, tokenizer, MODEL_NAME, max_model_len=backend.max_context_len,
                                 max_body_bytes=1 << 20))
