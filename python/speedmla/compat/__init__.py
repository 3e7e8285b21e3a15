"""Drop-in replacements for the kernel APIs that inference engines call today, backed by speedmla.

- ``speedmla.compat.tokenspeed_mla``: the seed's kernel API (TokenSpeed's
  ``tokenspeed_kernel.ops.attention.tokenspeed_mla``): ``tokenspeed_mla_decode``,
  ``tokenspeed_mla_prefill``, ``mla_kv_pack_quantize_fp8``, ``warmup_compile_prefill``,
  ``get_num_sm``, ``has_binary_prefill``.
- ``speedmla.compat.flash_mla``: FlashMLA's dense decode API (``get_mla_metadata``,
  ``flash_mla_with_kvcache``), as SGLang's and vLLM's Hopper MLA backends call it.

An engine switches by changing one import; docs/python.md lists every remaining difference.
Like the rest of the package, neither module needs PyTorch to import, and both run NumPy arrays
and CPU tensors through the CPU reference.
"""
