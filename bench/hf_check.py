"""A check with Hugging Face's transformers, not part of the project: python -m llm.export's folder, loaded by
GPT2LMHeadModel and AutoTokenizer offline, gives our logits and tiktoken's token ids. Needs torch and
transformers (never dependencies); bench/gpu_check.sh's stage hf runs it.

    python -m bench.hf_check [-e MODEL.bin] [--vocab gpt2.tiktoken] [--tol 1e-4]

A random model (L=2, C=64, NH=4, maxT=64, every parameter drawn, so a misplaced tensor shows) and, with -e,
a checkpoint of yours (or a run's -o directory) are exported in fp32 and in bf16. For each, transformers
computes the logits of a batch in fp32 on the CPU (no TF32), and so does our NumPy forward, on the parameters
the folder holds (rounded to bf16 for the bf16 export); the largest difference must be within --tol. The
tokenizer must encode each text as tiktoken does. Exit status 1 if anything differs.
"""
import os
import tempfile

from bench import needs, positive_number

os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")   # the folder alone, no download
needs("torch", "transformers")
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer, GPT2LMHeadModel  # noqa: E402

from llm import export, formats  # noqa: E402
from llm.backends import get_backend  # noqa: E402
from llm.checkpoint import find_model  # noqa: E402
from llm.config import GPT2Config  # noqa: E402
from llm.launch import Parser, run  # noqa: E402
from llm.model import GPT2  # noqa: E402
from llm.tokenizer import Tokenizer  # noqa: E402

RANDOM = GPT2Config(max_seq_len=64, num_layers=2, num_heads=4, channels=64)
B, T = 2, 64
TEXTS = ["Hello world! This is GPT-2's tokenizer, exported.",
         "naïve café, Ünïcödé, 日本語のテキスト, emoji 🙂👍🏽",
         "a  b   c\t\td\n\n\nend   \n  \r\n indented    ",
         "3.14159 + 1234567890 = 2024-12-03, ½ ²",
         "I'm sure you're right: we've, they'll, she'd, it's; DON'T"]


def random_model(path):
    """Every parameter from N(0, 0.1), wte's padding rows 0, written as a v3 model file."""
    params = (0.1 * np.random.default_rng(0).standard_normal(RANDOM.num_parameters)).astype(np.float32)
    params[RANDOM.vocab_size * RANDOM.channels:RANDOM.padded_vocab_size * RANDOM.channels] = 0
    formats.write_model(path, RANDOM, params)


def logits_difference(model_path, folder, dtype):
    """max |transformers' logits - ours| over a batch of random tokens, and the largest logit."""
    config, params, _ = formats.read_model(model_path)
    if dtype == "bf16":
        params = formats.bf16_bits_to_float32(formats.float32_to_bf16_bits(params))
    x = np.random.default_rng(1).integers(0, config.vocab_size, (B, min(T, config.max_seq_len)))
    ours = GPT2(config, get_backend("numpy"))
    ours.load_params(params)
    expected = ours.forward(x.astype(np.int32))[..., :config.vocab_size]
    hf = GPT2LMHeadModel.from_pretrained(folder, torch_dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        logits = hf(torch.from_numpy(x)).logits.numpy()
    return float(np.abs(logits - expected).max()), float(np.abs(expected).max())


def tokenizer_differences(folder, tiktoken):
    """The texts that AutoTokenizer encodes otherwise than tiktoken."""
    hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return [text for text in TEXTS if hf(text)["input_ids"] != tiktoken.encode(text)]


def main(argv):
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-e", help="a model checkpoint .bin (or a run's -o directory) to check as well")
    parser.add_argument("--vocab", help="GPT-2's BPE ranks, a gpt2.tiktoken file (default: $GPT2_VOCAB, else "
                                        "tiktoken's download)")
    parser.add_argument("--tol", type=positive_number, default=1e-4,
                        help="the largest logit difference allowed")
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    tiktoken = Tokenizer(args.vocab)
    vocab = ["--vocab", args.vocab] if args.vocab else []
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"the random model": os.path.join(tmp, "random.bin")}
        random_model(models["the random model"])
        if args.e:
            models[args.e] = find_model(args.e)
        for i, (label, path) in enumerate(models.items()):
            for dtype in ("fp32", "bf16"):
                folder = os.path.join(tmp, f"hf{i}_{dtype}")
                export.main(["-e", path, "--out", folder, "--dtype", dtype, *vocab])
                diff, largest = logits_difference(path, folder, dtype)
                ok = diff <= args.tol
                print(f"{dtype} export of {label}: max |logits - ours| = {diff:.2e} "
                      f"(logits up to {largest:.1f}): {'OK' if ok else 'NOT OK'}")
                failures += [] if ok else [f"{label} {dtype} logits"]
                bad = tokenizer_differences(folder, tiktoken)
                print(f"  AutoTokenizer: {len(TEXTS) - len(bad)}/{len(TEXTS)} texts encoded as tiktoken does")
                failures += [f"{label} tokenizer: {text!r}" for text in bad]
    print("hf check:", "OK" if not failures else "FAILED: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    run(main)
