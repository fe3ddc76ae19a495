"""Check the trainer's GPT-2 (llm/) against ground truth, in the manner of llm.c's test_gpt2.c.

  python test_gpt2.py                               a small random model vs reference/ in float64
  python test_gpt2.py --backend cupy --precision bf16
  python test_gpt2.py -e gpt2_124M.bin -ds gpt2_124M_debug_state.bin   vs llm.c's files (PyTorch's numbers)

It compares the logits, the loss and all 16 parameter gradients of one batch, then trains 10 AdamW steps
on that batch and compares the losses. One OK / NOT OK line per check, then `overall okay: 1` (or 0);
the exit code is non-zero on failure.
"""
import os

import llm   # noqa: F401   first: a missing package is one line naming the venv (llm/__init__.py)
import numpy as np

from llm import formats, launch, memory
from llm.backends import get_backend
from llm.backends.numpy_backend import host_memory_available
from llm.comm import SingleComm
from llm.config import WEIGHTS_HINT, GPT2Config
from llm.launch import Parser, UserError
from llm.layout import PARAM_NAMES, ParamViews
from llm.model import GPT2
from llm.outliers import UpdateGuard
from llm.step import train_step
from llm.weight_init import init_params
from llm.zero import ZeroOptimizer
from reference import gpt2 as ref

# llm.c's test_gpt2.cu losses for GPT-2 124M on its debug-state batch: AdamW lr 1e-4, betas (0.9, 0.95),
# weight decay 0, clipping at 1.0
LLMC_LOSSES = [5.270009, 4.060681, 3.320085, 2.717550, 2.181066,
               1.653923, 1.168050, 0.736873, 0.401021, 0.187493]
LR, STEPS = 1e-4, 10
# reference_run's float64 copies of the parameters: p, m and v, their next values while adamw_step makes
# them, and two steps' gradients (the first, kept to compare, and the current one)
REFERENCE_COPIES = 8

# tolerances: logits, loss, per-step losses, and grads passing |got - want| <= grad_abs + grad_rel * |want|
TOLERANCES = {
    "fp32": dict(logits=1e-4, loss=1e-5, losses=1e-4, grad_abs=1e-5, grad_rel=1e-3),   # vs float64: tight
    "llmc": dict(logits=1e-2, loss=1e-2, losses=1e-2, grad_abs=2e-2, grad_rel=0.0),    # test_gpt2.c's fp32
    # test_gpt2.cu's fp32
    "gpu_fp32": dict(logits=1e-3, loss=1e-5, losses=1e-5, grad_abs=1e-6, grad_rel=0.079),
    "bf16": dict(logits=25.0, loss=0.05, losses=0.05, grad_abs=None, grad_rel=0.079),  # test_gpt2.cu's bf16
}
# llm.c's per-tensor bf16 gradient thresholds (test_gpt2.cu)
BF16_GRAD_ABS = dict(wte=5e-1, wpe=4e-3, ln1w=1e-1, ln1b=4e-2, qkvw=5e-2, qkvb=3.5e-2, attprojw=2e-2,
                     attprojb=3e-2, ln2w=5e-2, ln2b=3e-2, fcw=3e-2, fcb=3e-2, fcprojw=2e-2, fcprojb=1e-2,
                     lnfw=1e-1, lnfb=2e-2)


def reference_run(config, params, x, y, steps):
    """The float64 reference: logits, loss and grads at step 0, then the losses of `steps` AdamW steps."""
    p = ParamViews(params, config).copies(np.float64)
    m = {k: np.zeros_like(a) for k, a in p.items()}
    v = {k: np.zeros_like(a) for k, a in p.items()}
    losses = []
    for step in range(steps):
        logits, loss, cache = ref.gpt2_forward(p, config, x, y)
        grads = ref.gpt2_backward(p, config, cache)
        if step == 0:
            first = (logits, loss, grads)
        losses.append(loss)
        norm = np.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
        scale = 1.0 / norm if norm > 1.0 else 1.0
        p, m, v = ref.adamw_step(p, grads, m, v, step + 1, LR, weight_decay=0.0, grad_scale=scale)
    return first, losses


def check_memory(backend, config, B, T):
    """Refuse in one line, before anything large is allocated, a model whose run here does not fit: the
    trainer's (llm/memory.py) where the backend computes, the float64 reference on the host."""
    advice = "use a smaller model"
    trainer = memory.needed(backend, config, [(B, T)])
    reference = {"the float64 reference": REFERENCE_COPIES * 8 * config.num_parameters}
    if backend.xp is np:
        memory.check({**trainer, **reference}, backend.memory_available(), advice)
    else:
        memory.check(trainer, backend.memory_available(), advice)
        memory.check(reference, host_memory_available(), advice)


def trainer_run(config, params, x, y, steps, backend):
    """The same on llm/: the trainer's model, optimizer and training step, with a single process."""
    model = GPT2(config, backend)
    model.load_params(params)
    optimizer = ZeroOptimizer(model, SingleComm(), zero_stage=0, weight_decay=0.0)
    guard = UpdateGuard()
    logits = backend.to_numpy(model.forward(x)).astype(np.float32)   # step 0's logits, read before training
    losses = []
    for step in range(steps):
        result = train_step(model, optimizer, [(x, y)], LR, step + 1, guard)
        if step == 0:   # the gradients stay in place after the update, until the next step zeroes them
            first = (logits, result.loss, ParamViews(model.grads_numpy(), config))
        losses.append(result.loss)
        print(f"step {step + 1}: loss {result.loss:f}")
    return first, losses


def check(label, ok, detail):
    print(f"{'OK' if ok else 'NOT OK'} ({label}) {detail}")
    return ok


