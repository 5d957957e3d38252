#!/usr/bin/env bash
# Issue 20: llamatron's mixture of experts against megatron-core 0.19.2's on the same shape (mixtral-1b: hidden
# 2048, 16 layers, 8 experts of FFN 5632, top-2, seq 4096, 8 sequences per step), on one GPU, in one call.
# usage, from the checkout's root with .peers and .peers-whl carried (../shared/peers/README.md):
#   bash benchmarks/moe_compare.sh
# Writes $OUT/megatron_moe.jsonl (benchmarks/megatron_moe_bench.py rows), $OUT/llamatron_moe.jsonl
# (`llamatron bench --json` rows), $OUT/moe_log.txt (all output) and prints the tokens/s ratios.
# Settings (environment): MBS micro-batch sizes ("1 2 4"), GBS (8), STEPS (5), WARMUP (3),
# MEGATRON_IMPLS expert paths in order ("sequential grouped-mm"; sequential is megatron-core's own, grouped-mm
# this repo's torch grouped_mm stand-in for TE's GroupedLinear, see the script), LLAMATRON_ARGS extra bench flags
# ("--distributed-optimizer", as megatron's side), PEERS_WHL (.peers-whl), BUDGET seconds for the whole script (360): a run that
# would start with under 40 s left is skipped and recorded as such; each run is also killed at its own timeout.
# SHAPE=fine-grained: issue 34's fine-grained shape (64 experts of ffn 704, top 8) on both sides instead.
# SMOKE=1: the same plumbing on CPU with tiny shapes (megatron's `tiny`, llamatron's mixtral-test); numbers mean nothing.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG="$OUT/moe_log.txt"
MEG_RESULTS="$OUT/megatron_moe.jsonl"
LT_RESULTS="$OUT/llamatron_moe.jsonl"
MBS=${MBS:-1 2 4}; GBS=${GBS:-8}; STEPS=${STEPS:-5}; WARMUP=${WARMUP:-3}
MEGATRON_IMPLS=${MEGATRON_IMPLS:-sequential grouped-mm}
LLAMATRON_ARGS=${LLAMATRON_ARGS:---distributed-optimizer}
BUDGET=${BUDGET:-360}
START=$(date +%s)
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
MEG_SHAPE="--model mixtral-1b --seq 4096"; LT_SHAPE="--model mixtral-1b --seq-length 4096"
if [ "${SHAPE:-mixtral-1b}" = fine-grained ]; then
  MEG_SHAPE="--model fine-grained --seq 4096"
  LT_SHAPE="$LT_SHAPE --num-experts 64 --moe-router-topk 8 --ffn-hidden-size 704"
fi
if [ -n "${SMOKE:-}" ]; then
  export BENCH_CPU_SMOKE=1
  MEG_SHAPE="--model tiny --seq 64"; LT_SHAPE="--model mixtral-test --seq-length 64 --device cpu"
elif [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -lt 1 ]; then
  echo "moe_compare.sh: no NVIDIA GPU found" >&2; exit 2
fi

# megatron-core and the peers' other wheels, as .peers/run_suite.sh installs them, into SITE: on PYTHONPATH for
# megatron's runs only (SKIP_WHL=1: SITE already holds them)
WHL=${PEERS_WHL:-.peers-whl}; SITE=${PEERS_SITE:-/tmp/site}
if [ -z "${SKIP_WHL:-}" ]; then
  if ! ls "$WHL"/megatron_core-*.whl >/dev/null 2>&1; then
    echo "moe_compare.sh: no megatron_core wheel in $WHL (carry .peers-whl; see ../shared/peers/README.md)" >&2; exit 2
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHL"/*.whl >>"$LOG" 2>&1
fi
[ -z "${SMOKE:-}" ] && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv >>"$LOG" 2>&1
git rev-parse HEAD >>"$LOG" 2>&1

