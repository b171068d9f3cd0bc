"""DeepSeek's released (upstream) checkpoint layout, for scripts/gen_fixtures.py.

The released V4 instruct checkpoints (config.json, shard headers, and the reference
`inference/model.py` / `kernel.py` of the model repo) store:

- `layers.N.attn.{wq_a,wq_b,wkv,wo_a,wo_b}`, `layers.N.ffn.shared_experts.w{1,2,3}`,
  `layers.N.attn.indexer.wq_b` as F8_E4M3 with an F8_E8M0 `.scale` per 128x128 block,
  `[ceil(out/128), ceil(in/128)]` (partial blocks at the edges);
- routed experts `layers.N.ffn.experts.E.w{1,2,3}` as FP4 e2m1 packed two per byte in I8
  `[out, in/2]` (low nibble = even element) with an F8_E8M0 `.scale` `[out, in/32]`;
- F32 `attn_sink` and hyper-connection tensors (`hc_*`), I64 `tid2eid`, BF16 the rest;
- no `model.` prefix (`embed.weight`, `norm.weight`, `hc_head_fn`, `head.weight`), and the
  multi-token-prediction layer (`mtp.*`), which inference does not use.

`quantize_dir` turns a float checkpoint written by transformers' `save_pretrained` into
that layout, and writes a float32 twin holding exactly the values the stored formats
decode to, for transformers to load and compute the reference logits from. Scales are
powers of two chosen as DeepSeek's reference weight quantization does (amax / 448 for
e4m3, amax / 6 for e2m1, rounded up to a power of two: ue8m0 holds exponents only).
The safetensors files are written here (header + raw bytes), so the dtype names on disk
are exactly the released ones whatever torch/safetensors version runs this.
"""

import json
import math
import os
import re
import struct

import numpy as np
import torch

BLOCK = 128  # FP8 weight_block_size, both dims
FP4_GROUP = 32  # FP4 scale group along the input dim
E4M3_MAX = 448.0
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # code = index (+8: sign)

QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [BLOCK, BLOCK],
    "activation_scheme": "dynamic",
}

FP8_RE = re.compile(
    r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123]|attn\.indexer\.wq_b)\.weight$"
)
FP4_RE = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
F32_RE = re.compile(r"(^|\.)(attn_sink|hc_[a-z_]+)$|^hc_head_(fn|base|scale)$")
INT_RE = re.compile(r"\.tid2eid$")

# save_pretrained (transformers 5.17) keeps `model.` and a few transformers names that the
# released checkpoints spell DeepSeek's way.
TOP_LEVEL = {
    "embed_tokens.weight": "embed.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}


def released_name(saved):
    bare = saved[len("model."):] if saved.startswith("model.") else saved
    return TOP_LEVEL.get(bare, bare)


def storage(name):
    """How the released layout stores tensor `name`: fp8, fp4, f32, i64 or bf16."""
    if FP8_RE.match(name):
        return "fp8"
    if FP4_RE.match(name):
        return "fp4"
    if INT_RE.search(name):
        return "i64"
    if F32_RE.search(name):
        return "f32"
    return "bf16"


def pow2_scale_exponent(amax, qmax):
    """Smallest e with amax / 2^e <= qmax (amax 0: the smallest normal scale exponent)."""
    e = torch.ceil(torch.log2(amax.clamp_min(1e-30) / qmax))
    return e.clamp(-127, 127).to(torch.int32)


def fp8_block(w):
    """[out, in] f32 -> (e4m3 codes uint8 [out, in], ue8m0 uint8 [ceil(out/128), ceil(in/128)],
    decoded f32 [out, in])."""
    out, inp = w.shape
    sr, sc = math.ceil(out / BLOCK), math.ceil(inp / BLOCK)
    padded = torch.zeros(sr * BLOCK, sc * BLOCK)
    padded[:out, :inp] = w
    blocks = padded.view(sr, BLOCK, sc, BLOCK)
    e = pow2_scale_exponent(blocks.abs().amax(dim=(1, 3)), E4M3_MAX)  # [sr, sc]
    scale = torch.pow(2.0, e.float())
    full_scale = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:out, :inp]
    codes = (w / full_scale).to(torch.float8_e4m3fn)
    decoded = codes.float() * full_scale
    assert torch.isfinite(decoded).all()
    return codes.view(torch.uint8), (e + 127).to(torch.uint8), decoded


