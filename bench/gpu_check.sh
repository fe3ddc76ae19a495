#!/usr/bin/env bash
# One pass on a GPU machine: versions, the backend's op checks, test_gpt2 in fp32 and bf16, and the d12
# throughput benchmark beside torch.compile's. Logs go to $OUT (or ./gpu_logs).
# Usage: bash bench/gpu_check.sh [stage ...], each one of STAGES below (default: env ops test table).
# ab compares this tree with the one in $BASELINE (say, `git archive COMMIT | tar -x -C DIR`), steps in a
# row, alternating, with each one's per-op table: d12 B=64, 20 steps, unless AB_ARGS says otherwise
# (AB_ARGS="--model d48 -b 16 --steps 6").
set -u
STAGES="env attn ops test opsbench gemms table kernels ab bench small torch d48 d48max zero train mpi ckpt hf"
stages=${*:-env ops test table}
# every stage named, and what the stages need, checked before the first runs: a mistake in the last of a
# long list stops the pass before it starts, not after an hour of GPU time
for stage in $stages; do
  case " $STAGES " in
  *" $stage "*) ;;
  *) echo "error: unknown stage '$stage': choose from $STAGES" >&2; exit 1 ;;
  esac
done
case " $stages " in
*" ab "*) [ -d "${BASELINE:-}/llm" ] || {
  echo "error: stage ab needs BASELINE=DIR, a tree of the project (git archive COMMIT | tar -x -C DIR)" >&2
  exit 1; } ;;
esac
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT" 2>/dev/null && [ -w "$OUT" ] ||
  { echo "error: OUT=$OUT: cannot write there: choose another folder" >&2; exit 1; }
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache} \
  PATH=$PATH:/usr/local/cuda/bin
MPIRUN="mpirun --allow-run-as-root --oversubscribe"
TS="-i data/tinyshakespeare/tiny_shakespeare_train.bin -j data/tinyshakespeare/tiny_shakespeare_val.bin"
for stage in $stages; do
  echo "=== $stage"
  case $stage in
  env)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import cupy, numpy, ml_dtypes, mpi4py, threadpoolctl; from cupy.cuda import nccl
