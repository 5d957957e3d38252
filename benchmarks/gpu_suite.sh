#!/usr/bin/env bash
# The GPU benchmark suite: `llamatron bench` rows as JSON lines in $OUT/bench.jsonl, logs in $OUT/log.txt.
# Written for a 2-GPU host: single-GPU rows run two at a time, one on GPU 0 and one on GPU 1.
# usage: benchmarks/gpu_suite.sh [GROUP...]   (no group: single dp tests)
#   2 GPUs: single, dp, overlap, tp, tpab, kernels, fa4, repeat, commit_ab, tp7, single7, fastpath, tests
#   1 GPU:  clocks, profile, plan, commit_ab1, masks, masks_fa4, window_pair, longctx, fp8_7b, fp8_1b, fp8_parity, fp8_parity_moe,
#           lora7, lora70, lora_fp8, dpo, generate, fsdp1, deepseek_titan
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -lt 1 ]; then echo "gpu_suite.sh: no NVIDIA GPU found" >&2; exit 2; fi
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
B1="--model llama-1b --seq-length 4096 --global-batch-size 8 --steps 10 --warmup 3"
B7="--model llama2-7b --seq-length 4096 --global-batch-size 8 --steps 4 --warmup 2"
one() {  # one GPU ARGS...: a single-GPU row on GPU $1, with "_gpu": $1 (and "_tag": ROW_TAG when that is set)
  local gpu=$1; shift
  CUDA_VISIBLE_DEVICES=$gpu timeout 500 python3 -m llamatron bench --json "$@" >"$OUT/row-$gpu.tmp" 2>>"$OUT/log.txt"
  echo "== 1 GPU${ROW_TAG:+ ($ROW_TAG)}: $* -> rc $?" >>"$OUT/log.txt"
  tail -1 "$OUT/row-$gpu.tmp" | sed "s/^{/{\"_gpu\": $gpu, /; ${ROW_TAG:+s/^{/{\"_tag\": \"$ROW_TAG\", /}" \
    >>"$OUT/bench.jsonl"
}
ab() {  # ab ARGS...: overlapped vs not, alternating in one 2-GPU process (benchmarks/overlap_ab.py)
  timeout 300 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/overlap_ab.py "$@" >"$OUT/row-ab.tmp" 2>>"$OUT/log.txt"
  echo "== overlap A/B: $* -> rc $?" >>"$OUT/log.txt"; tail -1 "$OUT/row-ab.tmp" >>"$OUT/overlap.jsonl"
}
multi() {  # multi N ARGS...
  local n=$1; shift
  timeout 500 python3 -m torch.distributed.run --nproc-per-node "$n" -m llamatron bench --json "$@" >"$OUT/row-m.tmp" 2>>"$OUT/log.txt"
  echo "== $n GPUs: $* -> rc $?" >>"$OUT/log.txt"; tail -1 "$OUT/row-m.tmp" >>"$OUT/bench.jsonl"
}
plan_check() {  # the planner's prediction against measured peak memory, on GPU ${PLAN_GPU:-0}
  for a in "--micro-batch-size 4" "--micro-batch-size 8 --recompute full"; do
    CUDA_VISIBLE_DEVICES=${PLAN_GPU:-0} timeout 300 python3 scripts/check_plan_memory.py --model llama-1b --seq-length 4096 \
      --global-batch-size 8 $a >>"$OUT/plan.jsonl" 2>>"$OUT/log.txt"
    echo "== plan check $a -> rc $?" >>"$OUT/log.txt"
  done
}
for group in ${@:-single dp tests}; do
  case $group in
    fp8_7b|fp8_1b)  # issue 19: FP8 against our bf16 default; FP8_SETTINGS: the rows' flags, ';'-separated
      IFS=';' read -ra settings <<<"${FP8_SETTINGS:---fp8 none;--fp8 tensorwise;--fp8 rowwise}"
      for s in "${settings[@]}"; do
        if [ $group = fp8_7b ]; then ROW_TAG="$s" one 0 $B7 --micro-batch-size 1 $s; else ROW_TAG="$s" one 0 $B1 --micro-batch-size 8 $s; fi
      done ;;
    fsdp1)  # issue 35: --fsdp with one rank against the default, alternating (A B A B), llama-1b then Llama 2 7B;
      # the target: within 2%. Then the GPU tests of --fsdp.
      for r in 1 2; do
        ROW_TAG=default one 0 $B1 --micro-batch-size 8 --compile
        ROW_TAG=fsdp one 0 $B1 --micro-batch-size 8 --compile --fsdp
      done
      for r in 1 2; do
        ROW_TAG=default one 0 $B7 --micro-batch-size 1 --compile
        ROW_TAG=fsdp one 0 $B7 --micro-batch-size 1 --compile --fsdp
      done
      CUDA_VISIBLE_DEVICES=0 timeout 600 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fsdp_gpu.py \
        >>"$OUT/pytest_fsdp_gpu.txt" 2>&1 ;;
    lora7)  # issue 36: LoRA (rank 16, every linear) against full fine-tuning, Llama 2 7B, seq 4096, mbs 1
      ROW_TAG=full one 0 $B7 --micro-batch-size 1 --compile
      ROW_TAG=lora16 one 0 $B7 --micro-batch-size 1 --compile --lora-rank 16 --lora-alpha 32 ;;
    lora70)  # issue 36: LoRA on Llama 2 70B's shape with a bf16 base, LORA_LAYERS of its 80 layers each
      for n in ${LORA_LAYERS:-20 40 80}; do
        ROW_TAG="70b-$n-lora16" one 0 --model llama2-70b --num-layers $n --seq-length 4096 --global-batch-size 2 \
          --micro-batch-size 1 --steps 2 --warmup 1 --compile --recompute full --lora-rank 16 --lora-alpha 32
      done ;;
    lora_fp8)  # issue 36: LoRA with the frozen base's matmuls in FP8 (tensorwise) against bf16, 7B; 70B's shape, 20 layers
      ROW_TAG=lora16 one 0 $B7 --micro-batch-size 1 --compile --lora-rank 16 --lora-alpha 32
      ROW_TAG=lora16-fp8 one 0 $B7 --micro-batch-size 1 --compile --lora-rank 16 --lora-alpha 32 --fp8 tensorwise
      for f in none tensorwise; do
        ROW_TAG="70b-20-lora16-fp8-$f" one 0 --model llama2-70b --num-layers 20 --seq-length 4096 --global-batch-size 2 \
          --micro-batch-size 1 --steps 2 --warmup 1 --compile --recompute full --lora-rank 16 --lora-alpha 32 --fp8 $f
      done ;;
    dpo)  # issue 36: DPO trains on GPU (llama-1b, bf16, compiled): full and LoRA, on synthetic pairs of 1024 tokens
      python3 benchmarks/synthetic_pairs.py /tmp/pairs/p_pref --pairs 4096 --vocab 32000 --length 1024 >>"$OUT/log.txt"
      for lora in "" "--lora-rank 16 --lora-alpha 32"; do
        tag=dpo${lora:+-lora}
        timeout 500 python3 -m llamatron train --model llama-1b --objective dpo --preference-data /tmp/pairs/p_pref \
          --seq-length 1023 --micro-batch-size 8 --global-batch-size 32 --train-steps 60 --lr 5e-5 --warmup-steps 5 \
          --eval-interval 0 --log-interval 10 --no-progress $lora --metrics-file "$OUT/$tag.jsonl" >"$OUT/$tag.log" 2>&1
        echo "== $tag -> rc $?" >>"$OUT/log.txt"
      done ;;
    fp8_parity)  # issue 19: bf16, tensorwise and rowwise trained side by side on GPU 0 on real text
      # PARITY_DATA: the --data prefix of benchmarks/code_corpus.py's corpus
      for r in none tensorwise rowwise; do
        CUDA_VISIBLE_DEVICES=0 timeout "${PARITY_TIMEOUT:-540}" python3 -m llamatron train --config configs/fp8-parity-350m.yaml \
          --data "$PARITY_DATA" --fp8 $r --no-progress --metrics-file "$OUT/parity-$r.jsonl" >"$OUT/parity-$r.log" 2>&1 &
        sleep 15  # the first run writes the data's index cache; the others then read it
      done
      wait ;;
    fp8_parity_moe)  # issue 34: bf16 and FP8 experts (--fp8 rowwise --fp8-experts) side by side on real text
      for r in none rowwise; do
        a=""; [ $r = rowwise ] && a="--fp8-experts"
        CUDA_VISIBLE_DEVICES=0 timeout "${PARITY_TIMEOUT:-540}" python3 -m llamatron train --config configs/fp8-parity-moe.yaml \
          --data "$PARITY_DATA" --fp8 $r $a --no-progress --metrics-file "$OUT/parity-moe-$r.jsonl" >"$OUT/parity-moe-$r.log" 2>&1 &
        sleep 12
      done
      wait ;;
    single)
      (one 0 $B1 --micro-batch-size 8 --compile; one 0 $B1 --micro-batch-size 8 --no-compile) &
      (one 1 $B7 --micro-batch-size 2 --compile --recompute full; one 1 $B1 --micro-batch-size 4 --compile) &
      wait ;;
    dp)
      multi 2 $B1 --global-batch-size 16 --micro-batch-size 8 --compile --distributed-optimizer
      multi 2 $B1 --global-batch-size 16 --micro-batch-size 8 --compile --distributed-optimizer --no-overlap-grad-reduce --no-overlap-param-gather
      multi 2 $B1 --global-batch-size 16 --micro-batch-size 8 --compile --distributed-optimizer --grad-reduce-dtype bf16 ;;
    overlap)  # issue 5: does overlapping the data-parallel traffic beat not overlapping it?
      A="--model llama-1b --seq-length 4096 --global-batch-size 16 --micro-batch-size 8 --compile --distributed-optimizer --rounds 4 --steps 6"
      ab $A
      ab $A --dp-comm-max-ctas 4
      ab $A --dp-comm-max-ctas 4 --grad-reduce-dtype bf16 ;;
    tp)
      multi 2 $B1 --micro-batch-size 8 --compile --tp 2 --sequence-parallel ;;
    tpab)  # tensor parallel: column-parallel backward overlap on vs off (same machine, back to back)
      multi 2 $B1 --micro-batch-size 8 --compile --tp 2 --sequence-parallel --no-tp-comm-overlap
      multi 2 $B1 --micro-batch-size 8 --compile --tp 2 --sequence-parallel ;;
    kernels)  # kernel switches against the default (llama-1b, 1 GPU), each pair on both GPUs with the settings
      # swapped (~1 min a switch): by default torch's RMSNorm and rotary instead of the Triton ones;
      # KERNEL_AB="--adamw-kernel torch;--swiglu-backend torch" picks others (those two: RESULTS runs 3-4);
      # KERNEL_ARGS (e.g. "--attention-backend fa4 --steps 30") goes to both sides
      if [ -n "${KERNEL_AB:-}" ]; then IFS=';' read -ra switches <<<"$KERNEL_AB"
      else switches=("--rmsnorm-backend torch" "--rope-backend torch"); fi
      for k in "${switches[@]}"; do
        one 0 $B1 --micro-batch-size 8 --compile ${KERNEL_ARGS:-} & one 1 $B1 --micro-batch-size 8 --compile ${KERNEL_ARGS:-} $k & wait
        one 0 $B1 --micro-batch-size 8 --compile ${KERNEL_ARGS:-} $k & one 1 $B1 --micro-batch-size 8 --compile ${KERNEL_ARGS:-} & wait
      done ;;
    commit_ab)  # this checkout against an older llamatron: AB_BASE is a directory holding that package (made with
      # `git archive COMMIT llamatron | tar -x -C DIR`); AB_ARGS (default "--attention-backend fa4") for both;
      # ROUNDS rounds (default 2), the two swapped across the GPUs each round; rows tagged "this" / "base"
      for round in $(seq "${ROUNDS:-2}"); do
        g=$((round % 2))
        ROW_TAG=this one $g $B1 --micro-batch-size 8 --compile --steps 30 ${AB_ARGS:---attention-backend fa4} &
        (cd "$AB_BASE" && ROW_TAG=base one $((1 - g)) $B1 --micro-batch-size 8 --compile --steps 30 \
          ${AB_ARGS:---attention-backend fa4}) &
        wait
      done ;;
    fa4)  # FlashAttention 4 (--attention-backend fa4) vs SDPA's cuDNN: microbenchmark, then llama-1b on both GPUs
      # with the settings swapped. Needs flash-attn-4 importable: benchmarks/fa4_carry.sh packs it for machines
      # without internet and says how to unpack it there (two calls, PYTHONPATH)
      CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/attention_layout.py --iters 50 >>"$OUT/attention_layout.txt" 2>>"$OUT/log.txt"
      echo "== attention_layout with fa4 -> rc $?" >>"$OUT/log.txt"
      one 0 $B1 --micro-batch-size 8 --compile & one 1 $B1 --micro-batch-size 8 --compile --attention-backend fa4 & wait
      one 0 $B1 --micro-batch-size 8 --compile --attention-backend fa4 & one 1 $B1 --micro-batch-size 8 --compile & wait ;;
    tp7)  # Llama 2 7B on 2 GPUs: tensor parallel vs data parallel with the distributed optimizer
      # (12 B/param with the optimizer sharded over 2 leaves ~55 GB for activations: no recompute needed)
      multi 2 $B7 --global-batch-size 16 --micro-batch-size 1 --compile --distributed-optimizer
      multi 2 $B7 --global-batch-size 16 --micro-batch-size 2 --compile --distributed-optimizer
      multi 2 $B7 --micro-batch-size 2 --compile --tp 2 --sequence-parallel ;;
    single7)  # Llama 2 7B on 1 GPU at micro-batch 1: no recompute, and 8 recomputed layers (one row per GPU)
      # (RESULTS run 3: 12.2k and 11.3k tokens/s; no recompute peaks at 131.75 GiB of the H200's 139.8)
      one 0 $B7 --micro-batch-size 1 --compile &
      one 1 $B7 --micro-batch-size 1 --compile --recompute full --recompute-layers 8 &
      wait ;;
    fastpath)  # each fast path off, one at a time, against the compiled default (llama-1b, 1 GPU)
      (one 0 $B1 --micro-batch-size 8 --compile --attention-backend flash
       one 0 $B1 --micro-batch-size 8 --compile --recompute selective) &
      (one 1 $B1 --micro-batch-size 8 --compile --recompute full; PLAN_GPU=1 plan_check) &
      wait ;;
    profile)  # where llama-1b's step time goes, by kernel category, and where the GPU idles between kernels;
      # PROFILE_ARGS adds flags (e.g. "--attention-backend fa4")
      CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/profile_step.py --model llama-1b --seq-length 4096 \
        --micro-batch-size 8 --global-batch-size 8 --compile --top 60 --gaps 20 --sync-debug ${PROFILE_ARGS:-} \
        >"$OUT/profile.txt" 2>>"$OUT/log.txt"
      echo "== profile ${PROFILE_ARGS:-} rc $?" >>"$OUT/log.txt" ;;
    repeat)  # the spread of one setting: REPEAT_ARGS (default "--attention-backend fa4") 3 times on each GPU,
      # --steps 30 (RESULTS run 5: five runs of that setting spanned 95.7-96.4k tokens/s)
      for round in 1 2 3; do
        one 0 $B1 --micro-batch-size 8 --compile --steps 30 ${REPEAT_ARGS:---attention-backend fa4} &
        one 1 $B1 --micro-batch-size 8 --compile --steps 30 ${REPEAT_ARGS:---attention-backend fa4} &
        wait
      done ;;
    clocks)  # is in-model attention slower than alone because the GPU clocks down under matmul load?
      # SM clock and power sampled every 200 ms while the attention microbenchmark runs alone, then while a
      # llama-1b row runs (RESULTS run 3: cuDNN attention 5.72 ms/layer in the model vs 4.85 alone)
      for what in attention model; do
        nvidia-smi -i 0 --query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv \
          -lms 200 >"$OUT/clocks-$what.csv" 2>>"$OUT/log.txt" & local_smi=$!
        if [ $what = attention ]; then
          CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/attention_layout.py --iters 200 >>"$OUT/attention_layout.txt" 2>>"$OUT/log.txt"
        else
          one 0 $B1 --micro-batch-size 8 --compile --steps 20
        fi
        kill $local_smi
      done ;;
    commit_ab1)  # commit_ab on one GPU: AB_BASE as for commit_ab; each setting of AB_SETTINGS (';'-separated,
      # default "$B1 --micro-batch-size 8 --compile --steps 20") runs ROUNDS rounds (default 2) of this and base
      # one after the other on GPU 0, the order alternating by round; rows tagged "this" / "base"
      IFS=';' read -ra settings <<<"${AB_SETTINGS:-$B1 --micro-batch-size 8 --compile --steps 20}"
      for setting in "${settings[@]}"; do
        for round in $(seq "${ROUNDS:-2}"); do
          for side in $( ((round % 2)) && echo "this base" || echo "base this"); do
            if [ $side = this ]; then ROW_TAG=this one 0 $setting
            else (cd "$AB_BASE" && ROW_TAG=base one 0 $setting); fi
          done
        done
      done ;;
    deepseek_titan)  # issue 49: Moonlight's shape cut to DS_LAYERS layers (default 4), llamatron beside torchtitan's
      # own deepseek_v3 model (benchmarks/titan_deepseek_bench.py; PEERS_WHL: its wheels, .peers: the peers' helpers),
      # for each MTP depth of DS_MTP (default "0 1"); seq 4096, 4 sequences a step, compiled; one after the other
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ${PEERS_WHL:-.peers-whl}/*.whl \
        >>"$OUT/log.txt" 2>&1
      for mtp in ${DS_MTP:-0 1}; do
        ROW_TAG="llamatron-mtp$mtp" one 0 --model moonlight-16b-a3b --model-override num_layers=${DS_LAYERS:-4} \
          --model-override num_nextn_predict_layers=$mtp --seq-length 4096 --micro-batch-size 1 --global-batch-size 4 \
          --steps 6 --warmup 2 --compile
        PYTHONPATH=/tmp/site:${PYTHONPATH:-} RESULTS="$OUT/titan.jsonl" timeout 500 torchrun --standalone \
          --nproc_per_node=1 benchmarks/titan_deepseek_bench.py --layers ${DS_LAYERS:-4} --mtp $mtp --compile \
          >>"$OUT/titan_log.txt" 2>&1
        echo "== torchtitan deepseek_v3 mtp $mtp -> rc $?" >>"$OUT/log.txt"
      done ;;
    generate)  # issue 37: decoding tokens/s, llamatron against transformers' generate; one case a process
      for c in llama-1b:1 llama2-7b:1 llama-1b:32; do
        CUDA_VISIBLE_DEVICES=0 timeout 580 python3 benchmarks/generate_speed.py --cases $c --out "$OUT/generate.jsonl" \
          >>"$OUT/log.txt" 2>&1
        echo "== generate_speed $c -> rc $?" >>"$OUT/log.txt"
      done
      CUDA_VISIBLE_DEVICES=0 timeout 420 python3 -m pytest -q -m gpu tests/test_decode_gpu.py tests/test_kv_cache_gpu.py \
        -p no:cacheprovider -n 0 >>"$OUT/pytest_decode_gpu.txt" 2>&1
      echo "== pytest -m gpu (decoding) rc $?" >>"$OUT/log.txt" ;;
    plan)  # the planner's prediction against measured peak memory
      plan_check ;;
    masks)  # issue 18: every mask kind beside plain causal on one GPU; real documents from CORPUS (default
      # runs/bench_corpus, built by benchmarks/doc_corpus.py): defs (~443-token documents) and files (~4k)
      C=${CORPUS:-runs/bench_corpus}; D="--tokenizer $C/tokenizer --data $C/defs_text_document"
      S8="--model llama-1b --seq-length 8192 --global-batch-size 4 --micro-batch-size 4 --steps 8 --warmup 2"
      printf 'model: llama-1b\nmodel_overrides:\n  sliding_window: 1024\n' >"$OUT/window.yaml"
      printf 'model: mistral-7b\nmodel_overrides:\n  num_layers: 4\n' >"$OUT/mistral4.yaml"
      ROW_TAG=causal-8k one 0 $S8 ${MASK_ARGS:-}
      ROW_TAG=window-8k one 0 --config "$OUT/window.yaml" $S8 ${MASK_ARGS:-}
      ROW_TAG=causal-defs one 0 $B1 --micro-batch-size 8 --steps 8 $D ${MASK_ARGS:-}
      ROW_TAG=docs-defs one 0 $B1 --micro-batch-size 8 --steps 8 $D --reset-attention-mask ${MASK_ARGS:-}
      ROW_TAG=docs-window-defs one 0 --config "$OUT/window.yaml" $B1 --micro-batch-size 8 --steps 8 $D \
        --reset-attention-mask ${MASK_ARGS:-}
      ROW_TAG=docs-files one 0 $B1 --micro-batch-size 8 --steps 8 --tokenizer $C/tokenizer \
        --data $C/files_text_document --reset-attention-mask ${MASK_ARGS:-}
      ROW_TAG=mistral4-32k one 0 --config "$OUT/mistral4.yaml" --seq-length 32768 --global-batch-size 1 \
        --micro-batch-size 1 --steps 4 --warmup 2 ${MASK_ARGS:-} ;;
    masks_fa4)  # with FlashAttention 4 importable: auto (now fa4) causal and its windowed kernel against flex
      S8="--model llama-1b --seq-length 8192 --global-batch-size 4 --micro-batch-size 4 --steps 8 --warmup 2"
      printf 'model: llama-1b\nmodel_overrides:\n  sliding_window: 1024\n' >"$OUT/window.yaml"
      ROW_TAG=causal-8k-auto one 0 $S8
      ROW_TAG=causal-8k-cudnn one 0 $S8 --attention-backend cudnn
      ROW_TAG=window-8k-fa4 one 0 --config "$OUT/window.yaml" $S8
      ROW_TAG=window-8k-flex one 0 --config "$OUT/window.yaml" $S8 --attention-backend cudnn ;;
    window_pair)  # issue 18: plain causal against the 1024 window at seq 8192, WINDOW_GBS sequences a step
      # (default 4: one micro-batch; 32 spreads the optimizer step over 8 as a real run does); WINDOW_ARGS: flags
      # for both rows (e.g. --fp8 tensorwise)
      G=${WINDOW_GBS:-4}
      SA="--model llama-1b --seq-length 8192 --global-batch-size $G --micro-batch-size 4 --steps 8 --warmup 2"
      printf 'model: llama-1b\nmodel_overrides:\n  sliding_window: 1024\n' >"$OUT/window.yaml"
      ROW_TAG="causal-8k-gbs$G ${WINDOW_ARGS:-}" one 0 $SA ${WINDOW_ARGS:-}
      ROW_TAG="window-8k-gbs$G ${WINDOW_ARGS:-}" one 0 --config "$OUT/window.yaml" $SA ${WINDOW_ARGS:-} ;;
    longctx)  # issue 18: the longest sequences one GPU trains at, full recompute, micro-batch 1 (LONG_1B, LONG_7B)
      for s in ${LONG_1B:-32768 65536 131072}; do
        ROW_TAG=llama-1b-$s one 0 --model llama-1b --seq-length $s --global-batch-size 1 --micro-batch-size 1 \
          --recompute full --steps 3 --warmup 1
      done
      for s in ${LONG_7B:-16384 32768}; do
        ROW_TAG=llama2-7b-$s one 0 --model llama2-7b --seq-length $s --global-batch-size 1 --micro-batch-size 1 \
          --recompute full --steps 2 --warmup 1
      done ;;
    tests)
      timeout 420 python3 -m pytest -q -m gpu tests -p no:cacheprovider --durations 15 >>"$OUT/pytest_gpu.txt" 2>&1
      echo "== pytest -m gpu rc $?" >>"$OUT/log.txt" ;;
    *) echo "gpu_suite.sh: unknown group '$group' (see the header for the groups)" >&2; exit 2 ;;
  esac
done
cat "$OUT"/bench.jsonl "$OUT"/overlap.jsonl "$OUT"/plan.jsonl "$OUT"/generate.jsonl 2>/dev/null; tail -5 "$OUT/pytest_gpu.txt" 2>/dev/null; grep "==" "$OUT/log.txt"
