"""The committed gRPC stubs match the .proto, and the CLI applies SGLang's speculative defaults and validation."""
from __future__ import annotations

import argparse

import pytest

from protos.generate import stale_files
from tandem.args import resolve_spec
from tandem.cli import build_parser


def test_committed_stubs_are_fresh():
    assert stale_files() == [], "run `python -m protos.generate` and commit the stubs"


def _spec(*flags: str) -> tuple[str, int, int, int]:
    return resolve_spec(build_parser().parse_args(["serve", *flags]))


def test_no_algorithm_means_plain_decoding():
    assert _spec() == ("NONE", 0, 1, 1)


def test_standalone_auto_defaults_are_sglangs():
    assert _spec("--speculative-algorithm", "standalone") == ("STANDALONE", 3, 1, 4)


def test_topk_one_forces_num_draft_tokens_to_steps_plus_one():
    flags = ["--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "5",
             "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3"]
    assert _spec(*flags) == ("STANDALONE", 5, 1, 6)


def test_tree_shape_passes_through():
    flags = ["--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "3",
             "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16"]
    assert _spec(*flags) == ("STANDALONE", 3, 4, 16)


def test_ngram_derives_topk_and_steps_from_bfs_breadth():
    algorithm, steps, topk, ndt = _spec("--speculative-algorithm", "NGRAM", "--speculative-ngram-max-bfs-breadth",
                                        "4", "--speculative-num-draft-tokens", "12")
    assert (algorithm, topk, ndt, steps) == ("NGRAM", 4, 12, 3)


@pytest.mark.parametrize("flags", [
    ["--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "3"],  # set all three or none
    ["--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "2", "--speculative-eagle-topk", "2",
     "--speculative-num-draft-tokens", "40"],  # more nodes than the tree can hold
    ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
])
def test_invalid_speculative_flags_exit_with_a_message(flags, capsys):
    with pytest.raises(SystemExit) as exc:
        _spec(*flags)
    assert "error" in str(exc.value)


def test_unknown_algorithm_is_refused():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-algorithm", "MEDUSA"])


def test_every_flag_has_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for action in p._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"tandem {name} {action.option_strings[0]} has no help text"