print('cupy', cupy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion(),
      'nccl', nccl.get_version(), 'numpy', numpy.__version__, 'ml_dtypes', ml_dtypes.__version__,
      'mpi4py', mpi4py.__version__)" ;;
  attn)    # every attention kernel against the float64 naive one at odd sizes
    timeout 240 python3 -m pytest -q -rs tests/test_cupy_backend.py -k fused_attention 2>&1 |
      tee "$OUT/attn.log" | tail -4 ;;
  ops)
    timeout 300 python3 -m pytest -q -rs tests/test_cupy_backend.py 2>&1 | tee "$OUT/ops.log" | tail -25 ;;
  opsbench)   # each op alone at d12, B=64: ms, GB/s, TFLOP/s, and the sum over one step
    timeout 200 python3 -m bench.gpu_ops --B 64 2>&1 | tee "$OUT/opsbench.log" | tail -40 ;;
  test)
    timeout 150 python3 test_gpt2.py --backend cupy --precision fp32 2>&1 | tee "$OUT/test_fp32.log" |
      grep -iE "logits|overall"
    timeout 150 python3 test_gpt2.py --backend cupy --precision bf16 2>&1 | tee "$OUT/test_bf16.log" |
      grep -iE "logits|overall"
    timeout 150 python3 test_gpt2.py --backend cupy --attention cudnn 2>&1 | tee "$OUT/test_cudnn.log" |
      grep -iE "logits|overall" ;;
  bench)   # flash attention (the default), without CUDA graphs, cuDNN's, and cuDNN's with -r 2
    for opts in "" "--cuda-graph 0" "--attention cudnn" "--attention cudnn -r 2"; do
      timeout 200 python3 -m bench.step --backend cupy --model d12 -b 64 -t 1024 --steps 8 $opts 2>&1 |
        tee -a "$OUT/bench.log" | grep -vE "^(step|warm-up)"
    done ;;
  small)   # a small batch, where launching ~300 kernels a step from Python costs most: graphs on and off
    for opts in "" "--cuda-graph 0"; do
      timeout 200 python3 -m bench.step --backend cupy --model d12 -b 4 -t 1024 --steps 20 $opts 2>&1 |
        tee -a "$OUT/small.log" | grep -E "^d12|in a row|memory"
    done ;;
  d48)     # GPT-2 1.5B, B=16: ours beside torch.compile's
    timeout 300 python3 -m bench.step --backend cupy --model d48 -b 16 -t 1024 --steps 6 > "$OUT/d48.log" 2>&1
    timeout 400 python3 -m bench.torch_gpt2 --model d48 -b 16 -t 1024 --steps 6 > "$OUT/d48_torch.log" 2>&1
    python3 -m bench.table "this project, d48 B=16=$OUT/d48.log" \
      "torch.compile, d48 B=16=$OUT/d48_torch.log" \
      --yardstick "torch.compile, d48 B=16" --limit 80460 ;;  # 790 TFLOP/s over d48's 9.82 GFLOP a token
  d48max)  # the largest d48 batch that fits: ours (-r 1) from the top down, since our memory estimate
           # refuses a batch that does not fit at once; torch.compile's from B=16 up, since it finds out
           # only after compiling: each up to the first batch that does not fit
    for B in 64 60 56 48 40 32 28 24 20 16; do
      timeout 300 python3 -m bench.step --backend cupy --model d48 -b $B -t 1024 --steps 2 \
        > "$OUT/d48max_b$B.log" 2>&1
      grep -E "^error|in a row|^memory" "$OUT/d48max_b$B.log" | sed "s/^/ours B=$B: /"
      grep -q "in a row" "$OUT/d48max_b$B.log" && break
    done
    for B in 24 32 40 48; do
      timeout 400 python3 -m bench.torch_gpt2 --model d48 -b $B -t 1024 --steps 2 \
        > "$OUT/d48max_torch_b$B.log" 2>&1
      tail -1 "$OUT/d48max_torch_b$B.log" | sed "s/^/torch.compile B=$B: /"
      grep -q "in a row" "$OUT/d48max_torch_b$B.log" || break
    done ;;
  gemms)   # each GEMM of the d12 B=64 step with every cuBLASLt candidate, and what the epilogues cost
    timeout 300 python3 -m bench.gemms 2>&1 | tee "$OUT/gemms.log" | tail -25 ;;
  table)   # the headline, one call: ours (flash, cuDNN) beside torch.compile as nanoGPT writes it, d12 B=64,
           # 20 steps in a row each, as torch.compile's: the clock falls to the power cap's in the first few
    for opts in "" "--attention cudnn"; do
      timeout 200 python3 -m bench.step --backend cupy --model d12 -b 64 -t 1024 --steps 20 $opts \
        > "$OUT/table${opts//[ -]/}.log" 2>&1
    done
    timeout 400 python3 -m bench.torch_gpt2 --model d12 -b 64 -t 1024 --steps 20 > "$OUT/table_torch.log" 2>&1
    python3 -m bench.table "this project, defaults=$OUT/table.log" \
      "this project, --attention cudnn=$OUT/tableattentioncudnn.log" \
      "torch.compile (nanoGPT's model)=$OUT/table_torch.log" --yardstick "torch.compile (nanoGPT's model)" \
      --limit 983000   # 790 TFLOP/s over d12's 0.80 GFLOP a token at T=1024
    grep -A 18 "^per-op" "$OUT/table.log" ;;
  kernels) # one d12 B=64 step kernel by kernel (CUPTI): GEMMs, attention, the rest, the GPU's idle time,
           # where it waits, and (ours) the host's calls around the longest wait
    timeout 300 python3 -m bench.kernels --top 12 2>&1 | tee "$OUT/kernels.log" | grep -v -i warn
    timeout 400 python3 -m bench.kernels --torch --top 12 2>&1 | tee "$OUT/kernels_torch.log" |
      grep -v -i warn ;;
  ab)      # a lever before and after: this tree against $BASELINE's, alternating twice, in one call
    for round in 1 2; do
      for side in after before; do
        dir=.; [ $side = before ] && dir=$BASELINE
        (cd "$dir" && timeout 300 python3 -m bench.step --backend cupy ${AB_ARGS:---steps 20} 2>&1) \
          > "$OUT/ab_${side}_$round.log"
        echo "$side, round $round: $(grep -E 'in a row' "$OUT/ab_${side}_$round.log")"
        grep -E 'SM clock' "$OUT/ab_${side}_$round.log" | sed 's/^/  /'   # the clock moves at the power cap
      done
    done
    python3 - "$OUT/ab_before_1.log" "$OUT/ab_after_1.log" <<'OPS'   # the per-op tables, op by op
import re, sys
def table(path):   # bench/step.py's per-op table, the last thing it prints: op -> ms
    text = open(path).read().split("\nop ", 1)[-1]
    return {op: float(ms) for op, ms in re.findall(r"^(\w+) +\d+ +([\d.]+) ", text, re.M)}
before, after = table(sys.argv[1]), table(sys.argv[2])
print(f"{'op, one step without graphs (round 1)':<40}{'before ms':>10}{'after ms':>10}")
for op in sorted(before.keys() | after.keys(), key=lambda op: -before.get(op, 0.0)):
    print(f"{op:<40}{before.get(op, float('nan')):10.2f}{after.get(op, float('nan')):10.2f}")
