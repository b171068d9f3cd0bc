#!/usr/bin/env python3
"""Reference fixtures for pdserve, made with HF transformers' DeepSeek-V4 (>= 5.17).

Needs torch + transformers 5.17 + safetensors (the H200 machine has them; a CPU-only
`pip install torch==2.11.0 transformers==5.17.0` works too: everything runs on the CPU in
float32, so the result does not depend on a GPU).

    gen_fixtures.py --out DIR [--only NAME ...] [--seed S]
        For each fixture NAME (mixed, legacy, default_schedule, quantized) write DIR/NAME/:
          config.json, model.safetensors (or model.safetensors.index.json + shards),
          (`quantized`: DeepSeek's released FP8/FP4 layout, scripts/released_layout.py;
          its logits come from the float32 model holding the values it decodes to),
          expected.safetensors  {tokens: int64 [n], logits: float32 [n, vocab]},
          meta.json             {name, description, prefill_lens, seed, versions, ...}.
        `logits` is transformers' ONE-SHOT forward (use_cache=False) of the model loaded
        back from the files written, row t = logits after token t.

    gen_fixtures.py --embedded [--out DIR] [--seed S]
        Write DIR (default models/embedded)/{config.json, model.safetensors}: a small
        random bfloat16 model matching models/embedded/tokenizer.json.

    gen_fixtures.py --check-logits MODEL_DIR --logits-json FILE --tokens T0 T1 ... [--tol 1e-4]
        One-shot float32 forward of MODEL_DIR on the tokens; compare with FILE
        ({"logits": [[...], ...]}, row t = logits after token t) by relative L2 error per
        row. Prints PASS/FAIL; exit code 1 on FAIL.

Every parameter and buffer is randomised (transformers' own init leaves sinks,
position_bias, hc base, tid2eid and the router correction bias at zero, which hides bugs);
only the derived rotary inv_freq buffers keep their computed values.

Top-k selections (the Lightning Indexer's and the routers') are checked for near-ties:
a token sequence whose k-th and (k+1)-th candidates are closer than TIE_MARGIN is
rejected and another one drawn, so an implementation that is right to ~1e-6 always
selects the same entries as the reference.
"""

import argparse
import json
import math
import os
import shutil
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIE_MARGIN = 1e-4
MAX_TOKEN_TRIES = 50

