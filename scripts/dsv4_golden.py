#!/usr/bin/env python3
"""Golden DeepSeek-V4 prompts from the reference encoder, for router/tests/dsv4_golden.rs.

Runs `encode_messages` of the reference `encoding_dsv4.py` (the model repository's
`encoding/encoding_dsv4.py`, vendored by SGLang as
python/sglang/srt/entrypoints/openai/encoding_dsv4.py) on the chat requests below, mapped
to encoder input as SGLang's serving_chat.py does for the dsv4 encoding spec, and writes
the requests with the expected prompt strings to tests/fixtures/dsv4_encoding.json.

The reference is not part of this repository: pass its path with --encoder, or let the
script take it from the sglang 0.5.15 wheel on PyPI (pip download, no install).

    python3 scripts/dsv4_golden.py [--encoder PATH] [--out tests/fixtures/dsv4_encoding.json]
"""

import argparse
import copy
import hashlib
import importlib.util
import json
import pathlib
import subprocess
import sys
import tempfile
import zipfile

SGLANG = "sglang==0.5.15"
MEMBER = "sglang/srt/entrypoints/openai/encoding_dsv4.py"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression: 2 × 3 ≠ 5",
        "parameters": {
            "type": "object",
            "properties": {"expr": {"type": "string"}, "precision": {"type": "integer"}},
        },
    },
}


def call(id_, name, args):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": args}}


def user(c):
    return {"role": "user", "content": c}


def asst(c, reasoning=None, tool_calls=None):
    m = {"role": "assistant", "content": c}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    if tool_calls is not None:
        m["tool_calls"] = tool_calls
    return m


def tool(id_, c):
    return {"role": "tool", "tool_call_id": id_, "content": c}


THINK = {"thinking": True}
HISTORY = [
    {"role": "system", "content": "You are terse."},
    user("What is 2+2?"),
    asst("4", reasoning="Two plus two is four."),
    user("And 3+3?"),
]
TOOL_TURN = [
    user("Weather in Paris and Tokyo?"),
    asst(
        "Let me check.",
        tool_calls=[
            call("c1", "get_weather", '{"city": "Paris", "unit": "c"}'),
            call("c2", "get_weather", '{"city": "Tokyo"}'),
        ],
    ),
]
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
    },
}

