"""Multi-layer EAGLE (--enable-multi-layer-eagle): draft step s runs the target checkpoint's MTP layer s (DeepSeek's
chain, draft_service/eagle.py). Every Propose's chain equals a from-scratch run of every layer over all committed
tokens (each layer's KV is right after any commit pattern), greedy output equals HF `generate` of the target through
the services, a rollback past the kept features is answered STALE, and the trainer's K-layer unroll is the served
chain."""
from __future__ import annotations

import random

import pytest
import torch

from draft_service.eagle import EagleProposer
from draft_service.proposer import ProposeInput, SpecShape, Status
from runtime.config import EngineConfig, ModelConfig
from tests.tiny_models import add_mtp_layers, load_hf_model, make_tiny_model
from tandem.args import DEFAULT_DRAFT

CPU = EngineConfig(device="cpu", dtype="float32", max_total_tokens=1024, attention_backend="torch", block_size=4)


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    return add_mtp_layers(make_tiny_model("llama", tmp_path_factory.mktemp("mle")), num_layers=3)


def drive(proposer: EagleProposer, spec: SpecShape, num_proposes: int, seed: int = 0, seq_id: str = "s"):
    """The gateway's side without a target: commits 1..S+1 random tokens (random features) between Proposes, sometimes
    none; yields (committed tokens, their features, the chain proposed)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    width = proposer.feature_size
    committed = [rng.randrange(3, 320) for _ in range(6)]
    feats = torch.randn(len(committed) - 1, width, generator=gen)  # row i: feature of committed[i]
    assert proposer.prefill(seq_id, committed, feats) == Status.OK
    new_ids, new_feats = [], feats[:0]
    for _ in range(num_proposes):
        [out] = proposer.propose([ProposeInput(seq_id, len(committed), new_ids, spec, new_feats)])
        assert out.status == Status.OK
        yield committed, feats, out.tree.token_ids
        n = rng.choice([0, 1, 1, 2, spec.num_steps + 1])
        new_ids = [rng.randrange(3, 320) for _ in range(n)]
        new_feats = torch.randn(n, width, generator=gen)  # features of the last committed token, then new ones
        committed = committed + new_ids
        feats = torch.cat([feats, new_feats])


@pytest.mark.parametrize("steps", [2, 3])
def test_every_chain_equals_a_fresh_run_of_every_layer(mtp_target, steps):
    """Incremental Proposes (each layer's KV caught up over the window only) propose what a fresh proposer, running
    every layer over all committed tokens, proposes: no layer reads a stale or missing KV position."""
    spec = SpecShape(steps, 1, steps + 1)
    proposer = EagleProposer(mtp_target, mtp_target, CPU, algorithm="NEXTN", multi_layer_steps=steps)
    assert [type(layer).__name__ for layer in proposer.model.layers] == ["MTPLayer"] * steps
    fresh = EagleProposer(mtp_target, mtp_target, CPU, algorithm="NEXTN", multi_layer_steps=steps)
    chains = 0
    for committed, feats, chain in drive(proposer, spec, 12, seed=steps):
        assert fresh.prefill("f", committed, feats) == Status.OK
        [want] = fresh.propose([ProposeInput("f", len(committed), [], spec, feats[:0])])
        assert len(chain) == steps and chain == want.tree.token_ids
        fresh.release(["f"])
        chains += 1
    assert chains == 12
    proposer.release(["s"])
    assert proposer.runner.num_free_tokens() == proposer.runner.num_total_tokens()


def test_multi_layer_chain_differs_from_layer_zero_run_autoregressively(mtp_target):
    """The chain uses the deeper layers: the same committed state drafts otherwise with layer 0 alone (today's NEXTN
    on this checkpoint)."""
    spec = SpecShape(3, 1, 4)
    multi = EagleProposer(mtp_target, mtp_target, CPU, algorithm="NEXTN", multi_layer_steps=3)
    single = EagleProposer(mtp_target, mtp_target, CPU, algorithm="NEXTN")
    assert len(single.model.layers) == 1
    pairs = []
    for committed, feats, chain in drive(multi, spec, 4):
        assert single.prefill("x", committed, feats) == Status.OK
        [other] = single.propose([ProposeInput("x", len(committed), [], spec, feats[:0])])
        single.release(["x"])
        pairs.append((chain, other.tree.token_ids))
    assert all(a[0] == b[0] for a, b in pairs)  # step 0 is layer 0 either way
    assert any(a != b for a, b in pairs)


def test_other_shapes_get_no_proposal_and_a_deep_rollback_is_stale(mtp_target):
    spec = SpecShape(2, 1, 3)
    proposer = EagleProposer(mtp_target, mtp_target, CPU, algorithm="NEXTN", multi_layer_steps=2)
    committed = [3, 77, 150, 8, 299, 61, 9, 12]
    feats = torch.randn(len(committed) - 1, proposer.feature_size)
    assert proposer.prefill("s", committed, feats) == Status.OK
    [tree] = proposer.propose([ProposeInput("s", len(committed), [], SpecShape(3, 1, 4), feats[:0])])
    assert tree.status == Status.OK and tree.tree.token_ids == []  # not the served chain: no proposal
    [out] = proposer.propose([ProposeInput("s", len(committed), [], spec, feats[:0])])
    assert out.status == Status.OK and len(out.tree.token_ids) == 2
    # The gateway resends features from the kept length on; layer 1 would need one more: re-sync.
    [out] = proposer.propose([ProposeInput("s", 5, [299, 44], spec, feats[3:5])])
    assert out.status == Status.STALE and "rolled back" in out.error
    assert proposer.num_seqs == 0 and proposer.runner.num_free_tokens() == proposer.runner.num_total_tokens()


# ---------------------------------------------------------------------------------------------- through the services
@pytest.mark.parametrize("steps", [2, 3])
async def test_multi_layer_eagle_equals_hf_greedy_through_the_services(mtp_target, steps):
    import asyncio

    from tests.stack import generate_ids, local_stack
    from tests.test_lossless_greedy import _assert_no_kv_leak, hf_greedy, prompts

    hf = load_hf_model(mtp_target)
    all_prompts = prompts(hf.config.vocab_size)
    async with local_stack(mtp_target, algorithm="NEXTN", draft_path=mtp_target, num_steps=steps, topk=1,
                           num_draft_tokens=steps + 1, multi_layer=True) as scheduler:
        assert len(scheduler.test_proposer.model.layers) == steps
        results = await asyncio.gather(*(generate_ids(scheduler, p, 14 + 3 * i, request_id=f"m{i}")
                                         for i, p in enumerate(all_prompts)))
        for i, (prompt, (got, usage, _)) in enumerate(zip(all_prompts, results)):
            assert got == hf_greedy(hf, prompt, 14 + 3 * i), f"prompt {i} diverged from HF"
        assert sum(u.proposed_draft_tokens for _, u, _ in results) > 0
        await _assert_no_kv_leak(scheduler)


# ---------------------------------------------------------------------------------------------- the flag's rules
def _checkpoint(tmp_path, num_mtp_layers: int) -> str:
    """A config-only copy of the bundled target (LlamaForCausalLM: SGLang's 5/4/8 tree default) with MTP layers."""
    import json

    from tandem.args import DEFAULT_MODEL

    folder = tmp_path / f"mtp{num_mtp_layers}"
    folder.mkdir()
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": num_mtp_layers}))
    return str(folder)


def _spec(args) -> tuple:
    return (args.enable_multi_layer_eagle, args.speculative_num_steps, args.speculative_eagle_topk,
            args.speculative_num_draft_tokens)


def test_multi_layer_eagle_is_auto_on_for_several_mtp_layers_unless_said_otherwise(tmp_path):
    from tests.test_sglang_compat import _prepare

    two, one = _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 1)
    nextn = ("--speculative-algorithm", "NEXTN")
    assert _spec(_prepare("--model-path", two, *nextn)) == (True, 2, 1, 3)  # unset triple: K/1/K+1
    assert _spec(_prepare("--model-path", two, "--speculative-algorithm", "EAGLE")) == (True, 2, 1, 3)
    chain = ("--speculative-num-steps", "1", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2")
    assert _spec(_prepare("--model-path", two, *nextn, *chain)) == (True, 1, 1, 2)
    # what says otherwise: a tree, a chain deeper than K, the flag's negative (then layer 0 runs autoregressively)
    tree = ("--speculative-num-steps", "3", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8")
    assert _spec(_prepare("--model-path", two, *nextn, *tree)) == (False, 3, 4, 8)
    deep = ("--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4")
    assert _spec(_prepare("--model-path", two, *nextn, *deep)) == (False, 3, 1, 4)
    assert _spec(_prepare("--model-path", two, *nextn, "--no-enable-multi-layer-eagle")) == (False, 5, 4, 8)
    # one MTP layer: off unless asked
    assert _spec(_prepare("--model-path", one, *nextn)) == (False, 5, 4, 8)
    assert _spec(_prepare("--model-path", one, *nextn, "--enable-multi-layer-eagle")) == (True, 1, 1, 2)


@pytest.mark.parametrize("flags, message", [
    (("--speculative-num-steps", "2", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "5"),
     "multi-layer EAGLE drafts a chain: speculative_num_draft_tokens must equal speculative_num_steps + 1, got "
     "speculative_num_draft_tokens=5, speculative_num_steps=2"),
    (("--speculative-num-steps", "2", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "3"),
     "multi-layer EAGLE drafts a chain: speculative_eagle_topk must be 1, got 2"),
    (("--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"),
     "multi-layer EAGLE runs one MTP layer per draft step: speculative_num_steps=3 exceeds the 2 MTP layer(s) of"),
    (("--speculative-num-steps", "2"), "set all three of num_steps, topk and num_draft_tokens, or none of them"),
], ids=["ndt", "topk", "steps", "partial"])
def test_multi_layer_eagle_refuses_what_is_not_a_chain_of_its_layers(tmp_path, flags, message):
    from tests.test_sglang_compat import _prepare

    with pytest.raises(SystemExit) as exc:
        _prepare("--model-path", _checkpoint(tmp_path, 2), "--speculative-algorithm", "NEXTN",
                 "--enable-multi-layer-eagle", *flags)
    assert str(exc.value).startswith(f"error: {message}")


@pytest.mark.parametrize("flags, message", [
    # a draft path given to EAGLE wins over the target's own MTP layer; this checkpoint has none
    (("--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(DEFAULT_DRAFT)),
     "--enable-multi-layer-eagle needs MTP layers (num_nextn_predict_layers) in "),
    (("--speculative-algorithm", "EAGLE3"), "--enable-multi-layer-eagle drafts with the MTP layers of a checkpoint: "
     "it needs --speculative-algorithm EAGLE or NEXTN, not speculative_algorithm=EAGLE3"),
    (("--speculative-algorithm", "STANDALONE"), "it needs --speculative-algorithm EAGLE or NEXTN, not "
     "speculative_algorithm=STANDALONE"),
    ((), "--enable-multi-layer-eagle needs --speculative-algorithm"),
], ids=["no-mtp-layers", "eagle3", "standalone", "no-algorithm"])
def test_multi_layer_eagle_needs_mtp_layers_of_an_eagle_draft(flags, message):
    from tests.test_sglang_compat import _prepare

    with pytest.raises(SystemExit) as exc:
        _prepare(*flags, "--enable-multi-layer-eagle")
    assert message in str(exc.value)


def test_multi_layer_eagle_disables_adaptive_with_a_warning_and_reaches_every_child(tmp_path, capsys):
    from tandem.launch import commands
    from tests.test_sglang_compat import _prepare

    args = _prepare("--model-path", _checkpoint(tmp_path, 2), "--speculative-algorithm", "NEXTN",
                    "--speculative-adaptive")
    assert args.enable_multi_layer_eagle and not args.speculative_adaptive
    assert "--speculative-adaptive is disabled with multi-layer EAGLE" in capsys.readouterr().err
    for name, cmd in commands(args).items():
        if name != "envoy":
            assert "--enable-multi-layer-eagle" in cmd and "--speculative-adaptive" not in cmd, name
    off = _prepare("--model-path", _checkpoint(tmp_path, 3), "--speculative-algorithm", "NEXTN",
                   "--no-enable-multi-layer-eagle", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
                   "--speculative-num-draft-tokens", "3")
    assert "--no-enable-multi-layer-eagle" in commands(off)["target-0"]  # the child (drafting there) must not turn it back on


def test_the_draft_service_builds_the_layer_chain_from_the_flags(mtp_target):
    """`tandem draft --speculative-algorithm NEXTN --model-path <3 MTP layers>`: auto multi-layer, K/1/K+1, the
    registry's factory loads all three layers and drafts one per step."""
    from tandem.cli import build_parser, prepare
    from tandem.services import build_proposer

    parser = build_parser()
    args = parser.parse_args(["draft", "--model-path", mtp_target, "--speculative-algorithm", "NEXTN",
                              "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "512"])
    prepare(args, parser)
    proposer, path = build_proposer(args)
    assert path == mtp_target and proposer.multi_layer_steps == 3 and len(proposer.model.layers) == 3
    [(_, _, chain)] = list(drive(proposer, SpecShape(3, 1, 4), 1))
    assert len(chain) == 3


# ---------------------------------------------------------------------------------------------- training
def test_k_layer_training_unroll_is_the_served_chain(tmp_path):
    """tools/train_eagle3.MTPTrainHead with K = 2 layers: step k of its unroll equals MTP layer k served (through a
    ModelRunner, the layer's own KV) over the same tokens shifted by k, fed layer k-1's served outputs, on the
    checkpoint save_mtp wrote: what is trained is what multi-layer EAGLE serves."""
    import shutil

    from runtime.model_runner import ModelRunner, SeqForward
    from runtime.models.mtp import build_mtp_head
    from tools.train_eagle3 import MTPTrainHead, TrainConfig, save_mtp

    target = str(tmp_path / "target")
    shutil.copytree(make_tiny_model("llama", tmp_path / "src"), target)
    tcfg = ModelConfig.from_pretrained(target)
    hf = load_hf_model(target)
    torch.manual_seed(0)
    model = MTPTrainHead(tcfg.hidden_size, tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim, tcfg.intermediate_size,
                         tcfg.rms_norm_eps, tcfg.rope_theta, hf.lm_head.weight.detach().float(), num_layers=2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_mtp(model, target, tcfg, TrainConfig())
    served_config = ModelConfig.from_pretrained(target)
    assert served_config.num_mtp_layers == 2
    served, kv_config = build_mtp_head(target, served_config, CPU, num_layers=2)
    runner = ModelRunner(None, CPU, kv_config, model=served)
    tokens = torch.tensor([[5, 17, 200, 33, 9, 250, 41, 7, 88]])
    t = tokens.shape[1] - 1
    feats = torch.randn(1, t, tcfg.hidden_size)
    embed = hf.get_input_embeddings().weight
    with torch.no_grad():
        embeds = torch.nn.functional.pad(embed[tokens[:, 1:]], (0, 0, 0, 1))  # t_1.., one padding row
        trained = model.unrolled_hidden(embeds, feats, 2)
    features = feats[0]
    for k in range(2):
        served.active_layer = k
        runner.add_seq(f"layer{k}")
        ids = tokens[0, 1 + k:].tolist()  # layer k at base p reads t_{p+k+1}
        out = runner.forward([SeqForward(f"layer{k}", ids, logits="all", input_features=features[:len(ids)])],
                             capture_layers=[k])
        torch.testing.assert_close(out.features[0], trained[k][0, :len(ids)], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.logits[0], model.logits(trained[k][0, :len(ids)]), atol=1e-4, rtol=1e-4)
        features = out.features[0]
    served.active_layer = 0
    ModelRunner(target, CPU)  # the target itself still loads: the MTP layers are the draft's


def test_train_draft_kind_mtp_appends_k_layers_that_multi_layer_eagle_serves(tmp_path):
    import json
    import shutil
    from pathlib import Path

    from tools.lm_data import train_tokenizer
    from tools.train_draft import main

    target = tmp_path / "target"
    shutil.copytree(make_tiny_model("llama", tmp_path / "src"), target)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(__file__).read_text() * 10)
    train_tokenizer([corpus.read_text()], 320, target)  # the tiny target's vocabulary is 320
    main(["--kind", "mtp", "--num-mtp-layers", "2", "--target-model-path", str(target), "--corpus", str(corpus),
          "--output-dir", str(target), "--steps", "2", "--batch-size", "2", "--seq-len", "24", "--device", "cpu"])
    config = json.loads((target / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 2
    assert json.loads((target / "mtp_training_info.json").read_text())["kind"] == "mtp"
    proposer = EagleProposer(str(target), str(target), CPU, algorithm="NEXTN", multi_layer_steps=2)
    [(_, _, chain)] = list(drive(proposer, SpecShape(2, 1, 3), 1))
    assert len(chain) == 2


def test_sampled_chains_carry_the_distribution_each_layer_drew_from(mtp_target):
    """--speculative-use-rejection-sampling: a sampled request's chain token s is drawn from q_s (layer s at the root's
    row, the request's temperature), and q_s travels with it for the target's p/q rejection; a seeded request draws
    the same chain again."""
    from runtime.sampling import SamplingParams

    spec = SpecShape(3, 1, 4)
    proposer = EagleProposer(mtp_target, mtp_target, CPU, algorithm="NEXTN", use_rejection_sampling=True,
                             multi_layer_steps=3)
    committed = [3, 77, 150, 8, 299, 61, 9, 12]
    feats = torch.randn(len(committed) - 1, proposer.feature_size, generator=torch.Generator().manual_seed(2))
    chains = []
    for run in range(2):
        assert proposer.prefill(f"r{run}", committed, feats) == Status.OK
        [out] = proposer.propose([ProposeInput(f"r{run}", len(committed), [], spec, feats[:0],
                                               sampling=SamplingParams(temperature=1.5, seed=11))])
        tree = out.tree
        vocab = ModelConfig.from_pretrained(mtp_target).vocab_size
        assert tree.parents == [-1, 0, 1] and tree.draft_probs.shape == (3, vocab)
        torch.testing.assert_close(tree.draft_probs.sum(-1), torch.ones(3))
        assert all(tree.draft_probs[s, token] > 0 for s, token in enumerate(tree.token_ids))
        assert (tree.draft_probs > 0).sum(-1).min() > 1  # sampled, not a one-hot greedy pick
        chains.append(tree.token_ids)
    assert chains[0] == chains[1]