run() {  # run NAME TIMEOUT RESULTS CMD...: CMD under `timeout`, within what is left of BUDGET
  local name=$1 to=$2 results=$3; shift 3
  local now left rc
  now=$(date +%s); left=$((BUDGET - (now - START)))
  if [ "$left" -lt 40 ]; then
    echo "SKIP $name (budget: ${left}s left)" | tee -a "$LOG"
    echo "{\"_tag\": \"$name\", \"status\": \"skipped (time budget)\"}" >>"$results"
    return
  fi
  [ "$to" -gt "$left" ] && to=$left
  echo "=== RUN $name (timeout ${to}s, t=$((now - START))s): $*" | tee -a "$LOG"
  timeout -k 10 "$to" "$@" >"$OUT/run.tmp" 2>>"$LOG"
  rc=$?
  cat "$OUT/run.tmp" >>"$LOG"
  echo "=== END $name rc=$rc ($(($(date +%s) - now))s)" | tee -a "$LOG"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "{\"_tag\": \"$name\", \"status\": \"timeout after ${to}s\"}" >>"$results"
  elif [ "$rc" -ne 0 ]; then
    echo "{\"_tag\": \"$name\", \"status\": \"failed (rc $rc): see moe_log.txt\"}" >>"$results"
    grep -E "Error|error:|OOM" "$LOG" | tail -n 2 | cut -c1-300
  fi
  LAST_OUT="$OUT/run.tmp"
}

megatron() {  # megatron IMPL: every micro-batch size in one process (one build)
  RESULTS="$MEG_RESULTS" PYTHONPATH="$SITE" run "megatron-$1" 240 "$MEG_RESULTS" \
    torchrun --standalone --nproc_per_node=1 benchmarks/megatron_moe_bench.py $MEG_SHAPE \
    --mbs "$(echo $MBS | tr ' ' ,)" --global-batch "$GBS" --steps "$STEPS" --warmup "$WARMUP" --experts-impl "$1"
}

llamatron() {  # llamatron MBS: one bench row
  LAST_OUT=/dev/null
  run "llamatron-mb$1" 150 "$LT_RESULTS" python3 -m llamatron bench --json $LT_SHAPE \
    --micro-batch-size "$1" --global-batch-size "$GBS" --steps "$STEPS" --warmup "$WARMUP" $LLAMATRON_ARGS
  tail -n 1 "$LAST_OUT" | grep '^{' | sed "s/^{/{\"_tag\": \"llamatron-mb$1\", /" >>"$LT_RESULTS"
}

read -r first_impl other_impls <<<"$MEGATRON_IMPLS"
# megatron-core's own expert path first, then llamatron, then the other megatron paths
[ -n "$first_impl" ] && megatron "$first_impl"
for mb in $MBS; do llamatron "$mb"; done
for impl in $other_impls; do megatron "$impl"; done

echo "--- $MEG_SHAPE, global batch $GBS ($(($(date +%s) - START))s total)"
python3 - "$MEG_RESULTS" "$LT_RESULTS" <<'EOF'
import json, sys

def rows(path):
    try:
        return [json.loads(line) for line in open(path) if line.strip()]
    except OSError:
        return []

meg = [r for r in rows(sys.argv[1]) if r.get("status") == "ok"]
lt = [r for r in rows(sys.argv[2]) if "tokens_per_sec" in r]
for r in meg:
    print(f"megatron-core {r['experts_impl']:<10} mb={r['micro_batch']}: {r['tokens_per_s_per_gpu']:9.0f} tok/s "
          f"MFU {r['mfu']:.1%} step {r['step_s_median'] * 1e3:7.1f} ms peak {r['peak_alloc_gib']:.1f} GiB")
for r in lt:
    mfu = "n/a" if r.get("mfu") is None else f"{r['mfu']:.1%}"
    print(f"llamatron                mb={r['mbs']}: {r['tokens_per_sec']:9.0f} tok/s MFU {mfu} "
          f"step {r['step_ms']:7.1f} ms peak {r['peak_mem_gib']:.1f} GiB")
best_lt = max((r["tokens_per_sec"] for r in lt), default=None)
for impl in sorted({r["experts_impl"] for r in meg}):
    best_meg = max(r["tokens_per_s_per_gpu"] for r in meg if r["experts_impl"] == impl)
    if best_lt:
        print(f"best llamatron / best megatron-core ({impl}): {best_lt / best_meg:.3f}x (target >= 1.1x)")
EOF