def fp4_group(w):
    """[out, in] f32 -> (packed uint8 [out, in/2], ue8m0 uint8 [out, in/32], decoded f32)."""
    out, inp = w.shape
    assert inp % FP4_GROUP == 0, f"FP4 input dim {inp} is not a multiple of {FP4_GROUP}"
    groups = w.view(out, inp // FP4_GROUP, FP4_GROUP)
    e = pow2_scale_exponent(groups.abs().amax(dim=2), E2M1_GRID[-1].item())  # [out, in/32]
    scale = torch.pow(2.0, e.float())[:, :, None]
    x = groups / scale
    idx = (x.abs()[..., None] - E2M1_GRID).abs().argmin(dim=-1)  # nearest magnitude
    neg = (x < 0) & (idx > 0)  # no negative zero
    codes = (idx + 8 * neg).to(torch.uint8).view(out, inp)
    decoded = (E2M1_GRID[idx] * torch.where(neg, -1.0, 1.0) * scale).view(out, inp)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # low nibble = even element
    return packed, (e + 127).to(torch.uint8), decoded


def to_bytes(t):
    return np.ascontiguousarray(t.detach().cpu().numpy()).tobytes()


def write_safetensors(path, tensors):
    """tensors: name -> (dtype string as safetensors spells it, shape, bytes)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in sorted(tensors):
            f.write(tensors[name][2])
    os.chmod(path, 0o644)


def stored(name, t):
    """Released-layout tensors for saved tensor `name` (value `t`) and its decoded value."""
    kind = storage(name)
    if kind == "fp8":
        codes, scale, decoded = fp8_block(t.float())
        stem = name[: -len(".weight")]
        return {
            name: ("F8_E4M3", codes.shape, to_bytes(codes)),
            f"{stem}.scale": ("F8_E8M0", scale.shape, to_bytes(scale)),
        }, decoded
    if kind == "fp4":
        packed, scale, decoded = fp4_group(t.float())
        stem = name[: -len(".weight")]
        return {
            name: ("I8", packed.shape, to_bytes(packed.view(torch.int8))),
            f"{stem}.scale": ("F8_E8M0", scale.shape, to_bytes(scale)),
        }, decoded
    if kind == "i64":
        return {name: ("I64", t.shape, to_bytes(t.to(torch.int64)))}, t
    if kind == "f32":
        return {name: ("F32", t.shape, to_bytes(t.float()))}, t.float()
    b = t.to(torch.bfloat16)
    return {name: ("BF16", b.shape, to_bytes(b.view(torch.int16)))}, b.float()


def mtp_tensors(hidden, q_lora_rank, inter, seed):
    """A few tensors of the multi-token-prediction layer, in every stored format (ignored
    by inference, present in the released checkpoints)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in [
        ("mtp.0.enorm.weight", (hidden,)),
        ("mtp.0.attn.wq_a.weight", (q_lora_rank, hidden)),
        ("mtp.0.ffn.experts.0.w1.weight", (inter, hidden)),
    ]:
        t = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        kind = "fp8" if ".attn." in name else "fp4" if ".experts." in name else "bf16"
        if kind == "fp8":
            codes, scale, _ = fp8_block(t)
            out[name] = ("F8_E4M3", codes.shape, to_bytes(codes))
            out[name.replace(".weight", ".scale")] = ("F8_E8M0", scale.shape, to_bytes(scale))
        elif kind == "fp4":
            packed, scale, _ = fp4_group(t)
            out[name] = ("I8", packed.shape, to_bytes(packed.view(torch.int8)))
            out[name.replace(".weight", ".scale")] = ("F8_E8M0", scale.shape, to_bytes(scale))
        else:
            out[name] = ("BF16", t.shape, to_bytes(t.to(torch.bfloat16).view(torch.int16)))
    return out


def read_safetensors(path):
    """name -> (dtype string, shape, bytes) of a safetensors file, read without safetensors."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: (v["dtype"], tuple(v["shape"]), data[v["data_offsets"][0] : v["data_offsets"][1]]) for k, v in header.items()}


def e4m3_by_definition(b):
    """e4m3 (bias 7, subnormals at exponent 0); 0x7f / 0xff are NaN and never written."""
    e, m = (b >> 3) & 15, (b & 7) / 8
    v = m * 2.0**-6 if e == 0 else (1 + m) * 2.0 ** (e - 7)
    return -v if b & 0x80 else v


E4M3 = torch.tensor([e4m3_by_definition(b) for b in range(256)])


def decode(tensors):
    """Released-layout tensors -> name -> f32 value, decoded by the formats' definitions
    (an independent check of what `stored` wrote; the scale pairs with `X.weight`)."""
    out = {}
    for name, (dtype, shape, data) in tensors.items():
        if name.endswith(".scale"):
            continue
        raw = np.frombuffer(data, dtype={"F8_E4M3": np.uint8, "I8": np.uint8, "BF16": np.uint16,
                                         "F32": np.float32, "I64": np.int64}[dtype]).reshape(shape)
        if dtype == "BF16":
            v = torch.from_numpy((raw.astype(np.uint32) << 16).view(np.float32).copy())
        elif dtype in ("F32", "I64"):
            v = torch.from_numpy(raw.copy())
        else:
            s_dtype, s_shape, s_data = tensors[name[: -len(".weight")] + ".scale"]
            assert s_dtype == "F8_E8M0", (name, s_dtype)
            s = torch.pow(2.0, torch.from_numpy(np.frombuffer(s_data, np.uint8).reshape(s_shape).astype(np.float32)) - 127)
            if dtype == "F8_E4M3":
                rows, cols = shape
                full = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
                v = E4M3[torch.from_numpy(raw.astype(np.int64))] * full
            else:
                lo, hi = raw & 0xF, raw >> 4
                nib = np.stack([lo, hi], axis=-1).reshape(shape[0], shape[1] * 2).astype(np.int64)
                mag = E2M1_GRID[torch.from_numpy(nib & 7)]
                sign = torch.from_numpy(np.where(nib & 8, -1.0, 1.0).astype(np.float32))
                v = mag * sign * s.repeat_interleave(FP4_GROUP, 1)
        out[name] = v
    return out


def quantize_dir(saved_dir, out_dir, twin_dir, mtp_dims, seed):
    """Write saved_dir's float checkpoint (save_pretrained's model.safetensors) in the
    released layout to out_dir/model.safetensors, and its decoded values in save_pretrained's
    names to twin_dir/model.safetensors (float32, saved_dir's config.json): the model the
    reference logits come from. Returns {storage kind: tensor count}."""
    from safetensors.torch import load_file, save_file

    saved = load_file(os.path.join(saved_dir, "model.safetensors"))
    released, twin, counts = {}, {}, {}
    for name, t in saved.items():
        rname = released_name(name)
        parts, decoded = stored(rname, t)
        released.update(parts)
        twin[name] = decoded.to(t.dtype).contiguous() if storage(rname) == "i64" else decoded.float().contiguous()
        counts[storage(rname)] = counts.get(storage(rname), 0) + 1
    # The decoded file must hold exactly what transformers will load (independent decoder).
    check = decode(released)
    for name, t in twin.items():
        got = check[released_name(name)]
        assert got.shape == t.shape and torch.equal(got.to(t.dtype), t), f"decode mismatch: {name}"
    released.update(mtp_tensors(*mtp_dims, seed))
    os.makedirs(twin_dir, exist_ok=True)
    save_file(twin, os.path.join(twin_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(saved_dir, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(twin_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), released)
    cfg["dtype"] = "bfloat16"
    cfg["quantization_config"] = QUANTIZATION_CONFIG
    cfg["expert_dtype"] = "fp4"
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    os.chmod(os.path.join(out_dir, "config.json"), 0o644)
    return counts


def saved_name(released):
    """Inverse of `released_name`: the name save_pretrained gives the tensor."""
    for bare, rel in TOP_LEVEL.items():
        if released == rel:
            return f"model.{bare}"
    return released if released == "head.weight" else f"model.{released}"


def write_twin(model_dir, twin_dir):
    """The float32 checkpoint (save_pretrained's names, config.json without the quantization
    keys) holding the values `model_dir`'s released-layout checkpoint decodes to: what
    transformers can load (it has no FP4 expert support to load the released files with)."""
    from safetensors.torch import save_file

    values = decode(read_safetensors(os.path.join(model_dir, "model.safetensors")))
    twin = {saved_name(k): v.contiguous() for k, v in values.items() if not k.startswith("mtp.")}
    os.makedirs(twin_dir, exist_ok=True)
    save_file(twin, os.path.join(twin_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    for k in ("quantization_config", "expert_dtype"):
        cfg.pop(k, None)
    cfg["dtype"] = "float32"
    with open(os.path.join(twin_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def is_released_layout(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        return "quantization_config" in json.load(f)
