"""The NumPy reference, derived by hand: one forward/backward pair per layer, and GPT-2 composed from them.

Every function is pure (fresh outputs, inputs untouched) and runs in the dtype of its arguments. The
layers follow llm.c's train_gpt2.c; the NumPy backend (llm/backends/numpy_backend.py) calls them, and
reference.gpt2 is the ground truth the trainer is tested against.
"""
from .adamw import adamw_update
from .attention import attention_backward, attention_forward
from .crossentropy import crossentropy_backward, crossentropy_forward
from .encoder import encoder_backward, encoder_forward
from .flash_attention import (flash_backward, flash_backward_dkv, flash_backward_dot, flash_backward_dq,
                              flash_forward)
from .gelu import gelu_backward, gelu_forward
from .layernorm import layernorm_backward, layernorm_forward
from .matmul import matmul_backward, matmul_forward
from .residual import residual_backward, residual_forward
