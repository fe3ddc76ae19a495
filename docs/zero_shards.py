"""Each rank's ZeRO-1 shard of the flat buffers, as llm/zero.py cuts it (docs/04-zero.md's "Try it").

    .venv/bin/mpirun -np 3 .venv/bin/python docs/zero_shards.py            d2c64h4 on three ranks
    .venv/bin/mpirun -np 2 .venv/bin/python docs/zero_shards.py d12        any model, any number of ranks

Every rank builds the model and the optimizer as train_gpt2.py -z 1 does, then rank 0 prints what each rank
owns: its range of the flat buffers, and the runs of that range with one weight-decay flag (the tensors it
covers, and the padding that makes the buffers divide by N).
"""
import sys

from llm.backends import get_backend
from llm.comm import make_comm
from llm.config import GPT2Config
from llm.layout import tensor_at
from llm.model import GPT2
from llm.zero import ZeroOptimizer, padded_size


def owned(optimizer, config):
    """This rank's shard as lines of text: its range, then one line per weight-decay segment."""
    lines = [f"rank {optimizer.comm.rank} owns [{optimizer.lo:,}, {optimizer.hi:,}): "
             f"its m and v hold {optimizer.shard_size:,} floats each"]
    for lo, hi, decay in optimizer.segments:
        lo, hi = lo + optimizer.lo, hi + optimizer.lo             # shard -> flat coordinates
        name = tensor_at(config, lo) or "padding"
        lines.append(f"    {name:<9} [{lo:,}, {hi:,})" + ("  weight decay" if decay else ""))
    return "\n".join(lines)


def main():
    comm = make_comm()
    descriptor = sys.argv[1] if len(sys.argv) > 1 else "d2c64h4"
    config = GPT2Config.from_descriptor(descriptor)
    flat_size = padded_size(config.num_parameters, comm.world_size, zero_stage=1)   # equal shards
    model = GPT2(config, get_backend("numpy"), flat_size=flat_size)
    optimizer = ZeroOptimizer(model, comm, zero_stage=1, weight_decay=0.1)
    text = owned(optimizer, config)
    texts = comm.comm.gather(text, root=0) if comm.world_size > 1 else [text]
    if comm.rank == 0:
        N, padded = comm.world_size, optimizer.shard_size * comm.world_size
        print(f"{descriptor}: P = {config.num_parameters:,} parameters; "
              f"at N = {N} the flat buffers hold {padded:,} = {N} x {optimizer.shard_size:,}")
        print("\n".join(texts))


if __name__ == "__main__":
    main()
