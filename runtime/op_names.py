"""The names of the ops the acceptance dispatcher (``runtime/dispatch.py``) may run as Triton kernels: a module that
imports nothing, so settings and configs can check a name without importing torch."""

# The ops with a Triton kernel in ``kernellab.kernels.KERNELS`` (the same set: tests/unit/kernels/test_registry.py).
# The kernels of ``kernels.STANDALONE`` (teaching chapters, quantized GEMVs) are never dispatched.
__all__ = ["REPLACEABLE"]

REPLACEABLE = (
    "rms_norm",
    "add_rms_norm",
    "rotary_embedding",
    "qk_norm_rope",
    "qk_norm_rope_store_kv",
    "store_kv",
    "silu_and_mul",
    "linear",
    "silu_and_mul_linear",
    "add_rms_norm_linear",
    "paged_decode_attention",
    "paged_decode_attention_qk_norm_rope",
    "decode_attention_o_proj",
    "argmax",
    "l2_prefetch",
    "varlen_causal_attention",
    "gate_up_swiglu",
    "qkv_proj_norm_rope_store_kv",
)
