"""GPT-2 model configuration: llm.c's six fields and its model descriptors.

Descriptors (what `-e` accepts when the argument does not end in .bin):
  dL          GPT-2 with L layers, as llm.c: d6, d12, d24, d36, d48 (and d60, d72, d84)
  dLcChNH     a tiny model for tests and quick runs, e.g. d2c64h4 = 2 layers, 64 channels, 4 heads
A descriptor model has maxT = 1024, V = 50257 and Vp = 50304, as in llm.c.
"""
from dataclasses import dataclass
import re

from llm.launch import UserError

VOCAB_MULTIPLE = 128    # Vp is V rounded up to a multiple of this, so that the lm_head matmul tiles well


def padded_vocab(V):
    """Vp for a vocabulary of V tokens, as llm.c pads it."""
    return -(-V // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


GPT2_VOCAB = 50257      # V: the real vocabulary
GPT2_PADDED = padded_vocab(GPT2_VOCAB)   # Vp = 50304
GPT2_EOT = 50256        # <|endoftext|>: the last token of GPT-2's vocabulary, which separates documents
GPT2_MAX_SEQ = 1024
# what to say when a model file such as gpt2_124M.bin (the trainer's default -e) is missing
WEIGHTS_HINT = "python -m data.gpt2 writes GPT-2's weights (gpt2_124M.bin, gpt2_124M_bf16.bin)"

# depth -> (channels, heads), from llm.c's gpt2_set_hyperparameters
DEPTHS = {6: (384, 6), 12: (768, 12), 24: (1024, 16), 36: (1280, 20), 48: (1600, 25),
          60: (1920, 30), 72: (2880, 30), 84: (3456, 36)}


class ConfigError(UserError):
    """A model description that cannot be built (bad descriptor, sizes that do not divide)."""


class DescriptorError(ConfigError):
    """Text that is no model descriptor at all (where a command also takes a file, it says so)."""


@dataclass(frozen=True)
class GPT2Config:
    max_seq_len: int = GPT2_MAX_SEQ        # maxT, rows of wpe
    vocab_size: int = GPT2_VOCAB           # V
    padded_vocab_size: int = GPT2_PADDED   # Vp, rows of wte
    num_layers: int = 12                   # L
    num_heads: int = 12                    # NH
    channels: int = 768                    # C

    def __post_init__(self):
        if min(self.max_seq_len, self.vocab_size, self.num_layers, self.num_heads, self.channels) <= 0:
            raise ConfigError(f"every model size must be positive: {self}")
        if self.channels % self.num_heads:
            raise ConfigError(f"channels {self.channels} is not divisible by num_heads {self.num_heads}: "
                              f"choose a number of heads that divides the channels")
        if self.padded_vocab_size < self.vocab_size:
            raise ConfigError(f"padded_vocab_size {self.padded_vocab_size} < vocab_size {self.vocab_size}")

    @property
    def num_parameters(self):
        """Vp*C + maxT*C + L*(12C^2 + 13C) + 2C: 124,475,904 for d12."""
        C, L = self.channels, self.num_layers
        return self.padded_vocab_size * C + self.max_seq_len * C + L * (12 * C * C + 13 * C) + 2 * C

    def __str__(self):
        """The sizes in one short phrase, as a descriptor names them: "d2c64h4 (V 50257 padded to 50304,
        maxT 1024)"."""
        return (f"d{self.num_layers}c{self.channels}h{self.num_heads} (V {self.vocab_size} padded to "
                f"{self.padded_vocab_size}, maxT {self.max_seq_len})")

    @property
    def eot(self):
        """The <|endoftext|> id that samples start from, when no tokenizer file names it: GPT-2's is the
        last id of its vocabulary (50256), and a model with another vocabulary is taken to do the same."""
        return self.vocab_size - 1

    def flops_per_token(self, T):
        """llm.c's training FLOPs per token at sequence length T, for MFU: 6N for the forward and backward
        matmuls over the N parameters, and 6LCT for attention's two (T, T) products per layer."""
        return 6 * self.num_parameters + 6 * self.num_layers * self.channels * T

    @classmethod
    def from_descriptor(cls, desc):
        """Build a config from 'd12' or 'd2c64h4'; raise ConfigError with a clear message otherwise."""
        m = re.fullmatch(r"(?:gpt2:)?d(\d+)(?:c(\d+)h(\d+))?", desc)
        if not m:
            raise DescriptorError(f"unsupported model descriptor '{desc}': use dL (d6, d12, d24, d36, d48) "
                                  f"or dLcChNH (e.g. d2c64h4)")
        L = int(m.group(1))
        if m.group(2) is None:
            if L not in DEPTHS:
                raise ConfigError(f"unsupported GPT-2 depth {L} in '{desc}': choose one of "
                                  + ", ".join(f"d{d}" for d in DEPTHS))
            C, NH = DEPTHS[L]
        else:
            C, NH = int(m.group(2)), int(m.group(3))
        return cls(num_layers=L, num_heads=NH, channels=C)
