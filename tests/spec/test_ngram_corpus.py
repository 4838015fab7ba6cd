"""External NGRAM corpora (--speculative-ngram-external-corpus-*): the suffix-array index against brute force, the
tree budget split with the trie, the token cap, the corpus file format, the flags through `tandem serve`'s parser and
the registry's factory, and greedy output through the real services unchanged while a corpus holding the answer
lifts acceptance."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch
import transformers

from draft_service.ngram import NgramConfig, NgramProposer
from core.corpus import read_corpus_documents
from draft_service.ngram_corpus import SEPARATOR, ExternalCorpus
from tests.stack import generate_ids, local_stack
from tests.test_lossless_greedy import hf_greedy
from tests.tiny_models import make_tiny_model


def test_suffix_array_and_occurrences_match_brute_force():
    rng = random.Random(0)
    for _ in range(60):
        docs = [[rng.randrange(4) for _ in range(rng.randrange(0, 25))] for _ in range(rng.randrange(1, 4))]
        corpus = ExternalCorpus(docs)
        text = corpus.tokens.tolist()
        assert corpus.sa.tolist() == sorted(range(len(text)), key=lambda i: text[i:])
        assert len(corpus) == sum(map(len, docs))
        for _ in range(8):
            pattern = [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
            lo, hi = corpus.occurrences(pattern)
            assert sorted(corpus.sa[lo:hi].tolist()) == [i for i in range(len(text))
                                                         if text[i:i + len(pattern)] == pattern]


def test_matches_and_continuations_stay_inside_a_document():
    corpus = ExternalCorpus([[5, 6, 7], [8, 9, 5, 6]])
    assert SEPARATOR in corpus.tokens.tolist()
    assert corpus.occurrences([7, 8]) == (0, 0) or corpus.occurrences([7, 8])[0] == corpus.occurrences([7, 8])[1]
    # "5 6" occurs in both documents: continued by 7 in the first, by nothing (document end) in the second
    anchors = list(corpus.anchors([1, 5, 6], max_depth=6, node_type=_node_type()))
    assert [d for _, d in anchors] == [2, 1]
    root, _ = anchors[0]
    assert list(root.children) == [7] and not root.children[7].children  # never past the end of document 0


def _node_type():
    from draft_service.ngram import _Node

    return _Node


def test_the_corpus_drafts_its_share_after_the_trie():
    doc = list(range(100, 140))
    trie = NgramProposer(NgramConfig(num_draft_tokens=8, external_sam_budget=7))
    trie.sync("s", [1, 2, 3, 110, 111, 112])
    assert trie.propose(["s"])[0].token_ids == []  # nothing in the trie continues 112
    assert trie.add_corpus("docs", [doc]) == 40
    tree = trie.propose(["s"])[0]
    assert tree.token_ids == list(range(113, 120)) and tree.parents == [-1, 0, 1, 2, 3, 4, 5]

    # SGLang's default budget 0: a corpus drafts nothing
    none = NgramProposer(NgramConfig(num_draft_tokens=8))
    none.add_corpus("docs", [doc])
    none.sync("s", [110, 111, 112])
    assert none.propose(["s"])[0].token_ids == []

    # the trie drafts first and keeps its share; the corpus adds its own after
    both = NgramProposer(NgramConfig(num_draft_tokens=6, external_sam_budget=2, max_bfs_breadth=1))
    both.add_corpus("docs", [doc])
    both.sync("s", [110, 111, 112, 50, 51, 52, 110, 111, 112])
    tree = both.propose(["s"])[0]
    assert tree.token_ids[:3] == [50, 51, 52]  # the trie's continuation of "110 111 112"
    assert 113 in tree.token_ids and len(tree.token_ids) == 5


def test_token_cap_ids_and_removal():
    trie = NgramProposer(NgramConfig(external_sam_budget=4, external_corpus_max_tokens=10))
    assert trie.add_corpus("a", [[1, 2, 3], [4, 5]]) == 5
    with pytest.raises(ValueError, match="does not fit"):
        trie.add_corpus("b", [[1] * 6])
    assert trie.add_corpus("a", [[1] * 9]) == 9  # a corpus replaced under the same id counts once
    assert trie.corpus_token_counts() == {"a": 9}
    with pytest.raises(ValueError, match="no tokens"):
        trie.add_corpus("c", [[]])
    trie.remove_corpus("a")
    assert trie.corpus_token_counts() == {}
    with pytest.raises(KeyError):
        trie.remove_corpus("a")
    with pytest.raises(ValueError):
        NgramConfig(external_sam_budget=-1)


def test_corpus_file_format(tmp_path):
    encode = lambda text: [ord(c) for c in text]  # noqa: E731
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps("ab") + "\n\n" + json.dumps("") + "\n" + json.dumps("cde") + "\n")
    assert read_corpus_documents(good, encode, 100) == [[97, 98], [99, 100, 101]]
    with pytest.raises(ValueError, match="exceeds .* at line 4"):
        read_corpus_documents(good, encode, 4)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="line 1: expected a JSON string"):
        read_corpus_documents(bad, encode, 100)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="line 1: not JSON"):
        read_corpus_documents(bad, encode, 100)
    with pytest.raises(ValueError, match="does not exist"):
        read_corpus_documents(tmp_path / "missing.jsonl", encode, 100)


def test_serve_flags_load_the_corpus_with_the_targets_tokenizer(tmp_path):
    from draft_service.ngram_draft import build
    from tandem.args import DEFAULT_MODEL
    from tandem.cli import build_parser, prepare

    text = "def area(width, height):\n    return width * height\n"
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps(text) + "\n")
    parser = build_parser()
    args = parser.parse_args(["serve", "--speculative-algorithm", "NGRAM", "--speculative-ngram-external-"
                                      "corpus-path", str(corpus), "--speculative-ngram-external-sam-budget", "4"])
    prepare(args, parser)
    draft, _ = build(SimpleNamespace(args=args, target_path=str(DEFAULT_MODEL)))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
    assert draft.trie.corpus_token_counts() == {str(corpus): len(tokenizer.encode(text, add_special_tokens=False))}
    assert draft.trie.config.external_sam_budget == 4

    corpus.write_text(json.dumps(["not", "a string"]) + "\n")
    with pytest.raises(SystemExit, match="external-corpus-path: .*line 1: expected a JSON string"):
        build(SimpleNamespace(args=args, target_path=str(DEFAULT_MODEL)))


async def test_greedy_output_unchanged_and_a_corpus_holding_the_answer_is_accepted(tmp_path):
    target = make_tiny_model("llama", tmp_path / "target")
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    prompts = [torch.randint(3, hf.config.vocab_size, (12,), generator=torch.Generator().manual_seed(s)).tolist()
               for s in range(3)]
    expected = [hf_greedy(hf, prompt, 24) for prompt in prompts]
    accepted = {}
    for with_corpus in (False, True):
        async with local_stack(target, algorithm="NGRAM", num_draft_tokens=6,
                               ngram_kwargs={"external_sam_budget": 5}) as scheduler:
            if with_corpus:  # documents that quote the answers (prompt tail + continuation), and one unrelated
                scheduler.test_proposer.trie.add_corpus("answers", [p[-4:] + e for p, e in zip(prompts, expected)]
                                                        + [list(range(3, 40))])
            total = 0
            for i, (prompt, want) in enumerate(zip(prompts, expected)):
                got, usage, _ = await generate_ids(scheduler, prompt, 24, request_id=f"c{i}")
                assert got == want, f"prompt {i}: output with corpus={with_corpus} diverged from HF greedy"
                total += usage.accepted_draft_tokens
            accepted[with_corpus] = total
    assert accepted[True] >= 2 * len(prompts) * 10 and accepted[True] > accepted[False]


async def test_corpus_endpoints_through_the_gateway_and_the_ngram_pod(tmp_path):
    """SGLang's POST /add_external_corpus, /remove_external_corpus, /list_external_corpora through the REST app, the
    scheduler and the NGRAM draft pod (real gRPC): documents as text, a file or token ids; errors are 400 envelopes
    for that request; a corpus holding the answer is drafted from, and the output is unchanged."""
    import httpx

    from gateway.openai_api import build_app
    from gateway.tokenizer import Tokenizer
    from tandem.args import DEFAULT_MODEL

    tokenizer = Tokenizer(DEFAULT_MODEL)
    prompt = tokenizer.hf.encode("import os\nimport sys\n\n\ndef main(argv):\n    ", add_special_tokens=False)
    async with local_stack(DEFAULT_MODEL, algorithm="NGRAM", num_draft_tokens=6, tokenizer=tokenizer,
                           ngram_kwargs={"external_sam_budget": 5}) as scheduler:
        app = build_app(scheduler, tokenizer, "tandem-demo-code", max_model_len=2048)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            plain, usage_plain, _ = await generate_ids(scheduler, prompt, 32, request_id="plain")
            assert (await http.get("/list_external_corpora")).json()["corpus_token_counts"] == {}

            r = await http.post("/add_external_corpus", json={"corpus_id": "answer", "token_chunks": [prompt + plain]})
            assert r.status_code == 200 and r.json()["success"], r.text
            assert r.json()["loaded_token_count"] == len(prompt) + 32
            text = "def helper(x):\n    return x + 1\n"
            r = await http.post("/add_external_corpus", json={"documents": [text]})
            assert r.status_code == 200, r.text
            generated_id = r.json()["corpus_id"]
            assert r.json()["loaded_token_count"] == len(tokenizer.hf.encode(text, add_special_tokens=False))
            corpus_file = tmp_path / "docs.jsonl"
            corpus_file.write_text(json.dumps(text) + "\n" + json.dumps(text * 2) + "\n")
            r = await http.post("/add_external_corpus", json={"file_path": str(corpus_file)})
            assert r.status_code == 200 and r.json()["corpus_id"] == str(corpus_file), r.text
            counts = (await http.post("/list_external_corpora")).json()["corpus_token_counts"]
            assert set(counts) == {"answer", generated_id, str(corpus_file)}

            quoted, usage, _ = await generate_ids(scheduler, prompt, 32, request_id="quoted")
            assert quoted == plain  # (the shared trie saw the answer too: the corpus's own effect is the test above)
            assert usage.accepted_draft_tokens >= usage_plain.accepted_draft_tokens

            for body, words in (({"documents": ["x"], "token_chunks": [[1]]}, "exactly one of"),
                                ({"token_chunks": [[10 ** 9]]}, "below the vocabulary size"),
                                ({"file_path": str(tmp_path / "none.jsonl")}, "does not exist"),
                                ({"documents": [""]}, "no tokens"),
                                ({"documents": ["x"], "merge": True}, "merge")):
                r = await http.post("/add_external_corpus", json=body)
                assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)
            r = await http.post("/remove_external_corpus", json={"corpus_id": "answer"})
            assert r.status_code == 200 and "answer" not in r.json()["corpus_token_counts"]
            r = await http.post("/remove_external_corpus", json={"corpus_id": "answer"})
            assert r.status_code == 400 and "no external corpus 'answer'" in r.json()["error"]["message"]
            assert (await generate_ids(scheduler, prompt, 32, request_id="after"))[0] == plain  # still serving


async def test_corpus_endpoints_refuse_a_server_that_does_not_draft_with_ngram():
    import httpx

    from gateway.openai_api import build_app
    from tandem.args import DEFAULT_MODEL

    async with local_stack(DEFAULT_MODEL) as scheduler:
        app = build_app(scheduler, None, "tandem-demo-code", max_model_len=2048)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            r = await http.post("/add_external_corpus", json={"token_chunks": [[5, 6, 7]]})
            assert r.status_code == 400 and "external corpora are NGRAM's" in r.json()["error"]["message"]
            assert (await http.get("/list_external_corpora")).status_code == 400
