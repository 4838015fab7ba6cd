"""The gateway's tokenizer: a thin wrapper over a local HF tokenizer folder that encodes prompts, renders chat
templates (with message validation), decodes output and knows the model's EOS ids.

It knows nothing about requests, sampling or the wire; it never imports torch.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gateway.types import InvalidRequest

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class Tokenizer:
    """Wraps `transformers.AutoTokenizer.from_pretrained(path)` for a local folder (no downloads)."""

    def __init__(self, path: str | Path):
        import transformers  # heavy import: only when a tokenizer is actually built

        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"tokenizer folder not found: {folder}")
        self.path = folder
        self.hf = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.eos_token_ids: list[int] = _eos_token_ids(self.hf, folder)
        # No token covers more UTF-8 bytes than its vocabulary string has (byte-level BPE: one char per byte;
        # SentencePiece: "▁" and "<0xNN>" are longer than what they stand for), so bytes / this bounds the count.
        self.max_token_bytes = max((len(t.encode()) for t in self.hf.get_vocab()), default=1) or 1

    @property
    def vocab_size(self) -> int:
        return len(self.hf)  # added tokens included, unlike hf.vocab_size

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, max_len: int | None = None) -> list[int]:
        """Tokenize a plain completion prompt; special tokens (e.g. BOS) as the tokenizer's HF default adds them.

        max_len: reject (InvalidRequest) a text that certainly has more tokens, without tokenizing it (an 8 MiB
        prompt takes seconds to tokenize and would hold the event loop).
        """
        self._check_len(text, max_len, "prompt")
        return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], max_len: int | None = None) -> list[int]:
        """Render OpenAI-style messages with the generation prompt appended and tokenize them.

        The rendered text already holds the template's special tokens, so none are added again (HF's own rule).
        """
        if not self.has_chat_template:
            raise InvalidRequest("this model's tokenizer has no chat template; use /v1/completions instead",
                                 "messages")
        normalized = normalize_messages(messages)
        for i, message in enumerate(normalized):  # before the template: jinja would fail later with a 500
            self._check_len(message["content"], None, f"messages[{i}].content")
        try:
            text = self.hf.apply_chat_template(normalized, tokenize=False, add_generation_prompt=True)
        except InvalidRequest:
            raise
        except Exception as exc:  # jinja's raise_exception (e.g. "roles must alternate") and template errors
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", "messages") from None
        self._check_len(text, max_len, "messages")
        return list(self.hf.encode(text, add_special_tokens=False))

    def _check_len(self, text: str, max_len: int | None, param: str) -> None:
        try:
            num_bytes = len(text.encode())
        except UnicodeEncodeError:  # a lone surrogate: no tokenizer can encode it
            raise InvalidRequest(f"the {param} is not valid Unicode text (lone surrogate)", param) from None
        if max_len is None:
            return
        min_tokens = -(-num_bytes // self.max_token_bytes)
        if min_tokens > max_len:
            exc = InvalidRequest(f"This model's maximum context length is {max_len} tokens. However, the {param} "
                                 f"has at least {min_tokens} tokens. Please reduce the length of the {param}.", param)
            exc.code = "context_length_exceeded"
            raise exc


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Check roles and content types; flatten text-part lists into one string per message."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", "messages")
    out = []
    for i, msg in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise InvalidRequest(f"{param} must be an object", param)
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"{param}.role must be one of {', '.join(CHAT_ROLES)}; got {role!r}", f"{param}.role")
        content = _flatten_content(msg.get("content"), role, f"{param}.content")
        entry = {"role": role, "content": content}
        if isinstance(msg.get("name"), str):
            entry["name"] = msg["name"]
        out.append(entry)
    return out


def _flatten_content(content: Any, role: str, param: str) -> str:
    if content is None and role == "assistant":  # an assistant turn that only carried tool calls
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{param} must be a string or a list of text parts", param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequest(f"{param}[{j}]: only {{'type': 'text', 'text': str}} parts are supported, "
                                 f"got {kind!r}", f"{param}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)  # vLLM's rule for string-only templates


def _eos_token_ids(hf: Any, folder: Path) -> list[int]:
    """EOS ids from the tokenizer plus generation_config.json / config.json (where `eos_token_id` may be a list)."""
    ids: set[int] = set()
    if getattr(hf, "eos_token_id", None) is not None:
        ids.add(int(hf.eos_token_id))
    for name in ("generation_config.json", "config.json"):
        file = folder / name
        if not file.is_file():
            continue
        try:
            value = json.loads(file.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value if isinstance(v, int))
    return sorted(ids)
