"""Hugging Face's GPT-2 (GPT2LMHeadModel): its tensor names and layout, and the sizes in its config.json.

One table serves both directions: data/gpt2.py reads Hugging Face's model.safetensors into llm.c's flat
buffer, and llm/export.py writes that buffer out as one. Three things differ from llm.c's layout:
  - Hugging Face's GPT-2 computes its linear layers as Conv1D, x @ W with W stored (in, out); llm.c's
    matrices are (out, in), as nn.Linear's, so c_attn, c_proj, c_fc and mlp.c_proj are transposed.
  - wte has the V = 50257 real rows; llm.c pads it with zero rows up to Vp = 50304, a multiple of 128.
  - the lm_head is tied to wte (llm.c stores it once), and the causal-mask buffers (h.<l>.attn.bias and
    .masked_bias) are not parameters: none of the three is in the table.
Names may carry the "transformer." prefix, as GPT2LMHeadModel's state dict does.
"""
import re

WEIGHTS = "model.safetensors"
PREFIX = "transformer."
LM_HEAD = "lm_head.weight"
MASK_BUFFER = re.compile(r"h\.\d+\.attn\.(masked_)?bias")      # the causal mask, not a parameter

# llm.c's per-layer tensor <-> Hugging Face's h.<l>.<name>
LAYER_TENSORS = {
    "ln1w": "ln_1.weight", "ln1b": "ln_1.bias",
    "qkvw": "attn.c_attn.weight", "qkvb": "attn.c_attn.bias",
    "attprojw": "attn.c_proj.weight", "attprojb": "attn.c_proj.bias",
    "ln2w": "ln_2.weight", "ln2b": "ln_2.bias",
    "fcw": "mlp.c_fc.weight", "fcb": "mlp.c_fc.bias",
    "fcprojw": "mlp.c_proj.weight", "fcprojb": "mlp.c_proj.bias",
}
CONV1D = frozenset(("qkvw", "attprojw", "fcw", "fcprojw"))   # stored (in, out): transposed on the way
# config.json's sizes <-> GPT2Config's fields (n_head aside: data/gpt2.py may have to infer it)
CONFIG_SIZES = {"n_layer": "num_layers", "n_embd": "channels", "n_positions": "max_seq_len",
                "vocab_size": "vocab_size"}


def hf_views(p, config):
    """Each tensor of Hugging Face's GPT-2 as a view into llm.c's buffer (llm.layout.ParamViews p):
    {name: (view, transposed)}. Names are without "transformer."; Hugging Face stores the view transposed
    when `transposed`, so its shape is the view's, reversed."""
    views = {"wte.weight": (p.wte[:config.vocab_size], False),   # rows V..Vp are llm.c's padding
             "wpe.weight": (p.wpe, False),
             "ln_f.weight": (p.lnfw, False), "ln_f.bias": (p.lnfb, False)}
    for l in range(config.num_layers):
        for name, hf_name in LAYER_TENSORS.items():
            views[f"h.{l}.{hf_name}"] = (getattr(p, name)[l], name in CONV1D)
    return views
