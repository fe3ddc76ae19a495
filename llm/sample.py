"""Sampling text from a model: llm.c's sampler, and a command line that prints text from a checkpoint.

  python -m llm.sample -e log_train/model_00000250.bin                 64 tokens after an EOT
  python -m llm.sample -e gpt2_124M.bin --prompt "The meaning of life is" -g 100 --top_k 40
  python -m llm.sample -e log_train                                    the run's newest complete checkpoint

Training prints samples as llm.c does (generate()): xorshift* coins from seed 1337 and inverse-CDF
sampling over softmax(logits), starting from EOT. The command line adds what nanoGPT's sample.py
offers: a prompt, a temperature and top-k, a seed, decoded text. With its defaults (no prompt,
temperature 1, no top-k, seed 1337) it prints what training would print after the same checkpoint.
"""
import math
import os

import numpy as np

from llm import formats, launch, memory
from llm.backends import get_backend, resolve
from llm.checkpoint import find_model
from llm.config import WEIGHTS_HINT
from llm.launch import Parser, UsageError, UserError
from llm.model import GPT2
from llm.tokenizer import Tokenizer, TokenizerFile

MASK64 = (1 << 64) - 1
SEED = 1337           # llm.c's sampler seed, reset for every sample
CHUNK = 256           # forward windows are padded to multiples of this (or of max_T when smaller)
ADVICE = "sample on a machine (or a GPU: --backend cupy) with more memory"   # when the model does not fit


class Rng:
    """llm.c's 64-bit xorshift* generator (llmc/sampler.h)."""

    def __init__(self, seed):
        self.state = seed & MASK64

    def u32(self):
        s = self.state
        s ^= s >> 12
        s ^= (s << 25) & MASK64
        s ^= s >> 27
        self.state = s
        return ((s * 0x2545F4914F6CDD1D) & MASK64) >> 32

    def f32(self):
        """A float in [0, 1) from the top 24 bits of a draw."""
        return (self.u32() >> 8) / 16777216.0


def sample_softmax(logits, coin, temperature=1.0):
    """Index i where the running sum of softmax(logits / temperature) first exceeds coin (the last index if
    none). The largest logit is subtracted before dividing, in float64: it gives exp(0) = 1 at any
    temperature, so a tiny temperature is the argmax (greedy), where logits / temperature would overflow
    to inf - inf = NaN."""
    x = logits.astype(np.float64)
    with np.errstate(over="ignore"):   # a tiny temperature divides to -inf, whose exp is the 0 it should be
        p = np.exp((x - x.max()) / temperature)
    cdf = np.cumsum(p / p.sum())
    return min(int(np.searchsorted(cdf, coin, side="right")), len(logits) - 1)


def pick(logits, coin, temperature=1.0, top_k=0):
    """sample_softmax over logits / temperature, keeping only the top_k largest logits (0: all of them).

    The others become -inf, so their probability is 0; top_k = 1 is greedy decoding (the argmax)."""
    if 0 < top_k < len(logits):
        kth = np.partition(logits, -top_k)[-top_k]
        logits = np.where(logits >= kth, logits, -np.inf)
    return sample_softmax(logits, coin, temperature)


def sample(model, context, n, max_T, rng, temperature=1.0, top_k=0):
    """n new tokens after `context` (token ids, an EOT first), one forward and one coin per token.

    Each forward sees the tokens so far, padded with EOT to a multiple of min(max_T, 256) as llm.c does,
    which keeps the shapes (and activation buffers) few; attention is causal, so the padding never
    reaches the logits read at the last real position. The whole sequence must fit max_T."""
    if len(context) + n > max_T:
        raise ValueError(f"{len(context)} tokens of context and {n} new tokens exceed the window of {max_T}")
    V = model.config.vocab_size
    tokens = list(context)
    for _ in range(n):
        t = len(tokens)
        window = np.full((1, window_length(t, max_T)), context[0], np.int32)
        window[0, :t] = tokens
        row = model.backend.to_numpy(model.forward(window)[0, t - 1, :V]).astype(np.float32)
        tokens.append(pick(row, rng.f32(), temperature, top_k))
    return tokens[len(context):]


