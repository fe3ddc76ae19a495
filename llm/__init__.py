"""GPT-2 training from first principles: see the README.

Every command imports this package first (train_gpt2.py and test_gpt2.py before numpy, python -m llm.*,
data.* and bench.* through their packages), so a Python without the project's packages, such as the
system's `python` instead of the venv's, stops here with one line rather than a ModuleNotFoundError's
traceback. find_spec looks a package up without importing it."""
from importlib.util import find_spec
import sys

REQUIRED = ("numpy", "tiktoken", "mpi4py", "threadpoolctl", "xxhash")   # pyproject.toml's dependencies

missing = [name for name in REQUIRED if find_spec(name) is None]
if missing:
    sys.exit(f"error: {sys.executable} has no {', '.join(missing)}: run the commands with .venv/bin/python "
             f"(`make setup` creates it)")
