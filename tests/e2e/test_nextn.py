"""End to end: `tandem serve --speculative-algorithm NEXTN` on a checkpoint that carries an MTP layer (the bundled
demo target, copied, with a DeepSeek-V3-layout MTP layer appended to its sharded checkpoint): three real processes,
no draft model flag; the draft service runs the target's own MTP layer (with two layers: multi-layer EAGLE, one layer
per draft step, on by default); greedy output equals HF `generate`."""
from __future__ import annotations

import shutil

import openai
import pytest
import torch
import transformers

from tandem.args import DEFAULT_MODEL
from tandem.cli import build_parser, prepare
from tandem.launch import commands
from tests.e2e.test_serve import Stack
from tests.tiny_models import add_mtp_layers

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("num_mtp_layers", [1, 2], ids=["one-layer", "multi-layer"])
def test_nextn_serves_the_targets_own_mtp_layer(tmp_path, num_mtp_layers):
    target = tmp_path / "demo-mtp"
    shutil.copytree(DEFAULT_MODEL, target)
    add_mtp_layers(str(target), num_layers=num_mtp_layers, std=0.02)
    flags = ("--model-path", str(target), "--speculative-algorithm", "NEXTN", "--device", "cpu",
             "--speculative-num-steps", "2", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3")
    parser = build_parser()
    args = parser.parse_args(["serve", *flags])
    prepare(args, parser)
    # two MTP layers and a chain of two steps: multi-layer EAGLE turns itself on (and reaches the draft, which runs
    # in the target's process: serve co-locates a draft that shares the target's device)
    assert args.enable_multi_layer_eagle == (num_mtp_layers == 2)
    cmds = commands(args)
    assert "draft-0" not in cmds and "--colocate-draft" in cmds["target-0"]
    assert ("--enable-multi-layer-eagle" in cmds["target-0"]) == (num_mtp_layers == 2)
    resp = _greedy_equals_hf(flags, target, "def fibonacci(n):\n    ", 24)
    assert resp.usage.completion_tokens == 24


@pytest.mark.parametrize("algorithm,shape", [
    ("NEXTN", ("--speculative-num-steps", "3", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8")),
    ("EAGLE", ()),
], ids=["nextn-tree", "eagle-auto"])
def test_the_bundled_target_serves_its_own_trained_mtp_layer_with_no_model_flags(algorithm, shape):
    """The bundled target carries one trained MTP layer: `tandem serve --speculative-algorithm NEXTN` (or EAGLE, no
    head given) drafts with it, three processes; greedy equals HF `generate` and the trained layer is accepted."""
    flags = ("--speculative-algorithm", algorithm, "--device", "cpu", *shape)
    parser = build_parser()
    args = parser.parse_args(["serve", *flags])
    prepare(args, parser)
    assert args.speculative_draft_model_path == str(DEFAULT_MODEL)
    resp = _greedy_equals_hf(flags, DEFAULT_MODEL, "import json\n\n\ndef load(path):\n    ", 48)
    # tau well above 1: the trained layer drafts (random MTP weights would give about 1.0)
    assert resp.usage.model_extra["spec"]["mean_accept_length"] > 1.5


def _greedy_equals_hf(flags, model_path, prompt: str, max_tokens: int):
    """`tandem serve *flags` as three processes: one greedy completion equals HF `generate` of model_path; returns
    the completion."""
    stack = Stack(*flags)
    try:
        stack.wait_ready()
        client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf.generate(ids, do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0,
                              attention_mask=torch.ones_like(ids))
        resp = client.completions.create(model=model_path.name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert resp.choices[0].text == tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
        return resp
    finally:
        assert stack.stop() == 0
