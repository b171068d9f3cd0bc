#!/usr/bin/env python3
"""The peer for `pdserve bench`: the same synthetic model through transformers' DeepSeek-V4
reference implementation (DeepseekV4ForCausalLM) on the same device, random weights,
timed decode and prefill, written as JSON for `pdserve bench decode|prefill --peer`.

    pdserve bench config --layers 4 --experts 64 --out bench-config.json
    python3 scripts/peer_bench.py --config bench-config.json --out peer.json
    pdserve bench decode --device cuda:0 --layers 4 --experts 64 --peer peer.json
    pdserve bench prefill --device cuda:0 --layers 4 --experts 64 --peer peer.json

Needs torch + transformers >= 5.17 (the H200 machine has both). Weights are drawn on the
device with the same distributions pdserve uses (linear N(0, 1/sqrt(fan_in)), norm weights
1 + 0.2 N, sinks N(0,1), position biases N(0,0.5), hyper-connection maps
N(0, 0.5/sqrt(fan_in)), bases N(0,0.5), scales U(0.5,1.5), router bias N(0,0.1), tid2eid
k distinct experts per token), not the same values.

Decode: for each (batch, context) a prefill of `batch x context` random tokens builds the
reference's own KV cache (DynamicCache with its CSA/HCA layers), then `--steps` decode
steps of one token per sequence are timed (CUDA-synchronised wall clock, median). Prefill:
one sequence of N random tokens, logits for the last row only, median of `--repeats`.
Every measurement that fails (out of memory, an unsupported path) is recorded with its
error instead of ending the run; once a batch runs out of memory at a context, the larger
batches at that context are recorded as skipped without being tried. The defaults cover
the rows of `pdserve bench decode`'s default table (batch 1 to 256, contexts 4K and 32K);
rows the peer could not run show "-" in its peer columns.
"""

import argparse
import json
import math
import statistics
import sys
import time


def parse_list(s):
    return [int(x) for x in s.split(",") if x.strip()]


