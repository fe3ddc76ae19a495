"""GPT-2's released weights as llm.c's files: gpt2_124M.bin (fp32), gpt2_124M_bf16.bin, gpt2_tokenizer.bin.

  python -m data.gpt2                                        download gpt2 (124M) from Hugging Face
  python -m data.gpt2 --model gpt2-xl                        gpt2_1558M.bin and gpt2_1558M_bf16.bin
  python -m data.gpt2 --input gpt2/ --vocab gpt2.tiktoken    offline: a model folder, or its model.safetensors
  python -m data.gpt2 --debug-state                          also the debug state that test_gpt2.py checks

This is what llm.c's train_gpt2.py exports after loading GPT2LMHeadModel, without PyTorch: the tensors of
Hugging Face's model.safetensors, laid out in llm/layout.py's flat order. llm/hf.py says what changes on the
way (Conv1D matrices are transposed, wte gets zero rows up to Vp = 50304, so their logits are 0) and what
is skipped (the tied lm_head, the causal-mask buffers); python -m llm.export goes the other way.

The sizes come from the tensors: L from the h.<l> layers, C from wte's columns, V from its rows, maxT
from wpe's rows. NH is --heads, else n_head of a config.json beside the weights, else C / 64 (every
GPT-2 has head size 64). --model names the size expected and the files written; without it, a local
model is named after its size (gpt2_124M.bin), or its descriptor for other sizes (gpt2_d2c64h4.bin).
Needs the optional packages: pip install -e ".[weights]".

--debug-state also writes what llm.c's train_gpt2.py writes for its tests: the first batch of tiny
Shakespeare's val split (B=4, T=64; python -m data.tinyshakespeare writes it) with the model's logits, loss
and gradients on it. llm.c computes them with PyTorch; here they come from reference/ in float64. Then
`test_gpt2.py -e gpt2_124M.bin -ds gpt2_124M_debug_state.bin` checks the trainer against them and against
the losses llm.c's test prints, and llm.c's own test_gpt2 reads the file as well.
"""
import json
import os
import re

import numpy as np

from data import REPO, PrepError, arguments, first_line, outputs, quiet_hub_retries
from llm import formats, memory
from llm.backends.numpy_backend import host_memory_available
from llm.config import DEPTHS, ConfigError, GPT2Config, padded_vocab
from llm.hf import CONFIG_SIZES, LM_HEAD, MASK_BUFFER, PREFIX, WEIGHTS, hf_views
from llm.launch import optional, run
from llm.layout import ParamViews
from llm.tokenizer import Tokenizer
from reference import gpt2 as ref

# Hugging Face model -> (llm.c's name for its size, L); llm.config.DEPTHS gives its C and NH
MODELS = {"gpt2": ("124M", 12), "gpt2-medium": ("355M", 24), "gpt2-large": ("774M", 36),
          "gpt2-xl": ("1558M", 48)}
# their configs: maxT = 1024, V = 50257 and Vp = 50304 are GPT2Config's defaults
NAMED = {name: GPT2Config(num_layers=L, channels=DEPTHS[L][0], num_heads=DEPTHS[L][1])
         for name, (_, L) in MODELS.items()}
HUB = "openai-community"
HEAD_SIZE = 64
# llm.c's train_gpt2.py writes its debug state from its first batch, at its defaults
DEBUG_DATA = os.path.join(REPO, "data", "tinyshakespeare", "tiny_shakespeare_val.bin")
DEBUG_B, DEBUG_T = 4, 64
DEBUG_BYTES_PER_PARAMETER = 40   # the float64 parameters and gradients, and their float32 copies, with room


def locate(path):
    """--input: a model.safetensors file, or a folder holding one -> (its path, the config.json beside it or
    None)."""
    if os.path.isdir(path):
        path = os.path.join(path, WEIGHTS)
    if not os.path.exists(path):
        raise PrepError(f"{path}: no such file: pass --input PATH to a {WEIGHTS} or a model folder holding "
                        f"one")
    config_json = os.path.join(os.path.dirname(path), "config.json")
    return path, config_json if os.path.isfile(config_json) else None


