"""mlx-lm's ``llama`` forward pass and its gradients, written out in numpy (float32).

The toy model (``mlxkv.models.toy``) was trained with it (``benchmarks/quality/train.py``)
rather than in MLX because the Linux ``mlx[cpu]`` wheel multiplies matrices with a reference
BLAS (single-threaded, a few GFLOP/s), while numpy's OpenBLAS uses every core. The arithmetic
is the mlx-lm llama's exactly (RMSNorm, split-half RoPE, grouped-query causal attention,
SwiGLU, tied embeddings); ``tests/test_quality_model.py`` checks logits and gradients against
MLX's autograd on the mlx-lm module.

Parameters are a dict keyed by mlx-lm's weight names, linear weights ``[out, in]``.
"""

import numpy as np


def param_shapes(cfg: dict) -> dict:
    d, v, f = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    hq, hkv, dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (hq * dh, d),
                p + "self_attn.k_proj.weight": (hkv * dh, d),
                p + "self_attn.v_proj.weight": (hkv * dh, d),
                p + "self_attn.o_proj.weight": (d, hq * dh),
                p + "post_attention_layernorm.weight": (d,),
                p + "mlp.gate_proj.weight": (f, d),
                p + "mlp.up_proj.weight": (f, d),
                p + "mlp.down_proj.weight": (d, f),
            }
        )
    return shapes


