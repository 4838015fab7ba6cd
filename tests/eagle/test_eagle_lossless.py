"""Greedy speculative decoding with EAGLE / EAGLE-3 drafts equals HF `generate` token for token (chain and tree, with
and without an FR-Spec token map), and heads that know the target's next token get drafts accepted — the check that
catches an off-by-one in the feature/token shift (a shifted head would predict the root again, and be rejected).

The target side of the feature protocol is written here as a small in-process loop: ModelRunner prefill/verify
with capture_hidden (EAGLE) or capture_layers (EAGLE-3), verify_greedy, KV compaction as target_service does.
"""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_service.eagle import EagleProposer
from draft_service.proposer import ProposeInput, SpecShape, Status
from runtime.config import EngineConfig
from runtime.model_runner import ModelRunner, SeqForward
from runtime.speculative.verify import verify_greedy
from tests.eagle.heads import make_eagle3_head, make_eagle_head
from tests.tiny_models import load_hf_model, make_tiny_model
from tools.train_eagle3 import TrainConfig, train_eagle3

ENGINE = EngineConfig(device="cpu", dtype="float32", max_total_tokens=4096, block_size=4)
CHAIN = SpecShape(num_steps=3, topk=1, num_draft_tokens=4)
TREE = SpecShape(num_steps=3, topk=2, num_draft_tokens=6)


def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def speculative_greedy(target: ModelRunner, proposer: EagleProposer, prompt: list[int], max_new_tokens: int,
                       spec: SpecShape, seq_id: str = "s") -> tuple[list[int], list[int]]:
    """(generated tokens, accept length per verify step). Features follow the protocol of draft_service/eagle.py."""
    capture = proposer.target_capture_layers  # None = EAGLE: the target's final-norm hidden state

    def features(out, i: int = 0) -> torch.Tensor:  # (T, F): one row per token of the forward
        return out.features[i] if capture is not None else out.hidden[i]

    target.add_seq(seq_id)
    out = target.forward([SeqForward(seq_id, prompt, logits="all", capture_hidden=capture is None)],
                         capture_layers=capture)
    committed = prompt + [int(out.logits[0][-1].argmax())]
    assert proposer.prefill(seq_id, committed, features(out)) == Status.OK  # row i = feature of committed[i]
    generated, accepts = committed[len(prompt):], []
    new_ids, new_feats = [], features(out)[:0]
    while len(generated) < max_new_tokens:
        [res] = proposer.propose([ProposeInput(seq_id, len(committed), new_ids, spec, new_feats)])
        assert res.status == Status.OK and res.base_committed_len == len(committed)
        tree = res.tree
        kv_len = target.kv_len(seq_id)
        assert kv_len == len(committed) - 1
        depths = [0] + [d + 1 for d in tree.depths()]
        verify = SeqForward(seq_id, [committed[-1], *tree.token_ids], positions=[kv_len + d for d in depths],
                            parents=[-1] + [p + 1 for p in tree.parents], logits="all", capture_hidden=capture is None)
        out = target.forward([verify], capture_layers=capture)
        outcome = verify_greedy(tree, out.logits[0].argmax(dim=-1))
        rows = [0] + [n + 1 for n in outcome.accepted_nodes]  # root, then the accepted path
        target.compact(seq_id, rows)
        # Row i of the next features is the feature of the token before new_ids[i]: the root, then accepted nodes.
        new_ids, new_feats = outcome.tokens, features(out)[rows]
        committed += new_ids
        generated += new_ids
        accepts.append(outcome.accept_length)
    target.free_seq(seq_id)
    proposer.release([seq_id])
    assert proposer.runner.num_free_tokens() == proposer.runner.num_total_tokens(), "draft KV leaked"
    return generated[:max_new_tokens], accepts


def _prompts(n: int, length: int = 5, seed: int = 7) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 320, (n, length), generator=gen).tolist()


@pytest.fixture(scope="module")
def target(target_path):
    return ModelRunner(target_path, ENGINE), load_hf_model(target_path)


@pytest.fixture(scope="module")
def trained_eagle3(target_path, eagle_dir, target):
    """An EAGLE-3 head trained (tools/train_eagle3.py, TTT) on the tiny target's own greedy continuations."""
    _, hf = target
    prompts = _prompts(12, length=4, seed=11)
    sequences = [p + hf_greedy(hf, p, 36) for p in prompts]
    out = os.path.join(eagle_dir, "trained3")
    stats = train_eagle3(target_path, sequences, out, TrainConfig(steps=50, batch_size=4, seq_len=32, lr=2e-2,
                                                                  draft_vocab_size=128))
    return out, prompts, stats


