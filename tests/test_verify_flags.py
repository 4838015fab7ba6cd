"""SGLang's verify knobs at start-up: every validation rule stops the command with SGLang's message on one line, the
lossy thresholds and SGLANG_NGRAM_FORCE_GREEDY_VERIFY get a warning, and `tandem serve` hands the knobs to its
children (the target verifies with them, the draft samples with them)."""
from __future__ import annotations

import argparse

import pytest

from tandem.cli import build_parser, prepare
from tandem.launch import commands
from tandem.verify_flags import NGRAM_FORCE_GREEDY_ENV, verify_notes

EAGLE_CHAIN = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
               "--speculative-num-draft-tokens", "4"]


def _prepare(*flags: str, command: str = "serve") -> argparse.Namespace:
    parser = build_parser()
    extra = ["--target-address", "h:1"] if command == "gateway" else []
    args = parser.parse_args([command, *extra, *flags])
    prepare(args, parser)
    return args


@pytest.mark.parametrize("flags, message", [
    (["--speculative-algorithm", "STANDALONE", "--speculative-use-rejection-sampling"],
     "--speculative-use-rejection-sampling is only supported for EAGLE / EAGLE3 / NEXTN, not "
     "speculative_algorithm=STANDALONE"),
    (["--speculative-algorithm", "NGRAM", "--speculative-use-rejection-sampling"],
     "only supported for EAGLE / EAGLE3 / NEXTN, not speculative_algorithm=NGRAM"),
    (["--speculative-use-rejection-sampling"], "not speculative_algorithm=NONE"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3", "--speculative-eagle-topk", "4",
      "--speculative-num-draft-tokens", "8", "--speculative-use-rejection-sampling"],
     "--speculative-use-rejection-sampling requires --speculative-eagle-topk=1"),
    ([*EAGLE_CHAIN, "--speculative-use-rejection-sampling", "--speculative-accept-threshold-single", "0.9"],
     "--speculative-use-rejection-sampling is incompatible with --speculative-accept-threshold-single / "
     "--speculative-accept-threshold-acc"),
    ([*EAGLE_CHAIN, "--speculative-use-rejection-sampling", "--speculative-accept-threshold-acc", "0.5"],
     "rejection sampling ignores the accept thresholds"),
    (["--speculative-algorithm", "STANDALONE", "--speculative-accept-threshold-single", "0"],
     "--speculative-accept-threshold-single must be in (0, 1], got 0.0"),
    (["--speculative-algorithm", "STANDALONE", "--speculative-accept-threshold-acc", "1.5"],
     "--speculative-accept-threshold-acc must be in (0, 1], got 1.5"),
    (["--speculative-algorithm", "STANDALONE", "--speculative-accept-threshold-acc", "nan"],
     "--speculative-accept-threshold-acc must be in (0, 1], got nan"),
], ids=["standalone", "ngram", "none", "topk", "single", "acc", "single-zero", "acc-above-one", "acc-nan"])
@pytest.mark.parametrize("command", ["serve", "target", "draft", "gateway"])
def test_every_verify_knob_rule_stops_start_up_with_sglangs_message(flags, message, command):
    with pytest.raises(SystemExit) as exc:
        _prepare(*flags, command=command)
    text = str(exc.value)
    assert text.startswith("error: ") and message in text and "\n" not in text


@pytest.mark.parametrize("command", ["serve", "target", "draft", "gateway"])
def test_rejection_sampling_on_an_eagle_chain_starts(command):
    args = _prepare(*EAGLE_CHAIN, "--speculative-use-rejection-sampling", command=command)
    assert args.speculative_use_rejection_sampling and args.speculative_eagle_topk == 1


def test_nextn_takes_rejection_sampling_like_eagle():
    args = _prepare("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2", "--speculative-eagle-topk",
                    "1", "--speculative-num-draft-tokens", "3", "--speculative-use-rejection-sampling")
    assert args.speculative_algorithm == "NEXTN" and args.speculative_use_rejection_sampling


@pytest.mark.parametrize("command", ["serve", "target"])
def test_thresholds_below_one_start_with_a_lossy_warning(command, capsys):
    args = _prepare("--speculative-algorithm", "STANDALONE", "--speculative-accept-threshold-acc", "0.5",
                    command=command)
    assert args.speculative_accept_threshold_acc == 0.5
    err = capsys.readouterr().err
    assert "warning: --speculative-accept-threshold-single 1.0 / --speculative-accept-threshold-acc 0.5: LOSSY" in err


