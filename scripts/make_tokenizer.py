#!/usr/bin/env python3
"""Train the small byte-level BPE tokenizer shipped in models/embedded/tokenizer.json.

    python3 scripts/make_tokenizer.py                  # train from scripts/tokenizer_corpus.txt
    python3 scripts/make_tokenizer.py --build-corpus   # (re)write the corpus first, then train

Needs only the HF `tokenizers` package (pip install tokenizers).

The corpus (scripts/tokenizer_corpus.txt) is plain English prose: the docstrings of a
fixed list of CPython standard-library modules (Python Software Foundation License),
collected with `inspect.getdoc`. It is committed, so training does not depend on the
Python version that happens to be installed; `--build-corpus` only documents how it
was made (CPython 3.11.7 produced the committed file).

Tokenizer: byte-level BPE, vocab 512, special tokens <|begin_of_text|> (id 0, bos) and
<|end_of_text|> (id 1, eos); ByteLevel pre-tokenizer (no prefix space) and decoder, so
any UTF-8 string round-trips through encode/decode. Training is single-threaded-equivalent
deterministic: the script trains twice and checks both results are byte-identical.
"""

import argparse
import inspect
import importlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CORPUS = os.path.join(HERE, "tokenizer_corpus.txt")
OUT = os.path.join(ROOT, "models", "embedded", "tokenizer.json")
VOCAB_SIZE = 512
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"]

CORPUS_MODULES = [
    "textwrap", "string", "json", "collections", "itertools", "functools", "heapq",
    "bisect", "contextlib", "dataclasses", "enum", "abc", "argparse", "logging",
    "unittest", "datetime", "random", "statistics", "fractions", "decimal", "shutil",
    "subprocess", "threading", "queue", "csv", "pathlib", "os", "io", "tempfile",
    "glob", "fnmatch", "difflib", "pprint", "copy", "weakref", "typing", "inspect",
    "pickle", "base64", "hashlib", "zipfile", "tarfile", "gzip", "socket", "select",
    "selectors", "asyncio", "email", "http.client", "urllib.parse", "sched", "calendar",
    "locale", "gettext", "codecs", "unicodedata", "math", "cmath", "operator", "re",
]
TARGET_BYTES = 150_000


def build_corpus():
    seen = set()
    paras = []
    total = 0
    for name in CORPUS_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception:
            continue
        objs = [mod] + [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_")]
        for obj in objs:
            try:
                doc = inspect.getdoc(obj)
            except Exception:
                doc = None
            if not doc or doc in seen:
                continue
            seen.add(doc)
            for para in doc.split("\n\n"):
                lines = [l.strip() for l in para.splitlines()]
                text = " ".join(l for l in lines if l)
                # keep prose: mostly letters, several words, no code-ish lines
                if len(text) < 60 or ">>>" in text or text.count("(") > 4:
                    continue
                letters = sum(c.isalpha() or c == " " for c in text)
                if letters / len(text) < 0.85:
                    continue
                paras.append(text)
                total += len(text) + 2
                if total >= TARGET_BYTES:
                    break
            if total >= TARGET_BYTES:
                break
        if total >= TARGET_BYTES:
            break
    with open(CORPUS, "w", encoding="utf-8") as f:
        f.write("\n\n".join(paras) + "\n")
    print(f"wrote {CORPUS}: {os.path.getsize(CORPUS)} bytes, {len(paras)} paragraphs")


def train():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([CORPUS], trainer)
    return tok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-corpus", action="store_true")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    if args.build_corpus or not os.path.exists(CORPUS):
        build_corpus()

    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    a = train().to_str(pretty=True)
    b = train().to_str(pretty=True)
    if a != b:
        sys.exit("tokenizer training is not deterministic")

    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(a)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(a + "\n")

    samples = [
        "Hello, world! The quick brown fox jumps over the lazy dog.",
        "  leading spaces, tabs\tand\nnewlines\r\n",
        "Grüße aus Köln — naïve café, 東京, Привет, 🙂👍🏽",
        "",
        "<|begin_of_text|>specials inside text<|end_of_text|>",
    ]
    tok = Tokenizer.from_file(args.out)
    for s in samples:
        enc = tok.encode(s)
        dec = tok.decode(enc.ids, skip_special_tokens=False)
        assert dec == s, (s, dec)
        print(f"round-trip ok ({len(enc.ids):3d} tokens): {s!r}")
    print(f"wrote {args.out}: vocab {tok.get_vocab_size()}, {os.path.getsize(args.out)} bytes")
    print(json.dumps({"bos": SPECIALS[0], "bos_id": 0, "eos": SPECIALS[1], "eos_id": 1}))


if __name__ == "__main__":
    main()
