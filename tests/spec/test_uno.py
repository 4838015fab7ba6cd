"""UNO (LoRA self-drafting, sglang_spec.md §7.4): the batched LoRA of the draft rows, the shapes and SGLang's
validation messages, and greedy output equal to HF transformers' greedy `generate` through the in-process stack
(target server that also serves DraftService, the gateway scheduler and its clients), linear and tree mode."""
from __future__ import annotations

import asyncio

import argparse
import dataclasses

import pytest
import torch
import transformers

from core import algorithms
from runtime.lora import LoRALinear, apply_adapter, load_adapter, lora_linear_ref, segments
from runtime.speculative.uno import draft_chain, draft_tree
from tests.stack import generate_ids, local_stack
from tests.tiny_models import make_tiny_lora, make_tiny_model

FAMILIES = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=FAMILIES)
def uno_pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"uno-{request.param}")
    target = make_tiny_model(request.param, root / "target")
    lora = make_tiny_lora(target, root)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    return target, lora, hf


def _runner(target: str):
    from runtime.config import EngineConfig
    from runtime.model_runner import ModelRunner

    return ModelRunner(target, EngineConfig(device="cpu", dtype="float32", max_total_tokens=2048))


# ---------------------------------------------------------------- batched LoRA
@pytest.mark.parametrize("part_sizes", [[24, 8, 8], [16, 16], [20]])
def test_batched_lora_with_mixed_rows_equals_per_row_merged_weights(part_sizes):
    gen = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(12, sum(part_sizes), bias=True)
    lora = LoRALinear(base, part_sizes, scaling=1.5)
    parts = {}
    for p, size in enumerate(part_sizes):
        if p == 1 and len(part_sizes) > 1:
            continue  # a part the adapter leaves alone (e.g. k_proj of a q/v adapter)
        parts[p] = (torch.randn(3, 12, generator=gen), torch.randn(size, 3, generator=gen))
        lora.set_part(p, *parts[p])
    x = torch.randn(7, 12, generator=gen)
    ids = torch.tensor([-1, 0, 0, -1, 0, -1, -1])
    with torch.no_grad(), segments([lora], ids):
        got = lora(x)
    want = lora_linear_ref(x, base.weight, base.bias, part_sizes, parts, 1.5, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert torch.equal(lora(x), base(x)), "outside `segments` every row runs the base weights, bit for bit"


def test_draft_rows_change_with_the_adapter_and_clean_rows_do_not(uno_pair):
    """Through the runtime model, in one forward: the rows with segment id -1 equal the base model exactly (causal:
    they never see the adapter), and each adapter row equals a forward of that row alone with the adapter on, over
    the same clean KV (the per-row application)."""
    target, lora_path, _ = uno_pair
    from runtime.model_runner import SeqForward

    tokens = [5, 9, 17, 33, 2, 71, 8]
    adapter = load_adapter(lora_path)
    base_runner, lora_runner, ref = _runner(target), _runner(target), _runner(target)
    wrappers, ref_wrappers = apply_adapter(lora_runner.model, adapter), apply_adapter(ref.model, adapter)
    base_runner.add_seq("s")
    base = base_runner.forward([SeqForward("s", tokens, logits="all")]).logits[0]
    lora_runner.add_seq("s")
    with segments(wrappers, torch.tensor([-1, -1, -1, -1, 0, 0, 0])):
        mixed = lora_runner.forward([SeqForward("s", tokens, logits="all")]).logits[0]
    torch.testing.assert_close(mixed[:4], base[:4], rtol=0, atol=0)
    assert not torch.allclose(mixed[4:], base[4:], atol=1e-3)
    ref.add_seq("s")
    ref.forward([SeqForward("s", tokens[:4], logits="none")])
    for j in range(4, len(tokens)):  # row j alone, adapter on, after the clean prefix and the adapter rows before it
        with segments(ref_wrappers, torch.tensor([0])):
            row = ref.forward([SeqForward("s", [tokens[j]], logits="all")]).logits[0]
        torch.testing.assert_close(mixed[j], row[0], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- shapes
def test_best_first_tree_is_closed_and_ordered():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=gen) * 3
    tree = draft_tree(7, logits, topk=3, num_nodes=8)
    assert tree.token_ids[0] == 7 and tree.parents[0] == -1 and tree.parents.count(-1) == 1
    assert len(tree) == 8
    tree.validate()
    lp = torch.log_softmax(logits, dim=-1)
    depths = tree.depths()
    mass = [0.0]
    for i in range(1, len(tree)):
        mass.append(mass[tree.parents[i]] + lp[depths[i] - 1, tree.token_ids[i]].item())
    assert all(mass[i] >= mass[i + 1] - 1e-6 for i in range(1, len(tree) - 1)), "best-first: masses never increase"
    # exhaustive check: no unchosen candidate beats the worst chosen node
    chosen = {(tree.parents[i], tree.token_ids[i]) for i in range(1, len(tree))}
    top = lp.topk(3, dim=-1)
    for node in range(len(tree)):
        if depths[node] >= 3:
            continue
        for v, t in zip(top.values[depths[node]].tolist(), top.indices[depths[node]].tolist()):
            if (node, t) not in chosen:
                assert mass[node] + v <= min(mass[1:]) + 1e-6


def test_linear_chain_greedy_and_sampled():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    assert draft_chain(2, logits, None).token_ids == [2, 1, 0]
    from runtime.sampling import SamplingParams

    tree = draft_chain(2, logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert tree.parents == [-1, 0, 1] and tree.draft_probs.shape == (3, 3)
    assert tree.draft_probs[0].tolist() == [0.0, 0.0, 1.0]  # the clean root, one-hot
    torch.testing.assert_close(tree.draft_probs[1:], torch.softmax(logits, -1))


# ---------------------------------------------------------------- validation (SGLang's messages)
UNO = algorithms.get("UNO")


@pytest.mark.parametrize("triple, message", [
    ((None, 1, 0), "UNO requires --speculative-num-draft-tokens to be a positive integer denoting the linear width "
                   "or tree verify width Q."),
    ((3, 1, None), "UNO requires --speculative-num-draft-tokens to be a positive integer"),
    ((3, 0, 8), "UNO requires --speculative-eagle-topk to be at least 1, got 0."),
    ((None, 4, 8), "UNO tree mode requires --speculative-num-steps so its draft width F can be derived as "
                   "speculative_num_steps + 1."),
    ((0, 4, 8), "UNO tree mode requires --speculative-num-steps to be positive, got 0."),
    ((7, 4, 6), "UNO tree mode requires Q >= F; got Q=6, F=8."),
    ((3, 4, 129), "UNO tree mode currently supports at most Q=128 verify nodes, got Q=129."),
    ((3, 32, 65), "UNO tree mode currently supports Q*K <= 2048; got Q*K=65*32=2080."),
    ((1, 2, 4), "UNO tree mode cannot build the requested Q from F and K: Q=4 exceeds capacity=3 for F=2, K=2."),
    ((2, 2, 5), "UNO tree mode cannot represent the requested Q in EAGLE's parent-list ABI: Q-1=4 exceeds "
                "K*(F-2)+1=3 for F=3, K=2."),
])
def test_every_uno_shape_rule_has_sglangs_message(triple, message):
    with pytest.raises(ValueError) as exc:
        UNO.resolve_shape("LlamaForCausalLM", *triple)
    assert str(exc.value).startswith(message)


def test_uno_shapes_linear_and_tree(caplog):
    assert UNO.resolve_shape("LlamaForCausalLM") == (1, 1, 4)
    assert UNO.resolve_shape(None, None, None, 8) == (1, 1, 8)
    assert UNO.resolve_shape(None, 5, 1, 8) == (1, 1, 8)  # linear: F = num_draft_tokens, steps forced to 1
    assert "UNO uses speculative_num_steps=1; overriding 5." in caplog.text
    assert UNO.resolve_shape(None, 3, 4, 8) == (3, 4, 8)
    assert UNO.resolve_shape(None, 15, 32, 32) == (15, 32, 32)  # SGLang's B/K/V 16/32/32


def _prepare(*argv):
    from tandem.cli import build_parser, prepare

    parser = build_parser()
    args = parser.parse_args(["serve", *argv])
    prepare(args, parser)
    return args


@pytest.mark.parametrize("argv, message", [
    (["--speculative-draft-model-path", "x"],
     "UNO reuses the target model and does not accept --speculative-draft-model-path."),
    (["--speculative-use-rejection-sampling"],
     "UNO manages its own stochastic verification and does not use --speculative-use-rejection-sampling."),
    (["--speculative-num-steps", "3", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8",
      "--speculative-accept-threshold-single", "0.5"],
     "UNO tree mode reuses EAGLE target-only sampling and requires both speculative accept thresholds to be 1.0."),
    (["--tp-size", "2"], "UNO requires TP=PP=1."),
    (["--speculative-num-draft-tokens", "0"], "UNO requires --speculative-num-draft-tokens to be a positive"),
])
def test_uno_flag_rules_exit_with_sglangs_messages(argv, message):
    with pytest.raises(SystemExit) as exc:
        _prepare("--speculative-algorithm", "UNO", *argv)
    assert str(exc.value) == f"error: {message}" or str(exc.value).startswith(f"error: {message}")


def test_uno_lora_path_is_required_off_the_bundled_target(tmp_path, monkeypatch):
    monkeypatch.delenv("UNO_LORA_PATH", raising=False)
    target = make_tiny_model("llama", tmp_path)
    with pytest.raises(SystemExit) as exc:
        _prepare("--model-path", target, "--speculative-algorithm", "UNO")
    assert str(exc.value) == "error: UNO requires --uno-lora-path."
    lora = make_tiny_lora(target, tmp_path)
    monkeypatch.setenv("UNO_LORA_PATH", lora)
    assert _prepare("--model-path", target, "--speculative-algorithm", "UNO").uno_lora_path == lora
    args = _prepare("--model-path", target, "--speculative-algorithm", "uno", "--uno-lora-path", lora,
                    "--speculative-num-draft-tokens", "6")
    assert (args.speculative_algorithm, args.speculative_num_steps, args.speculative_eagle_topk,
            args.speculative_num_draft_tokens) == ("UNO", 1, 1, 6)


def test_serve_starts_no_draft_process_and_points_the_gateway_at_the_targets(tmp_path):
    from tandem.launch import commands

    target = make_tiny_model("llama", tmp_path)
    args = _prepare("--model-path", target, "--uno-lora-path", make_tiny_lora(target, tmp_path),
                    "--speculative-algorithm", "UNO", "--num-target-replicas", "2")
    cmds = commands(args)
    assert not [n for n in cmds if n.startswith("draft-")]
    gateway = cmds["gateway"]
    targets = gateway[gateway.index("--target-address") + 1]
    assert gateway[gateway.index("--draft-address") + 1] == targets
    assert "--uno-lora-path" in cmds["target-0"]


def test_draft_process_flags_and_other_algorithms_flags_get_a_warning(tmp_path, capsys):
    target = make_tiny_model("llama", tmp_path)
    lora = make_tiny_lora(target, tmp_path)
    _prepare("--model-path", target, "--uno-lora-path", lora, "--speculative-algorithm", "UNO",
             "--num-draft-replicas", "2")
    assert "--num-draft-replicas is ignored for UNO: the target pods draft" in capsys.readouterr().err
    _prepare("--model-path", target, "--uno-lora-path", lora, "--speculative-algorithm", "NGRAM")
    assert "--uno-lora-path is ignored for NGRAM: it is UNO's" in capsys.readouterr().err


# ---------------------------------------------------------------- lossless through the stack
def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("steps,topk,ndt", [(1, 1, 4), (1, 1, 1), (3, 3, 7)], ids=["linear-4", "linear-1", "tree"])
async def test_uno_greedy_matches_hf_generate(uno_pair, steps, topk, ndt):
    target, lora, hf = uno_pair
    gen = torch.Generator().manual_seed(7)
    rand = torch.randint(3, hf.config.vocab_size, (40,), generator=gen).tolist()
    prompts = [rand[:5], rand[:23], rand[:6] * 4, [rand[0]]]
    async with local_stack(target, algorithm="UNO", lora_path=lora, num_steps=steps, topk=topk,
                           num_draft_tokens=ndt) as scheduler:
        for i, prompt in enumerate(prompts):
            max_new = 13 + 5 * i
            got, usage, finish = await generate_ids(scheduler, prompt, max_new, request_id=f"p{i}")
            assert got == hf_greedy(hf, prompt, max_new), f"prompt {i}: UNO output diverged from HF greedy"
            assert finish.value == "length" and usage.completion_tokens == max_new
            # the clean root is accepted every step: at least one draft token per verify that was not cut short
            assert usage.accepted_draft_tokens >= (max_new - 1) // (ndt + 1)
        engine = scheduler.test_engine
        assert engine.num_seqs == 0 and not engine._pending
        runner = scheduler.test_target_runner
        assert runner.num_free_tokens() == runner.num_total_tokens(), "KV leaked"


@pytest.mark.parametrize("steps,topk,ndt", [(1, 1, 4), (3, 3, 7)], ids=["linear-4", "tree"])
async def test_concurrent_uno_requests_batch_their_draft_pass_and_match_hf(uno_pair, steps, topk, ndt):
    """Requests in flight together share one draft pass per step (their clean roots, chains and trees read back
    together); a repetition-penalty request among them takes its own root draw. Every output is HF's."""
    target, lora, hf = uno_pair
    gen = torch.Generator().manual_seed(11)
    rand = torch.randint(3, hf.config.vocab_size, (60,), generator=gen).tolist()
    prompts = [rand[:7], rand[10:31], rand[:4] * 5, rand[40:52]]
    async with local_stack(target, algorithm="UNO", lora_path=lora, num_steps=steps, topk=topk,
                           num_draft_tokens=ndt) as scheduler:
        results = await asyncio.gather(*(generate_ids(scheduler, p, 24, request_id=f"c{i}")
                                         for i, p in enumerate(prompts)))
        assert scheduler.test_engine.num_seqs == 0 and not scheduler.test_engine._pending
    for i, (prompt, (got, usage, _)) in enumerate(zip(prompts, results)):
        assert got == hf_greedy(hf, prompt, 24), f"prompt {i}: batched UNO output diverged from HF greedy"
        assert usage.accepted_draft_tokens > 0


# ---------------------------------------------------------------- trainer
def test_trainer_draft_pass_is_the_serving_draft_pass(tmp_path):
    """tools/train_uno.py's masked training forward computes exactly the rows serving computes: the clean rows of the
    window and, for a noise block after anchor t, the LoRA rows of the runtime's draft pass."""
    from runtime.lora import LoRAConfig, save_adapter
    from runtime.model_runner import SeqForward
    from tools.train_uno import LoRAWeights, UnoTrainConfig, clean_pass, draft_pass

    target = make_tiny_model("qwen2", tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    cfg = UnoTrainConfig(rank=4, alpha=8.0, width=4, seq_len=16)
    torch.manual_seed(0)
    lora = LoRAWeights(hf, cfg)
    with torch.no_grad():
        for p in lora.b.values():
            p.normal_(0, 0.2)
    save_adapter(tmp_path / "lora", LoRAConfig(4, 8.0, cfg.target_modules), lora.export(), dtype=torch.float32)
    ids = torch.randint(3, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([[5, 9]])
    noise = torch.randint(3, 300, (1, 2, 3), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        kvs, clean = clean_pass(hf, lora, ids)
        rows = draft_pass(hf, lora, kvs, anchors, noise, 16)  # (1, 2, 3, V)
    runner = _runner(target)
    wrappers = apply_adapter(runner.model, load_adapter(tmp_path / "lora"))
    for m, t in enumerate(anchors[0].tolist()):
        runner.add_seq(f"s{m}")
        runner.forward([SeqForward(f"s{m}", ids[0, :t].tolist(), logits="none")])
        with segments(wrappers, torch.tensor([-1, 0, 0, 0])):
            got = runner.forward([SeqForward(f"s{m}", [int(ids[0, t]), *noise[0, m].tolist()], logits="all")]).logits[0]
        torch.testing.assert_close(got[0], clean[0, t], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[1:], rows[0, m], rtol=1e-4, atol=1e-4)


def test_trainer_runs_and_writes_a_loadable_adapter(tmp_path):
    import json

    from tandem.args import DEFAULT_MODEL
    from tools.train_draft import main

    big = make_tiny_model("llama", tmp_path, vocab_size=8192)  # the demo tokenizer's ids fit its embedding
    transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL).save_pretrained(big)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 200)
    out = tmp_path / "uno"
    main(["--kind", "uno", "--target-model-path", big, "--corpus", str(corpus), "--output-dir", str(out),
          "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--lora-rank", "2", "--uno-width", "4",
          "--uno-anchors", "3", "--minutes", "2"])
    info = json.loads((out / "training_info.json").read_text())
    assert info["kind"] == "uno" and info["training"]["steps"] == 3
    adapter = load_adapter(out)
    assert adapter.config.r == 2 and len(adapter.weights) == 3 * 7
    assert any(b.abs().sum() > 0 for _, b in adapter.weights.values()), "three steps must move B off zero"
    runner = _runner(big)
    assert apply_adapter(runner.model, adapter)


# ---------------------------------------------------------------- what Tandem adds: penalties and logprobs
@pytest.mark.parametrize("steps,topk,ndt", [(1, 1, 4), (3, 3, 7)], ids=["linear", "tree"])
async def test_uno_with_repetition_penalty_and_logprobs_equals_hf(uno_pair, steps, topk, ndt):
    """SGLang's UNO refuses penalties and logprobs; here the clean root is drawn with the request's processing and
    the rows below it are penalised for their path, so a penalised greedy run equals HF's, and every emitted token's
    logprob (the clean root's from the draft pass's clean row) equals HF's."""
    from gateway.types import GenerateParams, request_sampling
    from tests.test_logprobs import _close, _reference

    target, lora, hf = uno_pair
    prompt = [5, 9, 13, 2, 7, 11, 3]
    async with local_stack(target, algorithm="UNO", lora_path=lora, num_steps=steps, topk=topk,
                           num_draft_tokens=ndt) as scheduler:
        params = GenerateParams("rp", prompt, 20, sampling=request_sampling(temperature=0.0, repetition_penalty=1.3),
                                detokenize=False)
        penalised = [t async for chunk in scheduler.generate(params) for t in chunk.token_ids]
        params = GenerateParams("lp", prompt, 20, sampling=request_sampling(temperature=0.0), detokenize=False,
                                logprobs=2)
        tokens, entries = [], []
        async for chunk in scheduler.generate(params):
            tokens += chunk.token_ids
            entries += chunk.logprobs
    with torch.no_grad():
        expect = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, repetition_penalty=1.3,
                             eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert penalised == expect[0, len(prompt):].tolist()
    assert tokens == hf_greedy(hf, prompt, 20)
    _close(entries, _reference(hf, prompt + tokens, len(prompt), 2))


def test_a_verify_that_does_not_build_on_the_draft_pass_rolls_its_root_kv_back(uno_pair):
    """The draft pass keeps the last committed token's KV; a Verify with another tree (here: none, a plain decode
    step), a second draft pass, or a release leave the engine exactly as without it."""
    from runtime.sampling import SamplingParams
    from runtime.speculative.tree import DraftTree
    from core.steps import PrefillInput, VerifyInput
    from core.types import StopRule
    from target_service.engine import TargetEngine
    from target_service.uno import attach_adapter

    target, lora, hf = uno_pair
    runner = _runner(target)
    engine = TargetEngine(runner)
    attach_adapter(engine, lora)
    prompt = [5, 9, 13, 2, 7]
    stop = StopRule(max_new_tokens=50, prompt_len=len(prompt))
    greedy = SamplingParams(temperature=0.0)
    engine.prefill([PrefillInput("s", prompt, False, greedy, stop)])
    assert runner.kv_len("s") == len(prompt) - 1
    first = engine.self_draft([("s", len(prompt), 4)])[0]
    assert runner.kv_len("s") == len(prompt) and first.draft_logits.shape[0] == 3
    again = engine.self_draft([("s", len(prompt), 3)])[0]  # a second draft pass: same clean root, same KV length
    assert again.root_token_id == first.root_token_id and runner.kv_len("s") == len(prompt)
    assert engine.self_draft([("s", len(prompt) + 1, 4)]) == [None]  # another committed length: nothing to draft
    out = engine.verify([VerifyInput("s", len(prompt), prompt[-1], DraftTree([], []), greedy, stop)])[0]
    assert out.token_ids == hf_greedy(hf, prompt, 1) == [first.root_token_id]
    committed = prompt + out.token_ids
    assert runner.kv_len("s") == len(committed) - 1
    engine.self_draft([("s", len(committed), 4)])
    engine.release(["s"])
    assert runner.num_free_tokens() == runner.num_total_tokens() and not engine._pending


@pytest.mark.parametrize("steps,topk,ndt", [(1, 1, 4), (3, 3, 7)], ids=["linear-4", "tree"])
async def test_uno_runs_several_speculative_steps_per_call_as_served(uno_pair, steps, topk, ndt):
    """`tandem serve` runs 4 speculative steps per Verify call where the target drafts (UNO's pods): each call
    verifies, self-drafts the next tree and verifies again; greedy output equals HF and the calls are about a
    quarter of the steps."""
    target, lora, hf = uno_pair
    gen = torch.Generator().manual_seed(9)
    rand = torch.randint(3, hf.config.vocab_size, (40,), generator=gen).tolist()
    async with local_stack(target, algorithm="UNO", lora_path=lora, num_steps=steps, topk=topk,
                           num_draft_tokens=ndt, num_continuous_decode_steps=4) as scheduler:
        servicer, calls = scheduler.test_servers[0].servicer, [0]
        steps_of = servicer._steps

        def counted(inputs):
            calls[0] += 1
            return steps_of(inputs)

        servicer._steps = counted
        verify_steps = 0
        for i, prompt in enumerate([rand[:5], rand[:23], rand[:6] * 4]):
            got, usage, _ = await generate_ids(scheduler, prompt, 30, request_id=f"k{i}")
            assert got == hf_greedy(hf, prompt, 30)
            verify_steps += usage.verify_steps
        assert calls[0] <= verify_steps / 4 + 3, (calls[0], verify_steps)
        assert scheduler.test_engine.num_seqs == 0 and not scheduler.test_engine._pending
