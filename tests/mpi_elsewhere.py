"""Run under mpiexec as `mpi_elsewhere.py DIR <train_gpt2.py's flags>`: train_gpt2.py, but rank 1 works in
DIR, as if it ran on another node, where the relative -o names another directory (or none)."""
import os
import runpy
import sys

from llm.launch import launched_rank
from conftest import TRAIN

if launched_rank() == 1:
    os.chdir(sys.argv[1])
sys.argv = [TRAIN] + sys.argv[2:]
runpy.run_path(TRAIN, run_name="__main__")
