"""Our exp2 Splash attention kernel, one module per concern (as JAX's
``jax/experimental/pallas/ops/tpu/splash_attention/`` is split):

* ``splash.blocks``: ``BlockSizes``, per-chip defaults, fitting blocks, scoped VMEM.
* ``splash.mask``: the ``Mask`` protocol, ``LocalMask``, ``HeadMasks``, segment ids.
* ``splash.mask_info``: a mask at one tiling -> the kernel's scalar-prefetched tables.
* ``splash.options``: ``AttentionOptions``.
* ``splash.kernel``: the Pallas kernel, ``attention``, and ``describe_calls``.
* ``splash.sharded``: the kernel under ``shard_map`` (heads, Ulysses, q sequence).
* ``splash.stock``: JAX's own splash kernel, the fallback.
* ``splash.reference``: float32 reference, XLA attention, the kernel self-check.
* ``splash.gpu``: the NVIDIA GPU backend: cuDNN flash attention and which calls take it.
* ``splash.chunked``: query-chunked XLA attention (bounded score memory), its chunk size.
* ``splash.sdpa``: the torch SDPA adapter's trace-time state (padding, forced backends).

Users import the public face, ``custom_splash_attention``; this package never imports it
(nor ``engine`` or ``families``).
"""
