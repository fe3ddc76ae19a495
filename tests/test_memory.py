"""Memory that does not exist: the count of what a run allocates (llm/memory.py) is the allocation's own, to
the byte; a step and a checkpoint stay within what it adds for them; and a run that does not fit stops in
one line before it reads or draws a parameter, as does an allocator's MemoryError."""
import re
import subprocess
import sys
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from llm import checkpoint, formats, memory
from llm.backends import numpy_backend
from llm.backends.numpy_backend import NumpyBackend, host_memory_available
from llm.comm import SingleComm
from llm.config import GPT2Config
from llm.data import DataLoader
from llm.model import GPT2
from llm.outliers import UpdateGuard
from llm.sample import ADVICE as SAMPLE_ADVICE
from llm.step import train_step
from llm.weight_init import init_params
from llm.zero import ZeroOptimizer, padded_size
import train_gpt2   # (importing it installs nothing: that happens under __main__ only)
from conftest import TRAIN, data_args, env

SMALL_VOCAB = dict(vocab_size=512, padded_vocab_size=512)


class HalfBackend(NumpyBackend):
    """The NumPy backend with 2-byte parameters, as bf16's on the GPU: the optimizer then keeps master
    weights. Only allocated here, never computed with."""
    dtype = np.float16


def tiny(L=2, C=64, NH=4, maxT=128, **vocab):
    return GPT2Config(num_layers=L, channels=C, num_heads=NH, max_seq_len=maxT, **vocab)


