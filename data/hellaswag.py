"""HellaSwag's val split as llm.c's eval file, data/hellaswag/hellaswag_val.bin, for train_gpt2.py -h 1.

  python data/hellaswag.py                                    download hellaswag_val.jsonl
  python data/hellaswag.py --input hellaswag_val.jsonl --vocab gpt2.tiktoken     offline

Each example is rendered as llm.c's dev/data/hellaswag.py renders it: the tokens of its context, the
tokens of each of its 4 endings encoded with a leading space (GPT-2's tokens carry the space before a
word, so the ending continues the context), and the label of the right ending.
"""
import json
import os
import sys

# run as a script, Python puts data/ on the path; the repo root is needed to import llm and data
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data import PrepError, arguments, read_text, run   # noqa: E402
from llm import formats   # noqa: E402
from llm.tokenizer import Tokenizer   # noqa: E402

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"


def render(line, tokenizer):
    """One jsonl line {"ctx": str, "label": 0..3, "endings": [4 str], ...} -> a formats.write_eval example."""
    example = json.loads(line)
    ctx, label, endings = example["ctx"], example["label"], example["endings"]
    if len(endings) != formats.EVAL_COMPLETIONS or label not in range(formats.EVAL_COMPLETIONS):
        raise ValueError(f"expected 4 endings and a label 0..3, got {len(endings)} and {label!r}")
    return dict(label=label, context=tokenizer.encode(ctx),
                completions=[tokenizer.encode(" " + ending) for ending in endings])


def main():
    args = arguments(__doc__.splitlines()[0], URL, os.path.join("data", "hellaswag")).parse_args()
    source = args.input or URL
    lines = read_text(args.input, URL).splitlines()
    tokenizer = Tokenizer(args.vocab)
    examples = []
    for n, line in enumerate(lines, 1):
        try:
            if line.strip():
                examples.append(render(line, tokenizer))
        except (ValueError, KeyError, TypeError) as e:   # json's errors are ValueErrors
            raise PrepError(f"{source} line {n}: not a HellaSwag example ({type(e).__name__}: {e})") from None
    path = os.path.join(args.out, "hellaswag_val.bin")
    os.makedirs(args.out, exist_ok=True)
    print(f"writing {len(examples):,} examples to {path}")
    formats.write_eval(path, examples)


if __name__ == "__main__":
    run(main)
