#!/usr/bin/env bash
# The GPU checks and benchmarks recorded in the issue notes, on an H200 machine (one or two GPUs).
# In a device run: source bench/gpu_prelude.sh && bash bench/h200.sh tests && bash bench/h200.sh tiny ...
#   bash bench/h200.sh check|bench   (two calls of under 10 minutes: everything below, results under $OUT)
#   bash bench/h200.sh tests|tiny|small|more|step   (more: no-spec baseline, decode on cuda:1; step:
#   bench/decode_step.py on the small preset)
set -u
OUT=${OUT:-/tmp/dspark-out}
mkdir -p "$OUT"
export MC_LOG_LEVEL=ERROR NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
PY=${PY:-python3}
NGPU=$(nvidia-smi -L | wc -l)

wait_for() {  # file text seconds pid: returns early (failing) when the process exits
  for _ in $(seq 1 "$3"); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    kill -0 "$4" 2>/dev/null || { echo "process exited before '$2' in $1"; tail -30 "$1"; return 1; }
    sleep 1
  done
  echo "timeout waiting for '$2' in $1"; tail -30 "$1"; return 1
}

pair() {  # label model prefill-args decode-args
  local label=$1 model=$2 pargs=$3 dargs=$4
  local gp=$((50000 + RANDOM % 1000)) hp=$((8000 + RANDOM % 1000))
  $PY -m cli.main serve-prefill --model "$model" --port $gp --master-port $((29000 + RANDOM % 500)) $pargs \
    > "$OUT/$label.prefill.log" 2>&1 &
  local ppid=$!
  wait_for "$OUT/$label.prefill.log" "prefill service ready" 300 $ppid || { kill $ppid; return 1; }
  $PY -m cli.main serve-decode --model "$model" --prefill 127.0.0.1:$gp --port $hp $dargs > "$OUT/$label.decode.log" 2>&1 &
  local dpid=$!
  if wait_for "$OUT/$label.decode.log" "decode service ready" 300 $dpid; then
    for _ in $(seq 1 60); do curl -sf http://127.0.0.1:$hp/ready >/dev/null && break; sleep 1; done
    URL=http://127.0.0.1:$hp GRPC=127.0.0.1:$gp
    shift 4
    "$@"
  fi
  kill $dpid $ppid 2>/dev/null; wait $dpid $ppid 2>/dev/null
}

case "${1:-tests}" in
check|bench)  # two device calls of under 10 minutes each, phases under time limits, logs tarred (a device run
  # returns only a few files): check = GPU tests + tiny equality; bench = small tables + decode step + no-spec
  self=$(readlink -f "$0")
  if [ "$1" = check ]; then
    timeout 150 bash "$self" tests; timeout 300 bash "$self" tiny
  else
    timeout 330 bash "$self" small; timeout 120 bash "$self" step; PAIRS=s1n timeout 100 bash "$self" more
  fi > /dev/null
  (cd "$OUT" && tar czf logs.tgz --remove-files ./*.log 2>/dev/null)
  cd "$OUT" && for f in gpu_tests.txt tiny_equality.txt serve.txt transfer.txt step.txt; do
    [ -f "$f" ] && { echo "== $f"; grep -v "^[WIE][0-9]\|^WARNING" "$f" | tail -60; }
  done
  ;;
tests)
  nvidia-smi > "$OUT/nvidia-smi.txt"
  $PY -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
  tail -3 "$OUT/gpu_tests.txt"
  ;;
tiny)  # PD == aggregated on the GPU(s): fp32 without simulations, so equality is exact up to argmax ties
  eq() { $PY bench/pd_equality.py --url "$URL" --model model/data/tiny --device cuda:0 --dtype float32 --no-qat-sim \
         --prompts 6 --max-tokens 32 >> "$OUT/tiny_equality.txt" 2>&1; }
  common="--dtype float32 --no-qat-sim"
  echo "== prefill PP=1 cuda:0, decode cuda:0 (tcp)" >> "$OUT/tiny_equality.txt"
  pair t1 model/data/tiny "--pp 1 $common" "--device cuda:0 $common" eq
  if [ "$NGPU" -ge 2 ]; then
    echo "== prefill PP=2 (cuda:0, cuda:1, NCCL), decode cuda:0" >> "$OUT/tiny_equality.txt"
    pair t2 model/data/tiny "--pp 2 $common" "--device cuda:0 $common" eq
    echo "== prefill PP=1 cuda:0, decode cuda:1" >> "$OUT/tiny_equality.txt"
    pair t3 model/data/tiny "--pp 1 $common" "--device cuda:1 $common" eq
  fi
  cat "$OUT/tiny_equality.txt"
  ;;
step)  # the decode step against the roofline: graphs vs host time (needs checkpoints/small, made by `small`)
  [ -f checkpoints/small/config.json ] || $PY -m cli.main make-checkpoint --preset small --dtype bf16 checkpoints/small \
    > "$OUT/make_small.txt" 2>&1
  for spec in --spec --no-spec; do
    $PY bench/decode_step.py --model checkpoints/small --device cuda:0 --batch 1,8,32 $spec >> "$OUT/step.txt" 2>&1
  done
  cat "$OUT/step.txt"
  ;;
small|more)
  [ -f checkpoints/small/config.json ] || $PY -m cli.main make-checkpoint --preset small --dtype bf16 checkpoints/small \
    > "$OUT/make_small.txt" 2>&1
  serve() { $PY bench/serve.py --url "$URL" --concurrency "${CONC:-1,8,32}" --requests 16 --prompt 256 \
            --max-tokens 64 --label "$LABEL" >> "$OUT/serve.txt" 2>&1; }
  both() { serve; $PY bench/transfer.py --prefill "$GRPC" --model checkpoints/small --device cuda:0 \
           --lengths 128,512,2048,8000 --repeats 2 --label "$LABEL" >> "$OUT/transfer.txt" 2>&1; }
  D="--max-model-len 4096"
  # s1: PP=1 spec; s3: PP=2 across both GPUs; s1n: the no-spec baseline; s2: decode on the second GPU
  [ "$1" = small ] && PAIRS=${PAIRS:-s1,s3} || PAIRS=${PAIRS:-s1n,s2}
  has() { [[ ",$PAIRS," == *",$1,"* ]]; }
  has s1 && LABEL="[PP=1, one GPU, spec]" pair s1 checkpoints/small "--pp 1" "--device cuda:0 $D" both
  has s3 && [ "$NGPU" -ge 2 ] && LABEL="[PP=2 cuda:0+1, decode cuda:0, spec]" pair s3 checkpoints/small "--pp 2" \
    "--device cuda:0 $D" both
  has s1n && LABEL="[PP=1, one GPU, no-spec]" pair s1n checkpoints/small "--pp 1" "--device cuda:0 --no-spec $D" serve
  has s2 && [ "$NGPU" -ge 2 ] && LABEL="[PP=1 cuda:0, decode cuda:1, spec]" pair s2 checkpoints/small "--pp 1" \
    "--device cuda:1 $D" serve
  cat "$OUT/serve.txt" "$OUT/transfer.txt" 2>/dev/null
  ;;
esac