def sync(device):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def randomise(model, seed, device):
    """Every parameter and floating buffer gets a random value (rules by name)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("inv_freq") or "rotary" in name:
                continue
            if name.endswith("tid2eid"):
                vocab, k = t.shape
                n_exp = model.config.n_routed_experts
                scores = torch.rand(vocab, n_exp, generator=g, device=device)
                t.copy_(scores.argsort(dim=1)[:, :k].to(t.dtype))
                continue
            if not t.is_floating_point():
                raise SystemExit(f"randomise: no rule for integer tensor {name}")
            fan = t.shape[-1] if t.dim() >= 2 else 1
            normal = lambda mean, std: t.copy_(
                torch.randn(t.shape, generator=g, device=device, dtype=torch.float32) * std + mean
            )
            if name.endswith("norm.weight"):
                normal(1.0, 0.2)
            elif name.endswith("embed_tokens.weight") or name.endswith(".sinks"):
                normal(0.0, 1.0)
            elif name.endswith("position_bias") or name.endswith("_hc.base") or name.endswith("hc_base"):
                normal(0.0, 0.5)
            elif name.endswith("_hc.fn") or name.endswith("hc_fn"):
                normal(0.0, 0.5 / math.sqrt(fan))
            elif name.endswith("_hc.scale") or name.endswith("hc_scale"):
                t.copy_(torch.rand(t.shape, generator=g, device=device, dtype=torch.float32) + 0.5)
            elif name.endswith("e_score_correction_bias"):
                normal(0.0, 0.1)
            elif name.endswith(".weight") or name.endswith("gate_up_proj") or name.endswith("down_proj"):
                normal(0.0, 1.0 / math.sqrt(fan))
            else:
                raise SystemExit(f"randomise: no rule for {name} {tuple(t.shape)}")


def build(cfg, args):
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
    config = DeepseekV4Config(
        **kwargs, attn_implementation=args.attn, experts_implementation=args.experts_impl
    )
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        try:
            model = DeepseekV4ForCausalLM._from_config(config, dtype=dtype)
        except TypeError:
            model = DeepseekV4ForCausalLM._from_config(config, torch_dtype=dtype)
    randomise(model, args.seed, args.device)
    return model.eval()


def timed(device, fn):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def bench_prefill(model, args, vocab):
    import torch

    rows = []
    for n in parse_list(args.prefill):
        try:
            ids = torch.randint(0, vocab, (1, n), device=args.device)
            runs = []
            for i in range(args.prefill_warmup + args.repeats):
                dt, out = timed(args.device, lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1))
                if not torch.isfinite(out.logits).all():
                    raise RuntimeError("non-finite logits")
                del out
                if i >= args.prefill_warmup:
                    runs.append(dt)
            s = statistics.median(runs)
            rows.append({"tokens": n, "seconds": s, "tokens_per_s": n / s})
        except Exception as e:  # recorded, the run goes on
            rows.append({"tokens": n, "error": repr(e)[:500]})
        print(json.dumps(rows[-1]), file=sys.stderr)
        release(args.device)
    return rows


def bench_decode(model, args, vocab):
    import torch

    rows = []
    for c in parse_list(args.decode_context):
        out_of_memory_at = None
        for b in sorted(parse_list(args.decode_batch)):
            if out_of_memory_at is not None:
                rows.append({"batch": b, "context": c,
                             "error": f"skipped: batch {out_of_memory_at} ran out of memory at this context"})
                print(json.dumps(rows[-1]), file=sys.stderr)
                continue
            try:
                ids = torch.randint(0, vocab, (b, c), device=args.device)
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                cache = out.past_key_values
                del out
                runs = []
                for step in range(args.warmup + args.steps):
                    nxt = torch.randint(0, vocab, (b, 1), device=args.device)
                    dt, out = timed(
                        args.device,
                        lambda: model(input_ids=nxt, past_key_values=cache, use_cache=True, logits_to_keep=1),
                    )
                    if not torch.isfinite(out.logits).all():
                        raise RuntimeError("non-finite logits")
                    cache = out.past_key_values
                    del out
                    if step >= args.warmup:
                        runs.append(dt)
                ms = statistics.median(runs) * 1e3
                rows.append({"batch": b, "context": c, "ms_per_step": ms, "tokens_per_s": b / (ms / 1e3)})
                del cache
            except Exception as e:  # recorded, the run goes on
                rows.append({"batch": b, "context": c, "error": repr(e)[:500]})
                if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e):
                    out_of_memory_at = b
            print(json.dumps(rows[-1]), file=sys.stderr)
            release(args.device)
    return rows


def release(device):
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="config.json from `pdserve bench config`")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--device", default="cuda:0", help="torch device (default cuda:0)")
    p.add_argument("--dtype", default="bfloat16", help="weights and activations dtype (default bfloat16)")
    p.add_argument("--attn", default="eager", help="attn_implementation (default eager, the reference)")
    p.add_argument("--experts-impl", default="eager", help="experts_implementation (eager, grouped_mm, ...)")
    p.add_argument("--decode-batch", default="1,8,32,64,128,256",
                   help="decode batch sizes (default 1,8,32,64,128,256, as bench decode)")
    p.add_argument("--decode-context", default="4096,32768",
                   help="decode contexts (default 4096,32768, as bench decode)")
    p.add_argument("--steps", type=int, default=10, help="timed decode steps (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps first")
    p.add_argument("--prefill", default="1024,8192", help="prefill lengths (default 1024,8192)")
    p.add_argument("--repeats", type=int, default=3, help="timed prefills per length (median)")
    p.add_argument("--prefill-warmup", type=int, default=1, help="untimed prefills per length first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-prefill", action="store_true")
    args = p.parse_args()

    import torch
    import transformers

    with open(args.config) as f:
        cfg = json.load(f)
    torch.manual_seed(args.seed)
    t = time.perf_counter()
    model = build(cfg, args)
    sync(args.device)
    print(f"model built in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    gpu = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    result = {
        "label": f"transformers {transformers.__version__} ({args.attn} attention, {args.experts_impl} experts, "
        f"{args.dtype}) on {gpu}",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "device": gpu,
        "config": cfg,
        "prefill": [],
        "decode": [],
    }
    vocab = cfg["vocab_size"]
    with torch.inference_mode():
        if not args.skip_prefill:
            result["prefill"] = bench_prefill(model, args, vocab)
        if not args.skip_decode:
            result["decode"] = bench_decode(model, args, vocab)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["prefill"] + result["decode"], indent=1))


if __name__ == "__main__":
    main()
