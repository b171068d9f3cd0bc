#!/usr/bin/env python3
"""Train the embedded model a little so `pdserve generate` shows text-like output.

Starts from models/embedded (gen_fixtures.py --embedded: every parameter randomised),
trains all parameters (tid2eid stays fixed: it is a buffer) on scripts/tokenizer_corpus.txt
with the model's own one-shot forward, and saves it back in bfloat16 with the same
save path as gen_fixtures.py. Needs torch + transformers >= 5.17; runs on CPU or CUDA.

    train_embedded.py [--steps N] [--seq 256] [--batch 16] [--lr 3e-3] [--seed 0]
"""

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_fixtures as gf  # noqa: E402

ROOT = gf.ROOT
MODEL_DIR = os.path.join(ROOT, "models", "embedded")


def corpus_ids():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(MODEL_DIR, "tokenizer.json"))
    with open(os.path.join(ROOT, "scripts", "tokenizer_corpus.txt"), encoding="utf-8") as f:
        text = f.read()
    return torch.tensor(tok.encode(text).ids, dtype=torch.long), tok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=0.0, help="stop after this wall time (0: no limit)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ids, tok = corpus_ids()
    print(f"corpus: {len(ids)} tokens; device {dev}")
    model = gf.load_model(MODEL_DIR).float().to(dev).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )
    t0 = time.time()
    step = 0
    for step in range(args.steps):
        starts = torch.randint(0, len(ids) - args.seq - 1, (args.batch,))
        x = torch.stack([ids[s : s + args.seq] for s in starts]).to(dev)
        out = model(input_ids=x, labels=x, use_cache=False)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0:
            print(f"step {step:5d} loss {out.loss.item():.3f} ({time.time() - t0:.0f} s)", flush=True)
        if args.minutes and time.time() - t0 > args.minutes * 60:
            print(f"time limit reached at step {step}")
            break
    model.eval()
    prompt = torch.tensor([tok.encode("The quick brown fox").ids], device=dev)
    with torch.no_grad():
        for _ in range(40):
            nxt = model(input_ids=prompt, use_cache=False).logits[0, -1].argmax()
            prompt = torch.cat([prompt, nxt.view(1, 1)], dim=1)
    print("greedy sample:", repr(tok.decode(prompt[0].tolist())))
    gf.save_embedded(model.cpu(), MODEL_DIR)
    print(f"trained {step + 1} steps in {time.time() - t0:.0f} s; saved to {MODEL_DIR}")


if __name__ == "__main__":
    main()
