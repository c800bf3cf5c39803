"""The video server behind ``generate_flax.py --serve`` (docs/serving.md).

OpenAI's asynchronous Videos API (``POST /v1/videos``, ``GET /v1/videos/{id}``,
``GET /v1/videos/{id}/content``, ``GET /v1/videos``, ``DELETE /v1/videos/{id}``) on one
loaded, placed and compiled model, with a web page at ``/``:

    flags      --serve, --host, --port, --api_key, --serve_sizes, --serve_frames; the buckets
    model      the warm model: load once, compile per (size, frames) bucket, warm up, run a job
    jobs       the job store (stdlib ``sqlite3`` under --output_dir): nothing accepted is lost
    requests   a request's fields checked against the served buckets (OpenAI error shape)
    uploads    input_reference: an image-to-video job's first frame, checked and stored
    hosts      multi-host hand-off: process 0 takes HTTP and gives each job to the others
    fatal_log  a multi-host process's stderr filter: JAX's fatal log on a peer's death -> one
               error line
    worker     one job at a time on the mesh, in arrival order
    webhooks   callback_url: an outbox row in the job store, delivered signed (Standard
               Webhooks), at least once, to public hosts only
    app        the FastAPI app and ``serve`` (uvicorn)

The top wing of the engine: it imports the wings below it and never the script or
``families``; the script hands it the model family and its own stage functions as values.
"""
