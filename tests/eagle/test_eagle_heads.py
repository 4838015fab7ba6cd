"""EAGLE / EAGLE-3 heads: published checkpoint layouts load, the paged-KV draft forward equals a plain-torch
re-implementation of the formulas on the same weights, and the proposer's drafts follow the one-token shift."""
from __future__ import annotations

import os

import pytest
import torch

from draft_service.eagle import EagleProposer
from draft_service.proposer import ProposeInput, SpecShape, Status
from runtime.config import EngineConfig
from runtime.model_runner import ModelRunner, SeqForward
from runtime.models.eagle import load_draft_head
from runtime.models.eagle3 import eagle3_capture_layers
from tests.eagle.heads import RefHead, make_eagle3_head, make_eagle_head, ref_draft_chain

ENGINE = EngineConfig(device="cpu", dtype="float32", max_total_tokens=4096, block_size=4)
H = 64  # tiny target hidden size
HEADS = {
    "eagle": lambda t, d: make_eagle_head(t, d, num_layers=2),
    "eagle3": lambda t, d: make_eagle3_head(t, d, draft_vocab_size=96, aux_layer_ids=[0, 1, 2]),
    "eagle3-fullvocab-fcnorm": lambda t, d: make_eagle3_head(t, d, draft_vocab_size=None, fc_norm=True,
                                                             norm_output=True),
    "eagle3-legacy-aux-norm-target-head": lambda t, d: make_eagle3_head(t, d, draft_vocab_size=None, fc_norm=True,
                                                                        legacy_aux_norm=True, with_lm_head=False),
}


@pytest.fixture(scope="module", params=list(HEADS))
def head(request, target_path, eagle_dir):
    name = request.param
    path = HEADS[name](target_path, os.path.join(eagle_dir, name))
    kind = "eagle3" if name.startswith("eagle3") else "eagle"
    return kind, path, RefHead.load(kind, path, target_path)


def _algorithm(kind: str) -> str:
    return "EAGLE3" if kind == "eagle3" else "EAGLE"


def _feats(n: int, kind: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3 * H if kind == "eagle3" else H, generator=gen)


