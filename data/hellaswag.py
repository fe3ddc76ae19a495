"""HellaSwag's val split as llm.c's eval file, data/hellaswag/hellaswag_val.bin, for train_gpt2.py -h 1.

  python -m data.hellaswag                                    download hellaswag_val.jsonl
  python -m data.hellaswag --input hellaswag_val.jsonl --vocab gpt2.tiktoken     offline

Each example is rendered as llm.c's dev/data/hellaswag.py renders it: the tokens of its context, the
tokens of each of its 4 endings encoded with a leading space (GPT-2's tokens carry the space before a
word, so the ending continues the context), and the label of the right ending.
"""
import json
import os

from data import PrepError, arguments, outputs, read_text
from llm import formats
from llm.launch import run
from llm.tokenizer import Tokenizer

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"


def render(line, tokenizer):
    """One jsonl line {"ctx": str, "label": 0..3, "endings": [4 str], ...} -> a formats.write_eval example."""
    example = json.loads(line)
    ctx, label, endings = example["ctx"], example["label"], example["endings"]
    if len(endings) != formats.EVAL_COMPLETIONS or label not in range(formats.EVAL_COMPLETIONS):
        raise ValueError(f"expected 4 endings and a label 0..3, got {len(endings)} and {label!r}")
    context = tokenizer.encode(ctx)
    if not context:   # (an ending is never empty: its leading space is a token)
        raise ValueError("its ctx is empty, and -h 1 scores each ending after the context")
    return dict(label=label, context=context,
                completions=[tokenizer.encode(" " + ending) for ending in endings])


def main(argv):
    args = arguments(__doc__.splitlines()[0], URL, os.path.join("data", "hellaswag")).parse_args(argv)
    source = args.input or URL
    with outputs(args.out):   # one file, written last
        lines = read_text(args.input, URL).splitlines()
        tokenizer = Tokenizer(args.vocab)
        examples = []
        for n, line in enumerate(lines, 1):
            try:
                if line.strip():
                    examples.append(render(line, tokenizer))
            except (ValueError, KeyError, TypeError) as e:   # json's errors are ValueErrors
                raise PrepError(f"{source} line {n}: not a HellaSwag example ({type(e).__name__}: {e}): "
                                f"correct or remove the line") from None
        path = os.path.join(args.out, "hellaswag_val.bin")
        print(f"writing {len(examples):,} examples to {path}")
        formats.write_eval(path, examples)


if __name__ == "__main__":
    run(main)