OPS
    ;;
  zero)    # ZeRO-1's memory per rank as llm.c's PR measured it: d48, B=4, four ranks on this one GPU
    for z in 0 1; do
      nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 200 \
        > "$OUT/zero$z.mem" &
      sampler=$!
      timeout 300 $MPIRUN -np 4 python3 train_gpt2.py -e d48 -b 4 -t 1024 -x 1 -v 100 -m 1 -s 0 -z $z $TS \
        > "$OUT/zero$z.log" 2>&1
      kill $sampler
      echo "-np 4 -z $z: $(grep -cE '^step' "$OUT/zero$z.log") step(s); the largest process held" \
        "$(sort -t, -k2 -n "$OUT/zero$z.mem" | tail -1 | cut -d, -f2 | tr -d ' ') MiB"
    done ;;
  torch)   # the yardstick, same model and batch, same GPU
    timeout 400 python3 -m bench.torch_gpt2 --model d12 -b 64 -t 1024 --steps 20 2>&1 |
      tee "$OUT/torch.log" | tail -3 ;;
  train)   # 30 steps of d12 on tiny Shakespeare: GPU fp32 (TF32 off) and bf16 (flash, cuDNN) curves
    common="-e d12 -b 8 -t 256 -l 3e-4 -x 30 -v 10 -m 4 -s 0 $TS"
    timeout 200 python3 train_gpt2.py $common --backend cupy --precision fp32 -f 0 \
      > "$OUT/train_fp32.log" 2>&1
    timeout 200 python3 train_gpt2.py $common --backend cupy > "$OUT/train_bf16.log" 2>&1
    timeout 200 python3 train_gpt2.py $common --backend cupy --cuda-graph 0 > "$OUT/train_bf16_eager.log" 2>&1
    losses() { grep -E '^(step|val)' "$1" | cut -d'|' -f1-3; }   # step, loss, norm: no timings
    echo "bf16 with CUDA graphs against without, losses and norms: $(diff <(losses "$OUT/train_bf16.log") \
      <(losses "$OUT/train_bf16_eager.log") > /dev/null && echo identical || echo DIFFERENT)"
    timeout 200 python3 train_gpt2.py $common --backend cupy --attention cudnn > "$OUT/train_cudnn.log" 2>&1
    for f in fp32 bf16 cudnn; do echo "$f: $(grep -E '^step' "$OUT/train_$f.log" | tail -1)"; done
    python3 - "$OUT" <<'CURVES'   # how far each bf16 curve strays from the fp32 one
import re, sys
def curve(name):
    log = open(f"{sys.argv[1]}/train_{name}.log").read()
    return [float(x) for x in re.findall(r"^step +\d+/\d+ \| loss ([\d.]+)", log, re.M)]
fp32 = curve("fp32")
for name in ("bf16", "cudnn"):
    d = [abs(a - b) for a, b in zip(curve(name), fp32)]
    print(f"{name} against fp32 over {len(d)} steps: loss differs by {max(d):.3f} at most, "
          f"{sum(d) / len(d):.3f} on average")
CURVES
    ;;
  mpi)     # two ranks on one GPU (MPI fallback) against one rank; one rank through NCCL
    common="-e d6 -b 4 -t 256 -d 2048 -l 3e-4 -x 10 -v 100 -m 2 -s 0 -z 1 $TS"
    common="$common --backend cupy --precision fp32 -f 0"
    timeout 200 python3 train_gpt2.py $common 2>&1 | tee "$OUT/np1.log" | grep -E "^step" | tail -3
    timeout 200 $MPIRUN -np 2 python3 train_gpt2.py $common 2>&1 | tee "$OUT/np2.log" |
      grep -E "falling back|^step|Zero|allocated" | tail -12
    timeout 200 python3 train_gpt2.py $common --comm nccl 2>&1 | tee "$OUT/nccl1.log" |
      grep -E "communicator|^step" | tail -4 ;;
  ckpt)    # a bf16 checkpoint written on the GPU gives the same val loss on the CPU, and the reverse
    rm -rf /tmp/ck_gpu /tmp/ck_cpu
    timeout 200 python3 train_gpt2.py -e d6 -b 8 -t 256 -x 5 -n 5 -o /tmp/ck_gpu -v 5 -m 4 -s 0 $TS \
      --backend cupy 2>&1 | grep "val loss" | tail -1
    timeout 200 python3 train_gpt2.py -e /tmp/ck_gpu/model_00000005.bin -b 8 -t 256 -x 1 -v 1 -m 4 -s 0 $TS \
      --backend numpy -l 0 2>&1 | grep "val loss" | head -1
    timeout 200 python3 train_gpt2.py -e d6 -b 8 -t 256 -x 5 -n 5 -o /tmp/ck_cpu -v 5 -m 4 -s 0 $TS \
      --backend numpy 2>&1 | grep "val loss" | tail -1
    timeout 200 python3 train_gpt2.py -e /tmp/ck_cpu/model_00000005.bin -b 8 -t 256 -x 1 -v 1 -m 4 -s 0 $TS \
      --backend cupy -l 0 2>&1 | grep "val loss" | head -1 ;;
  hf)      # llm.export's folder in transformers (needs torch and it; $GPT2_VOCAB offline): logits beside
           # ours, tokens beside tiktoken's; HF_MODEL=model.bin (or a run's -o dir) checks that one as well
    timeout 300 python3 -m bench.hf_check ${HF_MODEL:+-e "$HF_MODEL"} 2>&1 | tee "$OUT/hf.log" |
      grep -vE "^writing |\(version [35], (fp32|bf16)\): L=" ;;
  esac
done