def traced(build):
    """(what build() returns, the bytes it allocated and kept, as tracemalloc saw them)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        out = build()
        return out, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


# ---------------------------------------------------------------------------------------------- the count

@pytest.mark.parametrize("backend_class, shapes, recompute, zero_stage, world_size", [
    (NumpyBackend, [(4, 32)], 1, 0, 1),
    (NumpyBackend, [(2, 64)], 0, 1, 3),
    (NumpyBackend, [(3, 16), (1, 32)], 2, 1, 2),
    (HalfBackend, [(4, 32)], 1, 0, 1),
    (HalfBackend, [(2, 16), (2, 64)], 2, 1, 5),
])
def test_the_count_is_what_the_model_optimizer_and_activations_allocate(backend_class, shapes, recompute,
                                                                        zero_stage, world_size):
    config, backend = tiny(), backend_class()
    comm = SimpleNamespace(rank=world_size - 1, world_size=world_size)

    def build():
        model = GPT2(config, backend, recompute, padded_size(config.num_parameters, world_size, zero_stage))
        optimizer = ZeroOptimizer(model, comm, zero_stage, weight_decay=0.0)
        return model, optimizer, [model.activations(B, T) for B, T in shapes]
    (model, optimizer, acts), allocated = traced(build)
    buffers = [model.params_flat, model.grads_flat, optimizer.m, optimizer.v, optimizer.master]
    nbytes = sum(b.nbytes for b in buffers if b is not None) + sum(a.nbytes for a in acts)
    parts = memory.needed(backend, config, shapes, recompute, zero_stage=zero_stage, world_size=world_size)
    assert (optimizer.master is not None) == (backend.dtype == np.float16) == (parts["master weights"] > 0)
    assert parts["activations"] == sum(a.nbytes for a in acts)
    assert sum(parts[what] for what in ("parameters", "gradients", "AdamW m and v", "master weights",
                                        "activations")) == nbytes
    # beside the arrays' bytes, only Python objects: the named views, the decay segments (under 1%)
    assert nbytes <= allocated <= 1.01 * nbytes


@pytest.mark.parametrize("config, B, T", [
    (tiny(maxT=32), 4, 32),                           # the lm_head's (B, T, Vp) output is the largest
    (tiny(**SMALL_VOCAB), 8, 128),                    # attention's (B, NH, T, T) temporaries are
    (tiny(C=256, NH=2, maxT=16, vocab_size=8192, padded_vocab_size=8192), 1, 16),   # wte's gradient is
])
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_a_step_and_a_checkpoint_add_no_more_than_counted(tmp_path, monkeypatch, config, B, T, zero_stage):
    """On the CPU a step's temporaries stay within backend.scratch_bytes, and writing and reading a
    checkpoint within its host copies; both bounds are close (more than half of each is used). Two threads,
    on any machine: the AdamW and classifier slices they work on at once count too."""
    rng = np.random.default_rng(0)
    formats.write_shard(tmp_path / "train.bin", rng.integers(0, config.vocab_size, 4 * B * (T + 1)))
    monkeypatch.setattr(numpy_backend, "threads_per_rank", lambda: 2)
    backend, comm = NumpyBackend(), SingleComm()
    parts = memory.needed(backend, config, [(B, T)], zero_stage=zero_stage, checkpoints=True)
    slack = memory.MARGIN_FRACTION * sum(parts.values())   # small buffers: the batch, AdamW's slices
    model = GPT2(config, backend, flat_size=padded_size(config.num_parameters, 1, zero_stage))
    model.load_params(init_params(config))
    optimizer = ZeroOptimizer(model, comm, zero_stage, weight_decay=0.0)
    loader, guard = DataLoader(str(tmp_path / "train.bin"), B, T), UpdateGuard()
    batch = loader.next_batch()
    model.activations(B, T)
    out = checkpoint.OutputDir(str(tmp_path / "run"), resume=0, comm=comm)
    added = []
    tracemalloc.start()
    for work in (lambda: train_step(model, optimizer, [batch], 1e-3, 1, guard),
                 lambda: out.save(1, model, optimizer, loader, guard, comm),
                 lambda: checkpoint.load(str(tmp_path / "run"), 1, model, optimizer, loader, guard)):
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        work()
        added.append(tracemalloc.get_traced_memory()[1] - before)
    tracemalloc.stop()
    step, save, load = added
    assert parts["scratch"] / 2 < step <= parts["scratch"] + slack
    assert parts["host copies"] / 2 < max(save, load) <= parts["host copies"] + slack


def test_the_count_leaves_checkpoint_copies_out_on_the_gpu_and_loading_copies_in_on_the_cpu():
    config = tiny()
    P4 = 4 * config.num_parameters
    assert memory.needed(NumpyBackend(), config, [(1, 8)])["host copies"] == memory.LOADING_COPIES * P4
    assert memory.needed(NumpyBackend(), config, [(1, 8)], checkpoints=True)["host copies"] == \
        memory.CHECKPOINT_COPIES * P4
    device_arrays = SimpleNamespace(xp=None, dtype=np.float16, scratch_bytes=lambda *_: 0,
                                    attention_saved_shape=lambda B, T, NH: ((B, NH, T), np.float32))
    assert "host copies" not in memory.needed(device_arrays, config, [(1, 8)], checkpoints=True)


# ---------------------------------------------------------------------------------------------- what there is

def test_the_host_memory_is_meminfos_available_shared_among_the_ranks_on_the_machine(monkeypatch):
    available = host_memory_available()
    with open("/proc/meminfo") as f:
        kb = int(next(line.split()[1] for line in f if line.startswith("MemAvailable:")))
    assert 0 < available <= 1024 * kb * 1.1   # (the file changes as others allocate)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert 0 < NumpyBackend().memory_available() <= 1024 * kb * 1.1 / 4


# ---------------------------------------------------------------------------------------------- refusals

def refuse_work(monkeypatch):
    """Make drawing or reading the parameters fail the test: a refusal must come before either."""
    def never(*_):
        raise AssertionError("the parameters were drawn or read before the memory was counted")
    monkeypatch.setattr(train_gpt2, "init_params", never)
    monkeypatch.setattr(formats, "read_model", never)


def test_a_run_that_does_not_fit_is_refused_before_its_parameters_are_drawn(shards, monkeypatch):
    monkeypatch.chdir(shards)
    monkeypatch.setattr(NumpyBackend, "memory_available", lambda self: 1 << 30)
    refuse_work(monkeypatch)
    argv = ["-e", "d12", "-b", "4", "-t", "64", "-s", "0", *data_args()]
    with pytest.raises(memory.NotEnoughMemory) as e:
        train_gpt2.main(argv)
    parts = memory.needed(NumpyBackend(), GPT2Config.from_descriptor("d12"), [(4, 64)])
    total = (sum(parts.values()) + memory.margin(parts)) / 2**30
    assert re.fullmatch(rf"not enough memory: this run needs {total:.1f} GiB \(parameters 475 MiB, gradients "
                        rf"475 MiB, AdamW m and v 950 MiB, activations \d+ MiB, scratch \d+ MiB, host copies "
                        rf"950 MiB, margin \d+ MiB\) and 1.0 GiB is available: lower -b, use -r 2, a smaller "
                        rf"-e, or -z 1 over more ranks on more GPUs or machines", str(e.value)), str(e.value)


@pytest.mark.parametrize("descriptor", ["d2c6400h4", "d48"])
def test_a_descriptor_too_large_for_a_23_gb_machine_is_refused_before_any_init(shards, monkeypatch,
                                                                               descriptor):
    """A typo (d2c6400h4: 1.3 billion parameters) and a documented model (d48) on the machine where they
    once took 49 s to fail: the parameter count alone refuses them."""
    monkeypatch.chdir(shards)
    monkeypatch.setattr(NumpyBackend, "memory_available", lambda self: 23 * 10**9)
    refuse_work(monkeypatch)
    with pytest.raises(memory.NotEnoughMemory, match="and 21.4 GiB is available"):
        train_gpt2.main(["-e", descriptor, "-b", "1", "-t", "64", *data_args()])


def write_model_of_holes(path, config):
    """A model file of `config`'s size whose parameters are a hole: the file system stores no bytes for
    them (a reader checks the size against the header first)."""
    header = formats.new_header(formats.MODEL_MAGIC, formats.MODEL_VERSION_FP32)
    header[2:8] = (config.max_seq_len, config.vocab_size, config.num_layers, config.num_heads,
                   config.channels, config.padded_vocab_size)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.truncate(formats.HEADER_BYTES + 4 * config.num_parameters)


# 206 billion parameters, an 824 GB file: more than any machine these tests run on can train or sample
HUGE = dict(num_layers=16, channels=1 << 15, num_heads=1 << 9)


def assert_refused_in_one_line(proc, start):
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(start), proc.stderr


@pytest.mark.parametrize("args", [["-e", "d12", "-b", "100000"], ["-e", "huge.bin"]])
def test_a_run_no_machine_could_hold_stops_with_one_line(shards, args):
    """Exit 1, one line, nothing else: from a descriptor and batch, or from a model file's header, before
    its parameters are read."""
    write_model_of_holes(shards / "huge.bin", GPT2Config(**HUGE))
    proc = subprocess.run([sys.executable, TRAIN, *args, *data_args()], cwd=shards, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert_refused_in_one_line(proc, "error: not enough memory: this run needs ")
    assert proc.stdout == ""


def test_a_sample_from_a_model_no_machine_could_hold_stops_with_one_line(tmp_path):
    config = GPT2Config(max_seq_len=32, vocab_size=3, padded_vocab_size=128, **HUGE)
    write_model_of_holes(tmp_path / "huge.bin", config)
    formats.write_tokenizer(tmp_path / "tokenizer.bin", [b"a", b"b", b"<|endoftext|>"], 2)
    proc = subprocess.run([sys.executable, "-m", "llm.sample", "-e", "huge.bin", "--tokenizer",
                           "tokenizer.bin", "--backend", "numpy", "-g", "8"],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert_refused_in_one_line(proc, "error: not enough memory: this run needs ")
    assert proc.stderr.endswith(f": {SAMPLE_ADVICE}\n"), proc.stderr


def test_an_allocators_memory_error_is_one_line(shards):
    """Where the count misses something, NumPy's own MemoryError (a real one: an array larger than any
    address space, in place of the activations) becomes one line with the same advice."""
    code = ("import runpy, sys; import numpy as np; from llm import model; "
            "model.Activations.__init__ = lambda *_: np.empty(1 << 50, np.float32); "
            f"sys.argv[0] = {TRAIN!r}; runpy.run_path({TRAIN!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code, "-e", "d2c64h4", "-b", "4", "-t", "32", *data_args()],
                          cwd=shards, env=env(), capture_output=True, text=True, timeout=120)
    assert_refused_in_one_line(proc, "error: out of memory (Unable to allocate 4.00 PiB for an array with "
                                     "shape (1125899906842624,) and data type float32): "
                                     f"{memory.TRAINING_ADVICE}")
