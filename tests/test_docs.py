"""The docs cannot drift from the code.

- Every `path:name` that docs/ and the README cite names a file that exists and defines that name (a def, a
  class or an assignment in Python, dotted for a method; a function or kernel in CUDA), and every `path` and
  relative link names a file that exists.
- Every chapter's "Try it" commands run, at the sizes written, and print what the chapter shows under them:
  each line shown must appear in the output, in order; `...` stands for anything, a line of `...` alone for
  lines left out; integers are exact, and other numbers agree to 1e-3 (the last digits of a float32 loss
  differ between BLAS builds).
- A chapter's commands use only files the chapters have named by then, in their reading order.
- Every train_gpt2.py command in the README and in docs/ parses, and every script or module it runs exists.
- docs/figures.py still draws every image the chapters show, from the code as it is.
"""
import ast
import importlib.util
import math
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import MPIEXEC, REPO, env
import train_gpt2

DOCS = os.path.join(REPO, "docs")
CHAPTERS = ["01-flat-buffer.md", "02-layers.md", "03-training-step.md", "04-zero.md", "05-gpu.md",
            "06-flash-attention.md", "07-files-and-resume.md"]
PAGES = [os.path.join(DOCS, name) for name in sorted(os.listdir(DOCS)) if name.endswith(".md")]
README = os.path.join(REPO, "README.md")
SHARED = os.path.join(REPO, "..", "shared", "data")
CORPUS = os.environ.get("TINYSHAKESPEARE") or os.path.join(SHARED, "tinyshakespeare.txt")
VOCAB = os.environ.get("GPT2_VOCAB") or os.path.join(SHARED, "gpt2.tiktoken")

# `path`, `path:name`: a file of the repository in backticks, and what it defines
REFERENCE = re.compile(r"`((?:[\w.-]+/)*[\w.-]+\.(?:py|cu|cuh|sh|md|toml))(?::([\w.]+))?`")
LINK = re.compile(r"\]\(((?!https?:|#)[^)#\s]+)(?:#[^)]*)?\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
# what a command names in the repository: entry points at its root, and files in its folders
REPO_PATH = re.compile(r"(?<![\w/.-])((?:train_gpt2|test_gpt2)\.py|"
                       r"(?:tests|docs|bench|reference|llm)/[\w./-]+)")
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[+-]?\d+)?(?![\w])")


def read(path):
    with open(path) as f:
        return f.read()


def references(path):
    """[(file, name or None)] cited in a page; a file relative to the repository's root. A bare path counts
    when it starts in one of the repository's folders (llm.c's `dev/eval/...` is another repository's)."""
    text = read(path)
    cited = [(file, name or None) for file, name in REFERENCE.findall(text)
             if name or "/" in file and os.path.isdir(os.path.join(REPO, file.split("/")[0]))]
    for link in LINK.findall(text):
        target = os.path.normpath(os.path.join(os.path.dirname(path), link))
        cited.append((os.path.relpath(target, REPO), None))
    return cited


def defined_names(node):
    """The names a statement defines: a def's or a class's, or the targets of an assignment."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    targets = (node.targets if isinstance(node, ast.Assign) else
               [node.target] if isinstance(node, ast.AnnAssign) else [])
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]   # a, b = ... defines both


def python_defines(tree, dotted):
    """Whether a module's AST defines `dotted` (a.b: b inside class a) as a def, a class or an assignment."""
    body = tree.body
    for part in dotted.split("."):
        found = next((node for node in body if part in defined_names(node)), None)
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


def defines(path, name):
    text = read(os.path.join(REPO, path))
    if path.endswith(".py"):
        return python_defines(ast.parse(text), name)
    if path.endswith((".cu", ".cuh")):   # a kernel, a device function, a macro or a constant
        return re.search(rf"(?:__global__|__device__)[^;{{}}]*?\b{name}\s*\(|#define {name}\b|"
                         rf"constexpr[^;]*\b{name}\b", text) is not None
    return False


def excerpts(page):
    """[(file, lines)]: the code blocks of a page that open with a comment naming the file they quote."""
    out = []
    for _, body in FENCE.findall(read(page)):
        first, *lines = body.splitlines()
        if m := re.fullmatch(r"(?:#|//) ((?:[\w.-]+/)+[\w.-]+\.\w+)", first.strip()):
            out.append((m.group(1), lines))
    return out


def squeeze(line):
    return " ".join(line.split())


@pytest.mark.parametrize("page", [README] + PAGES, ids=lambda page: os.path.relpath(page, REPO))
def test_every_cited_file_exists_and_defines_the_cited_name(page):
    missing = []
    for file, name in references(page):
        if not os.path.exists(os.path.join(REPO, file)):
            missing.append(f"{file} does not exist")
        elif name and not defines(file, name):
            missing.append(f"{file} does not define {name}")
    assert not missing, f"{os.path.relpath(page, REPO)} cites: " + "; ".join(sorted(set(missing)))


@pytest.mark.parametrize("page", PAGES, ids=lambda page: os.path.relpath(page, REPO))
def test_every_code_excerpt_is_the_code_of_the_file_it_names(page):
    for file, lines in excerpts(page):
        code = {squeeze(line) for line in read(os.path.join(REPO, file)).splitlines()}
        for line in lines:
            assert not line.strip() or squeeze(line) in code, \
                f"{os.path.relpath(page, REPO)}: {file} has no line\n{line}"


def try_it(chapter):
    """[(commands, expected lines)] of a chapter's "Try it": each ```sh block and the ```text after it."""
    text = read(os.path.join(DOCS, chapter))
    section = text.split("\n## Try it", 1)[1].split("\n## ", 1)[0] if "\n## Try it" in text else ""
    blocks, out = FENCE.findall(section), []
    for (kind, body), (next_kind, next_body) in zip(blocks, blocks[1:] + [("", "")]):
        if kind == "sh":
            out.append((body, next_body.splitlines() if next_kind == "text" else []))
    return [(commands, expected) for commands, expected in out if expected]


