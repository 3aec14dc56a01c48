"""The paged-KV engine, driven directly (no ZeroMQ), against HF ``generate`` on the tiny checkpoints.

Prompts are built by the HF processor (chat template, placeholders expanded); image embeddings
come from encoder_stage.vision.VisionTower on the processor's resized pixels, as in serving.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmcache.encoder_stage.vision import VisionInput, VisionTower
from mmcache.llm_stage.engine import Engine
from mmcache.llm_stage.sequence import MediaRows, Sequence
from mmcache.processor.preprocess import Preprocessor
from mmcache.shared.block_hash import root_hash
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.config import LLMConfig
from mmcache.shared.messages import MediaSpan, SamplingParams
from mmcache.shared.torch_utils import cpu_has_bfloat16
from tests.hf_reference import reference_device
from tests.media import image_bytes

ARCHS = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe")
MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


@dataclass
class Env:
    arch: str
    path: Path
    spec: ModelSpec
    hf_processor: object
    hf_model: object
    pre: Preprocessor
    tower: VisionTower
    cache: dict = field(default_factory=dict)  # prompts and reference outputs, built once per arch


@dataclass
class Prompt:
    token_ids: list[int]
    spans: list[MediaSpan] = field(default_factory=list)
    media: list[MediaRows] = field(default_factory=list)
    hf_inputs: dict = field(default_factory=dict)


@pytest.fixture(scope="module", params=ARCHS)
def env(request, tiny_models) -> Env:
    return build_env(request.param, tiny_models)


def build_env(arch: str, tiny_models) -> Env:
    path = tiny_models[arch]
    spec = ModelSpec.load(path)
    return Env(
        arch,
        path,
        spec,
        AutoProcessor.from_pretrained(path),
        AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval().to(reference_device()),
        Preprocessor(str(path), video_fps=2.0, max_video_frames=64),
        VisionTower(spec, device=str(reference_device()), dtype="float32"),
    )


def make_prompt(env: Env, text: str, images: list[tuple[int, int, int]] = ()) -> Prompt:
    """A user turn with ``images`` ((width, height, seed) each) before ``text`` (cached per arch)."""
    key = ("prompt", text, tuple(images))
    if key not in env.cache:
        env.cache[key] = _build_prompt(env, text, images)
    return env.cache[key]


def _build_prompt(env: Env, text: str, images: list[tuple[int, int, int]]) -> Prompt:
    pil = [Image.open(io.BytesIO(image_bytes(w, h, seed=s))) for w, h, s in images]
    content = [{"type": "image"} for _ in pil] + [{"type": "text", "text": text}]
    chat = env.hf_processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs = env.hf_processor(text=[chat], images=pil or None, return_tensors="pt").to(reference_device())
    ids = inputs["input_ids"][0].tolist()
    prompt = Prompt(ids, hf_inputs=dict(inputs))
    pad = env.spec.image_token_id
    cursor = 0
    for image in pil:
        layout = env.pre.image(image, salt=None)
        offset = ids.index(pad, cursor)
        span = MediaSpan(offset, "image", layout.grid_thw, [c.key for c in layout.chunks], 1.0, 2)
        assert ids[offset : offset + span.num_tokens] == [pad] * span.num_tokens
        (rows,) = env.tower.encode([VisionInput("image", layout.chunks[0].pixels)])
        prompt.spans.append(span)
        prompt.media.append(MediaRows(offset, rows))
        cursor = offset + span.num_tokens
    return prompt


def make_engine(env: Env, **cfg) -> Engine:
    device = str(reference_device())
    options = {"model": str(env.path), "device": device, "dtype": "float32", "num_kv_blocks": 96, **cfg}
    return Engine(LLMConfig(**options), env.spec)


def make_seq(env: Env, engine: Engine, seq_id: int, prompt: Prompt, sampling: SamplingParams) -> Sequence:
    """A sequence with its media rows already present (no fetch)."""
    return Sequence.new(
        seq_id,
        prompt.token_ids,
        list(prompt.spans),
        root_hash(env.spec.weights_fingerprint, None),
        sampling,
        engine.max_model_len,
        env.spec.eos_token_ids,
        env.spec.tokens_per_second,
        media=prompt.media,
    )


def run(engine: Engine, seqs: list[Sequence], max_steps: int = 2000) -> dict[int, tuple[list[int], str]]:
    """Submit all, step until idle; seq_id → (generated tokens, finish reason)."""
    for seq in seqs:
        engine.submit(seq)
    tokens: dict[int, list[int]] = {seq.seq_id: [] for seq in seqs}
    reasons: dict[int, str] = {}
    steps = 0
    while engine.has_work():
        steps += 1
        assert steps <= max_steps, "engine did not finish"
        for out in engine.step().outputs:
            assert out.seq_id not in reasons, "output after the finish"
            if out.token_id is not None:
                tokens[out.seq_id].append(out.token_id)
            if out.finish_reason is not None:
                reasons[out.seq_id] = out.finish_reason
    assert set(reasons) == set(tokens)
    return {k: (tokens[k], reasons[k]) for k in tokens}


def hf_greedy(env: Env, prompt: Prompt, max_new: int = MAX_NEW) -> list[int]:
    key = ("hf", id(prompt), max_new)
    if key not in env.cache:
        inputs = prompt.hf_inputs
        with torch.no_grad():
            out = env.hf_model.generate(**inputs, max_new_tokens=max_new, do_sample=False)
        env.cache[key] = out[0, inputs["input_ids"].shape[1] :].tolist()
    return env.cache[key]


def expected_reason(env: Env, tokens: list[int]) -> str:
    return "stop" if tokens and tokens[-1] in env.spec.eos_token_ids else "length"


TEXT = "Tell me a story about the quiet harbor town and the old baker on Mill Street."
CONFIGS = {
    "one_step_prefill": {},
    "chunked_prefill_16": {"max_num_batched_tokens": 16},
    "chunked_no_prefix_cache": {"max_num_batched_tokens": 16, "no_prefix_cache": True},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_text_equals_hf_generate(env: Env, config: str):
    prompt = make_prompt(env, TEXT)
    hf = hf_greedy(env, prompt)
    engine = make_engine(env, **CONFIGS[config])
    ((tokens, reason),) = run(engine, [make_seq(env, engine, 1, prompt, GREEDY)]).values()
    assert tokens == hf
    assert reason == expected_reason(env, hf)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_image_prompt_equals_hf_generate(env: Env, config: str):
    prompt = make_prompt(env, "Describe the picture.", images=[(300, 200, 1)])
    grid = prompt.hf_inputs["image_grid_thw"][0].tolist()
    assert len(prompt.spans) == 1 and prompt.spans[0].num_tokens == grid[1] * grid[2] // 4
    hf = hf_greedy(env, prompt)
    engine = make_engine(env, **CONFIGS[config])
    ((tokens, reason),) = run(engine, [make_seq(env, engine, 1, prompt, GREEDY)]).values()
    assert tokens == hf
    assert reason == expected_reason(env, hf)


def test_image_embeddings_change_the_output(env: Env):
    """Guard against a vacuous pass: the image rows really reach the model."""
    a = make_prompt(env, "Describe the picture.", images=[(300, 200, 1)])
    b = make_prompt(env, "Describe the picture.", images=[(300, 200, 2)])
    assert a.token_ids == b.token_ids
    engine = make_engine(env)
    out = run(engine, [make_seq(env, engine, 1, a, GREEDY), make_seq(env, engine, 2, b, GREEDY)])
    assert out[1][0] != out[2][0]


def test_same_placeholders_different_image_is_no_prefix_hit(env: Env):
    """Two prompts with identical token ids but different images share only the blocks before
    the image; the second one's output is its own, not the first one's."""
    a = make_prompt(env, "Describe the picture.", images=[(300, 200, 1)])
    b = make_prompt(env, "Describe the picture.", images=[(300, 200, 2)])
    engine = make_engine(env)
    first = run(engine, [make_seq(env, engine, 1, a, GREEDY)])[1]
    seq_b = make_seq(env, engine, 2, b, GREEDY)
    second = run(engine, [seq_b])[2]
    fresh = make_engine(env)
    assert second == run(fresh, [make_seq(env, fresh, 2, b, GREEDY)])[2]
    assert second != first
    # The text before the image, not one token more (a block's shared start extends only a full-block
    # hit: Qwen3-VL's template has no default system prompt, so its image starts inside block 0).
    offset = b.spans[0].offset
    assert seq_b.num_cached_tokens == (offset if offset >= engine.blocks.block_size else 0)


CONCURRENT = [
    ("Hi.", [], 12),
    (TEXT, [], 16),
    (TEXT + " Then tell me about the ferry, the gulls, the schoolhouse and the post office. " * 3, [], 12),
    ("What is in this image?", [(57, 57, 3)], 16),
    ("Compare the two images in detail, please.", [(300, 200, 4), (120, 90, 5)], 10),
    ("Short.", [(448, 448, 6)], 6),
]


CONCURRENT_CONFIGS = {
    "budget_2048": {"max_num_batched_tokens": 2048},
    "chunked_16": {"max_num_batched_tokens": 16},
    # 20 blocks of 16 tokens cannot hold all six: sequences are preempted and resumed
    "small_pool_preempts": {"max_num_batched_tokens": 64, "num_kv_blocks": 20},
}


@pytest.mark.parametrize("config", list(CONCURRENT_CONFIGS))
def test_concurrent_sequences_equal_their_single_runs(env: Env, config: str):
    prompts = [make_prompt(env, text, images) for text, images, _ in CONCURRENT]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for *_, n in CONCURRENT]
    assert len({len(p.token_ids) for p in prompts}) == len(prompts)  # all different lengths

    if "single" not in env.cache:  # each prompt alone in a fresh engine (shared by both params)
        env.cache["single"] = []
        for prompt, sp in zip(prompts, params, strict=True):
            engine = make_engine(env)
            env.cache["single"].append(run(engine, [make_seq(env, engine, 0, prompt, sp)])[0])
    single = env.cache["single"]

    engine = make_engine(env, **CONCURRENT_CONFIGS[config])
    seqs = [make_seq(env, engine, i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    together = run(engine, seqs)
    if config == "small_pool_preempts":
        assert engine.scheduler.num_preemptions > 0
    for i, (tokens, reason) in enumerate(single):
        assert together[i] == (tokens, reason), f"sequence {i}"
        assert reason == "length" and len(tokens) == params[i].max_tokens
    # and the single runs themselves are HF's greedy output (HF stops at eos, we ignore it)
    hf = hf_greedy(env, prompts[1], params[1].max_tokens)
    assert single[1][0][: len(hf)] == hf


def test_identical_prompts_share_the_prefix_cache_and_agree(env: Env):
    prompt = make_prompt(env, TEXT + " And the mill.", images=[(300, 200, 7)])
    engine = make_engine(env)
    first = run(engine, [make_seq(env, engine, 1, prompt, GREEDY)])[1]
    seq = make_seq(env, engine, 2, prompt, GREEDY)
    second = run(engine, [seq])[2]
    assert second == first
    assert seq.num_cached_tokens == len(prompt.token_ids) - 1  # all but the last token


SAMPLED = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)


def test_seeded_sampling_is_reproducible_across_engines(env: Env):
    prompt = make_prompt(env, TEXT)
    results = []
    for _ in range(2):
        engine = make_engine(env)
        results.append(run(engine, [make_seq(env, engine, 1, prompt, SAMPLED)])[1])
    assert results[0] == results[1]
    tokens, reason = results[0]
    assert len(tokens) == MAX_NEW and reason == "length"
    # it really sampled: not the greedy continuation, and another seed gives another text
    engine = make_engine(env)
    greedy = run(engine, [make_seq(env, engine, 1, prompt, SamplingParams(MAX_NEW, 0.0, ignore_eos=True))])
    assert greedy[1][0] != tokens
    other_seed = SamplingParams(MAX_NEW, 1.0, 0.9, 50, seed=8, ignore_eos=True)
    engine = make_engine(env)
    assert run(engine, [make_seq(env, engine, 1, prompt, other_seed)])[1][0] != tokens


def test_seeded_sampling_does_not_depend_on_batch_neighbours(env: Env):
    prompt = make_prompt(env, TEXT)
    engine = make_engine(env)
    alone = run(engine, [make_seq(env, engine, 1, prompt, SAMPLED)])[1]
    engine = make_engine(env, max_num_batched_tokens=16)
    others = [
        make_seq(env, engine, 10 + i, make_prompt(env, f"Other request number {i}."), SAMPLED)
        for i in range(3)
    ]
    mixed = run(engine, [*others, make_seq(env, engine, 1, prompt, SAMPLED)])
    assert mixed[1] == alone


def test_max_tokens_ends_with_length(env: Env):
    prompt = make_prompt(env, TEXT)
    engine = make_engine(env)
    longer = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reference, reason = run(engine, [make_seq(env, engine, 1, prompt, longer)])[1]
    assert reason == "length" and len(reference) == 12
    engine = make_engine(env)
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    tokens, reason = run(engine, [make_seq(env, engine, 1, prompt, sp)])[1]
    assert reason == "length"
    assert tokens == reference[:5]


def test_stop_token_ids_end_with_stop(env: Env):
    prompt = make_prompt(env, TEXT)
    engine = make_engine(env)
    free_run = run(engine, [make_seq(env, engine, 1, prompt, SamplingParams(MAX_NEW, 0.0, ignore_eos=True))])
    reference = free_run[1][0]
    # the first position whose token did not occur before it: stopping there is unambiguous
    cut = next(i for i in range(3, len(reference)) if reference[i] not in reference[:i])
    sp = SamplingParams(MAX_NEW, 0.0, stop_token_ids=[reference[cut]], ignore_eos=True)
    engine = make_engine(env)
    tokens, reason = run(engine, [make_seq(env, engine, 1, prompt, sp)])[1]
    assert reason == "stop"
    assert tokens == reference[: cut + 1]  # the stop token is the last one generated


def test_max_tokens_one(env: Env):
    prompt = make_prompt(env, "Hi.", images=[(57, 57, 1)])
    engine = make_engine(env, max_num_batched_tokens=16)
    tokens, reason = run(engine, [make_seq(env, engine, 1, prompt, SamplingParams(1, 0.0, ignore_eos=True))])[
        1
    ]
    assert reason == "length" and len(tokens) == 1
    assert tokens == hf_greedy(env, prompt, 1)


def test_new_question_about_a_cached_image_copies_the_image_tail_and_agrees(env: Env):
    """The block holding the image's last tokens also held the first question: the second
    question shares that block's start (copied, not recomputed): its K/V there equal what a
    fresh engine computes, and it answers as a fresh engine does."""
    first = make_prompt(env, "Describe the picture in one word.", images=[(300, 200, 8)])
    second = make_prompt(env, "Which colour dominates?", images=[(300, 200, 8)])
    engine, fresh = make_engine(env), make_engine(env)
    run(engine, [make_seq(env, engine, 1, first, GREEDY)])
    seqs = [make_seq(env, e, 2, second, GREEDY) for e in (engine, fresh)]
    for e, seq in zip((engine, fresh), seqs, strict=True):
        e.submit(seq)
        e.step()  # the whole prompt fits one step: its K/V are all in the cache now
    image_end = second.spans[0].offset + second.spans[0].tokens_per_chunk
    size = engine.blocks.block_size
    assert image_end % size  # the image ends inside a block ...
    cached = seqs[0].num_cached_tokens
    assert cached >= image_end and cached % size  # ... and none of it is recomputed: that block is shared
    start = cached // size * size

    def kv(e: Engine, seq) -> torch.Tensor:
        slots = [seq.block_table[t // size] * size + t % size for t in range(start, cached)]
        return e.kv.kv[:, slots]

    torch.testing.assert_close(kv(engine, seqs[0]), kv(fresh, seqs[1]), atol=1e-5, rtol=1e-5)
    tokens = {}
    for e, seq in zip((engine, fresh), seqs, strict=True):
        out = [seq.token_ids[-1]]
        while e.has_work():
            out += [o.token_id for o in e.step().outputs if o.token_id is not None]
        tokens[e] = out
    assert tokens[engine] == tokens[fresh]


@pytest.mark.skipif(
    not torch.cuda.is_available() and not cpu_has_bfloat16(),
    reason="this CPU has no bfloat16 instructions: torch's emulated bf16 products round a row by its batch",
)
def test_bfloat16_cpu_kernels_batch_rows_as_they_compute_alone(env: Env):
    """In bfloat16 on a CPU a layer's norms, rotary, SiLU and decode attention run as compiled kernels
    (``shared/cpu_kernels.c``, ``shared/cpu_attention.c``) that compute a row the same way whatever
    its neighbours: six sequences admitted one step apart (each prefill sharing its step with the
    others' decodes) generate what each generates alone in a fresh engine.

    NOTE: no preemption and no prefix hit here. In bfloat16 a recomputed or cache-hit prompt row
    goes through another attention path than a miss (decode attention, SDPA with a mask, SDPA
    causal), each rounding differently, so those are not bit-equal (docs/performance.md).

    NOTE: the weight products are oneDNN's, checked at load to round a row alone as in a batch
    (``shared/linear.py``). On a CPU without AVX512-BF16 or AMX (which ``--dtype auto`` serves in
    float32) torch emulates bfloat16 products and rounds a row by its batch's size: 4864x896 weight,
    seven rows at once against one at a time, up to 0.25 apart on an Intel Xeon with AVX512F only."""
    engine = make_engine(env, dtype="bfloat16", max_num_batched_tokens=2048)
    if engine.runner.device.type == "cpu":
        assert engine.runner.kernels is not None and engine.runner.attention.kernels is not None
    prompts = [make_prompt(env, text, images) for text, images, _ in CONCURRENT]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for *_, n in CONCURRENT]
    single = []
    for prompt, sp in zip(prompts, params, strict=True):
        fresh = make_engine(env, dtype="bfloat16")
        single.append(run(fresh, [make_seq(env, fresh, 0, prompt, sp)])[0][0])
    seqs = [make_seq(env, engine, i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    waiting, mixed = list(seqs), 0
    while waiting or engine.has_work():
        decoding = sum(s.num_output_tokens > 0 and s.finish_reason is None for s in seqs)
        if waiting:
            engine.submit(waiting.pop(0))
            mixed += decoding > 0  # this step prefills a newcomer next to others' decodes
        engine.step()
    assert mixed >= 3 and engine.scheduler.num_preemptions == 0
    assert [s.token_ids[s.num_prompt_tokens :] for s in seqs] == single