def compare(config, got, want, got_losses, want_losses, tolerance):
    tol = TOLERANCES[tolerance]
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = got, want
    V = config.vocab_size
    okay = True
    diff = np.max(np.abs(logits[..., :V] - ref_logits[..., :V]))
    okay &= check("LOGITS", diff < tol["logits"], f"max_diff = {diff:e}")
    diff = abs(loss - ref_loss)
    okay &= check("LOSS", diff < tol["loss"], f"{loss:f} {ref_loss:f}")
    for name in PARAM_NAMES:
        g, r = getattr(grads, name), ref_grads[name]
        if name == "wte":
            g, r = g[:V], r[:V]   # the padded rows' gradient is 0 on both sides; llm.c compares V rows
        abs_tol = BF16_GRAD_ABS[name] if tolerance == "bf16" else tol["grad_abs"]
        err = np.abs(g - r) - (abs_tol + tol["grad_rel"] * np.abs(r))
        diff = float(np.max(np.abs(g - r)))
        okay &= check(f"d{name}", bool(np.all(err <= 0)), f"max_diff = {diff:e}")
    for step, (a, b) in enumerate(zip(got_losses, want_losses)):
        okay &= check(f"step {step + 1} loss", abs(a - b) < tol["losses"], f"{a:f} {b:f}")
    return okay


def main(argv):
    parser = Parser(description="Check llm/'s GPT-2 against reference/ or llm.c's debug state.")
    parser.add_argument("-e", help="llm.c model checkpoint (.bin) to test with; needs -ds")
    parser.add_argument("-ds", help="llm.c debug state file (x, y, logits, loss, grads from PyTorch)")
    parser.add_argument("--backend", default="auto", choices=["numpy", "cupy", "auto"],
                        help="default: cupy when a GPU is usable, else numpy")
    parser.add_argument("--precision", default="auto", choices=["fp32", "bf16", "auto"],
                        help="default: bf16 on cupy, fp32 on numpy")
    parser.add_argument("--attention", default="auto", choices=["auto", "cudnn"],
                        help="default: flash attention on the GPU in bf16; cudnn: cuDNN's fused attention")
    parser.add_argument("--cuda-graph", type=int, default=1, choices=[0, 1],
                        help="replay the forward and backward as CUDA graphs (cupy in bf16), as training "
                             "does")
    parser.add_argument("--model", default="d2c64h4", help="descriptor of the random model (default d2c64h4)")
    args = parser.parse_args(argv)
    if bool(args.e) != bool(args.ds):
        raise UserError("-e and -ds go together: a model file and the debug state written with it")
    backend = get_backend(args.backend, args.precision, allow_tf32=False,   # fp32 means fp32 here
                          attention=args.attention, cuda_graph=bool(args.cuda_graph))
    if args.e:
        if not os.path.exists(args.e):
            raise formats.FormatError(f"{args.e}: no such file: {WEIGHTS_HINT}")
        if not os.path.exists(args.ds):
            raise formats.FormatError(f"{args.ds}: no such file: python -m data.gpt2 --debug-state writes it "
                                      f"(as llm.c's train_gpt2.py does)")
        config, _ = formats.read_model_config(args.e)
        state = formats.read_debug_state(args.ds, config)
        x, y = state["x"], state["y"]
        ids = np.concatenate([x.ravel(), y.ravel()])
        if ids.min() < 0 or ids.max() >= config.vocab_size:
            raise formats.FormatError(f"{args.ds}: token ids {ids.min()} to {ids.max()}, outside {args.e}'s "
                                      f"vocab 0..{config.vocab_size - 1}: the debug state of another model?")
        if x.shape[1] > config.max_seq_len:
            raise formats.FormatError(f"{args.ds}: T={x.shape[1]} exceeds {args.e}'s max_seq_len "
                                      f"{config.max_seq_len}: the debug state of another model?")
        check_memory(backend, config, *x.shape)
        params = formats.read_model(args.e)[1]
        print(f"[testing against {args.ds}: B={x.shape[0]} T={x.shape[1]}]")
    else:
        config = GPT2Config.from_descriptor(args.model)
        check_memory(backend, config, 4, 32)
        params = init_params(config)
        rng = np.random.default_rng(1234)
        x = rng.integers(0, config.vocab_size, (4, 32), dtype=np.int32)
        y = rng.integers(0, config.vocab_size, (4, 32), dtype=np.int32)
        print(f"[testing {args.model} ({config.num_parameters} parameters), B=4 T=32, "
              f"{backend.name} {backend.precision} vs reference/ in float64]")

    got, got_losses = trainer_run(config, params, x, y, STEPS, backend)
    if args.e:
        want = (state["logits"], float(state["loss"]), dict(ParamViews(state["grads"], config)))
        # GPT-2 124M's released weights on llm.c's debug batch (whose loss is llm.c's first), else any other
        is_llmc_batch = (config == GPT2Config() and x.shape == (4, 64)
                         and abs(state["loss"] - LLMC_LOSSES[0]) < 1e-3)
        want_losses = LLMC_LOSSES if is_llmc_batch else reference_run(config, params, x, y, STEPS)[1]
    else:
        want, want_losses = reference_run(config, params, x, y, STEPS)
    tolerance = "bf16" if backend.precision == "bf16" else "llmc" if args.e else \
        "gpu_fp32" if backend.name == "cupy" else "fp32"
    okay = compare(config, got, want, got_losses, want_losses, tolerance)
    print(f"overall okay: {int(okay)}")
    return 0 if okay else 1


if __name__ == "__main__":
    launch.run(main)