def test_the_chapters_are_the_reading_order_and_each_ends_with_a_try_it():
    assert [name for name in sorted(os.listdir(DOCS)) if re.match(r"\d\d-", name)] == CHAPTERS
    for name in CHAPTERS:
        assert try_it(name), f"docs/{name} has no '## Try it' with a ```sh block and the ```text it prints"


def matches(expected, line):
    """Whether an output line shows an expected one: `...` is anything, integers exact, floats to 1e-3."""
    pattern, numbers = "", []
    for i, part in enumerate(expected.split("...")):
        pattern += ".*?" if i else ""
        last = 0
        for m in NUMBER.finditer(part):
            pattern += re.escape(part[last:m.start()]) + f"({NUMBER.pattern})"
            numbers.append(m.group())
            last = m.end()
        pattern += re.escape(part[last:])
    m = re.fullmatch(pattern, line.rstrip())
    return m is not None and all(got == want if want.lstrip("-").isdigit() else
                                 math.isclose(float(got), float(want), rel_tol=1e-3, abs_tol=1e-9)
                                 for got, want in zip(m.groups(), numbers))


def assert_shows(output, expected):
    """Each expected line, but `...` alone, matches an output line after the one the previous matched."""
    lines = output.splitlines()
    at = 0
    for want in expected:
        if want.strip() in ("", "..."):
            continue
        while at < len(lines) and not matches(want, lines[at]):
            at += 1
        assert at < len(lines), f"the output has no line like\n  {want}\nin order; it was:\n{output[-4000:]}"
        at += 1


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory to run the commands in, with tiny Shakespeare prepared as `make data` would."""
    work = tmp_path_factory.mktemp("docs")
    if os.path.exists(CORPUS) and os.path.exists(VOCAB):
        prepare = [sys.executable, os.path.join(REPO, "data", "tinyshakespeare.py"), "--input", CORPUS,
                   "--vocab", VOCAB, "--out", os.path.join("data", "tinyshakespeare"), "--tokenizer",
                   "gpt2_tokenizer.bin"]
        subprocess.run(prepare, cwd=work, env=env(), check=True, capture_output=True, timeout=120)
    return work


def runnable(commands):
    """The commands as this test runs them: this Python and mpiexec, the repository's files by full path."""
    commands = commands.replace(".venv/bin/python", shlex.quote(sys.executable))
    commands = commands.replace(".venv/bin/mpirun", shlex.quote(MPIEXEC or "mpiexec"))
    return REPO_PATH.sub(lambda m: shlex.quote(os.path.join(REPO, m.group(1))), commands)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_try_it_prints_what_the_chapter_shows(chapter, workdir):
    for commands, expected in try_it(chapter):
        if "mpirun" in commands and MPIEXEC is None:
            pytest.skip("no mpiexec (pip install mpi4py mpich)")
        if "train_gpt2.py" in commands and not os.path.exists(workdir / "data" / "tinyshakespeare"):
            pytest.skip(f"tiny Shakespeare needs {CORPUS} and {VOCAB} (TINYSHAKESPEARE, GPT2_VOCAB)")
        proc = subprocess.run(["bash", "-e", "-c", runnable(commands)], cwd=workdir, env=env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, \
            f"{commands}\nfailed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        assert_shows(proc.stdout + proc.stderr, expected)


def test_a_chapter_runs_only_files_that_the_chapters_have_named_by_then():
    named = set()
    for chapter in CHAPTERS:
        page = os.path.join(DOCS, chapter)
        named |= {file for file, _ in references(page)}
        for commands, _ in try_it(chapter):
            for path in REPO_PATH.findall(commands):
                assert path in named, f"docs/{chapter} runs {path} before any chapter names it"


def commands(page):
    """Every command of a page's ```sh blocks as shell words: continued lines and quoted newlines joined."""
    out, pending = [], ""
    for kind, body in FENCE.findall(read(page)):
        for line in body.replace("\\\n", " ").splitlines() if kind == "sh" else []:
            pending += line + "\n"
            try:
                words = shlex.split(pending, comments=True)
            except ValueError:   # a quote still open: the command goes on at the next line
                continue
            out += [words] if words else []
            pending = ""
    return out


@pytest.mark.parametrize("page", [README] + PAGES, ids=lambda page: os.path.relpath(page, REPO))
def test_every_train_gpt2_command_parses_and_every_program_it_names_exists(page):
    for words in commands(page):
        for i, word in enumerate(words):
            if word.endswith("train_gpt2.py") and words[i + 1:] not in (["--help"], ["-help"]):
                train_gpt2.parse_args(words[i + 1:])   # raises UsageError, naming the flag
            if word.endswith("/python") and i + 1 < len(words):
                program = words[i + 1:i + 3]
                if program[0] == "-m":
                    assert importlib.util.find_spec(program[1]) is not None, f"{page}: no module {program[1]}"
                elif program[0].endswith(".py"):
                    assert os.path.exists(os.path.join(REPO, program[0])), f"{page}: no script {program[0]}"


def test_figures_py_draws_every_image_from_the_code(tmp_path):
    pytest.importorskip("matplotlib")
    subprocess.run([sys.executable, os.path.join(DOCS, "figures.py"), "--out", str(tmp_path)], env=env(),
                   check=True, capture_output=True, timeout=120)
    assert sorted(os.listdir(tmp_path)) == sorted(n for n in os.listdir(os.path.join(DOCS, "img")))
