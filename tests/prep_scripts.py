"""Shared by the tests of data/*.py: run a script as a user would, optionally without some packages."""
import os
import subprocess
import sys

import pytest

from conftest import REPO, env
VOCAB = os.environ.get("GPT2_VOCAB") or os.path.join(REPO, "..", "shared", "data", "gpt2.tiktoken")
needs_vocab = pytest.mark.skipif(not os.path.exists(VOCAB), reason=f"GPT-2 ranks not found at {VOCAB} "
                                 "(set GPT2_VOCAB to a gpt2.tiktoken file)")


def run_script(name, args, cwd, block=(), environ=None):
    """Run python -m data.<name> with `args` in `cwd`; `block` names packages it must see as not installed,
    and `environ` holds environment variables to set for it."""
    code = (f"import runpy, sys; sys.modules.update(dict.fromkeys({list(block)!r})); "   # None: import fails
            f"sys.argv[1:] = {list(map(str, args))!r}; "
            f"runpy.run_module('data.{name}', run_name='__main__', alter_sys=True)")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env={**env(), **(environ or {})},
                          capture_output=True, text=True, timeout=120)


def assert_one_line_error(proc, *problems):
    """The script failed with status 1 and one line, "error: ...", that says each of `problems`."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    for problem in problems:
        assert problem in proc.stderr, proc.stderr
