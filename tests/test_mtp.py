"""MTP / NextN layers inside a target checkpoint (runtime/models/mtp.py): the target loads without them (and still
equals HF), the MTP head loads them with the target's embedding and lm_head, and its forward equals an independent
HF-transformers computation of the same math (enorm / hnorm / eh_proj, one Llama decoder layer, shared_head.norm)."""
from __future__ import annotations

import pytest
import torch

from runtime.batch_builder import SeqForward
from runtime.config import EngineConfig, ModelConfig
from runtime.model_runner import ModelRunner
from runtime.models.mtp import build_mtp_head
from tests.tiny_models import add_mtp_layers, hf_logits, load_hf_model, make_tiny_model

CPU = EngineConfig(device="cpu", dtype="float32", max_total_tokens=512, attention_backend="torch")


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    return add_mtp_layers(make_tiny_model("llama", tmp_path_factory.mktemp("mtp")), num_layers=2)


def test_the_target_ignores_its_mtp_layers_and_still_equals_hf(mtp_target):
    config = ModelConfig.from_pretrained(mtp_target)
    assert config.num_mtp_layers == 2
    runner = ModelRunner(mtp_target, CPU)
    ids = [5, 17, 42, 7, 99, 3]
    runner.add_seq("s")
    ours = runner.forward([SeqForward("s", ids, logits="all")]).logits[0]
    torch.testing.assert_close(ours, hf_logits(load_hf_model(mtp_target), ids), atol=2e-4, rtol=2e-4)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("layer", [0, 1])
