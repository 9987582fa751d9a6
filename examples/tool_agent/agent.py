"""A tool-using agent with the `openai` client, trained by the job as it is (docs/JOB.md "Your agent"):

    .venv/bin/python examples/tool_agent/make_model.py outputs/tool_agent_model
    CONFIG=configs/tool_agent_cpu.yaml bash run_megatron.sh      # job.agent=examples/tool_agent/agent.py:agent

The job calls `agent(base_url=..., **row)` once per episode (a row of train.jsonl: `a` and `b`); the agent loops
over chat.completions calls, runs the `add` tool for every tool call a reply carries, asks once more when a reply
has none before the tool was used, and ends at a reply without tool calls (or after `max_calls`). Reward: 1 for
the right sum in the last reply, 0.2 for calling the tool correctly. With the example's random model this shows
the mechanics (every call sampled on the vLLM fleet, trained token-exact), not learning.
"""

import json

import openai

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


def agent(base_url: str, a: int, b: int, max_calls: int = 3) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key="unused")  # any key and model name: the job ignores them
    messages = [{"role": "user", "content": f"What is {a} + {b}? Use the add tool, then answer with the number."}]
    used_tool = nudged = False
    for _ in range(max_calls):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=24)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            if used_tool or nudged:
                break
            messages.append({"role": "user", "content": "Call the add tool first."})  # one nudge, then stop
            nudged = True
            continue
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
                result = str(int(arguments["a"]) + int(arguments["b"]))
                used_tool = used_tool or result == str(a + b)
            except (ValueError, KeyError, TypeError) as err:
                result = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    last = messages[-1]
    answer = (last.get("content") or "") if last["role"] == "assistant" else ""
    return {"reward": 1.0 if str(a + b) in answer.split() else 0.2 * used_tool}