def download(model):
    """Hugging Face's model.safetensors for `model` (cached by huggingface_hub) -> its local path."""
    hub = optional("huggingface_hub", "weights")
    repo = f"{HUB}/{model}"
    print(f"downloading {WEIGHTS} of {repo}")
    quiet_hub_retries()
    try:
        return hub.hf_hub_download(repo, WEIGHTS)
    except Exception as e:   # offline, the errors differ by huggingface_hub version and HTTP library
        raise PrepError(f"cannot download {repo} ({first_line(e)}): pass --input PATH to a local {WEIGHTS} "
                        f"or a model folder holding one") from None


def tensor_names(keys, path):
    """{name without "transformer.": stored key} for the parameters; skips the mask buffers and lm_head."""
    names = {}
    for key in keys:
        name = key.removeprefix(PREFIX)
        if MASK_BUFFER.fullmatch(name) or key == LM_HEAD:
            continue
        if name in names:
            raise PrepError(f"{path}: {name} is stored twice, as {names[name]} and as {key}")
        names[name] = key
    return names


def read_config_json(config_json):
    """config.json's n_head and those of CONFIG_SIZES it holds: {field: an integer of 1 or more}. Any
    other value is refused, naming the field: int() once cut 4.7 to 4, failed on 1e999 (infinity) in a
    traceback, and 0 fell back to C / 64 heads."""
    try:
        with open(config_json, encoding="utf-8") as f:
            fields = json.load(f)
        fields["n_head"]   # the one field it must hold: a KeyError, or a TypeError where fields is no dict
    except (OSError, ValueError, KeyError, TypeError) as e:   # json's errors are ValueErrors
        raise PrepError(f"{config_json}: not a GPT-2 config.json ({type(e).__name__}: {e})") from None
    sizes = {field: fields[field] for field in ("n_head", *CONFIG_SIZES) if field in fields}
    for field, value in sizes.items():
        if type(value) is not int or value < 1:   # (type: isinstance counts JSON's true as an int)
            raise PrepError(f"{config_json}: {field} is {json.dumps(value)}, not an integer of 1 or more: "
                            f"correct it in the file")
    return sizes


def infer_config(shapes, heads, config_json, path):
    """The model's sizes from the tensors' shapes; NH from --heads, else config.json, else C / 64."""
    for name in ("wte.weight", "wpe.weight"):
        if name not in shapes:
            raise PrepError(f"{path}: missing tensor {name}: not a GPT-2 model")
        if len(shapes[name]) != 2:
            raise PrepError(f"{path}: {name} has shape {shapes[name]}, expected 2 dimensions")
    (V, C), maxT = shapes["wte.weight"], shapes["wpe.weight"][0]   # wpe's C is checked with the other shapes
    layers = [int(m.group(1)) for name in shapes if (m := re.match(r"h\.(\d+)\.", name))]
    if not layers:
        raise PrepError(f"{path}: no layers (no h.0.* tensors): not a GPT-2 model")
    L = max(layers) + 1
    sizes = dict(num_layers=L, channels=C, max_seq_len=maxT, vocab_size=V)
    fields = read_config_json(config_json) if config_json else {}
    for field, size in CONFIG_SIZES.items():
        if field in fields and fields[field] != sizes[size]:
            raise PrepError(f"{config_json}: {field} is {fields[field]}, but the tensors of {path} have "
                            f"{sizes[size]}")
    NH = heads or fields.get("n_head") or C // HEAD_SIZE
    Vp = padded_vocab(V)
    try:
        return GPT2Config(padded_vocab_size=Vp, num_heads=NH, **sizes)
    except ConfigError as e:
        raise PrepError(f"{path}: {e}: pass --heads NH") from None