def test_mtp_layer_equals_an_hf_decoder_layer_over_the_same_weights(mtp_target, layer):
    import transformers
    from safetensors import safe_open

    config = ModelConfig.from_pretrained(mtp_target)
    model, kv_config = build_mtp_head(mtp_target, config, CPU, num_layers=2)
    model.active_layer = layer
    runner = ModelRunner(None, CPU, kv_config, model=model)
    ids = [5, 17, 42, 7, 99]
    feats = torch.randn(len(ids), config.hidden_size, generator=torch.Generator().manual_seed(1))
    runner.add_seq("s")
    ours = runner.forward([SeqForward("s", ids, logits="all", input_features=feats)]).logits[0]

    # The reference: HF's own Llama decoder (one layer) and final norm, fed eh_proj(cat(enorm(e), hnorm(f))).
    prefix = f"model.layers.{config.num_layers + layer}."
    with safe_open(f"{mtp_target}/mtp.safetensors", "pt") as f:
        w = {k.removeprefix(prefix): f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    with safe_open(f"{mtp_target}/model.safetensors", "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
        head = f.get_tensor("lm_head.weight") if "lm_head.weight" in f.keys() else embed
    hf_cfg = transformers.AutoConfig.from_pretrained(mtp_target)
    hf_cfg.num_hidden_layers = 1
    hf = transformers.LlamaModel(hf_cfg).eval()
    state = {f"layers.0.{k}": v for k, v in w.items() if not k.split(".")[0] in ("enorm", "hnorm", "eh_proj",
                                                                                   "shared_head")}
    state["norm.weight"] = w["shared_head.norm.weight"]
    state["embed_tokens.weight"] = embed
    hf.load_state_dict(state, strict=True)
    eps = config.rms_norm_eps
    e = embed[torch.tensor(ids)]
    h0 = torch.cat([_rms(e, w["enorm.weight"], eps), _rms(feats, w["hnorm.weight"], eps)], -1) @ w["eh_proj.weight"].T
    with torch.no_grad():
        out = hf(inputs_embeds=h0[None], position_ids=torch.arange(len(ids))[None]).last_hidden_state[0]
    torch.testing.assert_close(ours, out @ head.T, atol=2e-4, rtol=2e-4)


def test_bad_mtp_requests_are_refused(tmp_path, mtp_target):
    plain = make_tiny_model("llama", tmp_path)
    with pytest.raises(ValueError, match="no MTP layers"):
        build_mtp_head(plain, ModelConfig.from_pretrained(plain), CPU)
    with pytest.raises(ValueError, match="has 2 MTP layer"):
        build_mtp_head(mtp_target, ModelConfig.from_pretrained(mtp_target), CPU, num_layers=3)


# ---------------------------------------------------------------------------------------------- NEXTN end to end
@pytest.mark.parametrize("steps,topk,ndt", [(3, 1, 4), (3, 4, 8)], ids=["chain-3-1-4", "tree-3-4-8"])
async def test_nextn_with_the_targets_mtp_layer_equals_hf_greedy_through_the_services(mtp_target, steps, topk, ndt):
    """NEXTN with no draft model: the draft service runs the target checkpoint's first MTP layer autoregressively,
    fed the target's final hidden states; greedy output equals HF `generate` of the target."""
    import asyncio

    from tests.stack import generate_ids, local_stack
    from tests.test_lossless_greedy import _assert_no_kv_leak, hf_greedy, prompts

    hf = load_hf_model(mtp_target)
    all_prompts = prompts(hf.config.vocab_size)
    async with local_stack(mtp_target, algorithm="NEXTN", draft_path=mtp_target, num_steps=steps, topk=topk,
                           num_draft_tokens=ndt) as scheduler:
        assert type(scheduler.test_proposer.model).__name__ == "MTPHead"
        results = await asyncio.gather(*(generate_ids(scheduler, p, 14 + 3 * i, request_id=f"n{i}")
                                         for i, p in enumerate(all_prompts)))
        for i, (prompt, (got, usage, _)) in enumerate(zip(all_prompts, results)):
            assert got == hf_greedy(hf, prompt, 14 + 3 * i), f"prompt {i} diverged from HF"
        assert sum(u.proposed_draft_tokens for _, u, _ in results) > 0
        await _assert_no_kv_leak(scheduler)


def test_the_draft_service_builds_the_mtp_head_from_the_target_path(mtp_target):
    """`tandem draft --speculative-algorithm NEXTN --model-path <MTP target>`: the registry's factory loads the MTP
    layer (no head checkpoint), and the target service is told to return final hidden states."""
    from tandem.cli import build_parser, prepare
    from tandem.services import _feature_capture, build_proposer

    parser = build_parser()
    args = parser.parse_args(["draft", "--model-path", mtp_target, "--speculative-algorithm", "NEXTN",
                              "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "512"])
    prepare(args, parser)
    proposer, path = build_proposer(args)
    assert type(proposer.model).__name__ == "MTPHead" and path == mtp_target
    target_args = parser.parse_args(["target", "--model-path", mtp_target, "--speculative-algorithm", "NEXTN",
                                     "--device", "cpu"])
    prepare(target_args, parser)
    assert _feature_capture(target_args, ModelRunner(mtp_target, CPU)) == {"final_norm_features": True}


# ---------------------------------------------------------------------------------------------- training
def test_mtp_training_unroll_is_the_served_layer_math(tmp_path):
    """tools/train_eagle3.MTPTrainHead's step 0 equals the served MTP layer (runtime/models/mtp.py, through a
    ModelRunner) on the checkpoint save_mtp wrote into the target: what is trained is what NEXTN serves."""
    import shutil

    from tools.train_eagle3 import MTPTrainHead, TrainConfig, save_mtp

    target = str(tmp_path / "target")
    shutil.copytree(make_tiny_model("llama", tmp_path / "src"), target)
    tcfg = ModelConfig.from_pretrained(target)
    hf = load_hf_model(target)
    torch.manual_seed(0)
    model = MTPTrainHead(tcfg.hidden_size, tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim, tcfg.intermediate_size,
                         tcfg.rms_norm_eps, tcfg.rope_theta, hf.lm_head.weight.detach().float())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_mtp(model, target, tcfg, TrainConfig())
    served, kv_config = build_mtp_head(target, ModelConfig.from_pretrained(target), CPU)
    runner = ModelRunner(None, CPU, kv_config, model=served)
    tokens = torch.tensor([[5, 17, 200, 33, 9, 250, 41, 7]])
    t = tokens.shape[1] - 1
    feats = torch.randn(1, t, tcfg.hidden_size)
    with torch.no_grad():
        embeds = hf.get_input_embeddings().weight[tokens[:, 1:]]  # t_1..
        [trained] = model.unrolled_hidden(embeds, feats, 1)
    runner.add_seq("s")
    out = runner.forward([SeqForward("s", tokens[0, 1:].tolist(), logits="all", capture_hidden=True,
                                     input_features=feats[0])])
    torch.testing.assert_close(out.hidden[0], trained[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.logits[0], model.logits(trained[0]), atol=1e-4, rtol=1e-4)
    # the target itself still loads (and equals HF): the MTP layer is the draft's
    ModelRunner(target, CPU)


def test_train_draft_kind_mtp_appends_a_layer_that_nextn_serves(tmp_path):
    import json
    import shutil
    from pathlib import Path

    from draft_service.eagle import EagleProposer
    from draft_service.proposer import ProposeInput, SpecShape, Status
    from tools.lm_data import train_tokenizer
    from tools.train_draft import main

    target = tmp_path / "target"
    shutil.copytree(make_tiny_model("llama", tmp_path / "src"), target)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(__file__).read_text() * 10)
    train_tokenizer([corpus.read_text()], 320, target)  # the tiny target's vocabulary is 320
    before = json.loads((target / "config.json").read_text())
    main(["--kind", "mtp", "--target-model-path", str(target), "--corpus", str(corpus), "--output-dir", str(target),
          "--steps", "2", "--batch-size", "2", "--seq-len", "24", "--device", "cpu"])
    after = json.loads((target / "config.json").read_text())
    assert after["num_nextn_predict_layers"] == 1 and after["num_hidden_layers"] == before["num_hidden_layers"]
    assert json.loads((target / "mtp_training_info.json").read_text())["kind"] == "mtp"
    proposer = EagleProposer(str(target), str(target), CPU, algorithm="NEXTN")
    assert type(proposer.model).__name__ == "MTPHead"
    committed = [3, 77, 150, 8, 299, 61]
    feats = torch.randn(len(committed), proposer.feature_size, generator=torch.Generator().manual_seed(0))
    assert proposer.prefill("s", committed, feats[:-1]) == Status.OK
    [out] = proposer.propose([ProposeInput("s", len(committed), [], SpecShape(3, 1, 4), feats[:0])])
    assert out.status == Status.OK and out.tree.parents == [-1, 0, 1]
