"""Greedy answers of plain transformers to chat requests: the reference a server comparison adds.

The checkpoint is loaded in float32 with its Auto classes and answers each request body (text
messages, ``max_tokens``, ``ignore_eos``) as ``generate`` does without sampling; the text is the
new tokens decoded without special tokens, as an OpenAI-compatible server returns it.
"""

from __future__ import annotations

import torch


def greedy_texts(model_dir: str, payloads: list[dict]) -> list[str]:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for payload in payloads:
        prompt = processor.apply_chat_template(
            payload["messages"], tokenize=False, add_generation_prompt=True
        )
        inputs = processor(text=[prompt], return_tensors="pt")
        n = inputs["input_ids"].shape[1]
        # NOTE: ignore_eos as the servers take it: an end token is generated and not stopped at.
        stop = {} if not payload.get("ignore_eos") else {"eos_token_id": None}
        with torch.inference_mode():
            ids = model.generate(
                **inputs, max_new_tokens=payload["max_tokens"], min_new_tokens=0, do_sample=False, **stop
            )
        out.append(processor.tokenizer.decode(ids[0, n:], skip_special_tokens=True))
    return out