HEADS = [
    pytest.param("EAGLE", "random", None, id="eagle"),
    pytest.param("EAGLE", "random", "map", id="eagle-token-map"),
    pytest.param("EAGLE3", "random", None, id="eagle3"),
    pytest.param("EAGLE3", "trained", None, id="eagle3-trained"),
]


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("algorithm,head,token_map", HEADS)
def test_greedy_speculative_matches_hf_generate(request, target, target_path, eagle_dir, tmp_path,
                                                algorithm, head, token_map, spec):
    runner, hf = target
    trained = request.getfixturevalue("trained_eagle3") if head == "trained" else None  # train only when used
    if trained is not None:
        path = trained[0]
    elif algorithm == "EAGLE":
        path = make_eagle_head(target_path, os.path.join(eagle_dir, "lossless2"), num_layers=2)
    else:
        path = make_eagle3_head(target_path, os.path.join(eagle_dir, "lossless3"), draft_vocab_size=96)
    if token_map is not None:
        token_map = str(tmp_path / "hot.pt")
        torch.save(torch.randperm(320, generator=torch.Generator().manual_seed(5))[:64], token_map)
    proposer = EagleProposer(target_path, path, ENGINE, algorithm=algorithm, token_map=token_map)
    prompts = trained[1][:2] if trained is not None else _prompts(2)
    for i, prompt in enumerate(prompts):
        max_new = 14 + 5 * i  # ends mid-step: tokens past max_new are cut, as the gateway does
        got, _ = speculative_greedy(runner, proposer, prompt, max_new, spec)
        assert got == hf_greedy(hf, prompt, max_new), f"prompt {i}: speculative output diverged from HF greedy"
    assert runner.num_free_tokens() == runner.num_total_tokens()


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_trained_eagle3_head_gets_drafts_accepted(target, target_path, trained_eagle3, spec):
    runner, hf = target
    path, prompts, stats = trained_eagle3
    assert stats["step0_accuracy"] > 0.5, stats
    proposer = EagleProposer(target_path, path, ENGINE, algorithm="EAGLE3")
    accepts = []
    for prompt in prompts[:4]:
        got, acc = speculative_greedy(runner, proposer, prompt, 24, spec)
        assert got == hf_greedy(hf, prompt, 24)
        accepts += acc
    assert sum(accepts) / len(accepts) > 1.5, f"mean accept length {sum(accepts) / len(accepts):.2f}"


@pytest.fixture(scope="module")
def copy_pair(eagle_dir):
    """A target whose next token depends only on the current one (attention outputs zeroed, final norm = 1), and an
    EAGLE head built to compute that same function of its input token: fc passes the embedding through, its layers
    are the target's MLPs. With the one-token shift right it predicts exactly the target's next token."""
    base = make_tiny_model("llama", os.path.join(eagle_dir, "copy_base"))
    hf = load_hf_model(base)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        hf.model.norm.weight.fill_(1.0)
    target_path = os.path.join(eagle_dir, "copy_target")
    hf.save_pretrained(target_path, safe_serialization=True)
    tw = load_file(os.path.join(target_path, "model.safetensors"))
    h, n = hf.config.hidden_size, hf.config.num_hidden_layers
    head = make_eagle_head(target_path, os.path.join(eagle_dir, "copy_head"), num_layers=n)
    w = load_file(os.path.join(head, "model.safetensors"))
    w["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    w["fc.bias"] = torch.zeros(h)
    for i in range(n):
        w[f"layers.{i}.self_attn.o_proj.weight"] = torch.zeros(h, h)
        for name in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm", "input_layernorm"):
            if i > 0 or name != "input_layernorm":
                w[f"layers.{i}.{name}.weight"] = tw[f"model.layers.{i}.{name}.weight"]
    save_file(w, os.path.join(head, "model.safetensors"))
    return target_path, head, hf


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_head_that_knows_the_next_token_gets_every_draft_accepted(copy_pair, spec):
    target_path, head, hf = copy_pair
    runner = ModelRunner(target_path, ENGINE)
    proposer = EagleProposer(target_path, head, ENGINE, algorithm="EAGLE")
    prompt = _prompts(1)[0]
    got, accepts = speculative_greedy(runner, proposer, prompt, 20, spec)
    assert got == hf_greedy(hf, prompt, 20)
    if spec.topk == 1:  # the chain holds exactly the target's next num_steps tokens
        assert accepts[:-1] == [spec.num_steps + 1] * (len(accepts) - 1), accepts
    else:  # the beam tree need not reach full depth on the greedy path, but it starts with the right tokens
        assert min(accepts[:-1]) >= 2 and sum(accepts) / len(accepts) >= 3, accepts


def test_trained_head_round_trips_the_published_format(trained_eagle3, target_path):
    path, _, _ = trained_eagle3
    weights = load_file(os.path.join(path, "model.safetensors"))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= set(weights)
    assert weights["lm_head.weight"].shape[0] == 128 == weights["d2t"].numel()
    assert torch.equal(torch.arange(128) + weights["d2t"], weights["t2d"].nonzero().flatten())
    proposer = EagleProposer(target_path, path, ENGINE, algorithm="EAGLE3")
    assert proposer.target_capture_layers == [2, 1, 0]  # SGLang's default [2, L//2, L-3] for L=3