def size_name(config, model):
    """llm.c's name for the model's size: "124M" for --model gpt2 (the sizes must be gpt2's), else from the
    sizes."""
    if model:
        want = NAMED[model]
        if config != want:
            raise PrepError(f"--model {model} has L={want.num_layers}, C={want.channels}, "
                            f"NH={want.num_heads}, maxT={want.max_seq_len}, V={want.vocab_size}, but the "
                            f"weights have L={config.num_layers}, C={config.channels}, "
                            f"NH={config.num_heads}, maxT={config.max_seq_len}, V={config.vocab_size}: pass "
                            f"the matching --model")
        return MODELS[model][0]
    for name, named in NAMED.items():
        if config == named:
            return MODELS[name][0]
    return f"d{config.num_layers}c{config.channels}h{config.num_heads}"


def check_tensors(names, shapes, dests, config, path):
    """Every tensor the model needs is there, with its shape, and there is no other."""
    for hf_name in dests:
        if hf_name not in names:
            raise PrepError(f"{path}: missing tensor {hf_name} (L={config.num_layers}, C={config.channels})")
    for hf_name, key in names.items():
        if hf_name not in dests:
            raise PrepError(f"{path}: unexpected tensor {key}: not part of GPT-2's L={config.num_layers} "
                            f"layers")
        view, transposed = dests[hf_name]
        expected = view.shape[::-1] if transposed else view.shape
        if shapes[hf_name] != expected:
            raise PrepError(f"{path}: {key} has shape {shapes[hf_name]}, expected {expected}")


def read_weights(path, config_json, heads, model):
    """model.safetensors in Hugging Face's layout -> (config, flat float32 params in llm.c's layout, size
    name)."""
    safe_open = optional("safetensors", "weights").safe_open
    try:
        f = safe_open(path, framework="np")
    except Exception as e:   # safetensors' own error type, or an OSError
        raise PrepError(f"{path}: not a safetensors file ({first_line(e)})") from None

    def load(key):
        try:
            return f.get_tensor(key)
        except Exception as e:   # e.g. a dtype NumPy lacks, such as bf16
            raise PrepError(f"{path}: cannot read {key} ({first_line(e)}): store the weights as "
                            f"float32") from None

    with f:
        names = tensor_names(f.keys(), path)
        shapes = {name: tuple(f.get_slice(key).get_shape()) for name, key in names.items()}
        config = infer_config(shapes, heads, config_json, path)
        name = size_name(config, model)
        params = np.zeros(config.num_parameters, dtype=np.float32)
        dests = hf_views(ParamViews(params, config), config)
        check_tensors(names, shapes, dests, config, path)
        for hf_name, (view, transposed) in dests.items():
            w = load(names[hf_name])
            if not formats.all_finite(w):
                raise PrepError(f"{path}: {names[hf_name]} holds NaN or infinite values: the weights are "
                                f"damaged, or of a run that diverged")
            view[...] = w.T if transposed else w
        if LM_HEAD in f.keys() and not np.array_equal(load(LM_HEAD), dests["wte.weight"][0]):
            raise PrepError(f"{path}: {LM_HEAD} differs from wte.weight: llm.c ties the two, so an untied "
                            f"head cannot be stored")
    return config, params, name


def debug_batch(shard, config):
    """The first B*T+1 tokens of `shard` as llm.c's loader gives them: x, and y = x shifted by one. Checked,
    with the memory the reference needs, before any file is written."""
    memory.check({"the reference's float64 pass": DEBUG_BYTES_PER_PARAMETER * config.num_parameters},
                 host_memory_available(), "leave out --debug-state, or use a machine with more memory")
    T = min(DEBUG_T, config.max_seq_len)
    if not os.path.exists(shard):
        raise PrepError(f"--debug-state {shard}: no such file: python -m data.tinyshakespeare writes it")
    tokens = formats.read_shard(shard)
    if len(tokens) < DEBUG_B * T + 1:
        raise PrepError(f"--debug-state {shard}: {len(tokens)} tokens, the debug batch needs "
                        f"{DEBUG_B * T + 1} (B={DEBUG_B}, T={T})")
    batch = np.array(tokens[:DEBUG_B * T + 1], dtype=np.int32)
    if batch.max() >= config.vocab_size:
        raise PrepError(f"--debug-state {shard}: token id {batch.max()} is outside the model's vocab "
                        f"0..{config.vocab_size - 1}")
    return batch[:-1].reshape(DEBUG_B, T), batch[1:].reshape(DEBUG_B, T)


