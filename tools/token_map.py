"""FR-Spec hot-token map for `--speculative-token-map` (EAGLE-2 heads): the N most frequent target token ids over a
text corpus, saved as a torch.load-able int64 tensor, most frequent first (the layout of the published
`freq_32768.pt` files). Knows tokenizers and files, nothing about serving.

    python -m tools.token_map --model-path models/tandem-demo-code --corpus DIR --num-tokens 4096 --out hot.pt
"""
from __future__ import annotations

import argparse
import collections
import sysconfig
from pathlib import Path


def hot_token_ids(tokenizer_path: str, files: list[Path], num_tokens: int, max_bytes: int) -> list[int]:
    """The num_tokens most frequent ids over the files (read up to max_bytes in all); ties by id."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(tokenizer_path) / "tokenizer.json"))
    counts: collections.Counter[int] = collections.Counter()
    seen = 0
    for path in files:
        text = path.read_text(errors="ignore")
        counts.update(tokenizer.encode(text, add_special_tokens=False).ids)
        seen += len(text)
        if seen >= max_bytes:
            break
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:num_tokens]
    if len(ranked) < num_tokens:  # a small corpus: fill with the lowest unseen ids (BPE's earliest merges)
        missing = (t for t in range(tokenizer.get_vocab_size()) if t not in counts)
        ranked += [next(missing) for _ in range(num_tokens - len(ranked))]
    return ranked


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="target checkpoint folder (its tokenizer.json is used)")
    p.add_argument("--corpus", default=sysconfig.get_paths()["stdlib"],
                   help="folder of text files (*.py, *.txt, *.md; default: this Python's standard library)")
    p.add_argument("--num-tokens", type=int, default=4096, help="size of the hot vocabulary")
    p.add_argument("--max-mb", type=float, default=20.0, help="read at most this much text")
    p.add_argument("--out", required=True, help="output file (torch.save of an int64 tensor)")
    args = p.parse_args(argv)
    import torch

    files = sorted(f for pattern in ("*.py", "*.txt", "*.md") for f in Path(args.corpus).rglob(pattern))
    ids = hot_token_ids(args.model_path, files, args.num_tokens, int(args.max_mb * 1e6))
    torch.save(torch.tensor(ids, dtype=torch.int64), args.out)
    print(f"{args.out}: {len(ids)} hot token ids from {args.corpus}")


if __name__ == "__main__":
    main()