# SIZE_NOTE: all of tests/fixtures must stay near 3 MB of float32, so the widths
# (hidden, moe_intermediate) are smaller than the first plan; the structure (layer
# schedules, rates, windows, head_dim / rope split, legacy keys) is as planned.
# INDEX_HEADS_NOTE: the indexer score of an entry is sum_h w_h * relu(q_h . k); it is
# EXACTLY 0 when every head's q_h . k is negative, which with n heads happens with
# probability 2^-n per (query, entry). With 2 or 4 heads several entries per query tie at
# 0, the top-k boundary lands among them in every sequence drawn, and torch.topk breaks
# such ties in no documented order (not by index), so the reference would be ambiguous.
# 16 heads make exact-zero scores rare (2^-16), and the margin check below rejects the rest.
FIXTURES = {
    "mixed": {
        "description": (
            "4 layers sliding/CSA/HCA/CSA, hash_moe x2 then moe, compress rates 4/16, "
            "yarn on the compress rope (factor 4, original_max_position_embeddings 32), "
            "hidden 64, 16 index heads, vocab 97, 90 tokens"
        ),
        "seq_len": 90,
        "prefill_lens": [1, 3, 13, 37, 51, 89],
        "sharded": False,
        "config": dict(
            vocab_size=97,
            hidden_size=64,
            num_hidden_layers=4,
            layer_types=[
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "compressed_sparse_attention",
            ],
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
            num_attention_heads=4,
            head_dim=32,
            partial_rotary_factor=0.25,
            q_lora_rank=32,
            o_groups=2,
            o_lora_rank=16,
            index_n_heads=16,  # see INDEX_HEADS_NOTE
            index_head_dim=16,
            index_topk=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,  # see SIZE_NOTE
            hc_mult=4,
            sliding_window=8,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
            rope_theta=10000.0,
            compress_rope_theta=160000.0,
            # A flat rope dict is the compress rope's scaling: DeepseekV4Config.__post_init__
            # nests it as rope_parameters["compress"] (adding attention_factor=1.0) and gives
            # "main" the plain default rope.
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
            max_position_embeddings=4096,
        ),
    },
    "legacy": {
        "description": (
            "config.json with LEGACY keys only (compress_ratios [0,4,128,4], num_hash_layers 2, "
            "qk_rope_head_dim 16 of head_dim 64, compress_rate_csa 4; no compress_rates / "
            "layer_types / rope_parameters), sqrtsoftplus, routed_scaling_factor 2.5, "
            "swiglu_limit 0.5, 300 tokens (> one HCA window of 128), saved sharded"
        ),
        "seq_len": 300,
        "prefill_lens": [1, 7, 18, 133, 251, 299],
        "sharded": True,
        "legacy_config": {
            "vocab_size": 128,
            "hidden_size": 64,  # see SIZE_NOTE
            "num_hidden_layers": 4,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "qk_rope_head_dim": 16,
            "q_lora_rank": 40,
            "o_groups": 2,
            "o_lora_rank": 24,
            "index_n_heads": 16,  # see INDEX_HEADS_NOTE
            "index_head_dim": 32,
            "index_topk": 8,
            "n_routed_experts": 6,
            "n_shared_experts": 1,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 16,
            "sliding_window": 16,
            "scoring_func": "sqrtsoftplus",
            "routed_scaling_factor": 2.5,
            "swiglu_limit": 0.5,
            "compress_ratios": [0, 4, 128, 4],
            "compress_rate_csa": 4,
            "num_hash_layers": 2,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6,
            "rope_theta": 10000.0,
            "compress_rope_theta": 160000.0,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "tie_word_embeddings": False,
        },
    },
    "default_schedule": {
        "description": (
            "layer_types and mlp_layer_types omitted (transformers default: 2x HCA then "
            "interleaved CSA/HCA; 3 hash_moe then moe), 5 layers, compress rates 4/8, "
            "sigmoid scoring, hc_mult 2, hidden 40, vocab 64, 60 tokens"
        ),
        "seq_len": 60,
        "prefill_lens": [1, 5, 23, 45, 59],
        "sharded": False,
        # save_pretrained writes the derived schedules out; drop them again so that the
        # fixture's config.json really relies on the defaults.
        "drop_keys": ["layer_types", "mlp_layer_types"],
        "config": dict(
            vocab_size=64,
            hidden_size=40,
            num_hidden_layers=5,
            num_attention_heads=2,
            head_dim=32,
            partial_rotary_factor=0.25,
            q_lora_rank=32,
            o_groups=2,
            o_lora_rank=16,
            index_n_heads=16,  # see INDEX_HEADS_NOTE
            index_head_dim=16,
            index_topk=3,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            hc_mult=2,  # hc_mult other than 4 (Sinkhorn on 2x2)
            sliding_window=4,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            scoring_func="sigmoid",
            max_position_embeddings=4096,
        ),
    },
}

# QUANTIZED_NOTE: DeepSeek's released layout (scripts/released_layout.py): FP8 block-scaled
# attention / shared-expert / indexer-query weights, FP4 routed experts, BF16 rest. Widths
# pass one 128-block without filling the next (hidden 160, q_lora 144, heads x head_dim 192,
# o_groups x o_lora 160), so every FP8 weight has partial blocks in at least one dim.
FIXTURES["quantized"] = {
    "description": (
        "DeepSeek's released layout: FP8 e4m3 weights with ue8m0 128x128 block scales "
        "(partial blocks: hidden 160, q_lora 144, 2 heads x 96, o_lora 2x80), FP4 e2m1 routed "
        "experts with ue8m0 scales per 32, BF16/F32 rest, upstream names without `model.`, "
        "mtp.* present; CSA + HCA, hash_moe then moe, 72 tokens. Logits: transformers on the "
        "decoded values"
    ),
    "seq_len": 72,
    "prefill_lens": [1, 4, 17, 33, 71],
    "sharded": False,
    "released_layout": True,
    "config": dict(
        vocab_size=96,
        hidden_size=160,
        num_hidden_layers=2,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe"],
        num_attention_heads=2,
        head_dim=96,
        partial_rotary_factor=0.25,
        q_lora_rank=144,
        o_groups=2,
        o_lora_rank=80,
        index_n_heads=16,  # see INDEX_HEADS_NOTE
        index_head_dim=40,
        index_topk=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        hc_mult=4,
        sliding_window=8,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        max_position_embeddings=4096,
    ),
}

