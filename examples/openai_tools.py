"""A tool call round trip through the OpenAI server: the model calls a function, we run it, the model answers.

    python -m engine serve --model DIR --enable-auto-tool-choice --tool-call-parser auto    # in another terminal
    python examples/openai_tools.py [--url localhost:8080] [--tool-choice auto|required|none]
DIR is a checkpoint whose chat template has a tool section (Qwen2.5, Qwen3, Llama 3.x; the `tiny-qwen` and
`qwen2.5-0.5b` presets carry Qwen2.5's). A random-weight preset does not choose to call: use --tool-choice required.
"""
import argparse
import json

from openai import OpenAI

parser = argparse.ArgumentParser()
parser.add_argument("--url", default="localhost:8080")
parser.add_argument("--tool-choice", default="auto")
args = parser.parse_args()


def get_weather(city: str, unit: str) -> str:
    return json.dumps({"city": city, "temperature": 21 if unit == "celsius" else 70, "unit": unit})


tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}]

client = OpenAI(base_url=f"http://{args.url}/v1", api_key="none")
model = client.models.list().data[0].id
messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]

reply = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice=args.tool_choice,
                                       parallel_tool_calls=False,
                                       max_tokens=64, temperature=0).choices[0]
print("finish_reason:", reply.finish_reason)
messages.append(reply.message.model_dump(exclude_none=True))
for call in reply.message.tool_calls or []:
    arguments = json.loads(call.function.arguments)            # always valid JSON for the tool's schema
    result = get_weather(**arguments)
    print(f"call {call.function.name}({arguments}) -> {result}")
    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})

if reply.message.tool_calls:
    answer = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="none",
                                            max_tokens=32, temperature=0).choices[0]
    print("answer:", repr(answer.message.content))
else:
    print("no call; text:", repr(reply.message.content))
