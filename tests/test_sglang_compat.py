"""SGLang commands as written: every SGLang flag parses; the ones Tandem does not act on are refused at start-up with
one line (or accepted with a note when they change nothing); flags without effect get one warning each; --device
auto; --help shows defaults; the launcher's children do not repeat the warnings."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tandem.args import DEFAULT_MODEL
from tandem.cli import build_parser, prepare
from tandem.compat import COMPAT_FLAGS, resolve_device
from tandem.launch import commands, ports_in_use

# The flags of issue 16 that used to be "unrecognized arguments", with a value where they take one.
SGLANG_FLAGS = [
    ["--speculative-accept-threshold-single", "0.9"], ["--speculative-attention-mode", "decode"],
    ["--speculative-draft-model-revision", "main"], ["--speculative-draft-model-quantization", "fp8"],
    ["--speculative-moe-runner-backend", "triton"], ["--speculative-moe-a2a-backend", "deepep"],
    ["--speculative-dsa-topk-backend", "x"], ["--enable-multi-layer-eagle"], ["--disable-overlap-schedule"],
    ["--trust-remote-code"], ["--enable-dp-attention"], ["--enable-two-batch-overlap"], ["--uno-lora-path", "l"],
    ["--speculative-dflash-block-size", "16"], ["--speculative-draft-window-size", "512"],
    ["--speculative-use-rejection-sampling"], ["--speculative-accept-threshold-acc", "0.5"],
]
WARN_ONLY = {"--trust-remote-code"}
# SGLang flags Tandem acts on (parsed by every command, like the others): the overlap schedule, and issue 12 part 3's
# verify knobs (tests/test_verify_flags.py checks their rules).
ACCEPTED = {"--disable-overlap-schedule", "--speculative-accept-threshold-single", "--speculative-accept-threshold-acc",
            "--speculative-use-rejection-sampling", "--speculative-attention-mode",
            "--enable-multi-layer-eagle",  # tests/test_multi_layer_eagle.py checks its rules
            "--speculative-dflash-block-size",
            "--uno-lora-path"}  # DFLASH's (tests/test_dflash.py checks its rules; a note elsewhere)


def _prepare(*flags: str, command: str = "serve"):
    parser = build_parser()
    args = parser.parse_args([command, *flags])
    prepare(args, parser)
    return args


@pytest.mark.parametrize("flag", SGLANG_FLAGS, ids=lambda f: f[0])
def test_every_sglang_flag_parses_in_every_service_command(flag):
    for command in ("serve", "target", "draft", "gateway"):
        extra = ["--target-address", "h:1"] if command == "gateway" else []
        build_parser().parse_args([command, *extra, *flag])  # no "unrecognized arguments"


@pytest.mark.parametrize("flag", [f for f in SGLANG_FLAGS if f[0] not in WARN_ONLY | ACCEPTED], ids=lambda f: f[0])
def test_unsupported_flags_are_refused_at_start_up_with_one_line(flag):
    with pytest.raises(SystemExit) as exc:
        _prepare("--speculative-algorithm", "EAGLE3", *flag)
    message = str(exc.value)
    assert message.startswith(f"error: {flag[0]}") and "\n" not in message
    assert "not supported yet" in message or "not applicable" in message


@pytest.mark.parametrize("flag", sorted(WARN_ONLY))
def test_no_op_sglang_flags_start_with_a_note(flag, capsys):
    args = _prepare("--speculative-algorithm", "STANDALONE", flag)
    assert args.speculative_algorithm == "STANDALONE"
    assert f"warning: {flag}: no effect" in capsys.readouterr().err


@pytest.mark.parametrize("flag, neutral", [("--speculative-accept-threshold-single", "1.0"),
                                           ("--speculative-attention-mode", "prefill"),
                                           ("--speculative-draft-model-quantization", "unquant")])
def test_sglang_defaults_of_unsupported_flags_start(flag, neutral):
    assert _prepare("--speculative-algorithm", "STANDALONE", flag, neutral).speculative_algorithm == "STANDALONE"


@pytest.mark.parametrize("algorithm", ["DSPARK", "dspark"])
def test_unbuilt_algorithms_parse_and_are_refused(algorithm):
    with pytest.raises(SystemExit) as exc:
        _prepare("--speculative-algorithm", algorithm)
    assert "not supported yet" in str(exc.value) and algorithm.upper() in str(exc.value)


def test_nextn_on_a_checkpoint_with_mtp_layers_drafts_with_them(tmp_path, capsys):
    """NEXTN (and EAGLE without a head) on a target with MTP layers: the target's own layers draft, no draft path;
    a draft path given to NEXTN is not needed (said at start-up); without MTP layers NEXTN needs a head."""
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    config.pop("num_nextn_predict_layers")  # the bundled target has one; `plain` below has none
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    args = _prepare("--model-path", str(tmp_path), "--speculative-algorithm", "NEXTN")
    assert args.speculative_algorithm == "NEXTN" and args.speculative_draft_model_path == str(tmp_path)
    args = _prepare("--model-path", str(tmp_path), "--speculative-algorithm", "EAGLE")
    assert args.speculative_draft_model_path == str(tmp_path)
    capsys.readouterr()
    args = _prepare("--model-path", str(tmp_path), "--speculative-algorithm", "NEXTN",
                    "--speculative-draft-model-path", str(DEFAULT_MODEL))
    assert args.speculative_draft_model_path == str(tmp_path)
    assert "is not needed" in capsys.readouterr().err
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exc:
        _prepare("--model-path", str(plain), "--speculative-algorithm", "NEXTN")
    assert "NEXTN needs --speculative-draft-model-path" in str(exc.value) and "MTP layers" in str(exc.value)


def test_every_compat_flag_is_refused_or_noted():
    for f in COMPAT_FLAGS:
        assert f.reason.startswith(("not supported yet", "not applicable", "no effect")), f.flag


def test_token_map_with_eagle3_is_dropped_with_a_warning(capsys):
    args = _prepare("--speculative-algorithm", "EAGLE3", "--speculative-token-map", "/no/such/map.pt")
    assert args.speculative_token_map is None  # the draft never sees it (it used to crash on it)
    assert "--speculative-token-map is ignored for EAGLE3" in capsys.readouterr().err
    assert "--speculative-token-map" not in commands(args)["target-0"]  # the draft runs there (co-located)


@pytest.mark.parametrize("flags, expected", [
    (["--speculative-algorithm", "STANDALONE", "--speculative-token-map", "/missing.pt"],
     "--speculative-token-map is ignored for STANDALONE"),
    (["--speculative-algorithm", "NGRAM", "--speculative-token-map", "/missing.pt"],
     "--speculative-token-map is ignored for NGRAM"),
    (["--speculative-algorithm", "NEXTN", "--enable-multi-layer-eagle", "--speculative-num-steps", "1",
      "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2", "--enable-overlap-drafting"],
     "--enable-overlap-drafting is ignored with multi-layer EAGLE"),
    (["--speculative-algorithm", "UNO", "--enable-overlap-drafting"],
     "--enable-overlap-drafting is ignored for UNO"),
    (["--speculative-algorithm", "NGRAM", "--enable-overlap-drafting"],
     "--enable-overlap-drafting is ignored for NGRAM"),
    (["--speculative-algorithm", "STANDALONE", "--speculative-adaptive-config", "{}"],
     "--speculative-adaptive-config is ignored without --speculative-adaptive"),
    (["--speculative-algorithm", "NGRAM", "--speculative-draft-model-path", "x"],
     "--speculative-draft-model-path is ignored for NGRAM"),
    (["--speculative-algorithm", "NGRAM", "--speculative-draft-attention-backend", "torch"],
     "--speculative-draft-attention-backend is ignored for NGRAM"),
    (["--device", "cpu", "--cuda-graph-max-bs", "8", "--mem-fraction-static", "0.7"],
     "--mem-fraction-static, --cuda-graph-max-bs: CUDA only, no effect on --device cpu"),
    (["--device", "cpu", "--enable-torch-compile"], "--enable-torch-compile: CUDA only"),
    (["--speculative-algorithm", "NGRAM", "--speculative-ngram-external-corpus-path", "c.jsonl"],
     "--speculative-ngram-external-corpus-path drafts nothing with --speculative-ngram-external-sam-budget 0"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-ngram-external-corpus-path", "c.jsonl"],
     "--speculative-ngram-external-corpus-path is ignored for EAGLE3: it is NGRAM's"),
])
def test_flags_without_effect_warn_once_at_start_up(flags, expected, capsys):
    _prepare(*flags)
    err = capsys.readouterr().err
    assert err.count(expected) == 1, err


def test_a_plain_configuration_starts_without_warnings(capsys):
    _prepare("--speculative-algorithm", "STANDALONE", "--device", "cpu")
    _prepare("--speculative-algorithm", "NGRAM", "--device", "cpu")
    assert capsys.readouterr().err == ""


def test_children_of_serve_do_not_repeat_the_warnings(capsys):
    args = _prepare("--speculative-algorithm", "NGRAM", "--device", "cpu", "--cuda-graph-max-bs", "8")
    capsys.readouterr()
    for name, cmd in commands(args).items():
        child = build_parser().parse_args(cmd[cmd.index("tandem.cli") + 1:])
        assert child.no_startup_notes
        prepare(child, build_parser())
    assert capsys.readouterr().err == ""


def test_ngram_ignore_warning_only_when_the_user_set_steps_or_topk(capsys):
    args = _prepare("--speculative-algorithm", "NGRAM")
    assert "NGRAM ignores" not in capsys.readouterr().err
    for cmd in commands(args).values():  # the children derive steps/topk themselves: no warning there either
        assert "--speculative-num-steps" not in cmd and "--speculative-eagle-topk" not in cmd


def test_device_auto_is_cuda_when_torch_sees_a_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cuda:1") == "cuda:1"
    assert build_parser().parse_args(["serve"]).device == "auto"
    assert _prepare().device == "cpu"


def test_help_shows_defaults_and_algorithms_once():
    out = subprocess.run([sys.executable, "-m", "tandem.cli", "serve", "--help"], capture_output=True, text=True,
                         check=True).stdout
    flat = " ".join(out.split())
    for text in ("HTTP port of the OpenAI-compatible REST front (default: 30000)",
                 "port of the public gRPC Generate API (default: 30001)",
                 "listen port of the Envoy edge (default: 8080)", "(default: auto)"):
        assert text in flat, text
    assert "None" not in out.split("--speculative-algorithm {")[1].split("}")[0]
    assert "--trust-remote-code" in out and "--speculative-use-rejection-sampling" in out


def test_page_size_is_sglangs_name_of_the_kv_block_size():
    assert build_parser().parse_args(["serve", "--page-size", "32"]).kv_block_size == 32


def test_a_taken_port_is_reported_before_anything_starts():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        args = _prepare("--port", str(port))
        assert ports_in_use(args) == [f"--port 127.0.0.1:{port} (Address already in use)"]
        done = subprocess.run([sys.executable, "-m", "tandem.cli", "serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "port in use, nothing started: --port" in done.stderr
    assert "starting" not in done.stdout


def test_a_taken_metrics_port_is_reported_and_a_free_one_passes():
    """--metrics-port without --metrics-host: the services bind it on their own host (127.0.0.1 under serve), which
    the start-up check probes (it crashed on the unset host before)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert ports_in_use(_prepare("--metrics-port", str(port))) == [
            f"--metrics-port 127.0.0.1:{port} (Address already in use)"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert ports_in_use(_prepare("--metrics-port", str(free))) == []