def window_length(t, max_T):
    """The forward's length after t tokens: t padded to a multiple of min(max_T, CHUNK), at most max_T."""
    chunk = min(max_T, CHUNK)
    return min(-(-t // chunk) * chunk, max_T)


def sample_shapes(context_length, n, max_T):
    """The (B, T) of every forward that sample() runs, for the memory estimate (llm/memory.py)."""
    return sorted({(1, window_length(t, max_T)) for t in range(context_length, context_length + n)})


def _generate_length(config, gen_tokens, max_T):
    """generate()'s (new tokens, window): the sequence, EOT included, cut to max_T tokens (the training T, at
    most the model's max_seq_len), so that a huge -g is a short sample and not hours of forwards."""
    max_T = min(max_T, config.max_seq_len)
    return max(min(gen_tokens, max_T) - 1, 0), max_T


def generate(model, eot, gen_tokens, max_T):
    """llm.c's sample during training: gen_tokens - 1 tokens after an EOT, coins from seed 1337."""
    n, max_T = _generate_length(model.config, gen_tokens, max_T)
    return sample(model, [eot], n, max_T, Rng(SEED))


def generate_shapes(config, gen_tokens, max_T):
    """The (B, T) of every forward that generate() runs."""
    n, max_T = _generate_length(config, gen_tokens, max_T)
    return sample_shapes(1, n, max_T)


# ----------------------------------------------------------------------------------------------
# The command line: python -m llm.sample -e MODEL.bin [--prompt TEXT] [-g N] ...

def arguments():
    parser = Parser(description="Print text sampled from a model checkpoint (llm.c's sampler, plus a prompt, "
                    "temperature and top-k).")
    parser.add_argument("-e", default="gpt2_124M.bin", metavar="MODEL",
                        help="model checkpoint .bin, or a run's -o directory: its newest complete checkpoint "
                             "(default: gpt2_124M.bin, which python -m data.gpt2 writes)")
    parser.add_argument("--prompt", default="", metavar="TEXT",
                        help="text to continue (default: none, start from EOT alone); encoding it needs "
                             "GPT-2's BPE ranks, see --vocab")
    parser.add_argument("-g", "-n", dest="n", type=int, default=64, metavar="N",
                        help="new tokens to generate, train_gpt2.py's -g (default: 64)")
    parser.add_argument("--temperature", type=float, default=1.0, metavar="T",
                        help="divides the logits: below 1 is more conservative, above 1 more random "
                             "(default: 1)")
    parser.add_argument("--top_k", type=int, default=0, metavar="K",
                        help="sample from the k most likely tokens only; 1 is greedy (default: 0, all)")
    parser.add_argument("--seed", type=int, default=SEED,
                        help=f"the sampler's seed (default: {SEED}, llm.c's)")
    parser.add_argument("--backend", default="auto", help="numpy, cupy, or auto: cupy when a GPU is usable")
    parser.add_argument("--tokenizer", default="gpt2_tokenizer.bin", metavar="PATH",
                        help="llm.c's tokenizer file, to decode the text (default: gpt2_tokenizer.bin)")
    parser.add_argument("--vocab", metavar="PATH",
                        help="GPT-2's BPE ranks, a gpt2.tiktoken file, to encode the prompt (default: "
                             "$GPT2_VOCAB, else tiktoken's download)")
    return parser


def check_args(args):
    if args.n < 1:
        raise UsageError(f"-g {args.n}: generate at least 1 token")
    if not (args.temperature > 0 and math.isfinite(args.temperature)):
        raise UsageError(f"--temperature {args.temperature}: must be positive (--top_k 1 decodes greedily)")
    if args.top_k < 0:
        raise UsageError(f"--top_k {args.top_k}: must be 0 (all tokens) or positive")
    if args.seed & MASK64 == 0:
        raise UsageError(f"--seed {args.seed}: xorshift needs a seed that is not 0 modulo 2^64")


def main(argv):
    args = arguments().parse_args(argv)
    check_args(args)
    name, precision = resolve(args.backend)   # an unknown name fails here, before any file is read
    if not os.path.exists(args.e):
        raise UserError(f"{args.e}: no such file: {WEIGHTS_HINT}; `make train` writes "
                        f"log_train/model_00000250.bin")
    path = find_model(args.e)
    # the parameters are read once the memory is known to suffice
    config, _ = formats.read_model_config(path)
    if not os.path.exists(args.tokenizer):
        raise UserError(f"{args.tokenizer}: no such file: `make data` or python -m data.gpt2 writes it "
                        f"(or pass --tokenizer PATH)")
    tokenizer = TokenizerFile(args.tokenizer, expected_vocab=config.vocab_size)
    prompt = Tokenizer(args.vocab).encode(args.prompt) if args.prompt else []
    if prompt and max(prompt) >= config.vocab_size:
        raise UserError(f"the prompt has token id {max(prompt)}, beyond the model's vocab_size "
                        f"{config.vocab_size}")
    context = [tokenizer.eot] + prompt
    room = config.max_seq_len - len(context)
    if args.n > room:
        raise UserError(f"-g {args.n}: EOT, the prompt's {len(prompt)} tokens and the new tokens must fit "
                        f"the model's max_seq_len {config.max_seq_len}: "
                        + (f"ask for -g {room} or fewer" if room > 0 else "shorten the prompt"))
    backend = get_backend(name, precision, cuda_graph=True)   # one launch per token on the GPU
    shapes = sample_shapes(len(context), args.n, config.max_seq_len)
    memory.check(memory.needed(backend, config, shapes, train=False), backend.memory_available(), ADVICE)
    model = GPT2(config, backend)
    model.load_params(formats.read_model(path)[1])
    tokens = sample(model, context, args.n, config.max_seq_len, Rng(args.seed), args.temperature, args.top_k)
    print(tokenizer.decode(prompt + tokens))


if __name__ == "__main__":
    launch.run(main, memory_advice=ADVICE)