CASES = [
    ("chat_single_user", {"messages": [user("Hello")]}),
    ("thinking_single_user", {"messages": [user("Hello")], "chat_template_kwargs": THINK}),
    ("thinking_false_explicit", {"messages": [user("Hi")], "chat_template_kwargs": {"thinking": False}}),
    ("system_and_user_chat", {"messages": [{"role": "system", "content": "Be brief."}, user("Write a parser")]}),
    ("effort_max_thinking", {"messages": [{"role": "system", "content": "S"}, user("Prove it")], "chat_template_kwargs": THINK, "reasoning_effort": "max"}),
    ("effort_max_in_kwargs", {"messages": [user("Prove it")], "chat_template_kwargs": {"thinking": True, "reasoning_effort": "max"}}),
    ("effort_high_thinking", {"messages": [user("Prove it")], "chat_template_kwargs": THINK, "reasoning_effort": "high"}),
    ("effort_max_chat_mode", {"messages": [user("Prove it")], "reasoning_effort": "max"}),
    ("effort_medium_is_default", {"messages": [user("Prove it")], "chat_template_kwargs": THINK, "reasoning_effort": "medium"}),
    ("multi_turn_thinking_drops_old_reasoning", {"messages": HISTORY, "chat_template_kwargs": THINK}),
    ("multi_turn_thinking_keep_reasoning", {"messages": HISTORY, "chat_template_kwargs": {"thinking": True, "drop_thinking": False}}),
    ("multi_turn_chat_mode", {"messages": HISTORY}),
    ("tools_chat", {"messages": [user("Weather in Paris?")], "tools": [WEATHER]}),
    ("tools_thinking_multi_turn_keeps_reasoning", {"messages": HISTORY, "tools": [WEATHER, CALC], "chat_template_kwargs": THINK}),
    ("tool_calls_and_results", {"messages": TOOL_TURN + [tool("c1", "18C sunny"), tool("c2", "25C rain")], "tools": [WEATHER]}),
    ("tool_results_out_of_order_are_sorted", {"messages": TOOL_TURN + [tool("c2", "25C rain"), tool("c1", "18C sunny")], "tools": [WEATHER]}),
    ("tool_results_then_user_merge", {"messages": TOOL_TURN + [tool("c1", "18C"), tool("c2", "25C"), user("Which is warmer?")], "tools": [WEATHER]}),
    ("tool_turn_thinking_with_reasoning", {"messages": [user("Weather in Paris?"), asst("", reasoning="Need the tool.", tool_calls=[call("c1", "get_weather", '{"city": "Paris"}')]), tool("c1", "18C")], "tools": [WEATHER], "chat_template_kwargs": THINK}),
    ("tool_call_arguments_typed_values", {"messages": [user("x"), asst("", tool_calls=[call("k", "calc", '{"expr": "1/3", "precision": 4, "exact": false, "ratio": 0.5, "big": 1e-07, "opts": {"mode": "fast", "list": [1, 2.0, null]}, "note": "naïve “quote” \\n end"}')]), tool("k", "0.3333")], "tools": [CALC]}),
    ("tool_call_empty_arguments", {"messages": [user("x"), asst(None, tool_calls=[call("e", "calc", "{}")]), tool("e", "")], "tools": [CALC]}),
    ("response_format_json_schema", {"messages": [user("Give n")], "response_format": SCHEMA}),
    ("response_format_json_object_with_system_and_tools", {"messages": [{"role": "system", "content": "JSON only."}, user("Give n")], "response_format": {"type": "json_object"}, "tools": [CALC]}),
    ("developer_role", {"messages": [{"role": "developer", "content": "Answer in French."}, user("Hello")]}),
    ("developer_before_last_user_thinking_is_dropped", {"messages": [{"role": "system", "content": "S"}, {"role": "developer", "content": "Rule one."}, user("a"), asst("b", reasoning="r"), user("c")], "chat_template_kwargs": THINK}),
    ("developer_last_thinking", {"messages": [{"role": "developer", "content": "Only dev."}], "chat_template_kwargs": THINK}),
    ("consecutive_users_merge", {"messages": [user("first"), user("second")]}),
    ("unicode_and_quotes", {"messages": [user("日本語 🎉 \"q\" <tag> \\ back")], "chat_template_kwargs": THINK}),
    ("trailing_assistant_message", {"messages": [user("Hi"), asst("Hello there", reasoning="greet")], "chat_template_kwargs": THINK}),
    ("null_contents", {"messages": [{"role": "system", "content": None}, user(None)]}),
    ("system_only", {"messages": [{"role": "system", "content": "Only a system prompt."}]}),
]


def load_encoder(path):
    spec = importlib.util.spec_from_file_location("encoding_dsv4", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fetch_encoder(tmp):
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", SGLANG, "-d", tmp],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    wheel = next(pathlib.Path(tmp).glob("sglang-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extract(MEMBER, tmp)
    return pathlib.Path(tmp, MEMBER)


def encoder_input(req):
    """SGLang's dsv4 path: content None -> "", an empty system message first when the
    first is not one, request tools (and a JSON response_format) on it, thinking from
    chat_template_kwargs.thinking, reasoning_effort from the top level or the kwargs."""
    messages = copy.deepcopy(req["messages"])
    for m in messages:
        if m.get("content") is None:
            m["content"] = ""
    if messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": ""})
    if req.get("tools"):
        messages[0]["tools"] = req["tools"]
    rf = req.get("response_format")
    if rf and rf.get("type") != "text":
        messages[0]["response_format"] = rf
    kwargs = req.get("chat_template_kwargs") or {}
    effort = req.get("reasoning_effort") or kwargs.get("reasoning_effort")
    return messages, dict(
        thinking_mode="thinking" if kwargs.get("thinking", False) else "chat",
        drop_thinking=kwargs.get("drop_thinking", True),
        reasoning_effort=effort if effort in ("max", "high") else None,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--encoder", help="path of the reference encoding_dsv4.py")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent.parent / "tests/fixtures/dsv4_encoding.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(args.encoder) if args.encoder else fetch_encoder(tmp)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        enc = load_encoder(path)
        cases = []
        for name, req in CASES:
            messages, opts = encoder_input(req)
            cases.append({"name": name, "request": req, "prompt": enc.encode_messages(messages, **opts)})
    out = {
        "reference": f"{SGLANG} {MEMBER}" if not args.encoder else path.name,
        "reference_sha256": digest,
        "cases": cases,
    }
    pathlib.Path(args.out).write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    print(f"{len(cases)} cases -> {args.out}")


if __name__ == "__main__":
    main()
