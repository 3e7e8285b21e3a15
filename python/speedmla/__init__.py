"""speedmla: Multi-head Latent Attention for Hopper GPUs, from Python.

Operations (speedmla.ops, re-exported here): mla_decode, mla_prefill, merge_attn_states,
kv_cache_write, gather_cache, quantize_fp8, pack_prefill_kv, and the workspace helpers.
The engine-facing backend: MlaBackend (TokenSpeed's tokenspeed_mla method names) with
MlaBackendConfig and ForwardMode. speedmla.cp merges the ranks' partial results of a
context-parallel decode (mla_decode's causal_seqs, cp_world, cp_rank).

Works on PyTorch tensors (CPU or CUDA, in place through DLPack, on the current stream, inside
torch.cuda.graph capture) and on NumPy arrays (CPU reference). Importing needs neither PyTorch
nor a GPU; the compiled module is loaded on first use. Errors raise speedmla.Error.
"""

from . import cp
from ._native import Error, library_path
from .backend import (
    ChunkedPrefillMetadata,
    DecodeMetadata,
    ForwardMode,
    MlaBackend,
    MlaBackendConfig,
    PrefillMetadata,
)
from .ops import (
    CACHE_ROW_DIM,
    LATENT_DIM,
    PREFILL_QK_DIM,
    PREFILL_V_DIM,
    ROPE_DIM,
    DecodePlan,
    decode_page_size_supported,
    device_sm_count,
    gather_cache,
    kv_cache_write,
    merge_attn_states,
    mla_decode,
    mla_decode_plan,
    mla_decode_with_plan,
    mla_decode_workspace_size,
    mla_prefill,
    pack_prefill_kv,
    quantize_fp8,
    value_shape,
)

__version__ = "0.1.0"

__all__ = [
    "CACHE_ROW_DIM", "LATENT_DIM", "PREFILL_QK_DIM", "PREFILL_V_DIM", "ROPE_DIM",
    "ChunkedPrefillMetadata", "DecodeMetadata", "DecodePlan", "Error", "ForwardMode", "MlaBackend",
    "MlaBackendConfig", "PrefillMetadata", "decode_page_size_supported", "device_sm_count",
    "gather_cache", "kv_cache_write", "library_path", "merge_attn_states", "mla_decode",
    "mla_decode_plan", "mla_decode_with_plan", "mla_decode_workspace_size", "mla_prefill",
    "pack_prefill_kv", "quantize_fp8", "value_shape",
]
