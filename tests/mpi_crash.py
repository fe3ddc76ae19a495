"""Run under mpiexec with train_gpt2.py's flags: train_gpt2.py, but rank 1's first training step raises an
exception that nothing expects, while rank 0 goes on into the step's collectives."""
import runpy
import sys

import llm.step
from llm.launch import launched_rank
from conftest import TRAIN


def crash(*args, **kwargs):
    raise RuntimeError("an unexpected bug on rank 1")


if launched_rank() == 1:
    llm.step.train_step = crash   # train_gpt2.py imports it from llm.step below, and gets this one
sys.argv = [TRAIN] + sys.argv[1:]
runpy.run_path(TRAIN, run_name="__main__")