def init_params(cfg: dict, seed: int) -> dict:
    """Normal(0, 0.02) matrices (output projections scaled by 1/sqrt(2 * layers)), unit norms;
    drawn in sorted name order from one generator."""
    rng = np.random.default_rng(seed)
    out_scale = 1.0 / np.sqrt(2 * cfg["num_hidden_layers"])
    params = {}
    for name, shape in sorted(param_shapes(cfg).items()):
        if name.endswith("norm.weight"):
            params[name] = np.ones(shape, np.float32)
        else:
            std = 0.02 * (out_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
            params[name] = (rng.standard_normal(shape) * std).astype(np.float32)
    return params


# -- pieces -----------------------------------------------------------------------------


def _rms(x, w, eps):
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    xh = x * r
    return xh * w, (xh, r)


def _rms_back(dy, w, saved):
    xh, r = saved
    dw = np.sum((dy * xh).reshape(-1, xh.shape[-1]), axis=0)
    dxh = dy * w
    dx = r * (dxh - xh * np.mean(dxh * xh, axis=-1, keepdims=True))
    return dx, dw


def rope_tables(length: int, head_dim: int, base: float):
    inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    ang = np.arange(length, dtype=np.float32)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _rope(x, cos, sin, traditional=False):
    """Split-half RoPE (mlx-lm's default): dimension ``i`` turns with ``i + d/2``; traditional
    (llama.cpp's GGUF layout): ``2i`` with ``2i + 1``."""
    if traditional:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return np.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _rope_back(dy, cos, sin):
    h = dy.shape[-1] // 2
    d1, d2 = dy[..., :h], dy[..., h:]
    return np.concatenate([d1 * cos + d2 * sin, d2 * cos - d1 * sin], axis=-1)


def _silu(x):
    s = 1.0 / (1.0 + np.exp(-x))
    return x * s, s


# -- the model --------------------------------------------------------------------------


def _forward(params: dict, cfg: dict, inputs: np.ndarray):
    """The layers and the final norm: (normed hidden states [B, T, d], the norm's saved
    values, each layer's saved values). ``cfg["rope_traditional"]`` turns RoPE's pairs as
    llama.cpp's GGUF rows are laid out (forward only)."""
    B, T = inputs.shape
    hq, hkv, dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, group, traditional = cfg["rms_norm_eps"], hq // hkv, cfg.get("rope_traditional", False)
    cos, sin = rope_tables(T, dh, cfg.get("rope_theta", 10000.0))
    scale = np.float32(dh**-0.5)
    causal = np.triu(np.full((T, T), -np.inf, np.float32), 1)

    x = params["model.embed_tokens.weight"][inputs]  # [B, T, d]
    tape = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        xn, s1 = _rms(x, params[p + "input_layernorm.weight"], eps)
        q = (xn @ params[p + "self_attn.q_proj.weight"].T).reshape(B, T, hq, dh).transpose(0, 2, 1, 3)
        k = (xn @ params[p + "self_attn.k_proj.weight"].T).reshape(B, T, hkv, dh).transpose(0, 2, 1, 3)
        v = (xn @ params[p + "self_attn.v_proj.weight"].T).reshape(B, T, hkv, dh).transpose(0, 2, 1, 3)
        q, k = _rope(q, cos, sin, traditional), _rope(k, cos, sin, traditional)
        kr, vr = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        s = q @ kr.transpose(0, 1, 3, 2) * scale + causal
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        att = s / s.sum(axis=-1, keepdims=True)
        o = (att @ vr).transpose(0, 2, 1, 3).reshape(B, T, hq * dh)
        h = x + o @ params[p + "self_attn.o_proj.weight"].T
        hn, s2 = _rms(h, params[p + "post_attention_layernorm.weight"], eps)
        g = hn @ params[p + "mlp.gate_proj.weight"].T
        u = hn @ params[p + "mlp.up_proj.weight"].T
        sg, sig = _silu(g)
        a = sg * u
        x = h + a @ params[p + "mlp.down_proj.weight"].T
        tape.append((xn, s1, q, kr, vr, att, o, hn, s2, g, u, sg, sig, a))
    xf, sf = _rms(x, params["model.norm.weight"], eps)
    return xf, sf, tape


def logits(params: dict, cfg: dict, inputs: np.ndarray) -> np.ndarray:
    """The logits [B, T, V] of ``inputs`` ([B, T] ints)."""
    return _forward(params, cfg, inputs)[0] @ params["model.embed_tokens.weight"].T


def loss_and_grads(
    params: dict, cfg: dict, inputs: np.ndarray, targets: np.ndarray, weights: np.ndarray, need_grads: bool = True
):
    """Weighted mean cross-entropy of ``targets`` given ``inputs`` ([B, T] ints), the
    gradient of every parameter (None when ``need_grads`` is false), and per-token stats:
    ``nll`` and ``hit`` (the target is the arg-max), both [B, T]."""
    if need_grads and cfg.get("rope_traditional", False):
        raise ValueError("the gradients are written for split-half RoPE")
    B, T = inputs.shape
    d, hq, hkv, dh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    group = hq // hkv
    cos, sin = rope_tables(T, dh, cfg.get("rope_theta", 10000.0))
    scale = np.float32(dh**-0.5)
    emb = params["model.embed_tokens.weight"]
    xf, sf, tape = _forward(params, cfg, inputs)
    logits = xf @ emb.T  # [B, T, V]
    logits = logits - logits.max(axis=-1, keepdims=True)
    lse = np.log(np.sum(np.exp(logits), axis=-1))
    nll = lse - np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    wsum = float(weights.sum())
    loss = float(np.sum(nll * weights) / wsum)
    stats = {"nll": nll, "hit": np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] >= 0}
    if not need_grads:
        return loss, None, stats

    grads = {}
    dlogits = np.exp(logits - lse[..., None])
    np.put_along_axis(
        dlogits, targets[..., None], np.take_along_axis(dlogits, targets[..., None], axis=-1) - 1, axis=-1
    )
    dlogits *= (weights / wsum)[..., None].astype(np.float32)
    demb = dlogits.reshape(-1, dlogits.shape[-1]).T @ xf.reshape(-1, d)
    dxf = dlogits @ emb
    dx, grads["model.norm.weight"] = _rms_back(dxf, params["model.norm.weight"], sf)
    for i in reversed(range(cfg["num_hidden_layers"])):
        p = f"model.layers.{i}."
        xn, s1, q, kr, vr, att, o, hn, s2, g, u, sg, sig, a = tape[i]
        # MLP
        dh_ = dx
        grads[p + "mlp.down_proj.weight"] = dx.reshape(-1, d).T @ a.reshape(-1, a.shape[-1])
        da = dx @ params[p + "mlp.down_proj.weight"]
        du = da * sg
        dg = da * u * sig * (1 + g * (1 - sig))
        grads[p + "mlp.gate_proj.weight"] = dg.reshape(-1, dg.shape[-1]).T @ hn.reshape(-1, d)
        grads[p + "mlp.up_proj.weight"] = du.reshape(-1, du.shape[-1]).T @ hn.reshape(-1, d)
        dhn = dg @ params[p + "mlp.gate_proj.weight"] + du @ params[p + "mlp.up_proj.weight"]
        dhn, grads[p + "post_attention_layernorm.weight"] = _rms_back(
            dhn, params[p + "post_attention_layernorm.weight"], s2
        )
        dh_ = dh_ + dhn
        # attention
        grads[p + "self_attn.o_proj.weight"] = dh_.reshape(-1, d).T @ o.reshape(-1, o.shape[-1])
        do = (dh_ @ params[p + "self_attn.o_proj.weight"]).reshape(B, T, hq, dh).transpose(0, 2, 1, 3)
        datt = do @ vr.transpose(0, 1, 3, 2)
        dvr = att.transpose(0, 1, 3, 2) @ do
        ds = att * (datt - np.sum(datt * att, axis=-1, keepdims=True)) * scale
        dq = ds @ kr
        dkr = ds.transpose(0, 1, 3, 2) @ q
        dk = dkr.reshape(B, hkv, group, T, dh).sum(axis=2)
        dv = dvr.reshape(B, hkv, group, T, dh).sum(axis=2)
        dq, dk = _rope_back(dq, cos, sin), _rope_back(dk, cos, sin)
        dq = dq.transpose(0, 2, 1, 3).reshape(B, T, hq * dh)
        dk = dk.transpose(0, 2, 1, 3).reshape(B, T, hkv * dh)
        dv = dv.transpose(0, 2, 1, 3).reshape(B, T, hkv * dh)
        xf2 = xn.reshape(-1, d)
        grads[p + "self_attn.q_proj.weight"] = dq.reshape(-1, hq * dh).T @ xf2
        grads[p + "self_attn.k_proj.weight"] = dk.reshape(-1, hkv * dh).T @ xf2
        grads[p + "self_attn.v_proj.weight"] = dv.reshape(-1, hkv * dh).T @ xf2
        dxn = (
            dq @ params[p + "self_attn.q_proj.weight"]
            + dk @ params[p + "self_attn.k_proj.weight"]
            + dv @ params[p + "self_attn.v_proj.weight"]
        )
        dxn, grads[p + "input_layernorm.weight"] = _rms_back(dxn, params[p + "input_layernorm.weight"], s1)
        dx = dh_ + dxn
    np.add.at(demb, inputs.reshape(-1), dx.reshape(-1, d))
    grads["model.embed_tokens.weight"] = demb
    return loss, grads, stats
