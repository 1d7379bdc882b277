"""HTTP re-statements (own code, no vLLM code) of vLLM's request-model unit tests (test_tool_choice_null.py,
test_empty_prompt_list.py), sent to a running `tessera serve` on 127.0.0.1:8123. Results: docs/BENCHMARKS.md."""
import json

import requests

B = "http://127.0.0.1:8123"
M = requests.get(B + "/v1/models").json()["data"][0]["id"]
MSG = [{"role": "user", "content": "what is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]
def chat(**kw):
    r = requests.post(B + "/v1/chat/completions", json={"model": M, "messages": MSG, "max_tokens": 4, **kw})
    return r.status_code, r.json()
cases = {
    "tool_choice null + tools == absent (200)": chat(tools=TOOLS, tool_choice=None),
    "tool_choice null, no tools (200)": chat(tool_choice=None),
    "tool_choice null + response_format json_schema (200)": chat(tool_choice=None, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
    "tool_choice bogus (400)": chat(tools=TOOLS, tool_choice="bogus"),
    "tool_choice auto without tools (400)": chat(tool_choice="auto"),
    "tool_choice none + tools (200)": chat(tools=TOOLS, tool_choice="none"),
}
r = requests.post(B + "/v1/completions", json={"model": M, "prompt": [], "max_tokens": 4})
cases["completions prompt [] (400)"] = (r.status_code, r.json())
r = requests.post(B + "/v1/completions", json={"model": M, "prompt": ["hello"], "max_tokens": 4})
cases["completions prompt ['hello'] (200)"] = (r.status_code, r.json())
for k, (code, body) in cases.items():
    print(code, k, "" if code == 200 else json.dumps(body)[:160])
