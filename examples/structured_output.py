"""Structured output: a JSON schema the reply must follow, through the OpenAI server and offline.

    python -m engine serve --port 8080          # in another terminal
    python examples/structured_output.py [--url localhost:8080]
"""
import argparse
import json

from openai import OpenAI

parser = argparse.ArgumentParser()
parser.add_argument("--url", default="localhost:8080")
args = parser.parse_args()

schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "languages": {"type": "array", "items": {"enum": ["en", "fr", "ja"]}, "maxItems": 3}}}

client = OpenAI(base_url=f"http://{args.url}/v1", api_key="none")
model = client.models.list().data[0].id
reply = client.chat.completions.create(
    model=model, max_tokens=96, temperature=0,
    messages=[{"role": "user", "content": "Describe a person as JSON."}],
    response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
person = json.loads(reply.choices[0].message.content)             # parses, and follows the schema
print("person:", person, "finish_reason:", reply.choices[0].finish_reason)

# The same constraint offline: SamplingParams(structured_outputs={"json": schema}) with engine.LLM;
# vLLM's other kinds are "regex", "choice", "grammar" (EBNF) and "json_object".
reply = client.completions.create(model=model, prompt="Pick one:", max_tokens=8, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
print("choice:", repr(reply.choices[0].text))
