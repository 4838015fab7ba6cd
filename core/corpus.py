"""External NGRAM corpus files (SGLang's --speculative-ngram-external-corpus-path format): read by a model service at
start-up and by the gateway for POST /add_external_corpus {"file_path": ...}. Knows the format only."""
from __future__ import annotations

import json
from pathlib import Path


def read_corpus_documents(path: str | Path, encode, max_tokens: int) -> list[list[int]]:
    """SGLang's corpus file: JSONL, one JSON string (a document's text) per line; blank lines skipped. encode(text)
    -> token ids (the target's tokenizer, no special tokens). More than max_tokens tokens in all is an error naming
    the line, as is a line that is not a JSON string."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"external ngram corpus {path} does not exist")
    if max_tokens <= 0:
        raise ValueError("--speculative-ngram-external-corpus-max-tokens must be positive")
    documents, total = [], 0
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} line {line_no}: not JSON ({exc.msg})") from None
            if not isinstance(record, str):
                raise ValueError(f"{path} line {line_no}: expected a JSON string (a document's text)")
            ids = list(encode(record))
            if not ids:
                continue
            total += len(ids)
            if total > max_tokens:
                raise ValueError(f"{path} exceeds --speculative-ngram-external-corpus-max-tokens ({max_tokens}) at "
                                 f"line {line_no}")
            documents.append(ids)
    return documents
