"""Offline batch generation with the embedded default model (vLLM-style API)."""

from jaxllm import LLM, SamplingParams

prompts = [
    "def quicksort(arr):",
    "# A function that returns the n-th prime number\ndef nth_prime(n):",
    "Hello, my name is",
]

llm = LLM()  # Qwen2.5-Coder-0.5B-Instruct, float32 on CPU, bfloat16 + Pallas kernels on GPU
outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48))
for out in outputs:
    print(f"{out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")

question = "Write a one-line Python expression that sums 1..100."
chat = llm.chat([{"role": "user", "content": question}],
                SamplingParams(temperature=0.0, max_tokens=64))
print(chat[0].outputs[0].text)