def write_debug_state(path, config, params, x, y):
    """llm.c's debug state: the batch x, y with reference/'s float64 logits (the V real columns), mean loss
    and gradients (llm.c's flat layout, wte's padding rows 0) of the model on it."""
    print(f"computing the debug state of B={x.shape[0]}, T={x.shape[1]} with reference/ in float64")
    p = ParamViews(params, config).copies(np.float64)
    logits, loss, cache = ref.gpt2_forward(p, config, x, y)
    grads = ref.gpt2_backward(p, config, cache)
    flat = np.zeros(config.num_parameters, dtype=np.float32)
    for name, view in ParamViews(flat, config):
        view[...] = grads[name]
    print(f"writing {path} (loss {loss:.6f})")
    formats.write_debug_state(path, x, y, logits[..., :config.vocab_size], loss, flat)


def main(argv):
    parser = arguments(__doc__.splitlines()[0], f"{HUB}/<model>'s {WEIGHTS}", "",
                       input_help=f"a {WEIGHTS} file, or a model folder holding one")
    parser.add_argument("--model", choices=MODELS,
                        help="which GPT-2: names the files and checks the sizes (default: gpt2 for a "
                             "download; for --input, the sizes the weights have)")
    parser.add_argument("--heads", type=int, help="NH, when there is no config.json and C / 64 is not right")
    parser.add_argument("--debug-state", nargs="?", const=DEBUG_DATA, metavar="SHARD",
                        help="also write llm.c's debug state for test_gpt2.py, from the first batch of SHARD "
                             "(default: data/tinyshakespeare/tiny_shakespeare_val.bin)")
    args = parser.parse_args(argv)
    if args.heads is not None and args.heads < 1:
        raise PrepError(f"--heads {args.heads}: a model has at least 1 head")
    with outputs(args.out) as written:
        if args.input:
            model = args.model
            path, config_json = locate(args.input)
        else:
            model = args.model or "gpt2"
            path, config_json = download(model), None
        config, params, name = read_weights(path, config_json, args.heads, model)
        batch = None if args.debug_state is None else debug_batch(args.debug_state, config)
        tokenizer = Tokenizer(args.vocab)
        print(f"GPT-2 {name}: L={config.num_layers}, C={config.channels}, NH={config.num_heads}, "
              f"maxT={config.max_seq_len}, V={config.vocab_size}, Vp={config.padded_vocab_size}: "
              f"{config.num_parameters:,} parameters")
        for version, suffix in ((formats.MODEL_VERSION_FP32, ""), (formats.MODEL_VERSION_BF16, "_bf16")):
            out = os.path.join(args.out, f"gpt2_{name}{suffix}.bin")
            print(f"writing {out} (version {version}, {formats.MODEL_VERSIONS[version]})")
            formats.write_model(out, config, params, version)
            written.append(out)
        out = os.path.join(args.out, "gpt2_tokenizer.bin")
        print(f"writing the bytes of {tokenizer.enc.n_vocab:,} tokens to {out}")
        tokenizer.write_tokenizer_file(out)
        written.append(out)
        if batch is not None:
            write_debug_state(os.path.join(args.out, f"gpt2_{name}_debug_state.bin"), config, params, *batch)


if __name__ == "__main__":
    run(main)
