#!/usr/bin/env bash
# One pass on a GPU machine: versions, the backend's op checks, test_gpt2 in fp32 and bf16, and the d12
# throughput benchmark beside torch.compile's. Logs go to $OUT (or ./gpu_logs).
# Usage: bash bench/gpu_check.sh [stage ...]
# stages: env attn ops test opsbench bench small torch d48 train mpi ckpt hf (default: env ops test bench torch)
set -u
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache} PATH=$PATH:/usr/local/cuda/bin
MPIRUN="mpirun --allow-run-as-root --oversubscribe"
TS="-i data/tinyshakespeare/tiny_shakespeare_train.bin -j data/tinyshakespeare/tiny_shakespeare_val.bin"
stages=${*:-env ops test bench torch}
for stage in $stages; do
  echo "=== $stage"
  case $stage in
  env)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import cupy, numpy, ml_dtypes, mpi4py, threadpoolctl; from cupy.cuda import nccl
print('cupy', cupy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion(), 'nccl', nccl.get_version(),
      'numpy', numpy.__version__, 'ml_dtypes', ml_dtypes.__version__, 'mpi4py', mpi4py.__version__)" ;;
  attn)    # every attention kernel against the float64 naive one at odd sizes; then what the Hopper one compiled to
    timeout 240 python3 -m pytest -q -rs tests/test_cupy_backend.py -k fused_attention 2>&1 | tee "$OUT/attn.log" | tail -15
    for cubin in "$CUPY_CACHE_DIR"/*.sm_90a.cubin; do
      [ -e "$cubin" ] && echo "$(basename "$cubin"): $(cuobjdump -sass "$cubin" | grep -cE 'HGMMA') HGMMA," \
        "$(cuobjdump -sass "$cubin" | grep -cE 'UTMALDG') UTMALDG, $(cuobjdump -sass "$cubin" | grep -cE 'HMMA') HMMA"
    done ;;
  ops)
    timeout 300 python3 -m pytest -q -rs tests/test_cupy_backend.py 2>&1 | tee "$OUT/ops.log" | tail -25 ;;
  opsbench)   # each op alone at d12, B=64: ms, GB/s, TFLOP/s, and the sum over one step
    timeout 200 python3 -m bench.gpu_ops --B 64 2>&1 | tee "$OUT/opsbench.log" | tail -40 ;;
  test)
    timeout 150 python3 test_gpt2.py --backend cupy --precision fp32 2>&1 | tee "$OUT/test_fp32.log" | tail -32
    timeout 150 python3 test_gpt2.py --backend cupy --precision bf16 2>&1 | tee "$OUT/test_bf16.log" | tail -32
    timeout 150 python3 test_gpt2.py --backend cupy --attention cudnn 2>&1 | tee "$OUT/test_cudnn.log" | tail -32 ;;
  bench)   # flash attention (the default), without CUDA graphs, cuDNN's, and cuDNN's with -r 2
    for opts in "" "--cuda-graph 0" "--attention cudnn" "--attention cudnn -r 2"; do
      timeout 200 python3 -m bench.step --backend cupy --model d12 -b 64 -t 1024 --steps 8 $opts 2>&1 |
        tee -a "$OUT/bench.log" | grep -vE "^(step|warm-up)"
    done ;;
  small)   # a small batch, where launching ~300 kernels a step from Python costs most: graphs on and off
    for opts in "" "--cuda-graph 0"; do
      timeout 200 python3 -m bench.step --backend cupy --model d12 -b 4 -t 1024 --steps 20 $opts 2>&1 |
        tee -a "$OUT/small.log" | grep -E "^d12|median|memory"
    done ;;
  d48)     # GPT-2 1.5B: B=16 beside llm.c's figures, and B=56, the largest batch known to fit
    for b in 16 56; do
      timeout 200 python3 -m bench.step --backend cupy --model d48 -b $b -t 1024 --steps 3 2>&1 |
        tee -a "$OUT/d48.log" | grep -E "^d48|median|memory|Error" | head -4
    done ;;
  torch)   # the yardstick, same model and batch, same GPU
    timeout 400 python3 -m bench.torch_gpt2 --model d12 -b 64 -t 1024 --steps 20 2>&1 | tee "$OUT/torch.log" | tail -3 ;;
  train)   # 30 steps of d12 on tiny Shakespeare: GPU fp32 (TF32 off), bf16 (flash, cuDNN) and NumPy curves
    common="-e d12 -b 8 -t 256 -l 3e-4 -x 30 -v 10 -m 4 -s 0 $TS"
    timeout 200 python3 train_gpt2.py $common --backend cupy --precision fp32 -f 0 > "$OUT/train_fp32.log" 2>&1
    timeout 200 python3 train_gpt2.py $common --backend cupy > "$OUT/train_bf16.log" 2>&1
    timeout 200 python3 train_gpt2.py $common --backend cupy --cuda-graph 0 > "$OUT/train_bf16_eager.log" 2>&1
    losses() { grep -E '^(step|val)' "$1" | cut -d'|' -f1-3; }   # step, loss, norm: no timings
    echo "bf16 with CUDA graphs against without, losses and norms: $(diff <(losses "$OUT/train_bf16.log") \
      <(losses "$OUT/train_bf16_eager.log") > /dev/null && echo identical || echo DIFFERENT)"
    timeout 200 python3 train_gpt2.py $common --backend cupy --attention cudnn > "$OUT/train_cudnn.log" 2>&1
    timeout 240 python3 train_gpt2.py $common --backend numpy > "$OUT/train_numpy.log" 2>&1
    for f in numpy fp32 bf16 cudnn; do echo "$f: $(grep -E '^step' "$OUT/train_$f.log" | tail -1)"; done ;;
  mpi)     # two ranks on one GPU (MPI fallback) against one rank; one rank through NCCL
    common="-e d6 -b 4 -t 256 -d 2048 -l 3e-4 -x 10 -v 100 -m 2 -s 0 -z 1 $TS --backend cupy --precision fp32 -f 0"
    timeout 200 python3 train_gpt2.py $common 2>&1 | tee "$OUT/np1.log" | grep -E "^step" | tail -3
    timeout 200 $MPIRUN -np 2 python3 train_gpt2.py $common 2>&1 | tee "$OUT/np2.log" | grep -E "falling back|^step|Zero|allocated" | tail -12
    timeout 200 python3 train_gpt2.py $common --comm nccl 2>&1 | tee "$OUT/nccl1.log" | grep -E "communicator|^step" | tail -4 ;;
  ckpt)    # a bf16 checkpoint written on the GPU gives the same val loss on the CPU, and the reverse
    rm -rf /tmp/ck_gpu /tmp/ck_cpu
    timeout 200 python3 train_gpt2.py -e d6 -b 8 -t 256 -x 5 -n 5 -o /tmp/ck_gpu -v 5 -m 4 -s 0 $TS --backend cupy 2>&1 | grep "val loss" | tail -1
    timeout 200 python3 train_gpt2.py -e /tmp/ck_gpu/model_00000005.bin -b 8 -t 256 -x 1 -v 1 -m 4 -s 0 $TS --backend numpy -l 0 2>&1 | grep "val loss" | head -1
    timeout 200 python3 train_gpt2.py -e d6 -b 8 -t 256 -x 5 -n 5 -o /tmp/ck_cpu -v 5 -m 4 -s 0 $TS --backend numpy 2>&1 | grep "val loss" | tail -1
    timeout 200 python3 train_gpt2.py -e /tmp/ck_cpu/model_00000005.bin -b 8 -t 256 -x 1 -v 1 -m 4 -s 0 $TS --backend cupy -l 0 2>&1 | grep "val loss" | head -1 ;;
  hf)      # llm.export's folder in transformers (needs torch and it; $GPT2_VOCAB offline): logits beside
           # ours, tokens beside tiktoken's; HF_MODEL=model.bin (or a run's -o dir) checks that one as well
    timeout 300 python3 -m bench.hf_check ${HF_MODEL:+-e "$HF_MODEL"} 2>&1 | tee "$OUT/hf.log" |
      grep -vE "^writing |\(version [35], (fp32|bf16)\): L=" ;;
  esac
done
