#!/bin/bash
# The pending H200 measurements, in priority order, each stage under its own time limit so a slow stage cannot eat
# the rest; everything lands in $OUT/results.tgz (the device tool returns at most 8 files).
#   device run:  BUDGET_S=570 bash bench/gpu_session.sh [STAGE ...]   (carry .whl: gateway wheels + flashinfer; set
#                BUDGET_S under the call's limit_s, which shrinks to the device time left)
# Stages: spec8b_bs64 overlap8b_sep ar8b_bs1 prefetch_ab ngram_profile overlap_ab svc64_ab ar8b_profile profile_draft_all user_auto spec8b_bs1 fewer_kernels fewer_kernels_ab services_bs8 services_bs gateway_overhead spec8b_full profile_eagle3 spec8b compile_chained dflash_bundle chained_tests chained8b chained chained2 user_path run_ahead run_ahead8b defaults_k_compile profile_serve colocate_k colocate_k8b compile_steps colocate colocate_demo colocate8b step_tests overlap overlap2 predraft adaptive mtp mtp_bundle dflash_uno step tests profile_draft decode spec_inproc spec_services serve_decode eval accept flashinfer rpc prefix
# (default: the list below STAGES=, in order). Next session (bench/results/session27/NOTES.md: H100s only; no H200
# in sessions 25-27): on an H200 `ar8b_bs1 spec8b_bs64` (#11's AR floor needs one), then `user_path` and
# `adaptive` (ADAPTIVE_BS="1 16 32 64": session 27's one 0.63x at batch 64 did not repeat on H100s); on two GPUs
# `overlap2` (#14).
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false MAX_JOBS=16
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
OUT=${OUT:-/tmp/out}; R=/tmp/gpu_session; mkdir -p "$R" "$OUT"; T0=$(date +%s)
stage() { echo "=== $1 at $(( $(date +%s) - T0 ))s" | tee -a "$R/progress.log"; }
fin() { tar czf "$OUT/results.tgz" -C "$R" . ; }
# BUDGET_S: the device time this call may use (the device tool kills a call at its limit and then returns nothing that
# is not already under $OUT). 20 s before it, pack what exists and stop every stage.
if [ -n "${BUDGET_S:-}" ]; then
  ( sleep $(( BUDGET_S - 20 )); echo "=== budget of ${BUDGET_S}s reached: packing and stopping" | tee -a "$R/progress.log"
    fin; pkill -TERM -P $$ ; kill -TERM $$ ) &
  WATCHDOG=$!