def test_paged_forward_matches_reference_over_prefill_and_steps(head, target_path):
    kind, path, ref = head
    model, config = load_draft_head(path, target_path, ENGINE, _algorithm(kind))
    runner = ModelRunner(None, ENGINE, config, model=model)
    tokens = [5, 17, 200, 33, 9, 250, 41]
    target_feats = _feats(len(tokens), kind)
    feats = model.project_features(target_feats) if kind == "eagle3" else target_feats
    runner.add_seq("s")
    out = runner.forward([SeqForward("s", tokens, logits="all", capture_hidden=True, input_features=feats)])
    n = len(tokens)
    ref_logits, ref_hidden = ref.forward(tokens, ref.project(target_feats) if kind == "eagle3" else target_feats,
                                         list(range(n)), torch.ones(n, n).tril().bool())
    torch.testing.assert_close(out.logits[0], ref_logits, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(out.hidden[0], ref_hidden, atol=1e-3, rtol=1e-3)
    # Decode steps feed the head's own recurrent hidden back, one token at a time through the paged KV.
    all_tokens, all_feats, hidden = list(tokens), ref.project(target_feats) if kind == "eagle3" else target_feats, \
        out.hidden[0][-1:]
    for step in range(3):
        token = 40 + step
        out = runner.forward([SeqForward("s", [token], logits="last", capture_hidden=True, input_features=hidden)])
        all_tokens.append(token)
        all_feats = torch.cat([all_feats, hidden])
        m = len(all_tokens)
        ref_logits, ref_hidden = ref.forward(all_tokens, all_feats, list(range(m)), torch.ones(m, m).tril().bool())
        torch.testing.assert_close(out.logits[0][-1], ref_logits[-1], atol=1e-3, rtol=1e-3)
        hidden = out.hidden[0]
        torch.testing.assert_close(hidden[-1], ref_hidden[-1], atol=1e-3, rtol=1e-3)


def test_chain_draft_follows_reference_across_commits(head, target_path):
    kind, path, ref = head
    proposer = EagleProposer(target_path, path, ENGINE, algorithm=_algorithm(kind))
    committed = [3, 77, 150, 8, 299, 61]
    feats = _feats(len(committed), kind, seed=1)  # feats[i] = feature of committed[i]
    assert proposer.prefill("s", committed, feats[:-1]) == Status.OK
    spec = SpecShape(num_steps=3, topk=1, num_draft_tokens=4)
    [out] = proposer.propose([ProposeInput("s", len(committed), [], spec, feats[:0])])
    assert out.status == Status.OK
    assert out.tree.token_ids == ref_draft_chain(ref, committed, feats[:-1], 3)
    assert out.tree.parents == [-1, 0, 1]
    # Two more tokens get committed, then one of them is replaced (rollback): features travel with new tokens.
    for new, base in (([11, 222], len(committed)), ([11, 230, 19], len(committed))):
        committed = committed[:base] + new
        feats = torch.cat([feats[:base], _feats(len(new), kind, seed=len(committed))])
        [out] = proposer.propose([ProposeInput("s", len(committed), new, spec, feats[base - 1: len(committed) - 1])])
        assert out.status == Status.OK
        assert out.tree.token_ids == ref_draft_chain(ref, committed, feats[:-1], 3)
    assert proposer.runner.kv_len("s") == len(committed) - 1, "speculative KV must be rolled back"


def test_tree_nodes_are_topk_children_under_their_true_ancestors(head, target_path):
    """Faithful tree masks: every node is among the reference top-k after exactly its own ancestor path."""
    kind, path, ref = head
    proposer = EagleProposer(target_path, path, ENGINE, algorithm=_algorithm(kind))
    committed = [3, 77, 150, 8, 299, 61, 12]
    feats = _feats(len(committed) - 1, kind, seed=3)
    proposer.prefill("s", committed, feats)
    k = 3
    [out] = proposer.propose([ProposeInput("s", len(committed), [], SpecShape(4, k, 12), feats[:0])])
    tree = out.tree
    assert len(tree) == 11
    base = ref.project(feats) if kind == "eagle3" else feats
    for i in range(len(tree)):
        path_nodes = []
        node = tree.parents[i]
        while node != -1:
            path_nodes.insert(0, node)
            node = tree.parents[node]
        tokens, fs = list(committed[1:]), base
        logits, hidden = None, None
        for step in range(len(path_nodes) + 1):
            n = len(tokens)
            logits, hidden = ref.forward(tokens, fs, list(range(n)), torch.ones(n, n).tril().bool())
            if step < len(path_nodes):
                tokens.append(tree.token_ids[path_nodes[step]])
                fs = torch.cat([fs, hidden[-1:]])
        top = [ref.to_target(int(j)) for j in logits[-1].topk(k).indices]
        assert tree.token_ids[i] in top, f"node {i} is not a top-{k} child of its ancestor path"


def test_eagle3_d2t_offsets_map_draft_ids_to_target_ids(target_path, eagle_dir):
    path = make_eagle3_head(target_path, os.path.join(eagle_dir, "d2t"), draft_vocab_size=50, seed=9)
    model, _ = load_draft_head(path, target_path, ENGINE, "EAGLE3")
    ref = RefHead.load("eagle3", path, target_path)
    assert model.lm_head.weight.shape == (50, H)
    d2t = ref.w["d2t"]
    assert torch.equal(model.draft_to_target, torch.arange(50) + d2t)
    assert torch.equal(model.draft_to_target, ref.w["t2d"].nonzero().flatten()), "offsets, not absolute ids"
    proposer = EagleProposer(target_path, path, ENGINE, algorithm="EAGLE3")
    committed = [3, 77, 150, 8]
    feats = _feats(3, "eagle3")
    proposer.prefill("s", committed, feats)
    [out] = proposer.propose([ProposeInput("s", 4, [], SpecShape(3, 2, 6), feats[:0])])
    hot = set(model.draft_to_target.tolist())
    assert out.tree.token_ids and all(t in hot for t in out.tree.token_ids)


def test_fr_spec_token_map_restricts_and_maps_back_the_eagle_head(target_path, eagle_dir, tmp_path):
    path = make_eagle_head(target_path, os.path.join(eagle_dir, "frspec"), num_layers=1)
    hot = torch.tensor([7, 300, 12, 99, 150, 3, 64, 201, 45, 18])
    map_path = str(tmp_path / "freq_10.pt")
    torch.save(hot.tolist(), map_path)  # published maps are lists (or tensors) of target ids
    model, _ = load_draft_head(path, target_path, ENGINE, "EAGLE", token_map=map_path)
    ref = RefHead.load("eagle", path, target_path)
    torch.testing.assert_close(model.lm_head.weight, ref.target_head[hot])
    torch.testing.assert_close(model.embed_tokens.weight, ref.embed)  # the target's, not the checkpoint copy
    proposer = EagleProposer(target_path, path, ENGINE, algorithm="NEXTN", token_map=map_path)
    assert proposer.algorithm == "NEXTN" and type(proposer.model).__name__ == "LlamaEagleForCausalLM"  # a head
    committed = [3, 77, 150, 8, 21]
    feats = _feats(4, "eagle")
    proposer.prefill("s", committed, feats)
    [out] = proposer.propose([ProposeInput("s", 5, [], SpecShape(3, 1, 4), feats[:0])])
    # Reference: argmax over the hot rows only, mapped back with hot[idx].
    tokens, chain = list(committed[1:]), []
    fs = feats
    for _ in range(3):
        n = len(tokens)
        logits, hidden = ref.forward(tokens, fs, list(range(n)), torch.ones(n, n).tril().bool())
        d = int(hot[int((hidden[-1] @ ref.target_head[hot].T).argmax())])
        chain.append(d)
        tokens.append(d)
        fs = torch.cat([fs, hidden[-1:]])
    assert out.tree.token_ids == chain


def test_published_names_load_and_mismatches_fail(target_path, eagle_dir):
    eagle3 = make_eagle3_head(target_path, os.path.join(eagle_dir, "names3"))
    eagle = make_eagle_head(target_path, os.path.join(eagle_dir, "names2"))
    with pytest.raises(ValueError, match="does not fit"):
        load_draft_head(eagle3, target_path, ENGINE, "EAGLE")
    with pytest.raises(ValueError, match="does not fit"):
        load_draft_head(eagle, target_path, ENGINE, "EAGLE3")
    with pytest.raises(ValueError, match="token-map"):
        load_draft_head(eagle3, target_path, ENGINE, "EAGLE3", token_map=[1, 2])
    model, config = load_draft_head(eagle3, target_path, ENGINE, "EAGLE3")
    assert config.num_layers == 1 and model.layers[0].self_attn.qkv_proj.weight.shape == (64 + 2 * 32, 2 * H)
    assert model.fc.bias is None  # `bias` unset: published EAGLE-3 fc has no bias
    assert model.feature_size == 3 * H


def test_eagle3_capture_layers_default_and_plus_one():
    assert eagle3_capture_layers(32, None) == [2, 16, 29]
    assert eagle3_capture_layers(32, [1, 15, 28]) == [2, 16, 29]  # ids name layer outputs: capture input of id+1
    assert eagle3_capture_layers(3, [0, 1, 2]) == [1, 2, 3]  # 3 = the last layer's output, before the final norm
    with pytest.raises(ValueError):
        eagle3_capture_layers(3, [0, 1, 3])


def test_missing_or_misshaped_features_are_invalid(target_path, eagle_dir):
    path = make_eagle_head(target_path, os.path.join(eagle_dir, "invalid"))
    proposer = EagleProposer(target_path, path, ENGINE, algorithm="EAGLE")
    assert proposer.prefill("s", [3, 4, 5], None) == Status.INVALID
    assert proposer.prefill("s", [3, 4, 5], torch.zeros(3, H)) == Status.INVALID
    assert proposer.prefill("s", [3, 4, 5], torch.zeros(2, H)) == Status.OK
    spec = SpecShape(2, 1, 3)
    [out] = proposer.propose([ProposeInput("s", 4, [6], spec, None)])
    assert out.status == Status.INVALID
    [out] = proposer.propose([ProposeInput("s", 4, [6], spec, torch.zeros(1, H))])
    assert out.status == Status.OK and len(out.tree) == 2
    assert proposer.release(["s"]) == 1 and proposer.runner.num_free_tokens() == proposer.runner.num_total_tokens()
