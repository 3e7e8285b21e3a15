"""The engine-facing backend: speedmla's MlaBackend with the method names of TokenSpeed's
``tokenspeed_mla`` backend (CuteDSLMLABackend), so that an engine can swap it in.

The work is done in C++ (include/speedmla/backend.h): metadata is built on the device without
host synchronisation, CUDA-graph buffers are static, and each backend owns its decode
workspace: one per stream, and one for its CUDA graphs. This class converts the engine's objects and keeps the engine-visible metadata
(``forward_decode_metadata``, ``forward_prefill_metadata``, ``chunked_prefill_metadata``).
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from . import _tensors as tz
from ._native import Error, lib
from .ops import (CACHE_ROW_DIM, LATENT_DIM, PREFILL_QK_DIM, PREFILL_V_DIM, ROPE_DIM, _value_layout_transposed,
                  value_shape)

DEFAULT_CHUNKED_PREFILL_CAPACITY = 8192 * 4


class ForwardMode(enum.IntEnum):
    """What a forward pass does; speculative verify is DECODE with q_len > 1."""

    DECODE = 0
    EXTEND = 1
    MIXED = 2  # extend requests first (rows [0, num_extends)), decode requests after

    @classmethod
    def of(cls, mode: Any) -> ForwardMode:
        """Accepts a ForwardMode, its name ("decode", "extend", "mixed"), or an engine's mode
        object with is_extend_or_mixed()/is_mixed() (TokenSpeed, SGLang): anything that is
        neither extend nor mixed (decode, target verify, idle) is DECODE."""
        if isinstance(mode, cls):
            return mode
        if isinstance(mode, str):
            try:
                return cls[mode.upper()]
            except KeyError:
                raise Error(f"forward_mode must be decode, extend or mixed, got {mode!r}") from None
        if hasattr(mode, "is_extend_or_mixed"):
            if not mode.is_extend_or_mixed():
                return cls.DECODE
            return cls.MIXED if mode.is_mixed() else cls.EXTEND
        raise Error(f"forward_mode must be a speedmla.ForwardMode, a name or an engine "
                    f"ForwardMode, got {mode!r}")


def _dtype_of_cache(dtype: Any) -> str:
    """float8_e4m3fn or bfloat16 from a torch dtype or a name (engine spellings included)."""
    name = str(dtype).removeprefix("torch.")
    aliases = {"fp8_e4m3": "float8_e4m3fn", "fp8": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn",
               "bf16": "bfloat16", "bfloat16": "bfloat16"}
    if name not in aliases:
        raise Error(f"MlaBackend: kv_cache_dtype must be float8_e4m3fn or bfloat16, got {dtype!r}")
    return aliases[name]


def _device_of(device: Any) -> tuple[bool, int]:
    """(is CUDA, index) from "cpu", "cuda", "cuda:N", an int (CUDA ordinal) or a torch.device."""
    if isinstance(device, int):
        return True, device
    kind, _, index = str(device).partition(":")
    if kind not in ("cpu", "cuda"):
        raise Error(f"MlaBackend: device must be cpu or cuda[:N], got {device!r}")
    if kind == "cpu":
        return False, 0
    if index:
        return True, int(index)
    # A torch.device("cuda") carries its index (maybe None); a plain "cuda" string means device 0
    # (str has an unrelated .index method).
    current = None if isinstance(device, str) else getattr(device, "index", None)
    return True, current if current is not None else 0


@dataclass
class MlaBackendConfig:
    """The settings of speedmla::MlaBackendConfig; checked when the backend is built.

    num_heads: the model's attention heads; tp_size: attention tensor parallelism (each rank
    runs num_heads // tp_size heads, 1..128); page_size: a power of two from 1 to 128 tokens;
    kv_cache_dtype: "float8_e4m3fn" or "bfloat16" (torch dtypes and "fp8_e4m3" accepted);
    context_len: most tokens of a request; max_batch: most requests per forward outside CUDA
    graphs; max_graph_batch: largest graph batch (0: no graphs); num_draft_tokens: speculative
    verify tokens per request (the decode q_len, 0: plain decode); is_draft: a draft model's
    backend; seed_compatible: also require tokenspeed_mla's FP8 cache and page 32/64;
    chunked_prefill_capacity: prefix tokens gathered per loop; device: "cpu", "cuda[:N]",
    an ordinal or a torch.device.
    """

    num_heads: int
    context_len: int
    tp_size: int = 1
    page_size: int = 64
    kv_cache_dtype: Any = "float8_e4m3fn"
    max_batch: int = 256
    max_graph_batch: int = 0
    num_draft_tokens: int = 0
    is_draft: bool = False
    seed_compatible: bool = False
    chunked_prefill_capacity: int = DEFAULT_CHUNKED_PREFILL_CAPACITY
    device: Any = "cpu"

    @classmethod
    def from_engine(cls, config: Any, **overrides: Any) -> MlaBackendConfig:
        """From an engine's MLA config (TokenSpeed's MLAConfig: num_attention_heads,
        attn_tp_size, page_size, kv_cache_dtype, context_len, device); `overrides` set the
        rest (max_batch, max_graph_batch, num_draft_tokens, is_draft, ...)."""
        values = {
            "num_heads": config.num_attention_heads,
            "tp_size": getattr(config, "attn_tp_size", 1),
            "page_size": config.page_size,
            "kv_cache_dtype": config.kv_cache_dtype,
            "context_len": config.context_len,
            "device": getattr(config, "device", "cpu"),
        }
        values.update(overrides)
        return cls(**values)


@dataclass
class DecodeMetadata:
    """The decode rows of a batch (the seed's CuteDSLMLADecodeMetadata)."""

    num_extends: int = 0
    block_kv_indices: Any = None  # [bs, padded_pages] int32, padded with page 0
    max_seq_len_k: int | None = None  # context_len: a bound that needs no host sync
    seq_lens_k: Any = None  # [bs] int32, the engine's tensor


@dataclass
class PrefillMetadata:
    """The extend rows of a batch (the seed's CuteDSLMLAPrefillMetadata)."""

    max_seq_len: int
    cum_seq_lens: Any  # [n+1] int32: cumulative prefix + new tokens
    seq_lens: Any  # [n] the engine's seq_lens of the extend rows


@dataclass
class ChunkedPrefillMetadata:
    """The cached-prefix loops of an extend batch (as TokenSpeed's chunked-prefill metadata)."""

    extend_prefix_lens: Any
    extend_prefix_lens_cpu: Any
    extend_seq_lens: Any
    extend_seq_lens_cpu: Any
    req_pool_indices: Any
    cum_extend_seq_lens: Any  # [n+1] int32: cu_seqlens of the new tokens (q)
    max_extend_seq_len: int
    chunked_loop_num: int
    chunk_kv_indices_list: list = field(default_factory=list)  # per loop [tokens] int64 slots
    cu_chunked_seq_len: list = field(default_factory=list)  # per loop [n+1] int32
    max_chunk_len_per_loop: list = field(default_factory=list)  # per loop, host ints
    chunk_len: int = 0  # prefix tokens per request per loop
    max_loop_tokens: int = 0  # rows of attend_cached_prefix's scratch


class MlaBackend:
    """MLA attention for an inference engine: metadata, CUDA graphs, decode, chunked prefill.

    Method names and arguments follow TokenSpeed's tokenspeed_mla backend. All tensors of one
    backend live on its configured device; PyTorch tensors are used in place (DLPack) and work
    runs on PyTorch's current stream. A NumPy-only CPU backend runs the reference.
    """

    kv_lora_rank = LATENT_DIM
    qk_rope_head_dim = ROPE_DIM
    qk_nope_head_dim = PREFILL_QK_DIM - ROPE_DIM
    v_head_dim = PREFILL_V_DIM
    kv_cache_dim = CACHE_ROW_DIM

    def __init__(self, config: Any, **overrides: Any):
        """`config` is a MlaBackendConfig or an engine MLA config (see
        MlaBackendConfig.from_engine, which `overrides` are passed to)."""
        if not isinstance(config, MlaBackendConfig):
            config = MlaBackendConfig.from_engine(config, **overrides)
        elif overrides:
            raise Error("MlaBackend: overrides apply to engine configs; edit the MlaBackendConfig")
        self.config = config
        cuda, index = _device_of(config.device)
        self.data_type = _dtype_of_cache(config.kv_cache_dtype)
        self._handle = lib().make_backend(
            int(config.num_heads), int(config.tp_size), int(config.page_size), self.data_type,
            int(config.context_len), int(config.max_batch), int(config.max_graph_batch),
            int(config.num_draft_tokens), bool(config.is_draft), bool(config.seed_compatible),
            int(config.chunked_prefill_capacity), cuda, index)
        self.max_context_len = int(config.context_len)
        self.page_size = int(config.page_size)
        self.num_local_heads = int(config.num_heads) // int(config.tp_size)
        self.is_draft = bool(config.is_draft)
        self.forward_decode_metadata: DecodeMetadata | None = None
        self.forward_prefill_metadata: PrefillMetadata | None = None
        self.chunked_prefill_metadata: ChunkedPrefillMetadata | None = None
        self.decode_cuda_graph_metadata: dict[int, DecodeMetadata] = {}
        self.cuda_graph_seq_lens_buf = None
        self._block_table_aliased = False

    @property
    def block_table_width(self) -> int:
        """Pages per block-table row: ceil(context_len / page_size) rounded up to a multiple of
        max(1, 128 // page_size)."""
        return int(lib().backend_block_table_width(self._handle))

    def workspace_bytes(self, batch: int, q_len: int) -> int:
        """Device workspace forward_decode needs for `batch` requests of `q_len` tokens."""
        return int(lib().backend_workspace_bytes(self._handle, int(batch), int(q_len)))

    def workspace_capacity(self) -> int:
        """Bytes of this backend's workspace for eager calls on the current stream (0 before
        the stream's first forward_decode)."""
        return int(lib().backend_workspace_capacity(self._handle))

    # ---- metadata --------------------------------------------------------------------------

    def init_forward_metadata(self, bs: int, num_extends: int, req_pool_indices, seq_lens,
                              forward_mode, req_to_page, seq_lens_cpu=None, spec_info=None,
                              **kwargs) -> None:
        """Builds the metadata of a batch of `bs` requests, extend rows first.

        Args:
            req_pool_indices: [bs] int32/int64: each request's row of req_to_page.
            seq_lens: [bs] int32: KV lengths including new tokens; kept (aliased) by the decode
                metadata, so it must stay alive and in place for the forward pass.
            forward_mode: see ForwardMode.of.
            req_to_page: [pool_size, max_pages] int32 page ids.
            seq_lens_cpu, spec_info: accepted for the seed's signature; unused.
            kwargs: for extend and mixed batches, extend_prefix_lens[_cpu] and
                extend_seq_lens[_cpu] ([num_extends] each; the *_cpu host copies are used, the
                device ones read with a host sync when the copies are missing).

        Decode rows get a block table built by a GPU kernel (no host sync); extend rows get
        cumulative lengths and the chunked-prefill plan.
        """
        mode = ForwardMode.of(forward_mode)
        prefix_cpu = extend_cpu = None
        if mode != ForwardMode.DECODE:
            prefix_cpu = tz.host_int32(self._extend_lens(kwargs, "extend_prefix_lens"))
            extend_cpu = tz.host_int32(self._extend_lens(kwargs, "extend_seq_lens"))
        lib().backend_init_forward_metadata(self._handle, int(bs), int(num_extends), req_pool_indices,
                                            seq_lens, int(mode), req_to_page, prefix_cpu, extend_cpu)
        self.forward_decode_metadata = self._decode_metadata(seq_lens[:bs], seq_lens)
        self.forward_prefill_metadata = self.chunked_prefill_metadata = None
        if mode != ForwardMode.DECODE:
            self._set_extend_metadata(seq_lens, req_pool_indices, num_extends, kwargs,
                                      prefix_cpu, extend_cpu)

    @staticmethod
    def _extend_lens(kwargs: dict, name: str):
        host = kwargs.get(name + "_cpu")
        if host is not None:
            return host
        if kwargs.get(name) is None:
            raise Error(f"MlaBackend.init_forward_metadata: an extend or mixed batch needs {name}_cpu "
                        f"(or {name})")
        return kwargs[name]

    def _decode_metadata(self, seq_lens, reference) -> DecodeMetadata | None:
        native = lib().backend_decode_metadata(self._handle)
        if native is None:
            return None
        num_extends, max_seq_len, block_table = native
        return DecodeMetadata(num_extends=int(num_extends), block_kv_indices=tz.like(block_table, reference),
                              max_seq_len_k=int(max_seq_len), seq_lens_k=seq_lens)

    def _set_extend_metadata(self, seq_lens, req_pool_indices, num_extends, kwargs, prefix_cpu,
                             extend_cpu) -> None:
        (n, max_seq_len, max_extend, cu_seq_lens, cu_extend, chunk_len, max_loop_tokens, chunk_cu,
         chunk_slots, max_chunk_len) = lib().backend_extend_metadata(self._handle)
        self.forward_prefill_metadata = PrefillMetadata(
            max_seq_len=int(max_seq_len), cum_seq_lens=tz.like(cu_seq_lens, seq_lens),
            seq_lens=seq_lens[:num_extends])
        self.chunked_prefill_metadata = ChunkedPrefillMetadata(
            extend_prefix_lens=kwargs.get("extend_prefix_lens"), extend_prefix_lens_cpu=prefix_cpu,
            extend_seq_lens=kwargs.get("extend_seq_lens"), extend_seq_lens_cpu=extend_cpu,
            req_pool_indices=req_pool_indices[:n], cum_extend_seq_lens=tz.like(cu_extend, seq_lens),
            max_extend_seq_len=int(max_extend), chunked_loop_num=len(chunk_cu),
            chunk_kv_indices_list=[tz.like(t, seq_lens) for t in chunk_slots],
            cu_chunked_seq_len=[tz.like(t, seq_lens) for t in chunk_cu],
            max_chunk_len_per_loop=[int(v) for v in max_chunk_len], chunk_len=int(chunk_len),
            max_loop_tokens=int(max_loop_tokens))

    @contextlib.contextmanager
    def override_num_extends(self, num_extends: int) -> Iterator[None]:
        """Within the block, decode treats rows [num_extends:] as its requests."""
        metadata = self.forward_decode_metadata
        previous = lib().backend_set_num_extends(self._handle, int(num_extends))
        if metadata is not None:
            metadata.num_extends = int(num_extends)
        try:
            yield
        finally:
            lib().backend_set_num_extends(self._handle, previous)
            if metadata is not None:
                metadata.num_extends = int(previous)

    # ---- CUDA graphs ------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, seq_lens_buf) -> None:
        """Allocates the static block table for graph batches up to max_bs (<= max_graph_batch)
        and aliases seq_lens_buf ([>= max_bs] int32; the engine writes it, never the backend)."""
        lib().backend_init_cuda_graph_state(self._handle, int(max_bs), seq_lens_buf)
        self.cuda_graph_seq_lens_buf = seq_lens_buf
        self.decode_cuda_graph_metadata = {}

    def alias_cuda_graph_block_table(self, target: MlaBackend) -> None:
        """A draft backend reads its target's static block table; its replays skip the refresh
        (the target's replay fills the table for both). Call before capturing."""
        lib().backend_alias_cuda_graph_block_table(self._handle, target._handle)
        self._block_table_aliased = True

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices=None, seq_lens=None,
                                                 forward_mode=ForwardMode.DECODE) -> None:
        """Before capturing the graph of batch size bs: the decode metadata becomes views of the
        static buffers. Decode and verify only."""
        lib().backend_capture_cuda_graph(self._handle, int(bs), int(ForwardMode.of(forward_mode)))
        metadata = self._decode_metadata(self.cuda_graph_seq_lens_buf[:bs], self.cuda_graph_seq_lens_buf)
        self.decode_cuda_graph_metadata[bs] = metadata
        self.forward_decode_metadata = metadata

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices, seq_lens=None,
                                                forward_mode=None, req_to_page=None, *,
                                                num_real: int | None = None, **kwargs) -> None:
        """Before replaying the graph of batch size bs: refreshes its block table in place from
        req_to_page (skipped without it or when aliased). seq_lens are read from the aliased
        seq_lens_buf. Rows [num_real, bs) are padding: block-table rows of page 0 (the engine
        gives them seq_len get_cuda_graph_seq_len_fill_value())."""
        mode = ForwardMode.DECODE if forward_mode is None else ForwardMode.of(forward_mode)
        lib().backend_replay_cuda_graph(self._handle, int(bs), req_pool_indices, req_to_page,
                                        -1 if num_real is None else int(num_real), int(mode))
        self.forward_decode_metadata = self.decode_cuda_graph_metadata[bs]

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """seq_len of padded graph rows: one key, on the null page."""
        return 1

    # ---- forward ----------------------------------------------------------------------------

    def forward_decode(self, q, k, v, layer, out_cache_loc, token_to_kv_pool, bs: int,
                       save_kv_cache: bool = True, **kwargs):
        """Decode / verify of the decode rows, optionally writing the new tokens' KV first.

        Args:
            q: [bs*q_len, H, 576] (or [bs*q_len, H*576]) BF16, or FP8 for an FP8 cache.
            k: [bs*q_len, 1, 576] (or [bs*q_len, 576]) the new latent ‖ rope rows; v unused.
            layer: has `scaling`; optional `k_scale_float` (FP8 dequantisation scale, default
                1), `layer_id` and `tp_q_head_num`.
            out_cache_loc: [bs*q_len] int64 cache slots of the new tokens.
            token_to_kv_pool: has get_key_buffer(layer_id), or is the cache tensor itself;
                viewed as [num_pages, page_size, 576].
            bs: decode requests (rows [num_extends, num_extends + bs) of the metadata).

        FP8 cache: the query is quantised, softmax_scale = k_scale * scaling, the output is
        scaled by k_scale and new KV is written × 1/k_scale. Returns [bs*q_len, H*512] BF16.
        """
        heads = int(getattr(layer, "tp_q_head_num", self.num_local_heads))
        kv_cache = tz.reshape(self._cache(token_to_kv_pool, layer), (-1, self.page_size, CACHE_ROW_DIM))
        query = tz.reshape(q, (-1, heads, CACHE_ROW_DIM))
        out, out_arg = tz.empty(q, (tz.shape(query)[0], heads, LATENT_DIM), "bfloat16")
        new_kv = slots = None
        if save_kv_cache:
            if k is None:
                raise Error("MlaBackend.forward_decode: save_kv_cache needs k")
            new_kv, slots = tz.arg(k), out_cache_loc
        k_scale = getattr(layer, "k_scale_float", None)
        lib().backend_forward_decode(self._handle, tz.arg(query), tz.arg(kv_cache), int(bs), out_arg,
                                     float(layer.scaling), 1.0 if k_scale is None else float(k_scale),
                                     new_kv, slots, None)
        return tz.reshape(out, (-1, heads * LATENT_DIM))

    @staticmethod
    def _cache(token_to_kv_pool, layer):
        if hasattr(token_to_kv_pool, "get_key_buffer"):
            return token_to_kv_pool.get_key_buffer(getattr(layer, "layer_id", 0))
        return token_to_kv_pool

    def forward_extend_chunked(self, q, k, v, scaling: float, logits_soft_cap=None, *,
                               cum_seq_lens_q, cum_seq_lens_kv, max_q_len=None, max_kv_len=None,
                               seq_lens=None, batch_size=None, causal: bool, out=None,
                               v_layout: str = "token_major"):
        """Ragged prefill attention of this rank's H heads, returning (out, lse) like the seed.

        Args:
            q: [Σq, H*192] or [Σq, H, 192]; k: [Σk, H, 192]; v: [Σk, H, 128]. FP8 or BF16; with
                an FP8 q, PyTorch k and v are converted to FP8 (as the seed does).
            cum_seq_lens_q, cum_seq_lens_kv: [B+1] int32.
            causal: bottom-right aligned (the new tokens' own part); False for a prefix chunk.
            out: optional [Σq, H, 128] BF16.
            v_layout: "token_major" (default), or "fp8_transposed": v FP8 [H, 128, T] as
                pack_prefill_kv(..., v_layout="fp8_transposed") writes it, which the GPU kernel
                reads without transposing (speedmla.ops.mla_prefill).
            max_q_len, max_kv_len, seq_lens, batch_size: accepted for the seed's signature;
                the kernels read the cumulative lengths.
            logits_soft_cap: must be None or 0 (MLA models use none).

        Returns:
            (out [Σq, H, 128] BF16, lse [Σq, H] FP32 natural log).
        """
        if logits_soft_cap:
            raise Error(f"MlaBackend.forward_extend_chunked: logits_soft_cap is not supported, got {logits_soft_cap}")
        heads = self.num_local_heads
        q = tz.reshape(q, (-1, heads, PREFILL_QK_DIM))
        k = tz.reshape(k, (-1, heads, PREFILL_QK_DIM))
        transposed = _value_layout_transposed(v_layout)
        if not transposed:
            v = tz.reshape(v, (-1, heads, PREFILL_V_DIM))
        if tz.dtype_name(q) == "float8_e4m3fn":
            k = tz.to_dtype(k, "float8_e4m3fn")
            if not transposed:
                v = tz.to_dtype(v, "float8_e4m3fn")
        total_q = tz.shape(q)[0]
        if out is None:
            out, out_arg = tz.empty(q, (total_q, heads, PREFILL_V_DIM), "bfloat16")
        else:
            out_arg = tz.arg(out)
        lse, _ = tz.empty(q, (total_q, heads), "float32")
        lib().backend_forward_extend_chunked(self._handle, tz.arg(q), tz.arg(k), tz.arg(v), transposed,
                                             cum_seq_lens_q, cum_seq_lens_kv, bool(causal),
                                             float(scaling), out_arg, lse)
        return out, lse

    def attend_cached_prefix(self, q, kv_cache, expand: Callable, out, lse, scaling: float,
                             k_scale: float = 1.0, v_layout: str = "token_major"):
        """Adds the cached prefixes of the current extend batch to (out, lse), in place.

        (out, lse) hold the new tokens' causal attention to themselves (forward_extend_chunked).
        For each loop of chunked_prefill_metadata: the loop's prefix rows are gathered from the
        cache (dequantised × k_scale to BF16), ``expand(latent, k, v)`` fills k [n, H, 192] and
        v [n, H, 128] (q's dtype) from latent [n, 576] (the model's kv_b_proj; the arrays are on
        q's framework and valid during the call), the new tokens attend to them (non-causal),
        and the result is merged in by its LSE.

        Args:
            q: [Σq, H, 192] FP8 or BF16, Σq = the batch's new tokens.
            kv_cache: [num_pages, page_size, 576] (or a flat [slots, 1, 576] view).
            out: [Σq, H, 128] BF16 and lse: [Σq, H] FP32, read and written.
            v_layout: "token_major" (default), or "fp8_transposed" (FP8 q): expand then gets v as
                [H, 128, P] (P the loop rows rounded up to 16) to fill in that layout, e.g. with
                pack_prefill_kv(..., v_out=v, v_layout="fp8_transposed"), which the GPU kernel
                reads without transposing it.

        Returns:
            (out, lse)
        """
        transposed = _value_layout_transposed(v_layout)
        metadata = self.chunked_prefill_metadata
        if metadata is None:
            raise Error("MlaBackend.attend_cached_prefix: no extend metadata; call "
                        "init_forward_metadata with an extend or mixed batch first")
        heads, rows = self.num_local_heads, metadata.max_loop_tokens
        dtype, total_q = tz.dtype_name(q), tz.shape(out)[0]
        scratch = [tz.empty(q, (rows, CACHE_ROW_DIM), "bfloat16")[1],
                   tz.empty(q, (rows, heads, PREFILL_QK_DIM), dtype)[1],
                   tz.empty(q, value_shape(rows, heads, v_layout), dtype)[1],
                   tz.empty(q, (total_q, heads, PREFILL_V_DIM), "bfloat16")[1],
                   tz.empty(q, (total_q, heads), "float32")[1]]

        def expand_in_framework(latent, k, v):
            expand(tz.like(latent, q), tz.like(k, q), tz.like(v, q))

        kv_cache = tz.reshape(kv_cache, (-1, self.page_size, CACHE_ROW_DIM))
        lib().backend_attend_cached_prefix(self._handle, tz.arg(q), tz.arg(kv_cache), float(k_scale),
                                           expand_in_framework, *scratch[:3], transposed, *scratch[3:], tz.arg(out), lse,
                                           float(scaling))
        return out, lse