fi
STAGES="${*:-step tests profile_draft decode spec_inproc spec_services serve_decode eval accept flashinfer rpc prefix}"
M=models/tandem-demo-code
for s in $STAGES; do
  stage "$s"
  case $s in
    step_tests)  # the static draft + verify steps' GPU tests only (graphs == eager == plain decoding)
      timeout -s INT 200 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_draft_step_gpu.py \
        > "$R/step_tests.log" 2>&1
      tail -5 "$R/step_tests.log" ;;
    step)  # static draft + verify steps: graphs == eager == plain decoding, then where a step's time goes now
      timeout -s INT 200 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_draft_step_gpu.py \
        > "$R/step_tests.log" 2>&1
      tail -3 "$R/step_tests.log"
      timeout 300 python3 bench/profile_serve_step.py --device cuda --prompts 1 --new-tokens 128 --configs NONE \
        "EAGLE3 5/4/16" "EAGLE3 5/4/16 eager-verify" "EAGLE3 5/4/16 eager" "STANDALONE 3/1/4" \
        "STANDALONE 3/1/4 eager-verify" NGRAM --out-dir "$R/profile_serve_step" -- --cuda-graph-max-bs 8 \
        > "$R/profile_serve_step.log" 2>&1
      cat "$R/profile_serve_step/profile_serve_step.md" 2>/dev/null || tail -20 "$R/profile_serve_step.log" ;;
    tests)  # correctness first: kernels, graphs, fused kernels, lossless through the step path on CUDA
      timeout -s INT 240 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu \
        --ignore=tests/gpu/test_flashinfer_backend_gpu.py > "$R/gpu_tests.log" 2>&1
      grep -E "passed|failed|FAILED|ERROR" "$R/gpu_tests.log" | tail -15 ;;
    profile_draft)  # where a draft Propose's time goes: ops, kernels, GPU vs host ms, draft graphs on and off
      timeout 240 python3 bench/profile_draft.py --device cuda --graphs all compiled target --out-dir "$R/profile_draft" \
        > "$R/profile_draft.log" 2>&1
      cat "$R/profile_draft/profile_draft.md" 2>/dev/null || tail -20 "$R/profile_draft.log" ;;
    profile_draft_all)  # #11's draft host-time target (host ms per Propose <= GPU ms + 0.3) with the draft graphs on only
      timeout 130 python3 bench/profile_draft.py --device cuda --graphs all --methods "EAGLE3 tree 5/4/16" \
        "STANDALONE chain 3/1/4" --out-dir "$R/profile_draft_all" > "$R/profile_draft_all.log" 2>&1
      cat "$R/profile_draft_all/profile_draft.md" 2>/dev/null || tail -20 "$R/profile_draft_all.log" ;;
    decode)  # 8B in-process: graphs/eager vs HF vs ceiling, verify-16 ratio (eager should be back near 22 ms)
      timeout 150 python3 bench/decode.py --steps 32 --out-dir "$R/decode" > "$R/decode.log" 2>&1
      cat "$R/decode/results.md" ;;
    spec_inproc)  # synthetic acceptance; draft time was 77-196 ms/step before the fused-in-graphs-only fix
      timeout 330 python3 bench/speculative.py --device cuda:0 --margin-weights --batch-sizes 1 64 \
        --configs 5/1/6@3.5 6/4/16@5 8/8/60@6 --static-verify both --out-dir "$R/spec_inproc" > "$R/spec_inproc.log" 2>&1
      cat "$R/spec_inproc/results.md" 2>/dev/null || tail -20 "$R/spec_inproc.log" ;;
    spec_services)  # efficiency through gRPC (and AR through the gateway)
      timeout 200 python3 bench/speculative.py --mode services --device cuda:0 --margin-weights --batch-sizes 1 \
        --configs 5/1/6@3.5 6/4/16@5 8/8/60@6 \
        --out-dir "$R/spec_services" > "$R/spec_services.log" 2>&1
      cat "$R/spec_services/results.md" 2>/dev/null || tail -20 "$R/spec_services.log" ;;
    serve_decode)  # AR batch 1 through gateway + gRPC (target >= 210 tok/s), one, four and eight steps per call (default 4: AUTO_CONTINUOUS_DECODE_STEPS)
      for k in 1 4 8; do
        timeout 120 python3 bench/serve_decode.py --batch-sizes 1 --max-new-tokens 256 --out-dir "$R/serve_decode_k$k" \
          -- --cuda-graph-max-bs 4 --num-continuous-decode-steps $k > "$R/serve_decode_k$k.log" 2>&1
        cat "$R/serve_decode_k$k/results.md" 2>/dev/null || tail -5 "$R/serve_decode_k$k.log"
      done ;;
    eval)  # the demo family: every method's tau + batch-1 tok/s + HF generate/assisted/prompt lookup, one run
      timeout 240 python3 -m tools.spec_eval --model $M --draft $M-draft --eagle3 $M-eagle3 \
        --prompts $M/heldout_prompts.jsonl --device cuda --temperatures 0 1 --speed-prompts 5 \
        --out "$R/spec_eval_h200.json" > "$R/spec_eval.log" 2>&1
      cat "$R/spec_eval_h200.md" 2>/dev/null || grep "tok/s" "$R/spec_eval.log"
      # the same family on the held-out chat prompts (ChatML, answers stop at <|im_end|>)
      timeout 200 python3 -m tools.spec_eval --model $M --draft $M-draft --eagle3 $M-eagle3 \
        --prompts $M/heldout_chat_prompts.jsonl --device cuda --temperatures 0 1 --speed-prompts 5 --stop-at-eos \
        --out "$R/spec_eval_chat_h200.json" > "$R/spec_eval_chat.log" 2>&1
      cat "$R/spec_eval_chat_h200.md" 2>/dev/null || grep "tok/s" "$R/spec_eval_chat.log" ;;
    accept)  # the same family through the services (three processes, gRPC Generate)
      timeout 380 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --hf-peers cuda --configs AR EAGLE3-tree \
        EAGLE3-tree-eager-verify EAGLE3-auto STANDALONE-chain NGRAM-auto --out "$R/accept_h200.json" -- --device cuda \
        --cuda-graph-max-bs 8 > "$R/accept.log" 2>&1
      tail -8 "$R/accept.log" ;;
    overlap)  # ping-pong halves (default, measured choice) vs --disable-overlap-schedule, demo family, one GPU
      timeout 300 python3 bench/overlap.py --algorithm EAGLE3 --batch-sizes 8 32 1 --num-prompts 32 \
        --max-new-tokens 128 --shapes tree --out "$R/overlap_eagle3.json" -- --device cuda --cuda-graph-max-bs 32 \
        > "$R/overlap.log" 2>&1
      tail -9 "$R/overlap.log" ;;
    overlap2)  # the two-GPU machine (nvidia-h200-x2): draft pods on GPU 1, target on GPU 0 -- ping-pong halves
      # (default: measured per batch size) vs --disable-overlap-schedule, the demo family through tandem serve, then
      # 8B SYNTHETIC through the services
      timeout 200 python3 bench/overlap.py --algorithm EAGLE3 --batch-sizes 32 8 1 --num-prompts 32 \
        --max-new-tokens 128 --shapes tree --out "$R/overlap2_eagle3.json" -- --device cuda --base-gpu-id 0 \
        --draft-base-gpu-id 1 --cuda-graph-max-bs 32 > "$R/overlap2.log" 2>&1
      tail -9 "$R/overlap2.log"
      for mode in default sequential; do
        extra=""; [ $mode = sequential ] && extra="--gateway-args=--disable-overlap-schedule"
        timeout 170 python3 bench/speculative.py --mode services --device cuda:0 --draft-device cuda:1 \
          --margin-weights --batch-sizes 32 1 --configs 6/4/16@5 --max-new-tokens 96 $extra \
          --out-dir "$R/spec_services_2gpu_$mode" > "$R/spec_services_2gpu_$mode.log" 2>&1
        cat "$R/spec_services_2gpu_$mode/results.md" 2>/dev/null || tail -5 "$R/spec_services_2gpu_$mode.log"
      done ;;
    colocate)  # --colocate-draft (the draft in the target's process, each Verify drafting the next tree: one round
      # trip per step) vs separate draft and target processes, the demo family through tandem serve; GPU lossless first
      timeout -s INT 150 python3 -m pytest -q -rs -s -p no:cacheprovider tests/gpu/test_lossless_gpu.py -k colocate \
        > "$R/lossless_colocate.log" 2>&1
      grep -E "tau|passed|failed|FAILED|Error" "$R/lossless_colocate.log" | tail -6
      timeout 400 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR EAGLE3-tree \
        EAGLE3-tree-colocate EAGLE3-chain EAGLE3-chain-colocate EAGLE3-auto-colocate STANDALONE-chain \
        STANDALONE-chain-colocate NGRAM-auto NGRAM-auto-colocate --out "$R/accept_colocate.json" -- --device cuda \
        --cuda-graph-max-bs 8 > "$R/accept_colocate.log" 2>&1
      tail -13 "$R/accept_colocate.log" ;;
    colocate_demo)  # the demo half of `colocate` alone (the user path, batch 1)
      timeout 500 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR EAGLE3-tree \
        EAGLE3-tree-colocate EAGLE3-chain-colocate EAGLE3-auto-colocate STANDALONE-chain STANDALONE-chain-colocate \
        NGRAM-auto-colocate --out "$R/accept_colocate.json" -- --device cuda --cuda-graph-max-bs 8 \
        > "$R/accept_colocate.log" 2>&1
      tail -13 "$R/accept_colocate.log"; grep -E "KV pool|Error|error" "$R/accept_colocate.log" | head -5 ;;
    profile_serve)  # where a step's time goes in the real path (#11): `tandem serve` on the demo family, timed, then
      # one more prompt profiled through /start_profile + /stop_profile (every process: torch trace with CUDA kernels,
      # Python profile, summary with Python busy ms per step)
      timeout 420 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR EAGLE3-tree EAGLE3-auto \
        STANDALONE-chain EAGLE3-tree-k4 --profile-dir "$R/profiles" --out "$R/accept_profiled.json" -- \
        --device cuda --cuda-graph-max-bs 8 > "$R/accept_profiled.log" 2>&1
      grep -E "profile |^\| " "$R/accept_profiled.log" | tail -20 ;;
    compile_steps)  # --enable-torch-compile on the static draft/verify steps and decode graphs (bs 1) vs plain graphs:
      # fewer, fused kernels per graph replay (host replay cost grows with node count; bench/results/gpu_step_h200)
      timeout 500 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR AR-compile EAGLE3-tree \
        EAGLE3-tree-compile STANDALONE-chain STANDALONE-chain-compile --out "$R/accept_compile.json" -- \
        --device cuda --cuda-graph-max-bs 8 > "$R/accept_compile.log" 2>&1
      tail -9 "$R/accept_compile.log"; grep -E "torch.compile|compile'd|Error" "$R/accept_compile.log" | head -8 ;;
    colocate_k)  # continuous speculative steps with the draft in the target's process (serve's default since the ninth
      # session): k verify+draft steps per Verify call, k = 1 (default) / 2 / 4 -- the demo path, then 8B services
      timeout 360 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR EAGLE3-tree-apart \
        EAGLE3-tree EAGLE3-tree-k2 EAGLE3-tree-k4 EAGLE3-auto EAGLE3-auto-k4 STANDALONE-chain STANDALONE-chain-k4 \
        --profile-dir "$R/profiles_k" --out "$R/accept_k.json" -- \
        --device cuda --cuda-graph-max-bs 8 > "$R/accept_k.log" 2>&1
      tail -11 "$R/accept_k.log"; grep -E "profile " "$R/accept_k.log" | tail -9 ;;
    defaults_k_compile)  # the A/B behind two serve defaults, the demo path at batch 1: speculative steps per Verify
      # call (k = 1 / 2 / 4, co-located draft) and torch.compile'd graphs and static steps at batch 1; then 8B AR
      # through the services with and without torch.compile (its start-up time in the log)
      timeout 420 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR AR-compile EAGLE3-tree \
        EAGLE3-tree-k2 EAGLE3-tree-k4 EAGLE3-tree-k4-compile EAGLE3-auto-k4 STANDALONE-chain STANDALONE-chain-k4 \
        STANDALONE-chain-k4-compile --out "$R/accept_defaults.json" -- --device cuda --cuda-graph-max-bs 8 \
        > "$R/accept_defaults.log" 2>&1
      grep -E "^  [A-Z].*tok/s|^\| " "$R/accept_defaults.log" | tail -24
      for c in plain compile; do
        extra=""; [ $c = compile ] && extra="--enable-torch-compile --torch-compile-max-bs 1"
        timeout 150 python3 bench/serve_decode.py --batch-sizes 1 --max-new-tokens 256 --out-dir "$R/serve_decode_$c" \
          -- --cuda-graph-max-bs 4 $extra > "$R/serve_decode_$c.log" 2>&1
        grep -E "ready in" "$R/serve_decode_$c.log" | tail -1
        cat "$R/serve_decode_$c/results.md" 2>/dev/null || tail -5 "$R/serve_decode_$c.log"
      done ;;
    run_ahead)  # --enable-run-ahead (the target pod runs the expected next call while the answer travels) vs off:
      # the demo path at batch 1 (GPU lossless of the step path first), then 8B AR through the services
      timeout -s INT 150 python3 -m pytest -q -rs -s -p no:cacheprovider tests/gpu/test_lossless_gpu.py -k "ahead or colocate" \
        > "$R/run_ahead_tests.log" 2>&1
      tail -2 "$R/run_ahead_tests.log"
      timeout 330 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR AR-ahead EAGLE3-tree-k4 \
        EAGLE3-tree-k4-ahead EAGLE3-tree EAGLE3-tree-ahead STANDALONE-chain-k4 STANDALONE-chain-k4-ahead \
        --out "$R/accept_ahead.json" -- --device cuda --cuda-graph-max-bs 8 > "$R/accept_ahead.log" 2>&1
      grep -E "^  [A-Z].*tok/s|^\| " "$R/accept_ahead.log" | tail -20
      for c in off ahead; do
        extra=""; [ $c = ahead ] && extra="--enable-run-ahead"
        timeout 100 python3 bench/serve_decode.py --batch-sizes 1 --max-new-tokens 256 --out-dir "$R/serve_decode_$c" \
          -- --cuda-graph-max-bs 4 $extra > "$R/serve_decode_$c.log" 2>&1
        cat "$R/serve_decode_$c/results.md" 2>/dev/null || tail -5 "$R/serve_decode_$c.log"
      done ;;
    chained)  # speculative steps chained on the device (default) vs step by step (--disable-chained-speculative-steps):
      # GPU lossless of the chained path and the static steps first, then the demo path at batch 1
      timeout -s INT 200 python3 -m pytest -q -rs -s -p no:cacheprovider tests/gpu/test_lossless_gpu.py -k chained \
        tests/gpu/test_draft_step_gpu.py > "$R/chained_tests.log" 2>&1
      grep -E "chained|passed|failed|FAILED|Error" "$R/chained_tests.log" | tail -8
      timeout 380 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR EAGLE3-tree \
        EAGLE3-tree-unchained STANDALONE-chain STANDALONE-chain-unchained EAGLE3-tree-k8 EAGLE3-tree-ahead AR-ahead \
        EAGLE3-auto NGRAM-auto \
        --out "$R/accept_chained.json" -- --device cuda --cuda-graph-max-bs 8 > "$R/accept_chained.log" 2>&1
      grep -E "^  [A-Z].*tok/s|^\| |Error|error" "$R/accept_chained.log" | tail -14 ;;
    chained2)  # whole Verify calls chained on the device and run-ahead on by default: GPU lossless, then the demo path
      # at batch 1 (defaults vs run-ahead off vs step by step), then 8B AR through the services with the defaults
      timeout -s INT 150 python3 -m pytest -q -rs -s -p no:cacheprovider tests/gpu/test_lossless_gpu.py \
        -k "chained or ahead" > "$R/chained2_tests.log" 2>&1
      grep -E "chained|tau|passed|failed|FAILED|Error" "$R/chained2_tests.log" | tail -10
      timeout 330 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR EAGLE3-tree \
        EAGLE3-tree-noahead EAGLE3-tree-unchained AR-noahead STANDALONE-chain EAGLE3-auto NGRAM-auto \
        --out "$R/accept_chained2.json" -- --device cuda --cuda-graph-max-bs 8 > "$R/accept_chained2.log" 2>&1
      grep -E "^  [A-Z].*tok/s|^\| " "$R/accept_chained2.log" | tail -20
      timeout 110 python3 bench/serve_decode.py --batch-sizes 1 --max-new-tokens 256 --out-dir "$R/serve_decode_8b" \
        -- --cuda-graph-max-bs 4 > "$R/serve_decode_8b.log" 2>&1
      grep -E "ready in|starting" "$R/serve_decode_8b.log" | tail -2
      cat "$R/serve_decode_8b/results.md" 2>/dev/null || tail -5 "$R/serve_decode_8b.log" ;;
    chained_tests)  # the chained steps' GPU tests (greedy == HF, padding rows, a sampled neighbour) + static steps
      timeout -s INT 200 python3 -m pytest -q -rs -s -p no:cacheprovider tests/gpu/test_lossless_gpu.py -k chained \
        tests/gpu/test_draft_step_gpu.py > "$R/chained_tests.log" 2>&1
      grep -E "chained|passed|failed|FAILED|Error" "$R/chained_tests.log" | tail -8 ;;
    chained8b)  # 8B SYNTHETIC through the services with the draft co-located: chained steps (default) vs step by step
      # (#11's services efficiency >= 0.85 of in-process), then the in-process reference of the same configs
      for mode in chained unchained; do
        extra=""; [ $mode = unchained ] && extra="--target-args=--disable-chained-speculative-steps"
        timeout 200 python3 bench/speculative.py --mode services --device cuda:0 --margin-weights --batch-sizes 1 \
          --configs 5/1/6@3.5 6/4/16@5 8/8/60@6 --max-new-tokens 128 --colocate $extra \
          --out-dir "$R/spec_services_$mode" > "$R/spec_services_$mode.log" 2>&1
        cat "$R/spec_services_$mode/results.md" 2>/dev/null || tail -5 "$R/spec_services_$mode.log"
        # a chained run that failed falls back to step by step (logged by the target): say so
        grep -h "chained speculative steps\|are not chained" "$R/spec_services_$mode"/*target*.log 2>/dev/null | head -3
      done
      timeout 150 python3 bench/speculative.py --device cuda:0 --margin-weights --batch-sizes 1 \
        --configs 5/1/6@3.5 6/4/16@5 8/8/60@6 --static-verify on --out-dir "$R/spec_inproc" > "$R/spec_inproc.log" 2>&1
      cat "$R/spec_inproc/results.md" 2>/dev/null || tail -5 "$R/spec_inproc.log" ;;
    spec8b)  # #11's 8B targets, SYNTHETIC, batch 1 and 64: through the services (draft co-located, chained steps: the
      # defaults) and in-process, the same prompts (so the same tau) in both
      timeout 260 python3 bench/speculative.py --mode services --device cuda:0 --margin-weights --batch-sizes 1 64 \
        --configs 5/1/6@3.5 6/4/16@5 8/8/60@6 --max-new-tokens 128 --colocate --out-dir "$R/spec8b_services" \
        > "$R/spec8b_services.log" 2>&1
      cat "$R/spec8b_services/results.md" 2>/dev/null || tail -5 "$R/spec8b_services.log"
      grep -h "chained speculative steps\|are not chained" "$R/spec8b_services"/*target*.log 2>/dev/null | head -3
      timeout 150 python3 bench/speculative.py --device cuda:0 --margin-weights --batch-sizes 1 64 \
        --configs 5/1/6@3.5 6/4/16@5 8/8/60@6 --static-verify on --out-dir "$R/spec8b_inproc" > "$R/spec8b_inproc.log" 2>&1
      cat "$R/spec8b_inproc/results.md" 2>/dev/null || tail -5 "$R/spec8b_inproc.log" ;;
    gateway_overhead)  # the gateway alone on this host's CPU (an instant target, N Generate streams): the services'
      # batch-N ceiling; cProfile of the gateway at batch 64 (top functions into a text file)
      timeout 150 python3 bench/gateway_overhead.py --batch-sizes 1 16 64 --max-new-tokens 256 --profile "$R/gw64.prof" \
        --out "$R/gateway_overhead.json" > "$R/gateway_overhead.log" 2>&1
      tail -6 "$R/gateway_overhead.log"
      python3 -c "import pstats; pstats.Stats('$R/gw64.prof').sort_stats('tottime').print_stats(60)" \
        > "$R/gw64_top.txt" 2>&1; rm -f "$R/gw64.prof" ;;
    services_bs)  # 8B plain decoding through tandem serve at batch 1/8/64 with the gateway's own timings (Verify
      # round trip, loop step, prefill): where a call's wall goes past batch 1; run-ahead (default) vs off
      for c in default noahead; do
        extra=""; [ $c = noahead ] && extra="--disable-run-ahead"
        timeout 130 python3 bench/serve_decode.py --batch-sizes 1 8 64 --max-new-tokens 128 --prompt-len 256 \
          --out-dir "$R/services_bs_$c" -- --cuda-graph-max-bs 64 $extra > "$R/services_bs_$c.log" 2>&1
        echo "-- $c"; cat "$R/services_bs_$c/results.md" 2>/dev/null || tail -5 "$R/services_bs_$c.log"
      done ;;
    fewer_kernels)  # the speculative steps' own kernels (tandem_kernels/topk.py, tree.py, chain_glue.py, the packed
      # walk: sessions 16-18) and the pinned arena: their GPU tests, the demo user path with them (the default) and
      # without (TANDEM_STEP_KERNELS=0: torch's ops in the same graphs), then the static/chained GPU lossless tests
      timeout -s INT 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_topk.py \
        tests/kernels/test_tree_kernels.py tests/kernels/test_chain_glue.py tests/kernels/test_verify_greedy.py \
        tests/kernels/test_fused_elementwise.py tests/gpu/test_pinned_gpu.py > "$R/fewer_kernels_tests.log" 2>&1
      tail -2 "$R/fewer_kernels_tests.log"
      timeout 230 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR EAGLE3-tree \
        STANDALONE-chain EAGLE3-auto --out "$R/accept_fewer_kernels.json" -- --device cuda --cuda-graph-max-bs 8 \
        > "$R/accept_fewer_kernels.log" 2>&1
      grep -E "^  [A-Z].*tok/s|^\| " "$R/accept_fewer_kernels.log" | tail -8
      TANDEM_STEP_KERNELS=0 timeout 120 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs \
        EAGLE3-tree STANDALONE-chain --out "$R/accept_no_step_kernels.json" -- --device cuda --cuda-graph-max-bs 8 \
        > "$R/accept_no_step_kernels.log" 2>&1
      grep -E "^  [A-Z].*tok/s|^\| " "$R/accept_no_step_kernels.log" | tail -8
      timeout -s INT 120 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_lossless_gpu.py \
        tests/gpu/test_draft_step_gpu.py -k "chained or static" > "$R/fewer_kernels_chained_tests.log" 2>&1
      grep -E "passed|failed|FAILED|Error" "$R/fewer_kernels_chained_tests.log" | tail -4 ;;
    fewer_kernels_ab)  # fewer_kernels on little device time: EAGLE3 5/4/16 with the step kernels, without, then
      # plain decoding (three servers, one machine), then the kernels' GPU tests
      for c in on off AR; do
        cfg=EAGLE3-tree; [ $c = AR ] && cfg=AR
        env $([ $c = off ] && echo TANDEM_STEP_KERNELS=0) timeout 75 python3 bench/accept.py --num-prompts 4 \
          --max-new-tokens 128 --configs $cfg --out "$R/accept_ab_$c.json" -- --device cuda --cuda-graph-max-bs 8 \
          > "$R/accept_ab_$c.log" 2>&1
        echo "-- $c"; grep -E "^\| [A-Z]" "$R/accept_ab_$c.log" | tail -1
      done
      timeout -s INT 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_tree_kernels.py \
        tests/kernels/test_chain_glue.py tests/kernels/test_verify_greedy.py tests/gpu/test_pinned_gpu.py \
        > "$R/fewer_kernels_tests.log" 2>&1
      tail -2 "$R/fewer_kernels_tests.log" ;;
    services_bs8)  # is the 1-s batch-8 Prefill with run-ahead (services_bs, session 16) a one-time cost? batch 8 three
      # times around 64, run-ahead on then off, with the Triton kernels each run JIT-compiled
      for c in default noahead; do
        extra=""; [ $c = noahead ] && extra="--disable-run-ahead"
        timeout 120 python3 bench/serve_decode.py --batch-sizes 8 8 64 8 --max-new-tokens 128 --prompt-len 256 \
          --out-dir "$R/services_bs8_$c" -- --cuda-graph-max-bs 64 $extra > "$R/services_bs8_$c.log" 2>&1
        echo "-- $c"; cat "$R/services_bs8_$c/results.md" 2>/dev/null || tail -5 "$R/services_bs8_$c.log"
      done ;;
    spec8b_full)  # 8B in-process batch 64 with the full-batch rate (the steady state of a server kept full) next to
      # the drained static batch's
      timeout 200 python3 bench/speculative.py --device cuda:0 --margin-weights --batch-sizes 64 \
        --configs 5/1/6@3.5 6/4/16@5 --static-verify on --out-dir "$R/spec8b_full" > "$R/spec8b_full.log" 2>&1
      cat "$R/spec8b_full/results.md" 2>/dev/null || tail -5 "$R/spec8b_full.log" ;;
    profile_eagle3)  # where a chained EAGLE3 5/4/16 step's ~2.2 ms go on the demo user path: plain decoding and the
      # tree through tandem serve, then one more prompt profiled (every process: torch trace, Python profile)
      timeout 240 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR EAGLE3-tree \
        --profile-dir "$R/profiles" --out "$R/accept_profiled.json" -- --device cuda --cuda-graph-max-bs 8 \
        > "$R/accept_profiled.log" 2>&1
      grep -E "profile |^\| " "$R/accept_profiled.log" | tail -8
      find "$R/profiles" -name "*.trace.json.gz" -size +1500k -delete 2>/dev/null ;;
    compile_chained)  # --enable-torch-compile (bs 1) with chained steps and run-ahead (the defaults): EAGLE3 5/4/16
      # ABBA against plain graphs, plain decoding once (each graph replay's node count sets a step's time here)
      timeout 420 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR EAGLE3-tree \
        EAGLE3-tree-compile EAGLE3-tree-compile EAGLE3-tree --out "$R/accept_compile_chained.json" -- \
        --device cuda --cuda-graph-max-bs 8 > "$R/accept_compile_chained.log" 2>&1
      grep -E "^  [A-Z].*tok/s|^\| " "$R/accept_compile_chained.log" | tail -12
      grep -E "torch.compile|Error" "$R/accept_compile_chained.log" | head -6 ;;
    dflash_bundle)  # #13: the bundled DFLASH draft (compact: ~0.38 M parameters, 0.77 MB, to keep models/ under 30 MB:
      # one layer, 4 heads of 32, FFN 96, one target layer), trained here 2.5 min; then tau + tok/s through tandem serve
      # next to EAGLE3 and NEXTN on the same prompts
      rm -rf /tmp/demo-dflash
      timeout 200 python3 -m tools.train_draft --kind dflash --target-model-path $M --corpus /usr/lib/python3.12 \
        --exclude-files $M/heldout_files.txt --output-dir /tmp/demo-dflash --minutes 2.5 --device cuda --batch-size 64 \
        --seq-len 512 --dflash-num-heads 4 --dflash-head-dim 32 --dflash-num-kv-heads 1 --dflash-intermediate-size 96 \
        --dflash-target-layer-ids 3 --dflash-block-size 8 > "$R/dflash_train.log" 2>&1
      tail -3 "$R/dflash_train.log"; mkdir -p "$R/dflash" && cp /tmp/demo-dflash/* "$R/dflash/"; ls -l "$R/dflash"
      timeout 200 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR DFLASH-tmp EAGLE3-tree \
        NEXTN-chain --out "$R/accept_dflash.json" -- --device cuda --cuda-graph-max-bs 8 \
        > "$R/accept_dflash.log" 2>&1
      grep -E "^  [A-Z].*tok/s|^\| " "$R/accept_dflash.log" | tail -10 ;;
    spec8b_bs64)  # #11's batch-64 target (tree 6/4/16 >= 1.2x AR) with both timed services runs on a primed prefix
      # cache (session 23: the AR run alone paid its admission waves' prefills), then the in-process reference
      # (the speculative batch once more under the profiler: where the services' step goes next to in-process)
      timeout 190 python3 bench/speculative.py --mode services --device cuda:0 --margin-weights --batch-sizes 64 \
        --configs 6/4/16@5 --max-new-tokens 128 --colocate --out-dir "$R/spec8b64_services" \
        --profile-dir "$R/spec8b64_prof" > "$R/spec8b64_services.log" 2>&1
      grep -E "^\[bs" "$R/spec8b64_services.log"; grep -E "^\| 64" "$R/spec8b64_services/results.md" 2>/dev/null
      grep -h "^Python busy" "$R"/spec8b64_prof/*.summary.txt 2>/dev/null
      find "$R/spec8b64_prof" -name "*.trace.json.gz" -size +6000k -delete 2>/dev/null
      timeout 150 python3 bench/speculative.py --device cuda:0 --margin-weights --batch-sizes 64 --configs 6/4/16@5 \
        --static-verify on --out-dir "$R/spec8b64_inproc" > "$R/spec8b64_inproc.log" 2>&1
      grep -E "^\| 64" "$R/spec8b64_inproc/results.md" 2>/dev/null || tail -5 "$R/spec8b64_inproc.log" ;;
    spec8b_bs1)  # #11's 8B SYNTHETIC targets at batch 1 only: in-process (the reference), then through the services
      # (draft co-located, chained steps: the defaults), the same prompts (so the same tau) in both
      timeout 130 python3 bench/speculative.py --device cuda:0 --margin-weights --batch-sizes 1 \
        --configs 5/1/6@3.5 6/4/16@5 8/8/60@6 --static-verify on --out-dir "$R/spec8b_inproc" > "$R/spec8b_inproc.log" 2>&1
      cat "$R/spec8b_inproc/results.md" 2>/dev/null || tail -5 "$R/spec8b_inproc.log"
      timeout 170 python3 bench/speculative.py --mode services --device cuda:0 --margin-weights --batch-sizes 1 \
        --configs 5/1/6@3.5 6/4/16@5 8/8/60@6 --max-new-tokens 128 --colocate --out-dir "$R/spec8b_services" \
        > "$R/spec8b_services.log" 2>&1
      cat "$R/spec8b_services/results.md" 2>/dev/null || tail -5 "$R/spec8b_services.log"
      grep -h "chained speculative steps\|are not chained" "$R/spec8b_services"/*target*.log 2>/dev/null | head -3 ;;
    ar8b_bs1)  # #11's AR floor alone (>= 210 tok/s at 8B bs 1 through the services, H200): plain decoding through tandem
      # serve with every default (4 decode steps per call, run-ahead, the decode prefetch of a >= 1 GiB target)
      timeout 150 python3 bench/serve_decode.py --batch-sizes 1 1 --max-new-tokens 256 --out-dir "$R/ar8b_bs1" \
        -- --cuda-graph-max-bs 4 > "$R/ar8b_bs1.log" 2>&1
      cat "$R/ar8b_bs1/results.md" 2>/dev/null || tail -5 "$R/ar8b_bs1.log" ;;
    ar8b_profile)  # #11's AR floor (>= 210 tok/s at 8B bs 1 through the services): plain decoding through tandem serve
      # with the defaults, timed, then one request profiled in every process (GPU busy vs idle per Verify call)
      timeout 200 python3 bench/serve_decode.py --batch-sizes 1 --max-new-tokens 256 --profile-dir "$R/ar8b_prof" \
        --profile-tokens 64 --out-dir "$R/ar8b" -- --cuda-graph-max-bs 4 > "$R/ar8b.log" 2>&1
      cat "$R/ar8b/results.md" 2>/dev/null || tail -5 "$R/ar8b.log"
      head -6 "$R"/ar8b_prof/target-*.summary.txt "$R"/ar8b_prof/gateway-*.summary.txt 2>/dev/null
      find "$R/ar8b_prof" -name "*.trace.json.gz" -size +6000k -delete 2>/dev/null ;;
    prefetch_ab)  # the A/B that decides TANDEM_DECODE_PREFETCH (tandem/args.py decode_prefetch): 8B plain decoding
      # through tandem serve at batch 1, 8 and 64 without and with the next call's steps enqueued before the readback,
      # the second profiled (the GPU timeline's idle gaps between calls should close), then the demo path's AR
      for c in 0 1; do
        prof=""; [ $c = 1 ] && prof="--profile-dir $R/prefetch_prof --profile-tokens 64"
        TANDEM_DECODE_PREFETCH=$c timeout 170 python3 bench/serve_decode.py --batch-sizes 1 8 64 1 --max-new-tokens 256 \
          $prof --out-dir "$R/prefetch_$c" -- --cuda-graph-max-bs 64 > "$R/prefetch_$c.log" 2>&1
        echo "-- TANDEM_DECODE_PREFETCH=$c"; cat "$R/prefetch_$c/results.md" 2>/dev/null || tail -5 "$R/prefetch_$c.log"
      done
      head -5 "$R"/prefetch_prof/target-*.summary.txt 2>/dev/null
      find "$R/prefetch_prof" -name "*.trace.json.gz" -size +6000k -delete 2>/dev/null
      for c in 0 1; do
        TANDEM_DECODE_PREFETCH=$c timeout 70 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR \
          --out "$R/accept_prefetch_$c.json" -- --device cuda --cuda-graph-max-bs 8 > "$R/accept_prefetch_$c.log" 2>&1
        echo "-- demo AR, TANDEM_DECODE_PREFETCH=$c"; grep -E "^\| AR" "$R/accept_prefetch_$c.log" | tail -1
      done ;;
    ngram_profile)  # #11's NGRAM user-path step (1.15x on session 20's H100, target 1.2): plain decoding and NGRAM
      # timed, then one more prompt each profiled in every process (target's Python functions per step, GPU timeline)
      timeout 150 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR NGRAM-auto \
        --profile-dir "$R/ngram_prof" --out "$R/accept_ngram.json" -- --device cuda --cuda-graph-max-bs 8 \
        > "$R/accept_ngram.log" 2>&1
      grep -E "^  [A-Z].*tok/s|^\| |profile " "$R/accept_ngram.log" | tail -10
      for f in "$R"/ngram_prof/NGRAM*/target-*.summary.txt; do [ -f "$f" ] && sed -n 1,30p "$f"; done
      find "$R/ngram_prof" -name "*.trace.json.gz" -size +6000k -delete 2>/dev/null ;;
    overlap_ab)  # #14 on one GPU: the default overlap schedule (tokens streamed while the next call is in flight,
      # the target's run-ahead) against --disable-overlap-schedule (the sequential loop): demo EAGLE3 5/4/16 through
      # tandem serve at batch 1, then 8B SYNTHETIC tree 6/4/16 through the services (draft co-located) at batch 1, 32
      for c in default sequential; do
        extra=""; [ $c = sequential ] && extra="--disable-overlap-schedule"
        timeout 100 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs EAGLE3-tree \
          --out "$R/accept_overlap_$c.json" -- --device cuda --cuda-graph-max-bs 8 $extra > "$R/accept_overlap_$c.log" 2>&1
        echo "-- demo EAGLE3 5/4/16, $c"; grep -E "^\| EAGLE3" "$R/accept_overlap_$c.log" | tail -1
      done
      for c in default sequential; do
        extra=""; [ $c = sequential ] && extra="--disable-overlap-schedule"
        timeout 150 python3 bench/speculative.py --mode services --device cuda:0 --margin-weights --batch-sizes 1 32 \
          --configs 6/4/16@5 --max-new-tokens 128 --colocate --gateway-args="$extra" --target-args="$extra" \
          --out-dir "$R/overlap8b_$c" > "$R/overlap8b_$c.log" 2>&1
        echo "-- 8B services, $c"; grep -E "^\| (1|32) " "$R/overlap8b_$c/results.md" 2>/dev/null || tail -5 "$R/overlap8b_$c.log"
      done ;;
    overlap8b_sep)  # #14's one-GPU 8B target as the issue words it: draft and target as separate processes on one
      # GPU (no --colocate), the default overlap schedule against --disable-overlap-schedule, batch 1 and 32, then
      # pre-drafting (--enable-overlap-drafting: measured only on the demo family on one GPU, 0.53-0.59x there)
      for c in default sequential predraft; do
        extra=""; [ $c = sequential ] && extra="--disable-overlap-schedule"
        gw="$extra"; [ $c = predraft ] && gw="--enable-overlap-drafting"
        timeout 150 python3 bench/speculative.py --mode services --device cuda:0 --margin-weights --batch-sizes 1 32 \
          --configs 6/4/16@5 --max-new-tokens 128 --gateway-args="$gw" --target-args="$extra" \
          --out-dir "$R/overlap8b_sep_$c" > "$R/overlap8b_sep_$c.log" 2>&1
        echo "-- 8B services, separate draft process, $c"
        grep -E "^\| (1|32) " "$R/overlap8b_sep_$c/results.md" 2>/dev/null || tail -5 "$R/overlap8b_sep_$c.log"
      done ;;
    svc64_ab)  # the batch-64 plain decoding gap of the services bench (session 20, H100: 69 ms of wall per 4-step
      # Verify call against 33 ms of target handler): the run-ahead hits/misses it now reports, prefetch off then on
      for c in 0 1; do
        TANDEM_DECODE_PREFETCH=$c timeout 120 python3 bench/speculative.py --mode services --device cuda:0 \
          --margin-weights --batch-sizes 64 --configs 6/4/16@5 --max-new-tokens 128 --colocate \
          --out-dir "$R/svc64_$c" > "$R/svc64_$c.log" 2>&1
        echo "-- TANDEM_DECODE_PREFETCH=$c"; grep -E "run-ahead" "$R/svc64_$c.log" | tail -1
        cat "$R/svc64_$c/results.md" 2>/dev/null | grep -E "^\| 64" || tail -5 "$R/svc64_$c.log"
      done ;;
    user_auto)  # the user path's no-step-flag configs next to plain decoding (fewer_kernels measured the rest)
      timeout 200 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR EAGLE3-auto NGRAM-auto \
        --out "$R/accept_user_auto.json" -- --device cuda --cuda-graph-max-bs 8 > "$R/accept_user_auto.log" 2>&1
      grep -E "^  [A-Z].*tok/s|^\| " "$R/accept_user_auto.log" | tail -8 ;;
    user_path)  # #11's user path with the defaults: every method with no step flags next to plain decoding, batch 1
      timeout 360 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR EAGLE3-auto NGRAM-auto \
        EAGLE3-tree STANDALONE-chain --out "$R/accept_user_path.json" -- --device cuda --cuda-graph-max-bs 8 \
        > "$R/accept_user_path.log" 2>&1
      grep -E "^  [A-Z].*tok/s|^\| " "$R/accept_user_path.log" | tail -14 ;;
    run_ahead8b)  # the A/B that decides --enable-run-ahead for plain decoding: 8B AR through the services off / on,
      # then the demo path (AR and STANDALONE, each off / on) at batch 1
      for c in off ahead; do
        extra=""; [ $c = ahead ] && extra="--enable-run-ahead"
        timeout 110 python3 bench/serve_decode.py --batch-sizes 1 --max-new-tokens 256 --out-dir "$R/serve_decode_$c" \
          -- --cuda-graph-max-bs 4 $extra > "$R/serve_decode_$c.log" 2>&1
        grep -E "ready in" "$R/serve_decode_$c.log" | tail -1
        cat "$R/serve_decode_$c/results.md" 2>/dev/null || tail -5 "$R/serve_decode_$c.log"
      done
      timeout 260 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR AR-ahead STANDALONE-chain \
        STANDALONE-chain-ahead AR-ahead AR --out "$R/accept_ahead2.json" -- --device cuda --cuda-graph-max-bs 8 \
        > "$R/accept_ahead2.log" 2>&1
      grep -E "^  [A-Z].*tok/s|^\| " "$R/accept_ahead2.log" | tail -12 ;;
    colocate_k8b)  # the same at 8B shapes (SYNTHETIC) through the services, k = 2 and 4 (k = 1: colocate8b)
      for k in 2 4; do
        timeout 110 python3 bench/speculative.py --mode services --device cuda:0 --margin-weights --batch-sizes 1 \
          --configs 5/1/6@3.5 6/4/16@5 --max-new-tokens 128 --colocate "--gateway-args=--num-continuous-decode-steps $k" \
          --out-dir "$R/spec_services_k$k" > "$R/spec_services_k$k.log" 2>&1
        cat "$R/spec_services_k$k/results.md" 2>/dev/null || tail -5 "$R/spec_services_k$k.log"
      done ;;
    colocate8b)  # 8B SYNTHETIC through the services: draft process apart vs --colocate-draft (#11 efficiency >= 0.85)
      for mode in apart colocate; do
        extra=""; [ $mode = colocate ] && extra="--colocate"
        timeout 260 python3 bench/speculative.py --mode services --device cuda:0 --margin-weights --batch-sizes 1 \
          --configs 5/1/6@3.5 6/4/16@5 8/8/60@6 --max-new-tokens 128 $extra --out-dir "$R/spec_services_$mode" \
          > "$R/spec_services_$mode.log" 2>&1
        cat "$R/spec_services_$mode/results.md" 2>/dev/null || tail -5 "$R/spec_services_$mode.log"
      done ;;
    predraft)  # pre-drafting (--enable-overlap-drafting) vs the sequential loop, draft and target on one GPU: the
      # demo family through tandem serve, then 8B SYNTHETIC through the services
      timeout 230 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR EAGLE3-tree \
        EAGLE3-tree-predraft EAGLE3-chain EAGLE3-chain-predraft NEXTN-chain-predraft --out "$R/accept_predraft.json" \
        -- --device cuda --cuda-graph-max-bs 8 > "$R/accept_predraft.log" 2>&1
      tail -8 "$R/accept_predraft.log"
      for mode in sequential predraft; do
        extra=""; [ $mode = predraft ] && extra="--gateway-args=--enable-overlap-drafting"
        timeout 150 python3 bench/speculative.py --mode services --device cuda:0 --margin-weights --batch-sizes 1 \
          --configs 5/1/6@3.5 6/4/16@5 --max-new-tokens 128 $extra --out-dir "$R/spec_services_$mode" \
          > "$R/spec_services_$mode.log" 2>&1
        cat "$R/spec_services_$mode/results.md" 2>/dev/null || tail -5 "$R/spec_services_$mode.log"
      done ;;
    adaptive)  # 8B SYNTHETIC chain through the services with --speculative-adaptive: >= 0.95x AR at every batch size;
      # the draft in the target's process (serve's default on one device: each Verify drafts the tier's next chain).
      # ADAPTIVE_BS: the batch sizes (session 15 measured 1 8 32 64 before the bench primed both runs' prefixes)
      # The batch-32 run once more under the profiler (session 24: 14.87 ms of Propose handler per step there;
      # ADAPTIVE_PROFILE_BS picks another: session 27's batch 64 at 0.63x)
      timeout 330 python3 bench/speculative.py --mode services --device cuda:0 --margin-weights --adaptive --colocate \
        --batch-sizes ${ADAPTIVE_BS:-1 8 32 64} --configs 5/1/6@3.5 --out-dir "$R/spec_adaptive" \
        --profile-dir "$R/adaptive_prof" --profile-batch-sizes ${ADAPTIVE_PROFILE_BS:-32} > "$R/spec_adaptive.log" 2>&1
      cat "$R/spec_adaptive/results.md" 2>/dev/null || tail -20 "$R/spec_adaptive.log"
      grep -h "^Python busy" "$R"/adaptive_prof/*.summary.txt 2>/dev/null
      find "$R/adaptive_prof" -name "*.trace.json.gz" -size +6000k -delete 2>/dev/null ;;
    mtp)  # one MTP layer for the demo target (a copy), trained here, then NEXTN through tandem serve vs plain decoding
      rm -rf /tmp/demo-mtp && cp -r $M /tmp/demo-mtp
      timeout 360 python3 -m tools.train_draft --kind mtp --target-model-path $M --corpus /usr/lib/python3.12 \
        --exclude-files $M/heldout_files.txt --output-dir /tmp/demo-mtp --minutes 5 --device cuda --batch-size 64 \
        --seq-len 512 > "$R/mtp_train.log" 2>&1
      tail -3 "$R/mtp_train.log"; cp /tmp/demo-mtp/mtp.safetensors /tmp/demo-mtp/mtp_training_info.json "$R/" 2>/dev/null
      timeout 200 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR NEXTN-chain NEXTN-tree \
        --out "$R/accept_mtp.json" -- --device cuda --model-path /tmp/demo-mtp --cuda-graph-max-bs 8 \
        > "$R/accept_mtp.log" 2>&1
      tail -6 "$R/accept_mtp.log" ;;
    mtp_bundle)  # the bundled demo's MTP layer, trained here into the target (then NEXTN/EAGLE serve it with no flags),
      # a 2-layer copy for multi-layer EAGLE trained alongside (the tiny model leaves the GPU mostly idle), and tau +
      # tok/s of every MTP config next to EAGLE3 and plain decoding
      rm -rf /tmp/demo-mtp2 && cp -r $M /tmp/demo-mtp2
      timeout 200 python3 -m tools.train_draft --kind mtp --num-mtp-layers 2 --target-model-path /tmp/demo-mtp2 \
        --corpus /usr/lib/python3.12 --exclude-files $M/heldout_files.txt --output-dir /tmp/demo-mtp2 --minutes 2.6 \
        --device cuda --batch-size 64 --seq-len 512 > "$R/mtp2_train.log" 2>&1 &
      MTP2=$!
      timeout 240 python3 -m tools.train_draft --kind mtp --target-model-path $M --corpus /usr/lib/python3.12 \
        --exclude-files $M/heldout_files.txt --output-dir $M --minutes 3.3 --device cuda --batch-size 64 \
        --seq-len 512 > "$R/mtp_train.log" 2>&1
      wait $MTP2  # the 2-layer training (a bare `wait` would wait for the BUDGET_S watchdog too)
      tail -3 "$R/mtp_train.log"; tail -2 "$R/mtp2_train.log"; mkdir -p "$R/bundle"
      cp $M/config.json $M/model.safetensors.index.json $M/mtp*.safetensors $M/mtp_training_info.json "$R/bundle/"
      cp /tmp/demo-mtp2/mtp_training_info.json "$R/mtp2_training_info.json" 2>/dev/null
      timeout 250 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR AR-1step EAGLE3-tree \
        NEXTN-chain NEXTN-tree EAGLE-tree --out "$R/accept_mtp.json" -- --device cuda --cuda-graph-max-bs 8 > "$R/accept_mtp.log" 2>&1
      tail -9 "$R/accept_mtp.log"
      timeout 80 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR NEXTN-multi \
        --out "$R/accept_mtp2.json" -- --device cuda --model-path /tmp/demo-mtp2 --cuda-graph-max-bs 8 \
        > "$R/accept_mtp2.log" 2>&1
      tail -5 "$R/accept_mtp2.log" ;;
    dflash_uno)  # a DFLASH draft for the demo target (2.5 min; not bundled) and a 2-layer MTP copy (kept for CPU tau)
      # trained side by side, then tau + tok/s of DFLASH and UNO (bundled LoRA) next to EAGLE3 and plain decoding
      rm -rf /tmp/demo-mtp2 /tmp/demo-dflash && cp -r $M /tmp/demo-mtp2
      timeout 170 python3 -m tools.train_draft --kind mtp --num-mtp-layers 2 --target-model-path /tmp/demo-mtp2 \
        --corpus /usr/lib/python3.12 --exclude-files $M/heldout_files.txt --output-dir /tmp/demo-mtp2 --minutes 2.2 \
        --device cuda --batch-size 64 --seq-len 512 > "$R/mtp2_train.log" 2>&1 &
      MTP2=$!
      timeout 190 python3 -m tools.train_draft --kind dflash --target-model-path $M --corpus /usr/lib/python3.12 \
        --exclude-files $M/heldout_files.txt --output-dir /tmp/demo-dflash --minutes 2.5 --device cuda --batch-size 64 \
        --seq-len 512 > "$R/dflash_train.log" 2>&1 &
      DFLASH=$!
      # the GPU lossless tests (UNO and the MTP cases never ran on a GPU) beside the two trainings (tiny models)
      timeout -s INT 240 python3 -m pytest -q -rs -s -p no:cacheprovider tests/gpu/test_lossless_gpu.py \
        > "$R/lossless_gpu.log" 2>&1
      wait $MTP2 $DFLASH  # (a bare `wait` would wait for the BUDGET_S watchdog too)
      grep -E "tau|passed|failed|FAILED|Error" "$R/lossless_gpu.log" | tail -14
      tail -2 "$R/dflash_train.log"; tail -1 "$R/mtp2_train.log"
      mkdir -p "$R/dflash" "$R/mtp2" && cp /tmp/demo-dflash/* "$R/dflash/"
      cp /tmp/demo-mtp2/config.json /tmp/demo-mtp2/model.safetensors.index.json /tmp/demo-mtp2/mtp.safetensors \
        /tmp/demo-mtp2/mtp_training_info.json "$R/mtp2/"
      timeout 260 python3 bench/accept.py --num-prompts 4 --max-new-tokens 128 --configs AR EAGLE3-tree UNO-linear \
        UNO-tree DFLASH-tmp --out "$R/accept_dflash_uno.json" -- --device cuda --cuda-graph-max-bs 8 \
        > "$R/accept_dflash_uno.log" 2>&1
      tail -8 "$R/accept_dflash_uno.log" ;;
    flashinfer)
      timeout -s INT 150 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_flashinfer_backend_gpu.py \
        > "$R/flashinfer.log" 2>&1
      tail -5 "$R/flashinfer.log"
      timeout 120 python3 bench/decode.py --attention-backend flashinfer --batch-sizes 1 8 32 --steps 32 --skip-hf \
        --out-dir "$R/decode_flashinfer" > "$R/decode_flashinfer.log" 2>&1
      cat "$R/decode_flashinfer/results.md" 2>/dev/null ;;
    rpc)
      timeout 60 python3 bench/rpc_overhead.py --device cuda:0 --iters 1000 --out "$R/rpc_overhead.json" \
        > "$R/rpc.log" 2>&1
      tail -8 "$R/rpc.log" ;;
    prefix)  # TTFT with and without the target's prefix cache (bundled model: 2048 context, 1800-token prefix)
      timeout 120 python3 bench/prefix_cache.py --device cuda --prefix-len 1800 --out-dir "$R/prefix" \
        > "$R/prefix.log" 2>&1
      cat "$R/prefix/prefix_cache.md" 2>/dev/null || tail -5 "$R/prefix.log" ;;
    *) echo "unknown stage $s" ;;
  esac
  fin
done
stage done
# The watchdog's sleep, not only its subshell: a sleep left running holds the call's stdout open, and the device
# tool then waits (and counts device time) until it ends (session 20: 270 s lost after a 295-s run).
[ -n "${WATCHDOG:-}" ] && { pkill -TERM -P "$WATCHDOG" 2>/dev/null; kill "$WATCHDOG" 2>/dev/null; }
exit 0
