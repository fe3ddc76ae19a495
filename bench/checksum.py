"""What a checkpoint's checksums cost: xxh3_64 over the bytes of a model file and a state file, against
writing and reading those files (llm/formats.py computes the checksum on write and verifies it on read).

    python -m bench.checksum                 GPT-2 124M (d12): a 498 MB fp32 model, a 996 MB state (m, v)
    options: --model d12 --master 1 (the state holds master weights too) --dir DIR (where to write)
             --repeats 3

Prints, for each file, its size, the checksum's time (the best of --repeats) and its speed, and the time to
write the file (synced to disk, checksum included) and to read it back (verified); then the checksums' share
of a checkpoint's write. Compare the checksum time with one training step (bench.step) divided by the
steps between checkpoints (-n).
"""
import os
import tempfile
import time

import numpy as np
import xxhash

from llm import formats
from llm.config import GPT2Config
from llm.launch import Parser, output_dir, positive_int, run
from llm.weight_init import init_params


def best_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv):
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="d12")
    parser.add_argument("--master", type=int, default=0, choices=(0, 1))
    parser.add_argument("--dir", default=None,
                        help="where to write the files (default: a temporary directory)")
    parser.add_argument("--repeats", type=positive_int, default=3)
    args = parser.parse_args(argv)
    config = GPT2Config.from_descriptor(args.model)
    # the files go in a temporary folder made there: checked first, so that a place that cannot be written is
    # one line naming --dir, not a failed write naming that folder
    place = output_dir(tempfile.gettempdir() if args.dir is None else args.dir, "--dir")
    P = config.num_parameters
    params = init_params(config)
    rng = np.random.default_rng(0)
    m = rng.standard_normal(P, dtype=np.float32) * 1e-3
    v = np.abs(rng.standard_normal(P, dtype=np.float32)) * 1e-6
    master = params.copy() if args.master else None
    buffers = [m, v] if master is None else [m, v, master]
    print(f"{args.model}: {P:,} parameters; xxhash {xxhash.VERSION} (xxHash {xxhash.XXHASH_VERSION})")

    os.makedirs(place, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=place) as directory:
        model, state = os.path.join(directory, "model.bin"), os.path.join(directory, "state.bin")
        rows = [
            ("model (fp32)", model, [params],
             lambda: formats.write_model(model, config, params), lambda: formats.read_model(model)),
            ("state", state, buffers,
             lambda: formats.write_state(state, step=1, num_processes=1, rng_state=0, loader_state=(0, 0),
                                         m=m, v=v, master=master), lambda: formats.read_state(state, P)),
        ]
        total_hash = total_write = 0.0
        for name, path, payload, write, read in rows:
            hash_s = best_seconds(lambda: [xxhash.xxh3_64(b).intdigest() for b in payload], args.repeats)
            write_s = best_seconds(write, args.repeats)
            read_s = best_seconds(read, args.repeats)
            size = os.path.getsize(path)
            total_hash, total_write = total_hash + hash_s, total_write + write_s
            print(f"{name:13s} {size / 1e6:8.1f} MB"
                  f" | checksum {1e3 * hash_s:7.1f} ms ({size / hash_s / 1e9:5.1f} GB/s)"
                  f" | write {1e3 * write_s:8.1f} ms | read and verify {1e3 * read_s:8.1f} ms")
    print(f"checkpoint: checksums {1e3 * total_hash:.1f} ms of a {1e3 * total_write:.1f} ms write "
          f"({100 * total_hash / total_write:.1f}%)")


if __name__ == "__main__":
    run(main)
