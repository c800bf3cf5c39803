"""The family-agnostic engine behind ``generate_flax.py``, in seven wings (bottom to top):

    run        the process and its settings: errors, RunConfig, chips, mesh, runtime
    files      what a run reads and writes: checkpoint, integrity, image, videos, staging,
               report, plots
    weights    weights onto devices: placement, sharding, scan_layers, lora
    programs   what is compiled and run: step, step_cache, experts, VAE encode and decode,
               denoise (the denoising loop and its timing protocol)
    pipeline   one generation, stage by stage: prologue, stages, Generation, generate
    dry_run    the deviceless path: abstract, estimate, fit
    serve      ``--serve``: the OpenAI /v1/videos server (docs/serving.md)

A wing imports only itself and the wings below it; ``dry_run`` and ``serve`` are siblings at
the top and import neither each other; the engine imports the kernel
(``custom_splash_attention``) and never ``families``: a family arrives as a
``families.ModelFamily`` value. ``tests/test_layering.py`` keeps it so; docs/architecture.md
has the map.
"""
