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
