"""Chat with the OpenAI-compatible server through the official openai SDK, whole and streamed.

    python -m engine serve --port 8080          # in another terminal (any model; --model DIR_OR_GGUF)
    python examples/openai_chat.py [--url localhost:8080]
"""
import argparse

from openai import OpenAI

parser = argparse.ArgumentParser()
parser.add_argument("--url", default="localhost:8080")
args = parser.parse_args()

client = OpenAI(base_url=f"http://{args.url}/v1", api_key="none")       # --api-key KEY on the server: KEY here
model = client.models.list().data[0].id
messages = [{"role": "user", "content": "Say hello in three languages."}]

reply = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
print("whole:", repr(reply.choices[0].message.content), reply.choices[0].finish_reason,
      f"usage={reply.usage.prompt_tokens}+{reply.usage.completion_tokens}")

text = ""
for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0,
                                            stream=True):
    if chunk.choices:
        text += chunk.choices[0].delta.content or ""        # print it as it comes, in a real client
print("streamed:", repr(text))
