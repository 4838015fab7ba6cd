"""Held-out chat prompts for the demo family, built from the held-out code prompts (no file access needed).

Each code prompt (a 128-token window of a held-out file, `heldout_prompts.jsonl`) is decoded back to text; its
complete lines (the window's first and, unless it ends at a newline, last line are cut) become the user turn
"Continue this Python code:\n<lines>" — the format of the ChatML samples the target was trained on
(tools/lm_data.make_chat_examples), on files it never saw — rendered with the model's own chat template and
generation prompt (what the gateway's /v1/chat/completions sends). The assistant answers with the next lines and
stops at <|im_end|>, so chat acceptance is measured with EOS respected (`tools.spec_eval --stop-at-eos`).

    python -m tools.demo_chat_prompts            # writes models/tandem-demo-code/heldout_chat_prompts.jsonl
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "models" / "tandem-demo-code"
MAX_USER_LINES = 12  # training samples had 3-12 lines in the user turn


def chat_prompts(model_dir: str | Path, code_prompts: list[dict], max_lines: int = MAX_USER_LINES) -> list[dict]:
    """One chat prompt per code prompt that keeps at least 3 complete non-empty lines."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for entry in code_prompts:
        text = tok.decode(entry["prompt_ids"])
        lines = text.split("\n")
        lines = lines[1:] if text.endswith("\n") else lines[1:-1]  # partial first / last lines
        lines = lines[-max_lines:]
        while lines and not lines[0].strip():
            lines = lines[1:]
        if sum(1 for line in lines if line.strip()) < 3:
            continue
        messages = [{"role": "user", "content": "Continue this Python code:\n" + "\n".join(lines).rstrip("\n")}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        out.append({"file": entry.get("file", ""), "chat": True, "prompt_ids": [int(t) for t in ids]})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="model folder (tokenizer + chat template)")
    p.add_argument("--code-prompts", default=None, help="default: MODEL/heldout_prompts.jsonl")
    p.add_argument("--out", default=None, help="default: MODEL/heldout_chat_prompts.jsonl")
    args = p.parse_args(argv)
    model = Path(args.model)
    with open(args.code_prompts or model / "heldout_prompts.jsonl") as f:
        code = [json.loads(line) for line in f if line.strip()]
    prompts = chat_prompts(model, code)
    out = Path(args.out or model / "heldout_chat_prompts.jsonl")
    out.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    print(f"wrote {len(prompts)} chat prompts to {out}")


if __name__ == "__main__":
    main()