EMBEDDED_CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    num_hidden_layers=6,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "sliding_attention",
    ],
    num_attention_heads=4,
    head_dim=64,
    partial_rotary_factor=0.25,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=64,
    index_n_heads=16,  # see INDEX_HEADS_NOTE
    index_head_dim=32,
    index_topk=16,
    n_routed_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=48,  # 64 would make the bf16 file 6.8 MB
    hc_mult=4,
    sliding_window=64,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
    bos_token_id=0,
    eos_token_id=1,
    max_position_embeddings=4096,
)


def tf():
    import transformers
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    return transformers, DeepseekV4Config, DeepseekV4ForCausalLM


# --------------------------------------------------------------------------- randomise


def randomise(model, seed):
    """Give every parameter and buffer a random value; return the names touched."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M

    g = torch.Generator().manual_seed(seed)

    def normal(t, std, mean=0.0):
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32) * std + mean)

    def uniform(t, lo, hi):
        t.copy_(torch.rand(t.shape, generator=g, dtype=torch.float32) * (hi - lo) + lo)

    touched = {}
    with torch.no_grad():
        for mname, mod in model.named_modules():
            items = list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False))
            for pname, t in items:
                full = f"{mname}.{pname}" if mname else pname
                fan_in = t.shape[-1] if t.dim() >= 2 else None
                if pname.endswith("inv_freq"):
                    touched[full] = "derived (kept)"
                    continue
                if isinstance(mod, M.DeepseekV4RMSNorm) and pname == "weight":
                    normal(t, 0.2, 1.0)
                    how = "1+0.2N"
                elif isinstance(mod, torch.nn.Embedding) and pname == "weight":
                    normal(t, 1.0)
                    how = "N(0,1)"
                elif isinstance(mod, torch.nn.Linear) and pname == "weight":
                    # covers nn.Linear and DeepseekV4GroupedLinear (fan_in = per-group input)
                    normal(t, 1.0 / math.sqrt(fan_in))
                    how = "N(0,1/sqrt(fan_in))"
                elif isinstance(mod, M.DeepseekV4Attention) and pname == "sinks":
                    normal(t, 1.0)
                    how = "N(0,1)"
                elif pname == "position_bias":
                    normal(t, 0.5)
                    how = "N(0,0.5)"
                elif isinstance(mod, M.DeepseekV4HyperConnection) and pname == "fn":
                    normal(t, 0.5 / math.sqrt(fan_in))
                    how = "N(0,0.5/sqrt(fan_in))"
                elif isinstance(mod, M.DeepseekV4HyperConnection) and pname == "base":
                    normal(t, 0.5)
                    how = "N(0,0.5)"
                elif isinstance(mod, M.DeepseekV4HyperConnection) and pname == "scale":
                    uniform(t, 0.5, 1.5)
                    how = "U(0.5,1.5)"
                elif isinstance(mod, M.DeepseekV4HyperHead) and pname == "hc_fn":
                    normal(t, 0.5 / math.sqrt(fan_in))
                    how = "N(0,0.5/sqrt(fan_in))"
                elif isinstance(mod, M.DeepseekV4HyperHead) and pname == "hc_base":
                    normal(t, 0.5)
                    how = "N(0,0.5)"
                elif isinstance(mod, M.DeepseekV4HyperHead) and pname == "hc_scale":
                    uniform(t, 0.5, 1.5)
                    how = "U(0.5,1.5)"
                elif isinstance(mod, (M.DeepseekV4TopKRouter, M.DeepseekV4HashRouter)) and pname == "weight":
                    normal(t, 1.0 / math.sqrt(fan_in))
                    how = "N(0,1/sqrt(fan_in))"
                elif isinstance(mod, M.DeepseekV4TopKRouter) and pname == "e_score_correction_bias":
                    normal(t, 0.1)
                    how = "N(0,0.1)"
                elif isinstance(mod, M.DeepseekV4HashRouter) and pname == "tid2eid":
                    vocab, k = t.shape
                    rows = [torch.randperm(mod.num_experts, generator=g)[:k] for _ in range(vocab)]
                    t.copy_(torch.stack(rows).to(t.dtype))
                    how = f"distinct {k} of {mod.num_experts}"
                elif isinstance(mod, M.DeepseekV4Experts) and pname in ("gate_up_proj", "down_proj"):
                    normal(t, 1.0 / math.sqrt(fan_in))
                    how = "N(0,1/sqrt(fan_in))"
                else:
                    raise SystemExit(f"randomise: no rule for {full} ({type(mod).__name__}.{pname}, {tuple(t.shape)})")
                touched[full] = how

    every = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    missing = [n for n in every if n not in touched]
    if missing:
        raise SystemExit(f"randomise: not touched: {missing}")
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        if n.endswith("inv_freq"):
            continue
        if t.is_floating_point():
            assert not torch.all(t == 0), f"{n} is all zero"
            assert not torch.all(t == 1), f"{n} is all one"
            assert torch.isfinite(t).all(), f"{n} not finite"
        else:
            assert t.numel() <= 1 or not torch.all(t == t.flatten()[0]), f"{n} is constant"
    return touched


# --------------------------------------------------------------------------- model I/O


def build_config(DeepseekV4Config, kwargs):
    return DeepseekV4Config(**kwargs, attn_implementation="eager", experts_implementation="eager")


def load_model(path, dtype=torch.float32):
    """A checkpoint folder as transformers loads it; a released-layout (quantized) one
    through the float32 twin of its decoded values (released_layout.write_twin)."""
    import released_layout as rl

    if rl.is_released_layout(path):
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            rl.write_twin(path, tmp)
            return load_model(tmp, dtype)
    _, _, DeepseekV4ForCausalLM = tf()
    model = DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    )
    return model.eval()


def chmod_files(path):
    # safetensors writes 0600 files; make them readable like the rest of the tree
    for f in os.listdir(path):
        if os.path.isfile(os.path.join(path, f)):
            os.chmod(os.path.join(path, f), 0o644)


def clean_dir(path, keep_index):
    for f in sorted(os.listdir(path)):
        keep = f == "config.json" or f.endswith(".safetensors") or (keep_index and f == "model.safetensors.index.json")
        if not keep:
            p = os.path.join(path, f)
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)


def saved_tensors(path):
    """name -> (dtype, shape) of every tensor in the safetensors files of `path`."""
    from safetensors import safe_open

    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors") and f != "expected.safetensors":
            with safe_open(os.path.join(path, f), "pt") as sf:
                for k in sf.keys():
                    sl = sf.get_slice(k)
                    out[k] = (sl.get_dtype(), tuple(sl.get_shape()), f)
    return out


def print_tensor_list(path):
    ts = saved_tensors(path)
    print(f"  saved tensors ({len(ts)}):")
    for k in sorted(ts):
        dt, shape, f = ts[k]
        print(f"    {k} {dt} {list(shape)} [{f}]")


@torch.no_grad()
def forward_logits(model, tokens):
    return model(input_ids=tokens[None], use_cache=False).logits[0].float()


# --------------------------------------------------------------------------- tie margins


@torch.no_grad()
def topk_margins(model, tokens):
    """Smallest gap between the k-th and (k+1)-th candidate of every top-k selection
    made in the one-shot forward (indexer over causally visible entries, routers)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M

    margins = {}
    hooks = []

    def scorer_hook(name, indexer):
        def hook(mod, args, out):
            scores = out[0]  # [S, T]
            S, T = scores.shape
            worst = math.inf
            for s in range(S):
                visible = (s + 1) // indexer.compress_rate
                visible = min(visible, T)
                if visible <= indexer.index_topk:
                    continue
                v = torch.sort(scores[s, :visible], descending=True).values
                worst = min(worst, (v[indexer.index_topk - 1] - v[indexer.index_topk]).item())
            margins[name] = min(margins.get(name, math.inf), worst)

        return hook

    def router_hook(name, router):
        def hook(mod, args, out):
            logits = out[0]
            scores = router.score_fn(logits) + router.e_score_correction_bias
            if scores.shape[-1] <= router.top_k:
                return
            v = torch.sort(scores, dim=-1, descending=True).values
            worst = (v[:, router.top_k - 1] - v[:, router.top_k]).min().item()
            margins[name] = min(margins.get(name, math.inf), worst)

        return hook

    for name, mod in model.named_modules():
        if isinstance(mod, M.DeepseekV4Indexer):
            hooks.append(mod.scorer.register_forward_hook(scorer_hook(name, mod)))
        elif isinstance(mod, M.DeepseekV4TopKRouter):
            hooks.append(mod.register_forward_hook(router_hook(name, mod)))
    try:
        model(input_ids=tokens[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return margins


# --------------------------------------------------------------------------- fixtures


def write_legacy_config(path, legacy, DeepseekV4Config, reference_cfg):
    """Overwrite config.json with the legacy-keyed dict and check it parses the same."""
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    rewritten = [k for k in ("compress_ratios", "num_hash_layers", "compress_rate_csa") if k not in saved]
    modern = [k for k in ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters") if k in saved]
    print(f"  save_pretrained config.json: legacy keys dropped {rewritten}, modern keys written {modern}")
    out = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "dtype": "float32",
        **legacy,
        "transformers_version": saved.get("transformers_version"),
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    back = DeepseekV4Config.from_pretrained(path)
    for key in (
        "layer_types",
        "mlp_layer_types",
        "compress_rates",
        "partial_rotary_factor",
        "qk_rope_head_dim",
        "rope_parameters",
        "scoring_func",
        "routed_scaling_factor",
        "swiglu_limit",
    ):
        a, b = getattr(back, key), getattr(reference_cfg, key)
        assert a == b, f"legacy config.json round trip: {key}: {a} != {b}"
    print(f"  legacy config.json re-parsed: layer_types {back.layer_types}")
    print(f"    mlp_layer_types {back.mlp_layer_types} compress_rates {back.compress_rates}")
    print(f"    partial_rotary_factor {back.partial_rotary_factor} qk_rope_head_dim {back.qk_rope_head_dim}")
    print(f"    rope_parameters {back.rope_parameters}")


def drop_config_keys(path, keys, DeepseekV4Config, reference_cfg):
    """Remove `keys` from the saved config.json and check it still parses the same."""
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        saved = json.load(f)
    for k in keys:
        saved.pop(k, None)
    with open(cfg_path, "w") as f:
        json.dump(saved, f, indent=2, sort_keys=True)
        f.write("\n")
    back = DeepseekV4Config.from_pretrained(path)
    for key in keys:
        assert getattr(back, key) == getattr(reference_cfg, key), key
    print(f"  config.json: dropped {keys}; re-parsed layer_types {back.layer_types}")
    print(f"    mlp_layer_types {back.mlp_layer_types}")


@torch.no_grad()
def indexer_selections(model, tokens):
    """layer index -> the indexer's picks in the one-shot forward, int64 [n, index_topk]:
    each row sorted ascending, -1 (no pick) at the end."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M

    picks, hooks = {}, []
    for mod in model.modules():
        if isinstance(mod, M.DeepseekV4Attention) and mod.compressor is not None and hasattr(mod.compressor, "indexer"):

            def hook(m, args, out, layer=mod.layer_idx):
                idx = out[0].clone()
                big = torch.iinfo(idx.dtype).max
                idx = torch.where(idx < 0, torch.full_like(idx, big), idx).sort(dim=-1).values
                picks[layer] = torch.where(idx == big, torch.full_like(idx, -1), idx)

            hooks.append(mod.compressor.indexer.register_forward_hook(hook))
    try:
        model(input_ids=tokens[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return picks


@torch.no_grad()
def cached_drift(model, tokens, prefill):
    """Information only: transformers' own cached path (prefill + one token at a time)
    against its one-shot forward; returns (max rel L2 error, row)."""
    full = forward_logits(model, tokens)
    out = model(input_ids=tokens[None, :prefill], use_cache=True)
    pkv, rows = out.past_key_values, [out.logits[0].float()]
    for t in range(prefill, tokens.shape[0]):
        out = model(input_ids=tokens[None, t : t + 1], past_key_values=pkv, use_cache=True)
        pkv = out.past_key_values
        rows.append(out.logits[0].float())
    got = torch.cat(rows)
    err = (got - full).norm(dim=-1) / full.norm(dim=-1)
    return err.max().item(), int(err.argmax().item())


def make_fixture(name, spec, out_dir, seed):
    transformers, DeepseekV4Config, DeepseekV4ForCausalLM = tf()
    print(f"=== fixture {name} (seed {seed})")
    path = os.path.join(out_dir, name)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)

    if "legacy_config" in spec:
        cfg = build_config(DeepseekV4Config, dict(spec["legacy_config"]))
    else:
        cfg = build_config(DeepseekV4Config, dict(spec["config"]))
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    print(f"  layer_types {model.config.layer_types}")
    print(f"  mlp_layer_types {model.config.mlp_layer_types}")
    print(f"  compress_rates {model.config.compress_rates} qk_rope_head_dim {model.config.qk_rope_head_dim}")
    print(f"  rope_parameters {model.config.rope_parameters}")
    print(f"  attn {model.config._attn_implementation} experts {model.config._experts_implementation}")
    randomise(model, seed)

    stored = None
    if spec.get("released_layout"):
        model, stored = write_released_layout(model, path, seed)
    elif spec["sharded"]:
        model.save_pretrained(path, max_shard_size="400KB")
    else:
        model.save_pretrained(path)
    if stored is None:
        clean_dir(path, keep_index=spec["sharded"])
    if "legacy_config" in spec:
        write_legacy_config(path, spec["legacy_config"], DeepseekV4Config, model.config)
    if spec.get("drop_keys"):
        drop_config_keys(path, spec["drop_keys"], DeepseekV4Config, model.config)
    if spec["sharded"]:
        shards = [f for f in os.listdir(path) if f.endswith(".safetensors")]
        assert os.path.exists(os.path.join(path, "model.safetensors.index.json")) and len(shards) > 1, shards
        print(f"  sharded into {len(shards)} files")
    if stored is None:
        print_tensor_list(path)
        # The fixture is what is on disk: reload and check it equals the in-memory model.
        reloaded = load_model(path)
        sd_a, sd_b = model.state_dict(), reloaded.state_dict()
        assert sorted(sd_a) == sorted(sd_b), set(sd_a) ^ set(sd_b)
        for k in sd_a:
            assert torch.equal(sd_a[k], sd_b[k]), f"reload changed {k}"
        print("  reload: every tensor identical")
    else:
        reloaded = model  # already loaded back from the decoded values

    vocab = cfg.vocab_size
    n = spec["seq_len"]
    for attempt in range(MAX_TOKEN_TRIES):
        tg = torch.Generator().manual_seed(seed * 1000 + attempt)
        tokens = torch.randint(2, vocab, (n,), generator=tg, dtype=torch.int64)
        margins = topk_margins(reloaded, tokens)
        worst = min(margins.values()) if margins else math.inf
        if worst >= TIE_MARGIN:
            break
        print(f"  token draw {attempt}: top-k margin {worst:.2e} < {TIE_MARGIN}, drawing again")
    else:
        raise SystemExit(f"{name}: no token sequence without near-ties in {MAX_TOKEN_TRIES} draws")
    print(f"  token draw {attempt}: smallest top-k margins " + ", ".join(f"{k}={v:.3g}" for k, v in margins.items()))

    logits = forward_logits(reloaded, tokens)
    logits_mem = forward_logits(model, tokens)
    assert torch.equal(logits, logits_mem), "reloaded model gives different logits"
    assert torch.isfinite(logits).all()
    half = n // 2
    logits_half = forward_logits(reloaded, tokens[:half])
    causal = (logits_half - logits[:half]).abs().max().item()
    print(f"  causality: first {half} tokens alone vs full run, max abs diff {causal:.3e}")
    assert causal < 1e-5, causal
    print(f"  logits: shape {list(logits.shape)}, std {logits.std().item():.3f}, max |x| {logits.abs().max().item():.3f}")

    picks = indexer_selections(reloaded, tokens)
    for layer, p in sorted(picks.items()):
        valid = (p >= 0).sum(dim=-1)
        print(f"  indexer layer {layer}: picks per query min {valid.min().item()} max {valid.max().item()} "
              f"(index_topk {cfg.index_topk})")
    for prefill in (spec["prefill_lens"][1], spec["prefill_lens"][-2]):
        err, row = cached_drift(reloaded, tokens, prefill)
        print(f"  (info) transformers cached path, prefill {prefill} then decode: max rel L2 err {err:.2e} at row {row}")

    from safetensors.torch import save_file

    tensors = {"tokens": tokens.contiguous(), "logits": logits.contiguous()}
    for layer, p in picks.items():
        tensors[f"indexer_topk.{layer}"] = p.contiguous()
    save_file(tensors, os.path.join(path, "expected.safetensors"))
    meta = {
        "name": name,
        "description": spec["description"],
        "seq_len": n,
        "prefill_lens": spec["prefill_lens"],
        "seed": seed,
        "token_draw": attempt,
        "min_topk_margin": worst if math.isfinite(worst) else None,
        "causality_max_abs_diff": causal,
        "sharded": spec["sharded"],
        **({"stored_tensors": stored} if stored else {}),
        "expected_tensors": {
            "tokens": "int64 [n], ids in [2, vocab)",
            "logits": "float32 [n, vocab], one-shot forward, row t = logits after token t",
            "indexer_topk.L": "int64 [n, index_topk], CSA layer L's indexer picks per query "
            "(sorted ascending, -1 = no pick)",
        },
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    chmod_files(path)
    total = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    print(f"  wrote {path}: {sorted(os.listdir(path))}, {total} bytes")


def write_released_layout(model, path, seed):
    """Write `model` to `path` in DeepSeek's released layout (scripts/released_layout.py) and
    return (the model transformers loads from the values that layout decodes to, tensor
    counts per storage kind): the reference logits come from that model."""
    import tempfile

    import released_layout as rl

    cfg = model.config
    with tempfile.TemporaryDirectory() as tmp:
        saved, twin = os.path.join(tmp, "saved"), os.path.join(tmp, "twin")
        model.save_pretrained(saved)
        counts = rl.quantize_dir(saved, path, twin, (cfg.hidden_size, cfg.q_lora_rank, cfg.moe_intermediate_size), seed)
        decoded = load_model(twin)
    # The fixture is what is on disk: decoded back from the files, it is the same model.
    back = load_model(path)
    for (k, a), b in zip(decoded.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), f"released layout reload changed {k}"
    on_disk = rl.read_safetensors(os.path.join(path, "model.safetensors"))
    print(f"  released layout ({len(on_disk)} tensors; saved tensors per storage {counts}):")
    for k in sorted(on_disk):
        print(f"    {k} {on_disk[k][0]} {list(on_disk[k][1])}")
    # Every weight the released layout quantizes must differ from its float original
    # (otherwise the fixture would not exercise the decoding).
    changed = sum(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), decoded.state_dict().values()))
    print(f"  decoded model: {changed} of {len(model.state_dict())} tensors changed by the stored formats")
    return decoded, counts


def save_embedded(model, out_dir):
    """Write `model` to out_dir as bfloat16 config.json + model.safetensors (transformers' names)."""
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    os.makedirs(out_dir, exist_ok=True)
    for f in ("config.json", "model.safetensors", "model.safetensors.index.json"):
        if os.path.exists(os.path.join(out_dir, f)):
            os.remove(os.path.join(out_dir, f))
    tmp = os.path.join(out_dir, ".tmp_save")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    clean_dir(tmp, keep_index=False)
    for f in os.listdir(tmp):
        shutil.move(os.path.join(tmp, f), os.path.join(out_dir, f))
    shutil.rmtree(tmp)
    chmod_files(out_dir)


def make_embedded(out_dir, seed, vocab):
    transformers, DeepseekV4Config, DeepseekV4ForCausalLM = tf()
    print(f"=== embedded model (seed {seed}, vocab {vocab}) -> {out_dir}")
    kwargs = dict(EMBEDDED_CONFIG, vocab_size=vocab)
    cfg = build_config(DeepseekV4Config, kwargs)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    print(f"  layer_types {model.config.layer_types}")
    print(f"  mlp_layer_types {model.config.mlp_layer_types}")
    print(f"  rope_parameters {model.config.rope_parameters}")
    randomise(model, seed)
    save_embedded(model, out_dir)
    ts = saved_tensors(out_dir)
    dtypes = sorted({v[0] for v in ts.values()})
    print(f"  {len(ts)} tensors, dtypes {dtypes}")
    # reload (weights upcast to float32) and run a short prompt
    reloaded = load_model(out_dir)
    tokens = torch.randint(2, vocab, (40,), generator=torch.Generator().manual_seed(seed))
    logits = forward_logits(reloaded, tokens)
    assert torch.isfinite(logits).all()
    print(f"  reload + forward of 40 tokens ok, logits std {logits.std().item():.3f}")
    for f in sorted(os.listdir(out_dir)):
        print(f"  {f}: {os.path.getsize(os.path.join(out_dir, f))} bytes")


def tokenizer_vocab(default=512):
    p = os.path.join(ROOT, "models", "embedded", "tokenizer.json")
    if not os.path.exists(p):
        return default
    with open(p) as f:
        tok = json.load(f)
    ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok.get("added_tokens", [])]
    return max(ids) + 1


# --------------------------------------------------------------------------- check-logits


def check_logits(model_dir, logits_json, tokens, tol):
    with open(logits_json) as f:
        got = torch.tensor(json.load(f)["logits"], dtype=torch.float64)
    tokens = torch.tensor(tokens, dtype=torch.int64)
    model = load_model(model_dir)
    ref = forward_logits(model, tokens).double()
    margins = topk_margins(model, tokens)
    if margins:
        worst = min(margins.values())
        print(f"smallest top-k margin in the reference: {worst:.3e} ({min(margins, key=margins.get)})")
        if worst < TIE_MARGIN:
            print("WARNING: the reference has (near-)tied top-k choices on these tokens; a mismatch "
                  "after that point may be a tie broken differently, not a bug")
    if got.dim() != 2 or got.shape[0] > ref.shape[0] or got.shape[1] != ref.shape[1]:
        print(f"FAIL: logits shape {list(got.shape)} vs reference {list(ref.shape)}")
        return 1
    worst = 0.0
    for t in range(got.shape[0]):
        err = ((got[t] - ref[t]).norm() / ref[t].norm().clamp_min(1e-30)).item()
        if not math.isfinite(err):
            err = math.inf
        worst = max(worst, err)
        print(f"row {t:5d} token {tokens[t].item():6d}: rel L2 err {err:.3e}{'  <-- over tol' if err > tol else ''}")
    ok = worst <= tol
    print(f"{'PASS' if ok else 'FAIL'}: {got.shape[0]} rows, max rel L2 err {worst:.3e} (tol {tol:g})")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="output directory")
    ap.add_argument("--only", nargs="+", choices=sorted(FIXTURES), help="fixtures to make (default all)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--embedded", action="store_true", help="write the embedded bf16 model instead")
    ap.add_argument("--vocab", type=int, help="embedded vocab (default: from models/embedded/tokenizer.json)")
    ap.add_argument("--check-logits", metavar="MODEL_DIR")
    ap.add_argument("--logits-json")
    ap.add_argument("--tokens", nargs="+", help="token ids (space or comma separated)")
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()

    torch.set_grad_enabled(False)
    if args.check_logits:
        if not args.logits_json or not args.tokens:
            ap.error("--check-logits needs --logits-json and --tokens")
        toks = [int(x) for a in args.tokens for x in a.replace(",", " ").split()]
        sys.exit(check_logits(args.check_logits, args.logits_json, toks, args.tol))
    if args.embedded:
        out = args.out or os.path.join(ROOT, "models", "embedded")
        make_embedded(out, args.seed, args.vocab or tokenizer_vocab())
        return
    if not args.out:
        ap.error("--out is required")
    transformers, _, _ = tf()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for name in args.only or list(FIXTURES):
        make_fixture(name, FIXTURES[name], args.out, args.seed)


if __name__ == "__main__":
    main()
