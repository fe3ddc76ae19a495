"""Run under mpiexec: each rank builds the ZeRO-1 optimizer and rank 0 prints every rank's m/v bytes."""
import sys

from llm.backends import get_backend
from llm.comm import make_comm
from llm.config import GPT2Config
from llm.model import GPT2
from llm.zero import ZeroOptimizer, padded_size

comm = make_comm()
config = GPT2Config.from_descriptor(sys.argv[1])
model = GPT2(config, get_backend("numpy"), flat_size=padded_size(config.num_parameters, comm.world_size, 1))
opt = ZeroOptimizer(model, comm, zero_stage=1, weight_decay=0.0)
sizes = comm.comm.gather((opt.m.nbytes, opt.v.nbytes, opt.lo, opt.hi), root=0)
if comm.rank == 0:
    print(config.num_parameters, sizes)
