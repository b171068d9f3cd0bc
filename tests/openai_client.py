#!/usr/bin/env python3
"""Drive a pdserve router with the official `openai` Python client.

Checks completions and chat completions, streamed and not, usage, finish reasons, stop
strings and error mapping; prints a JSON summary on stdout (the Rust test
cli/tests/openai_client.rs compares it with `pdserve generate`) and exits non-zero on
the first failed check.

    python3 tests/openai_client.py --base-url http://127.0.0.1:8000/v1
"""

import argparse
import json
import sys
import urllib.request

import openai
from openai import OpenAI


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


def post(url, body):
    """POST a JSON body, the JSON answer (endpoints the openai client has no method for)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def pick_stop(text):
    """A 3-character piece from the middle of `text` that is not only whitespace."""
    for start in range(len(text) // 3, len(text) - 3):
        piece = text[start : start + 3]
        if piece.strip():
            return piece
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True, help="router URL ending in /v1")
    ap.add_argument("--model", default="pdserve-embedded")
    ap.add_argument("--prompt", default="The quick brown fox")
    ap.add_argument("--max-tokens", type=int, default=12)
    args = ap.parse_args()
    n = args.max_tokens
    client = OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=120)
    greedy = dict(model=args.model, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})

    ids = [m.id for m in client.models.list().data]
    check(args.model in ids, f"/v1/models lists {args.model}: {ids}")

    # Completions, not streamed and streamed.
    c = client.completions.create(prompt=args.prompt, **greedy)
    text = c.choices[0].text
    check(c.object == "text_completion", f"object {c.object}")
    check(c.choices[0].finish_reason == "length", f"finish {c.choices[0].finish_reason}")
    u = c.usage
    check(u.completion_tokens == n, f"completion_tokens {u.completion_tokens} != {n}")
    check(u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + n, f"usage {u}")
    chunks = list(
        client.completions.create(
            prompt=args.prompt, stream=True, stream_options={"include_usage": True}, **greedy
        )
    )
    streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    check(streamed == text, f"streamed {streamed!r} != {text!r}")
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    check(finishes == ["length"], f"stream finish reasons {finishes}")
    check(chunks[-1].choices == [] and chunks[-1].usage is not None, "last chunk carries usage only")
    check(chunks[-1].usage.completion_tokens == n, f"streamed usage {chunks[-1].usage}")
    check(chunks[-1].usage.prompt_tokens == u.prompt_tokens, "streamed prompt_tokens")

    # Stop strings: the text ends before the first occurrence and finish_reason is stop.
    stop = pick_stop(text)
    check(stop is not None, f"no stop string to pick from {text!r}")
    want = text[: text.index(stop)]
    s = client.completions.create(prompt=args.prompt, stop=[stop], **greedy)
    check(s.choices[0].text == want, f"stop {stop!r}: {s.choices[0].text!r} != {want!r}")
    check(s.choices[0].finish_reason == "stop", f"stop finish {s.choices[0].finish_reason}")
    check(s.usage.completion_tokens <= n, "stop usage")
    st = "".join(
        ch.choices[0].text
        for ch in client.completions.create(prompt=args.prompt, stop=stop, stream=True, **greedy)
        if ch.choices
    )
    check(st == want, f"streamed stop {st!r} != {want!r}")

    # Chat completions.
    messages = [{"role": "user", "content": args.prompt}]
    r = client.chat.completions.create(messages=messages, **greedy)
    chat = r.choices[0].message.content
    check(r.object == "chat.completion", f"object {r.object}")
    check(r.choices[0].message.role == "assistant", "assistant role")
    check(r.choices[0].finish_reason == "length", f"chat finish {r.choices[0].finish_reason}")
    check(r.usage.completion_tokens == n, f"chat usage {r.usage}")
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **greedy))
    check(all(ch.object == "chat.completion.chunk" for ch in chunks), "chunk objects")
    check(chunks[0].choices[0].delta.role == "assistant", "role on the first chunk")
    chat_streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    check(chat_streamed == chat, f"chat streamed {chat_streamed!r} != {chat!r}")
    check(chunks[-1].choices[0].finish_reason == "length", "chat stream finish")
    r3 = client.chat.completions.create(
        model=args.model, messages=messages, max_completion_tokens=3, temperature=0,
        extra_body={"ignore_eos": True},
    )
    check(r3.usage.completion_tokens == 3 and r3.choices[0].finish_reason == "length", "max_completion_tokens")

    # /tokenize gives exactly the ids a chat completion prefills; /detokenize inverts it.
    root = args.base_url.rsplit("/v1", 1)[0]
    tk = post(f"{root}/tokenize", {"messages": messages})
    check(tk["count"] == r.usage.prompt_tokens == len(tk["tokens"]), f"tokenize {tk} vs {r.usage}")
    check(tk["max_model_len"] > 0, "max_model_len")
    dt = post(f"{root}/detokenize", {"tokens": tk["tokens"]})
    check(dt["prompt"] == f"user: {args.prompt}\nassistant:", f"detokenize {dt}")
    tp = post(f"{root}/tokenize", {"prompt": args.prompt})
    check(tp["count"] == u.prompt_tokens, f"tokenize prompt {tp} vs {u}")

    # A tool-call round trip in the history: the assistant's call and the tool's answer
    # are accepted and rendered (the embedded template shows them as role lines).
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": \"fox\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a quick animal"},
    ]
    t = client.chat.completions.create(messages=history, tools=tools, **greedy)
    check(t.choices[0].finish_reason == "length", f"tool history finish {t.choices[0].finish_reason}")
    tk = post(f"{root}/tokenize", {"messages": history, "tools": tools})
    check(tk["count"] == t.usage.prompt_tokens, f"tool history tokenize {tk['count']} vs {t.usage}")
    dt = post(f"{root}/detokenize", {"tokens": tk["tokens"]})
    check(dt["prompt"].endswith("tool: a quick animal\nassistant:"), f"tool turn rendered: {dt}")

    # Log-probabilities: the top alternative of every greedy token is the token itself, the
    # streamed ones equal the whole ones, and chat reports the same numbers.
    lp = client.completions.create(prompt=args.prompt, logprobs=3, **greedy)
    lpc = lp.choices[0].logprobs
    check(lp.choices[0].text == text, "logprobs do not change the text")
    check(len(lpc.token_logprobs) == n and len(lpc.top_logprobs) == n, f"logprobs length {lpc}")
    for tok, lpv, top in zip(lpc.tokens, lpc.token_logprobs, lpc.top_logprobs):
        best = max(top.items(), key=lambda kv: kv[1])
        check(len(top) <= 3 and abs(best[1] - lpv) < 1e-6 and lpv <= 0, f"top entry {best} vs {tok} {lpv}")
    check("".join(lpc.tokens) == text, f"logprob tokens {lpc.tokens} vs {text!r}")
    streamed_lp = [
        x
        for ch in client.completions.create(prompt=args.prompt, logprobs=3, stream=True, **greedy)
        if ch.choices and ch.choices[0].logprobs
        for x in ch.choices[0].logprobs.token_logprobs
    ]
    check(streamed_lp == lpc.token_logprobs, f"streamed logprobs {streamed_lp} != {lpc.token_logprobs}")
    clp = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, **greedy)
    entries = clp.choices[0].logprobs.content
    check(len(entries) == n and all(len(e.top_logprobs) == 2 for e in entries), f"chat logprobs {entries}")
    check(all(abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6 and e.top_logprobs[0].token == e.token for e in entries),
          "chat top entry is the greedy token")
    chat_streamed_lp = [
        e.logprob
        for ch in client.chat.completions.create(messages=messages, logprobs=True, stream=True, **greedy)
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content
    ]
    check(chat_streamed_lp == [e.logprob for e in entries], "chat streamed logprobs")

    # Errors come back as the client's typed exceptions with OpenAI fields.
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        check(False, "unknown model accepted")
    except openai.NotFoundError as e:
        check(e.status_code == 404 and e.code == "model_not_found", f"404 {e.code} {e.body}")
    # echo: the prompt, then the same completion.
    e = client.completions.create(prompt=args.prompt, echo=True, **greedy)
    check(e.choices[0].text == args.prompt + text, f"echo {e.choices[0].text!r}")
    es = "".join(
        ch.choices[0].text
        for ch in client.completions.create(prompt=args.prompt, echo=True, stream=True, **greedy)
        if ch.choices
    )
    check(es == args.prompt + text, f"streamed echo {es!r}")

    # n > 1: independent choices over one prompt; greedy ones are all the greedy text.
    three = client.completions.create(prompt=args.prompt, n=3, **greedy)
    check(sorted(ch.index for ch in three.choices) == [0, 1, 2], f"n=3 indices {three.choices}")
    check(all(ch.text == text for ch in three.choices), "n=3 greedy choices equal the greedy text")
    check(three.usage.completion_tokens == 3 * n and three.usage.prompt_tokens == u.prompt_tokens, f"n=3 usage {three.usage}")
    sampled = client.chat.completions.create(
        model=args.model, messages=messages, n=3, max_tokens=n, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )
    check(len(sampled.choices) == 3, f"chat n=3 {len(sampled.choices)} choices")
    by_index = {}
    for ch in client.chat.completions.create(
        model=args.model, messages=messages, n=3, max_tokens=n, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True}, stream=True, stream_options={"include_usage": True},
    ):
        for c in ch.choices:
            by_index[c.index] = by_index.get(c.index, "") + (c.delta.content or "")
        if ch.usage is not None:
            check(ch.usage.completion_tokens == 3 * n, f"streamed n=3 usage {ch.usage}")
    check(by_index == {c.index: c.message.content for c in sampled.choices},
          f"streamed n=3 {by_index} != whole {[c.message.content for c in sampled.choices]}")
    try:
        client.completions.create(prompt="x", n=0, **greedy)
        check(False, "n=0 accepted")
    except openai.BadRequestError as e:
        check(e.param == "n", f"n=0 error param {e.param}")
    try:
        client.chat.completions.create(messages=messages, temperature=3, model=args.model)
        check(False, "temperature 3 accepted")
    except openai.BadRequestError as e:
        check(e.param == "temperature", f"temperature error param {e.param}")

    try:
        client.chat.completions.create(messages=messages, extra_body={"guided_json": {}}, **{k: v for k, v in greedy.items() if k != "extra_body"})
        check(False, "guided_json accepted")
    except openai.BadRequestError as e:
        check(e.param == "guided_json" and e.code == "unsupported_parameter", f"unknown field error {e.param} {e.code}")

    # Structured output: a json_schema reply parses and validates; a schema that does not
    # compile is a 400 naming it.
    schema = {"type": "object",
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                             "color": {"enum": ["red", "blue"]}},
              "required": ["n", "color"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "record", "strict": True, "schema": schema}}
    js = client.chat.completions.create(model=args.model, messages=messages, max_tokens=60, temperature=0,
                                        response_format=rf)
    rec = json.loads(js.choices[0].message.content)
    check(set(rec) == {"n", "color"} and isinstance(rec["n"], int) and 0 <= rec["n"] <= 99
          and rec["color"] in ("red", "blue") and js.choices[0].finish_reason == "stop", f"json_schema reply {rec}")
    try:
        client.chat.completions.create(model=args.model, messages=messages, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}})
        check(False, "a schema that does not compile accepted")
    except openai.BadRequestError as e:
        check(e.param == "response_format.json_schema.schema", f"bad schema param {e.param}")
    # A tool call forced by the grammar comes back as tool_calls; answered with a tool
    # message, the next turn renders it.
    weather = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    fc = client.chat.completions.create(model=args.model, messages=ask, tools=weather, tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=200, temperature=0)
    calls = fc.choices[0].message.tool_calls
    check(fc.choices[0].finish_reason == "tool_calls" and calls and calls[0].function.name == "get_weather",
          f"forced tool call {fc.choices[0]}")
    check(json.loads(calls[0].function.arguments)["city"] in ("Paris", "Rome"), f"arguments {calls[0].function.arguments}")
    answered = ask + [
        {"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "18C, sunny"},
    ]
    nt = client.chat.completions.create(messages=answered, tools=weather, **greedy)
    tk = post(f"{root}/tokenize", {"messages": answered, "tools": weather})
    check(tk["count"] == nt.usage.prompt_tokens, f"next turn tokenize {tk['count']} vs {nt.usage}")
    dt = post(f"{root}/detokenize", {"tokens": tk["tokens"]})
    check(dt["prompt"].endswith("tool: 18C, sunny\nassistant:"), f"next turn rendered: {dt}")
    # min_tokens: a stop token that would end the reply at once is held off.
    first = lp.choices[0].token_ids[0]
    held = client.completions.create(model=args.model, prompt=args.prompt, max_tokens=n, temperature=0,
                                     extra_body={"stop_token_ids": [first], "min_tokens": 3})
    check(held.usage.completion_tokens >= 3 and first not in held.choices[0].token_ids[:3], f"min_tokens {held}")

    print(json.dumps({
        "completion": text,
        "completion_prompt_tokens": u.prompt_tokens,
        "chat": chat,
        "chat_prompt_tokens": r.usage.prompt_tokens,
        "stop": stop,
        "stopped": s.choices[0].text,
        "prompt_ids": tp["tokens"],
        "completion_ids": lp.choices[0].token_ids,
        "token_logprobs": lpc.token_logprobs,
        "top_logprobs": [sorted(t.values(), reverse=True) for t in lpc.top_logprobs],
        "openai_version": openai.__version__,
    }))


if __name__ == "__main__":
    main()