@pytest.mark.parametrize("command", ["draft", "gateway"])
def test_services_that_do_not_verify_do_not_warn_about_thresholds(command, capsys):
    _prepare("--speculative-algorithm", "STANDALONE", "--speculative-accept-threshold-single", "0.5", command=command)
    assert "LOSSY" not in capsys.readouterr().err


def test_default_thresholds_start_without_a_warning(capsys):
    _prepare("--speculative-algorithm", "STANDALONE", "--speculative-accept-threshold-single", "1.0")
    assert "threshold" not in capsys.readouterr().err


def test_thresholds_without_speculation_are_noted_as_ignored(capsys):
    _prepare("--speculative-accept-threshold-single", "0.5")
    assert "are ignored without --speculative-algorithm" in capsys.readouterr().err


@pytest.mark.parametrize("value, warned", [("1", True), ("true", True), ("0", False), ("", False)])
def test_ngram_force_greedy_verify_is_refused_with_a_warning(value, warned, monkeypatch, capsys):
    monkeypatch.setenv(NGRAM_FORCE_GREEDY_ENV, value)
    _prepare("--speculative-algorithm", "NGRAM")
    err = capsys.readouterr().err
    assert (f"warning: {NGRAM_FORCE_GREEDY_ENV} is ignored: NGRAM verifies sampled requests by exact tree sampling"
            in err) == warned


def test_ngram_force_greedy_verify_note_reads_the_given_environment():
    args = argparse.Namespace(command="serve", speculative_algorithm="NGRAM")
    assert verify_notes(args, {NGRAM_FORCE_GREEDY_ENV: "True"})
    assert not verify_notes(args, {})


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("command", ["serve", "target", "draft", "gateway"])
def test_attention_mode_is_accepted_in_both_modes(mode, command, capsys):
    args = _prepare("--speculative-algorithm", "EAGLE3", "--speculative-attention-mode", mode, command=command)
    assert args.speculative_attention_mode == mode
    assert "attention-mode" not in capsys.readouterr().err  # accepted: neither refused nor warned


def test_attention_mode_outside_its_choices_is_a_parse_error():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-attention-mode", "extend"])


def test_serve_hands_the_knobs_to_target_draft_and_gateway():
    args = _prepare(*EAGLE_CHAIN, "--speculative-use-rejection-sampling", "--speculative-attention-mode", "decode",
                    "--no-colocate-draft")  # a draft process of its own gets them too
    cmds = commands(args)
    for name in ("target-0", "draft-0", "gateway"):
        cmd = cmds[name]
        assert "--speculative-use-rejection-sampling" in cmd, name
        assert cmd[cmd.index("--speculative-attention-mode") + 1] == "decode", name
    # A child parses what it was handed and passes the same checks.
    child = cmds["target-0"][cmds["target-0"].index("target"):]
    parser = build_parser()
    parsed = parser.parse_args(child)
    prepare(parsed, parser)
    assert parsed.speculative_use_rejection_sampling and parsed.speculative_attention_mode == "decode"


def test_serve_hands_lossy_thresholds_to_the_target_exactly():
    args = _prepare("--speculative-algorithm", "STANDALONE", "--speculative-accept-threshold-single", "0.35",
                    "--speculative-accept-threshold-acc", "0.7")
    target = commands(args)["target-0"]
    assert target[target.index("--speculative-accept-threshold-single") + 1] == "0.35"
    assert target[target.index("--speculative-accept-threshold-acc") + 1] == "0.7"
    assert "--no-startup-notes" in target  # the launcher warned once; its children do not repeat it


def test_serve_at_the_defaults_hands_no_verify_knobs():
    cmds = commands(_prepare("--speculative-algorithm", "STANDALONE"))
    for cmd in cmds.values():
        assert not any(a.startswith(("--speculative-accept", "--speculative-use-rej", "--speculative-attention"))
                       for a in cmd)


def test_the_target_service_builds_its_engine_thresholds_from_the_flags():
    from tandem.services import _accept_thresholds

    args = _prepare("--speculative-algorithm", "STANDALONE", "--speculative-accept-threshold-single", "0.4",
                    command="target")
    thresholds = _accept_thresholds(args)
    assert (thresholds.single, thresholds.acc) == (0.4, 1.0) and not thresholds.exact
    assert _accept_thresholds(_prepare("--speculative-algorithm", "STANDALONE", command="target")).exact
