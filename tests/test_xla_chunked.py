"""``--attention xla`` (the CPU default) runs the query-chunked XLA attention
(``splash.chunked``): exact float32-softmax attention in several query chunks, equal to torch's
own SDPA in float32 for the masks both families hand the override (none, cross-attention,
HunyuanVideo-1.5's key padding anywhere, sequence parallelism's declared tail, ``LocalMask``),
and compiled into bounded score memory where plain ``xla_attention`` holds every score."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import custom_splash_attention as csa
from splash.chunked import DEFAULT_SCORE_BYTES

B, H, D = 2, 3, 16
ROWS = 7  # query rows per chunk the small budget allows: several chunks and a ragged last one


def _inputs(q_len, kv_len, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, D, generator=g) for n in (q_len, kv_len, kv_len))


def _run(env, q, k, v, mask=None):
    with env:
        qx, kx, vx = env.to_xla((q, k, v))
        m = None if mask is None else env.to_xla(mask)
        out = torch.nn.functional.scaled_dot_product_attention(qx, kx, vx, attn_mask=m)
        return np.asarray(env.t2j_iso(out))


def _key_padding(kv_len):
    """(B, 1, 1, kv_len) bool, HunyuanVideo-1.5's form: row 0 a tail, row 1 a middle gap."""
    real = torch.ones(B, kv_len, dtype=torch.bool)
    real[0, kv_len - 9:] = False
    real[1, 10:17] = False
    return real[:, None, None, :]


@pytest.mark.parametrize("case", ["plain", "cross", "key_padding", "tail", "local"])
def test_xla_backend_is_chunked_and_equals_torch_sdpa(torchax_env, monkeypatch, case):
    q_len, kv_len = (50, 23) if case == "cross" else (50, 50)
    # A budget of ROWS query rows: the override must split the call into chunks.
    monkeypatch.setattr(csa, "score_budget_bytes", lambda: B * H * kv_len * 4 * ROWS)
    chunks, real_chunked = [], csa.chunked_attention

    def spy(*args, **kwargs):
        chunks.append(kwargs["chunk"])
        return real_chunked(*args, **kwargs)

    monkeypatch.setattr(csa, "chunked_attention", spy)
    monkeypatch.setattr(csa, "xla_attention", None)  # the whole-matrix path must not run
    window = csa.LocalMask(6) if case == "local" else None
    csa.install_sdpa_override(torchax_env, attention="xla",
                              options=csa.AttentionOptions(mask=window))
    q, k, v = _inputs(q_len, kv_len, seed=len(case))
    mask = _key_padding(kv_len) if case == "key_padding" else None
    if case == "local":
        mask = torch.from_numpy(np.array(window.dense(q_len, kv_len)))
    valid = 41 if case == "tail" else kv_len
    # The independent reference: torch's SDPA in float32 over the real keys only.
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :, :valid], v[:, :, :valid], attn_mask=mask).numpy()
    if case == "tail":  # Wan's sequence-parallel padding, declared at trace time
        v[:, :, valid:] = 1e4  # a padded key that leaked in would show
        token = csa.pad_self_attention_keys(kv_len, valid)
        flag = csa._IN_SELF_ATTENTION.set(True)
        try:
            got = _run(torchax_env, q, k, v)
        finally:
            csa._IN_SELF_ATTENTION.reset(flag)
            csa.unpad_self_attention_keys(token)
    else:
        got = _run(torchax_env, q, k, v, None if case == "local" else mask)
    assert chunks == [ROWS], chunks
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-5)


def test_xla_backend_bf16_matches_float32_reference(torchax_env, monkeypatch):
    """bf16 inputs: float32 scores and softmax inside, one bf16 rounding of the output."""
    monkeypatch.setattr(csa, "score_budget_bytes", lambda: B * H * 50 * 4 * ROWS)
    csa.install_sdpa_override(torchax_env, attention="xla")
    q, k, v = (x.to(torch.bfloat16) for x in _inputs(50, 50, seed=7))
    got = _run(torchax_env, q, k, v)
    want = csa.reference_attention(*(jnp.asarray(x.float().numpy()) for x in (q, k, v)))
    # bf16 has 8 mantissa bits: one rounding of an O(1) output is <= 2**-8 relative.
    np.testing.assert_allclose(got.astype(np.float32), np.asarray(want), atol=4e-3, rtol=4e-3)


def test_xla_backend_compiles_to_bounded_score_memory():
    """Compile only (nothing is allocated): 16384 tokens, 2 heads. The whole score matrix is
    2 GiB of float32; the chunked route needs about two chunks' worth (DEFAULT_SCORE_BYTES
    each, the CPU budget), plain ``xla_attention`` at least the whole matrix."""
    shape = jax.ShapeDtypeStruct((1, 2, 16384, 16), jnp.float32)
    whole = 2 * 16384 * 16384 * 4
    options = csa.AttentionOptions(mask=csa.LocalMask(100))

    def temp_bytes(fn):
        compiled = jax.jit(fn).lower(shape, shape, shape).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    chunked = temp_bytes(lambda q, k, v: csa._chunked_route(q, k, v, options, None,
                                                            scale=None, real=None))
    plain = temp_bytes(lambda q, k, v: csa.xla_attention(q, k, v))
    assert chunked <= 3 * DEFAULT_SCORE_BYTES < whole <= plain, (chunked, plain)
