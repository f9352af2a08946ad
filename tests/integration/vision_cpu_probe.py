"""Run the tiny vision model (`prepare.synthetic.TINY_VISION`) on vLLM 0.28.0's CPU build and
print what it answered: ``python vision_cpu_probe.py MODEL_DIR`` prints one ``PROBE {...}`` line.

Two engines, one after another in this process (vLLM imported once):

- ``vision``: ``limit_mm_per_prompt={"image": 1}``; chats carrying a PNG (data: URL): two
  64 x 64 images of different colours (4 image tokens each: 16 patches of 16 x 16, merged
  2 x 2) and one 128 x 128 (16 tokens), greedy, with the first step's top logprobs;
- ``text``: the same directory with ``language_model_only=True`` (what every profile sets
  today): a text chat, and the image chat, which must be refused.

The CPU image's torchvision is an import-only stand-in (docker/cpu/torchvision-standin), and
vLLM's Qwen3-VL processor asks transformers for the torchvision ("fast") image processor; the
image chats pass ``mm_processor_kwargs={"use_fast": False}`` so the PIL one is loaded instead
(docs/vision.md).
"""

from __future__ import annotations

import base64
import io
import json
import os
import resource
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

PIL_PROCESSOR = {"use_fast": False}
QUESTION = "What is in the picture?"


def png_url(color: tuple[int, int, int], size: int) -> str:
    """A ``size`` x ``size`` PNG of ``color`` with inverted stripes every 8 pixels, as a data: URL."""
    from PIL import Image

    image = Image.new("RGB", (size, size), color)
    stripe = tuple(255 - c for c in color)
    for x in range(0, size, 8):
        for y in range(size):
            image.putpixel((x, y), stripe)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_chat(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]


def _rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _engine(model: str, **extra):
    from vllm import LLM

    return LLM(model=model, max_model_len=512, max_num_seqs=2, enforce_eager=True, seed=0,
               kv_cache_memory_bytes=64 << 20, mamba_ssm_cache_dtype="float32", **extra)


def _answer(output, image_token_id: int) -> dict:
    first = output.outputs[0].logprobs[0]
    return {"prompt_ids": list(output.prompt_token_ids), "image_tokens": output.prompt_token_ids.count(image_token_id),
            "ids": list(output.outputs[0].token_ids), "text": output.outputs[0].text,
            "top": {str(k): v.logprob for k, v in first.items()}}


def probe(model: str) -> dict:
    import gc

    from vllm import SamplingParams

    config = json.loads(open(os.path.join(model, "config.json"), encoding="utf-8").read())
    image_id = config["image_token_id"]
    greedy = SamplingParams(max_tokens=8, temperature=0, logprobs=3)
    result: dict = {"image_token_id": image_id}

    began = time.perf_counter()
    llm = _engine(model, limit_mm_per_prompt={"image": 1, "video": 0})
    loaded = time.perf_counter()
    chats = [image_chat(png_url((200, 30, 30), 64)), image_chat(png_url((30, 30, 200), 64)),
             image_chat(png_url((30, 160, 30), 128))]
    outputs = llm.chat(chats, greedy, mm_processor_kwargs=PIL_PROCESSOR, use_tqdm=False)
    answered = time.perf_counter()
    result["vision"] = {"load_s": round(loaded - began, 2), "chat_s": round(answered - loaded, 2),
                        "rss_mb": _rss_mb(), "answers": [_answer(o, image_id) for o in outputs]}
    del llm
    gc.collect()

    began = time.perf_counter()
    llm = _engine(model, language_model_only=True)
    loaded = time.perf_counter()
    text = llm.chat([{"role": "user", "content": QUESTION}], greedy, use_tqdm=False)[0]
    text_only = {"load_s": round(loaded - began, 2), "answer": _answer(text, image_id)}
    try:
        llm.chat(image_chat(png_url((200, 30, 30), 64)), greedy, mm_processor_kwargs=PIL_PROCESSOR, use_tqdm=False)
        text_only["refused"] = None
    except Exception as error:  # noqa: BLE001 - the refusal is what is measured
        text_only["refused"] = f"{type(error).__name__}: {error}"
    text_only["rss_mb"] = _rss_mb()
    result["text"] = text_only
    return result


if __name__ == "__main__":
    print("PROBE " + json.dumps(probe(sys.argv[1])))
