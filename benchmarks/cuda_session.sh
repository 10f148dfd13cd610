#!/usr/bin/env bash
# One GPU session's checks, in order of value, each under its own time limit so a failure or overrun leaves the rest:
# the CUDA tests (tests/cuda), then the paper-width benchmark (benchmarks/run.py --preset paper) on the issue's
# target workload (GPT-2-small width, T 512: time, allocator peak, largest batch) and three more workloads (time and
# memory). Results under OUTDIR (stages.txt, log.txt, run_cuda_paper.json/csv, max_batch/run_cuda_paper.json/csv);
# docs/results/cuda.md records what a run gave.
#
#     bash benchmarks/cuda_session.sh OUTDIR [SECONDS_FOR_THE_WHOLE_SCRIPT]
set -u
OUTDIR=${1:?usage: cuda_session.sh OUTDIR [SECONDS]}
BUDGET=${2:-540}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
start=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
stage() {  # stage NAME SECONDS command...: run with min(SECONDS, time left - 5 s)
  local name=$1 limit=$2; shift 2
  local l; l=$(left); l=$(( l - 5 )); (( limit > l )) && limit=$l
  if (( limit < 20 )); then echo "== $name skipped: $(left) s left" | tee -a "$OUTDIR/stages.txt"; return; fi
  echo "== $name (limit $limit s) $(date -u +%T)" | tee -a "$OUTDIR/stages.txt"
  echo "======== $name: $*" >> "$OUTDIR/log.txt"
  timeout "$limit" "$@" >> "$OUTDIR/log.txt" 2>&1
  echo "== $name exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUTDIR/stages.txt"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} > "$OUTDIR/stages.txt" 2>&1
stage tests 170 python3 -m pytest -q -p no:cacheprovider -rfE --timeout 120 tests/cuda
P=(python3 benchmarks/run.py --preset paper --models gpt2 --sizes 512 --batch 16)
stage gpt2-T512 100 "${P[@]}" --results-dir "$OUTDIR" --no-max-batch --methods non-private "fastdp BK-MixOpt" \
  "non-private BiTFiT" DP-BiTFiT
stage gpt2-T512-max-batch 180 "${P[@]}" --results-dir "$OUTDIR/max_batch" --max-batch --max-batch-cap 1024 --reps 3 \
  --methods non-private "fastdp BK-MixOpt"
M=(--methods non-private "fastdp BK-MixOpt" "non-private BiTFiT" DP-BiTFiT --no-max-batch --update)
stage roberta-T256 80 python3 benchmarks/run.py --preset paper --results-dir "$OUTDIR" "${M[@]}" --models roberta --sizes 256 --batch 32
stage vit-img224 80 python3 benchmarks/run.py --preset paper --results-dir "$OUTDIR" "${M[@]}" --models vit --sizes 224 --batch 32
stage gpt2-T1024 80 python3 benchmarks/run.py --preset paper --results-dir "$OUTDIR" "${M[@]}" --models gpt2 --sizes 1024 --batch 8
cat "$OUTDIR/stages.txt"
ls -R "$OUTDIR"
