"""DFLASH (block-diffusion drafts): the target captures the draft's layers as HF names them, the proposer's cached
context KV (context KV injection, sliding window) drafts what a dense recomputation drafts, greedy output through the
services equals HF `generate`, a sampled verify of DFLASH chains follows the target distribution (χ²), SGLang's flag
rules with their messages, and the trainer writes drafts the proposer loads and whose drafts get accepted."""
from __future__ import annotations

import collections
import json
import logging

import pytest
import torch
from scipy.stats import chisquare

from core.steps import PrefillInput, ProposeInput, SpecShape, VerifyInput
from core.types import DraftTree, SamplingParams, StopRule
from core.types import SeqStatus as Status
from draft_service.dflash import DFlashProposer
from runtime.config import EngineConfig
from runtime.model_runner import ModelRunner
from runtime.models.dflash import load_dflash_draft
from runtime.sampling import process_logits
from target_service.engine import TargetEngine
from tests.stack import generate_ids, local_stack
from tests.test_lossless_greedy import _assert_no_kv_leak, hf_greedy, prompts
from tests.tiny_models import load_hf_model, make_tiny_dflash_draft, make_tiny_model

ENGINE = EngineConfig(device="cpu", dtype="float32", max_total_tokens=4096, block_size=4)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny 4-layer Llama target, its HF oracle, and a random DFlash draft (block 4, two target layers)."""
    root = tmp_path_factory.mktemp("dflash")
    target = make_tiny_model("llama", root / "target", num_hidden_layers=4)
    draft = make_tiny_dflash_draft(target, root / "draft", block_size=4, target_layer_ids=[0, 2])
    return target, draft, load_hf_model(target)


def hf_features(hf, ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """(len(ids), K*H): the outputs of the target layers `layer_ids` (HF hidden_states[i + 1]) of every token."""
    with torch.no_grad():
        hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hidden[i + 1][0] for i in layer_ids], dim=-1)


def dense_drafts(model, tokens: list[int], feats: torch.Tensor, block: int, window: int | None = None) -> list[int]:
    """Reference: context = features of positions [0, C-1) (the last `window` of them) recomputed from scratch, block
    [t_{C-1}, MASK...] at C-1.., no mask at all; the argmax of rows 1.."""
    c = len(tokens)
    first = 0 if window is None else max(0, c - 1 - window)
    pos = torch.arange(first, c - 1)
    context = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in model.context_kv(feats[first:c - 1], pos)]
    ids = torch.tensor([[tokens[-1]] + [model.dflash.mask_token_id] * (block - 1)])
    mask = torch.ones(1, 1, block, len(pos) + block, dtype=torch.bool)
    with torch.no_grad():
        hidden = model(ids, torch.arange(c - 1, c - 1 + block).unsqueeze(0), context, mask)
    return model.compute_logits(hidden[0, 1:]).argmax(-1).tolist()


def test_target_returns_the_outputs_of_the_draft_layers(pair):
    """SGLang's capture convention: target layer id's output (HF hidden_states[id + 1]), pre-final-norm."""
    target, draft, hf = pair
    proposer = DFlashProposer(target, draft, ENGINE)
    assert proposer.target_capture_layers == [1, 3]
    engine = TargetEngine(ModelRunner(target, ENGINE), feature_layers=proposer.target_capture_layers)
    ids = [5, 77, 140, 9, 230, 18]
    [out] = engine.prefill([PrefillInput("s", ids, True, SamplingParams(), StopRule(8, prompt_len=len(ids)),
                                         return_features=True)])
    torch.testing.assert_close(out.features, hf_features(hf, ids, [0, 2]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 6], ids=["full-context", "window-6"])
def test_cached_context_kv_drafts_what_a_dense_recomputation_drafts(pair, window):
    """Prefill, then Proposes after 1..3 newly committed tokens each (their features arrive one step late, as the
    gateway sends them): every chain equals the dense reference; with a window the draft KV of a sequence never
    outgrows it."""
    target, draft, hf = pair
    proposer = DFlashProposer(target, draft, ENGINE, window_size=window)
    model = load_dflash_draft(draft, target, ENGINE)
    spec = SpecShape(1, 1, 4)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 320, (40,), generator=gen).tolist()
    feats = hf_features(hf, tokens, [0, 2])
    committed = 7
    assert proposer.prefill("s", tokens[:committed], feats[:committed - 1]) == Status.OK
    synced, step = committed, 0
    while committed < len(tokens):
        [out] = proposer.propose([ProposeInput("s", committed, tokens[synced:committed], spec,
                                               features=feats[synced - 1:committed - 1])])
        assert out.status == Status.OK and out.tree.parents == [-1, 0, 1]
        assert out.tree.token_ids == dense_drafts(model, tokens[:committed], feats, 4, window)
        if window is not None:
            assert proposer.kv_slots_held("s") <= -(-window // ENGINE.block_size) * ENGINE.block_size
        synced, step = committed, step + 1
        committed = min(len(tokens), committed + 1 + step % 3)
    assert proposer.release(["s"]) == 1
    assert proposer.memory()[0] == proposer.memory()[1]  # every draft KV block back


def test_chain_is_cut_at_the_context_length(pair):
    target, draft, hf = pair
    proposer = DFlashProposer(target, draft, ENGINE)
    proposer.max_context_len = 10
    tokens = list(range(3, 11))  # C = 8: drafts would sit at 8, 9, 10 -> only 8 and 9 fit
    feats = hf_features(hf, tokens, [0, 2])
    proposer.prefill("s", tokens, feats[:-1])
    [out] = proposer.propose([ProposeInput("s", 8, [], SpecShape(1, 1, 4), features=feats[:0])])
    assert len(out.tree.token_ids) == 2 and out.tree.parents == [-1, 0]


def test_a_sequence_the_draft_kv_cannot_hold_drafts_nothing_then_resyncs(pair):
    """A full draft KV pool: that sequence gets an empty tree (a target-only step), its next Propose is STALE (the
    gateway re-syncs it), the others keep drafting; features of the wrong width are INVALID for that sequence alone."""
    target, draft, hf = pair
    proposer = DFlashProposer(target, draft, EngineConfig(device="cpu", dtype="float32", max_total_tokens=16,
                                                          block_size=4))
    tokens = list(range(3, 14))  # 11 committed: context of 10 positions = 3 blocks of the pool's 4
    feats = hf_features(hf, tokens, [0, 2])
    spec = SpecShape(1, 1, 4)
    for seq_id in ("a", "b"):
        assert proposer.prefill(seq_id, tokens, feats[:-1]) == Status.OK
    a, b = proposer.propose([ProposeInput(s, 11, [], spec, features=feats[:0]) for s in ("a", "b")])
    assert a.status == Status.OK and len(a.tree.token_ids) == 3
    assert b.status == Status.OK and b.tree.token_ids == []
    [b] = proposer.propose([ProposeInput("b", 12, [20], spec, features=feats[10:11])])
    assert b.status == Status.STALE
    [a, bad] = proposer.propose([ProposeInput("a", 12, [20], spec, features=feats[10:11]),
                                 ProposeInput("c", 12, [20], spec, features=feats[10:11, :5])])
    assert a.status == Status.OK and len(a.tree.token_ids) == 3
    assert bad.status == Status.INVALID and "features must be (len(new_token_ids), 128)" in bad.error
    assert proposer.prefill("d", tokens, feats[:-1, :7]) == Status.INVALID


@pytest.mark.parametrize("family,block,window", [("llama", 4, None), ("qwen3", 6, 8)],
                         ids=["llama-block4", "qwen3-block6-window8"])
async def test_greedy_through_the_services_matches_hf_generate(tmp_path, family, block, window):
    target = make_tiny_model(family, tmp_path / "target", num_hidden_layers=5)
    draft = make_tiny_dflash_draft(target, tmp_path / "draft", block_size=block)  # default layers: [L // 2]
    hf = load_hf_model(target)
    async with local_stack(target, algorithm="DFLASH", draft_path=draft, num_steps=1, topk=1, num_draft_tokens=block,
                           draft_window_size=window) as scheduler:
        for i, prompt in enumerate(prompts(hf.config.vocab_size)):
            got, usage, _ = await generate_ids(scheduler, prompt, 17 + 3 * i, request_id=f"d{i}")
            assert got == hf_greedy(hf, prompt, 17 + 3 * i), f"prompt {i}"
            assert usage.proposed_draft_tokens > 0, "the DFLASH draft pod never proposed: feature plumbing broken"
        await _assert_no_kv_leak(scheduler)
        assert scheduler.test_proposer.memory()[0] == scheduler.test_proposer.memory()[1]


# ---------------------------------------------------------------- sampling: χ² against the target distribution
NUM_TRIALS = 3000


def test_sampled_verify_of_dflash_chains_follows_the_target_distribution(tmp_path):
    """The DFLASH chain (greedy block draft) of a committed prefix, verified by the target for NUM_TRIALS seeds with
    temperature/top-k sampling: the first and second emitted tokens follow HF's distribution. The root is picked so
    that the first draft token is likely under the target (the accept branch runs often, and so does the residual)."""
    target = make_tiny_model("llama", tmp_path / "target", std=0.3, num_hidden_layers=4)
    draft = make_tiny_dflash_draft(target, tmp_path / "draft", block_size=4, target_layer_ids=[1])
    hf = load_hf_model(target)
    sampling = SamplingParams(temperature=0.9, top_k=8)
    prompt = [3, 17, 42, 9, 100]
    proposer = DFlashProposer(target, draft, ENGINE)
    feats = hf_features(hf, prompt, [1])
    roots = list(range(3, 320))
    for r in roots:
        proposer.prefill(f"r{r}", [*prompt, r], feats)
    outs = proposer.propose([ProposeInput(f"r{r}", len(prompt) + 1, [], SpecShape(1, 1, 4), features=feats[:0])
                             for r in roots])
    with torch.no_grad():
        logits = hf(torch.tensor([[*prompt, r] for r in roots])).logits[:, -1].float()
    probs = process_logits(logits, [sampling] * len(roots))  # (R, V)
    likely = [probs[i, o.tree.token_ids[0]].item() for i, o in enumerate(outs)]
    best = max(range(len(roots)), key=lambda i: likely[i])
    assert 0.15 < likely[best], f"no root makes the random draft's first token likely ({likely[best]:.3f})"
    root, tree = roots[best], outs[best].tree
    a = tree.token_ids[0]

    def hf_probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return process_logits(hf(torch.tensor([ids])).logits[0, -1:].float(), [sampling])[0]

    first, second = hf_probs([*prompt, root]), hf_probs([*prompt, root, a])
    engine = TargetEngine(ModelRunner(target, EngineConfig(device="cpu", dtype="float32",
                                                           max_total_tokens=NUM_TRIALS * 48)))
    stop = StopRule(max_new_tokens=100, prompt_len=len(prompt))
    seeded = [SamplingParams(temperature=0.9, top_k=8, seed=i) for i in range(NUM_TRIALS)]
    engine.prefill([PrefillInput(f"s{i}", [*prompt, root], False, seeded[i], stop) for i in range(NUM_TRIALS)])
    outputs = engine.verify([VerifyInput(f"s{i}", len(prompt) + 1, root, DraftTree(tree.token_ids, tree.parents),
                                         seeded[i], stop) for i in range(NUM_TRIALS)])
    assert all(o.status == 0 for o in outputs), {(o.status, getattr(o, "error", "")) for o in outputs}
    for dist, counts in ((first, collections.Counter(o.token_ids[0] for o in outputs)),
                         (second, collections.Counter(o.token_ids[1] for o in outputs if o.token_ids[0] == a))):
        total = sum(counts.values())
        assert total > 300
        support = [t for t in range(dist.numel()) if dist[t] > 1e-6]
        assert set(counts) <= set(support), "sampled a token outside the target's support"
        mass = sum(float(dist[t]) for t in support)
        assert chisquare([counts.get(t, 0) for t in support],
                         [float(dist[t]) / mass * total for t in support]).pvalue > 1e-3
    accepted = sum(1 for o in outputs if len(o.token_ids) > 1)
    assert accepted > 300, "the draft chain was (almost) never accepted: the accept branch went untested"


# ---------------------------------------------------------------- SGLang's flag rules and messages
def _prepare(*flags: str):
    from tandem.cli import build_parser, prepare

    parser = build_parser()
    args = parser.parse_args(["serve", "--device", "cpu", *flags])
    prepare(args, parser)
    return args


def _refused(*flags: str) -> str:
    with pytest.raises(SystemExit) as exc:
        _prepare(*flags)
    return str(exc.value)


@pytest.fixture(scope="module")
def draft_dir(pair):
    return pair[1]


def test_dflash_needs_a_draft_path_and_names_the_trainer(pair):
    """A target other than the bundled one (whose DFLASH draft is models/tandem-demo-code-dflash) needs a draft."""
    message = _refused("--model-path", pair[0], "--speculative-algorithm", "DFLASH")
    assert "DFLASH speculative decoding requires setting --speculative-draft-model-path." in message
    assert "python -m tools.train_draft --kind dflash" in message


def test_block_size_defaults_from_the_draft_config_else_16(pair, draft_dir, tmp_path, caplog):
    target = pair[0]
    args = _prepare("--model-path", target, "--speculative-algorithm", "DFLASH",
                    "--speculative-draft-model-path", draft_dir)
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (1, 1, 4)
    raw = json.loads(open(f"{draft_dir}/config.json").read())
    raw.pop("block_size")
    raw["dflash_config"].pop("block_size")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING):
        args = _prepare("--model-path", target, "--speculative-algorithm", "DFLASH",
                        "--speculative-draft-model-path", str(tmp_path))
    assert args.speculative_num_draft_tokens == 16
    assert "speculative_num_draft_tokens is not set; defaulting to 16 for DFLASH." in caplog.text


def test_block_size_flag_is_an_alias_of_num_draft_tokens(pair, draft_dir):
    base = ("--model-path", pair[0], "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", draft_dir)
    assert _prepare(*base, "--speculative-dflash-block-size", "6").speculative_num_draft_tokens == 6
    assert _prepare(*base, "--speculative-num-draft-tokens", "5").speculative_num_draft_tokens == 5
    args = _prepare(*base, "--speculative-num-draft-tokens", "6", "--speculative-dflash-block-size", "6")
    assert args.speculative_num_draft_tokens == 6
    message = _refused(*base, "--speculative-num-draft-tokens", "8", "--speculative-dflash-block-size", "6")
    assert message == ("error: Both --speculative-num-draft-tokens and --speculative-dflash-block-size are set but "
                       "they differ. For DFLASH they must match. speculative_num_draft_tokens=8, "
                       "speculative_dflash_block_size=6.")
    assert _refused(*base, "--speculative-dflash-block-size", "0") == (
        "error: DFLASH requires --speculative-dflash-block-size to be positive, got 0.")


def test_steps_and_topk_are_forced_to_one_with_a_warning(pair, draft_dir, caplog):
    with caplog.at_level(logging.WARNING):
        args = _prepare("--model-path", pair[0], "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
                        draft_dir, "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
                        "--speculative-num-draft-tokens", "4")
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (1, 1, 4)
    assert "DFLASH only supports speculative_num_steps == 1; overriding speculative_num_steps=3 to 1." in caplog.text
    assert "DFLASH only supports speculative_eagle_topk == 1; overriding speculative_eagle_topk=2 to 1." in caplog.text


def test_draft_window_rules(pair, draft_dir):
    base = ("--model-path", pair[0], "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", draft_dir)
    assert _prepare(*base, "--speculative-draft-window-size", "4").speculative_draft_window_size == 4
    assert _prepare(*base, "--speculative-dflash-draft-window-size", "6").speculative_draft_window_size == 6
    assert _refused(*base, "--speculative-draft-window-size", "3") == (
        "error: --speculative-draft-window-size must be >= --speculative-num-draft-tokens (block_size). "
        "window_size=3, block_size=4.")
    assert _refused(*base, "--speculative-draft-window-size", "0") == (
        "error: --speculative-draft-window-size must be positive, got 0.")
    message = _refused("--speculative-algorithm", "EAGLE3", "--speculative-draft-window-size", "64")
    assert message.startswith("error: --speculative-draft-window-size: not supported yet for "
                              "speculative_algorithm=EAGLE3")
    assert "needs --speculative-algorithm DFLASH" in _refused("--speculative-draft-window-size", "64")


def test_block_size_flag_is_noted_for_other_algorithms(capsys):
    _prepare("--speculative-algorithm", "STANDALONE", "--speculative-dflash-block-size", "8")
    assert "--speculative-dflash-block-size is ignored for STANDALONE" in capsys.readouterr().err


def test_launcher_passes_the_block_shape_and_window_to_the_model_services(pair, draft_dir):
    from tandem.launch import commands

    args = _prepare("--model-path", pair[0], "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
                    draft_dir, "--speculative-dflash-block-size", "6", "--speculative-draft-window-size", "32")
    draft = commands(args)["target-0"]  # the draft runs in the target's process (serve co-locates it)
    for flag, value in (("--speculative-num-steps", "1"), ("--speculative-eagle-topk", "1"),
                        ("--speculative-num-draft-tokens", "6"), ("--speculative-draft-window-size", "32")):
        assert draft[draft.index(flag) + 1] == value


# ---------------------------------------------------------------- the trainer
def test_training_blocks_are_the_served_blocks(pair):
    """The trainer's many-blocks-per-window forward gives, for every anchor a, the logits the served draft gives at
    committed length a+1 (context features of positions < a, block [t_a, MASK...]): what is trained is served."""
    from tools.train_dflash import block_logits

    target, draft, hf = pair
    model = load_dflash_draft(draft, target, ENGINE)
    tokens = torch.randint(3, 320, (2, 24), generator=torch.Generator().manual_seed(2))
    feats = torch.stack([hf_features(hf, row.tolist(), [0, 2]) for row in tokens])  # (2, 24, 2H)
    anchors = torch.tensor([[1, 9, 20], [5, 6, 14]])
    with torch.no_grad():
        got = block_logits(model, tokens, feats, anchors, 4)  # (2, 3, 3, V)
    for i in range(2):
        for j, a in enumerate(anchors[i].tolist()):
            committed = tokens[i, :a + 1].tolist()
            want = dense_drafts(model, committed, feats[i], 4)
            assert got[i, j].argmax(-1).tolist() == want
            ref = dense_logits(model, committed, feats[i], 4)
            torch.testing.assert_close(got[i, j], ref, atol=1e-4, rtol=1e-4)


def dense_logits(model, tokens: list[int], feats: torch.Tensor, block: int) -> torch.Tensor:
    c = len(tokens)
    pos = torch.arange(c - 1)
    context = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in model.context_kv(feats[:c - 1], pos)]
    ids = torch.tensor([[tokens[-1]] + [model.dflash.mask_token_id] * (block - 1)])
    mask = torch.ones(1, 1, block, c - 1 + block, dtype=torch.bool)
    with torch.no_grad():
        hidden = model(ids, torch.arange(c - 1, c - 1 + block).unsqueeze(0), context, mask)
    return model.compute_logits(hidden[0, 1:])


def test_train_draft_cli_writes_a_compact_draft_the_proposer_loads(tmp_path):
    from pathlib import Path

    from safetensors import safe_open

    from tools.lm_data import train_tokenizer
    from tools.train_draft import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(__file__).read_text() * 10)
    target = make_tiny_model("llama", tmp_path / "target", num_hidden_layers=4)
    train_tokenizer([corpus.read_text()], 320, Path(target))
    out = tmp_path / "dflash"
    main(["--kind", "dflash", "--target-model-path", target, "--corpus", str(corpus), "--output-dir", str(out),
          "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--device", "cpu", "--dflash-block-size", "5"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["num_hidden_layers"] == 1
    assert cfg["num_key_value_heads"] == 1 and cfg["intermediate_size"] == 64  # compact defaults
    assert cfg["dflash_config"]["block_size"] == 5 and cfg["dflash_config"]["target_layer_ids"] == [1]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.k_norm.weight"} <= names
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)
    info = json.loads((out / "training_info.json").read_text())
    assert info["kind"] == "dflash" and info["training"]["steps"] == 3
    proposer = DFlashProposer(target, str(out), ENGINE)
    assert proposer.block_size == 5 and proposer.target_capture_layers == [2]
    # the bundled draft's shape: head size and target layers given (4 heads of 8 over a hidden size of 64)
    main(["--kind", "dflash", "--target-model-path", target, "--corpus", str(corpus), "--output-dir", str(out / "b"),
          "--steps", "1", "--batch-size", "2", "--seq-len", "32", "--device", "cpu", "--dflash-num-heads", "4",
          "--dflash-head-dim", "8", "--dflash-intermediate-size", "24", "--dflash-target-layer-ids", "2"])
    cfg = json.loads((out / "b" / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["head_dim"], cfg["intermediate_size"]) == (4, 8, 24)
    assert cfg["dflash_config"]["target_layer_ids"] == [2]
    with safe_open(str(out / "b" / "model.safetensors"), framework="pt") as f:
        assert tuple(f.get_slice("layers.0.self_attn.q_proj.weight").get_shape()) == (32, cfg["hidden_size"])
        assert tuple(f.get_slice("fc.weight").get_shape()) == (cfg["hidden_size"], cfg["hidden_size"])


async def test_trained_draft_gets_drafts_accepted_more_than_a_random_one(tmp_path):
    """train_dflash_online on the target's own greedy continuations (a small vocabulary keeps it quick on CPU): the
    trained draft's chains get accepted through the services far more often than a random draft's."""
    from tools.train_dflash import DFlashTrainConfig, train_dflash_online
    from tools.train_eagle3 import TrainConfig

    target = make_tiny_model("llama", tmp_path / "target", num_hidden_layers=4, vocab_size=32)
    hf = load_hf_model(target)
    gen = torch.Generator().manual_seed(11)
    starts = [torch.randint(3, 32, (4,), generator=gen).tolist() for _ in range(16)]
    stream = torch.tensor([t for p in starts for t in p + hf_greedy(hf, p, 44)], dtype=torch.int32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny ops: one thread is several times faster than two contended ones
    try:
        stats = train_dflash_online(hf, stream, str(tmp_path / "trained"),
                                    TrainConfig(steps=400, batch_size=8, seq_len=32, lr=1e-2),
                                    DFlashTrainConfig(block_size=4, num_blocks=8))
    finally:
        torch.set_num_threads(threads)
    assert stats["steps"] == 400
    random_draft = make_tiny_dflash_draft(target, tmp_path / "random", block_size=4)

    async def accepted_per_step(draft) -> float:
        async with local_stack(target, algorithm="DFLASH", draft_path=draft, num_steps=1, topk=1,
                               num_draft_tokens=4) as scheduler:
            accepted = steps = 0
            for i, prompt in enumerate(starts[:4]):
                got, usage, _ = await generate_ids(scheduler, prompt, 24, request_id=f"t{i}")
                assert got == hf_greedy(hf, prompt, 24)
                accepted, steps = accepted + usage.accepted_draft_tokens, steps + usage.verify_steps
            return accepted / steps

    trained, baseline = await accepted_per_step(str(tmp_path / "trained")), await accepted_per_step(random_draft)
    assert trained > 0.1 and trained > 3 * baseline, (trained, baseline)
