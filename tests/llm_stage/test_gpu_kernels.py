"""The CUDA path against the SDPA path: FlashInfer's paged attention over the block pool, and decode
steps replayed from CUDA graphs. Skipped without CUDA (and FlashInfer); scripts/gpu-check runs them.

The tiny checkpoints have head_dim 32, which FlashInfer's kernels are not built for, so the
model-level tests use a variant with head_dim 64 (:func:`head_dim_64`): the same weights read as
half as many heads twice as wide (q/k/v projections keep their shapes).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mmcache.llm_stage.attention import SdpaBackend
from mmcache.llm_stage.attention_select import choose_backend, flashinfer_importable
from mmcache.llm_stage.engine import Engine
from mmcache.llm_stage.kv_cache import KVCache
from mmcache.llm_stage.scheduler import StepItem
from mmcache.llm_stage.sequence import Sequence
from mmcache.shared.block_hash import root_hash
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.config import LLMConfig
from mmcache.shared.keys import Fingerprint
from mmcache.shared.messages import SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_flashinfer = pytest.mark.skipif(
    not (torch.cuda.is_available() and flashinfer_importable()), reason="needs CUDA and flashinfer"
)


@pytest.fixture(scope="module")
def head_dim_64(tiny_models, tmp_path_factory) -> Path:
    """The qwen2-vl tiny checkpoint read with 2 query heads and 1 KV head of 64 (was 4 and 2 of 32)."""
    out = tmp_path_factory.mktemp("hd64") / "qwen2-vl-hd64"
    shutil.copytree(tiny_models["qwen2-vl"], out)
    config = json.loads((out / "config.json").read_text())
    text = config["text_config"]
    text["num_attention_heads"], text["num_key_value_heads"] = 2, 1
    text["rope_parameters"]["mrope_section"] = [8, 12, 12]  # sums to head_dim / 2
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_the_head_dim_64_variant_loads_and_would_take_flashinfer(head_dim_64):
    """Runs anywhere: the variant the CUDA tests use is a valid checkpoint (it decodes on CPU)."""
    spec = ModelSpec.load(head_dim_64)
    engine = Engine(LLMConfig(model=str(head_dim_64), device="cpu", dtype="float32", num_kv_blocks=32), spec)
    assert engine.lm.head_dim == 64 and engine.attention_backend == "sdpa" and engine.graphs is None
    assert choose_backend("auto", torch.device("cuda"), torch.bfloat16, 64, lambda: True).name == "flashinfer"
    out = run(engine, prompts(spec, engine, 2, max_tokens=3))
    assert all(len(tokens) == 3 for tokens in out.values())


def prompts(spec: ModelSpec, engine: Engine, n: int, max_tokens: int) -> list[Sequence]:
    """``n`` text prompts of different lengths (plain token ids, no media)."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    root = root_hash(spec.weights_fingerprint, None)
    return [
        Sequence.new(
            i,
            [(7 * i + 3 * t) % 1900 + 10 for t in range(5 + 11 * i)],
            [],
            root,
            sampling,
            engine.max_model_len,
            spec.eos_token_ids,
            spec.tokens_per_second,
        )
        for i in range(n)
    ]


def run(engine: Engine, seqs: list[Sequence], max_steps: int = 500) -> dict[int, list[int]]:
    for seq in seqs:
        engine.submit(seq)
    out: dict[int, list[int]] = {seq.seq_id: [] for seq in seqs}
    for _ in range(max_steps):
        if not engine.has_work():
            return out
        for o in engine.step().outputs:
            if o.token_id is not None:
                out[o.seq_id].append(o.token_id)
    raise AssertionError("engine did not finish")


# --- FlashInfer against SDPA, one attention call ---------------------------------------------


def seq_over(table: list[int], length: int, seq_id: int) -> Sequence:
    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    seq = Sequence.new(
        seq_id, list(range(length)), [], root_hash(Fingerprint(b"\x01" * 16), None), sampling, 4096, [], 1.0
    )
    seq.block_table = table
    return seq


@needs_flashinfer
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(14, 2, 64), (12, 2, 128), (8, 8, 128)])
def test_flashinfer_attends_as_sdpa_over_the_same_pool(heads, kv_heads, head_dim):
    from mmcache.llm_stage.attention_flashinfer import FlashInferBackend

    torch.manual_seed(0)
    dev, dtype, bs, blocks = torch.device("cuda"), torch.bfloat16, 16, 64
    kv = KVCache(
        SimpleNamespace(layers=[None], num_kv_heads=kv_heads, head_dim=head_dim), blocks, bs, dev, dtype
    )
    kv.kv.normal_()
    perm = torch.randperm(blocks).tolist()
    fresh = seq_over(perm[0:3], 40, 1)  # a whole prompt: tokens 0..39
    chunk = seq_over(perm[3:8], 70, 2)  # a chunk 50..69 over a cached prefix
    decode_a = seq_over(perm[8:12], 61, 3)  # one token at 60
    decode_b = seq_over(perm[12:13], 5, 4)  # one token at 4
    items = [
        StepItem(decode_a, 60, 61, True),
        StepItem(fresh, 0, 40, True),
        StepItem(chunk, 50, 70, True),
        StepItem(decode_b, 4, 5, True),
    ]
    rows = sum(it.num_tokens for it in items)
    qkv = torch.randn(rows, heads + 2 * kv_heads, head_dim, device=dev, dtype=dtype)
    scaling = head_dim**-0.5
    sdpa, flash = SdpaBackend(kv, heads, scaling), FlashInferBackend(kv, heads, scaling)
    want_plan, plan = sdpa.plan(items), flash.plan(items)
    sdpa.write(0, qkv[:, heads:], want_plan)
    want = sdpa.attend(0, qkv, want_plan)
    before = kv.kv.clone()
    flash.write(0, qkv[:, heads:], plan)
    assert torch.equal(kv.kv, before)  # the same slots, the same values
    got = flash.attend(0, qkv, plan)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    # decodes only: the path the CUDA graphs replay
    only = [items[0], items[3]]
    torch.testing.assert_close(
        flash.attend(0, qkv[[0, rows - 1]], flash.plan(only)),
        sdpa.attend(0, qkv[[0, rows - 1]], sdpa.plan(only)),
        atol=2e-2,
        rtol=2e-2,
    )


# --- the engine on CUDA: backends and graphs ---------------------------------------------------


def cuda_engine(path: Path, **cfg) -> Engine:
    options = {"model": str(path), "device": "cuda", "dtype": "bfloat16", "num_kv_blocks": 128, **cfg}
    return Engine(LLMConfig(**options), ModelSpec.load(path))


@needs_flashinfer
def test_decode_graphs_give_the_eager_tokens(head_dim_64):
    spec = ModelSpec.load(head_dim_64)
    graphed = cuda_engine(head_dim_64, attention_backend="flashinfer", cuda_graph_max_batch=8)
    eager = cuda_engine(head_dim_64, attention_backend="flashinfer", cuda_graph_max_batch=0)
    assert graphed.attention_backend == eager.attention_backend == "flashinfer"
    assert graphed.graphs is not None and eager.graphs is None
    assert graphed.graphs.sizes == (1, 2, 4, 8)
    # 5 sequences: decode batches of 5 (padded to 8), then fewer as they finish at their lengths
    want = run(eager, prompts(spec, eager, 5, max_tokens=12))
    got = run(graphed, prompts(spec, graphed, 5, max_tokens=12))
    assert graphed.graphs.replays > 0
    assert got == want


@needs_flashinfer
def test_flashinfer_engine_agrees_with_sdpa_engine(head_dim_64):
    spec = ModelSpec.load(head_dim_64)
    flash = cuda_engine(head_dim_64, attention_backend="flashinfer")
    sdpa = cuda_engine(head_dim_64, attention_backend="sdpa")
    assert (flash.attention_backend, sdpa.attention_backend) == ("flashinfer", "sdpa")
    want = run(sdpa, prompts(spec, sdpa, 4, max_tokens=8))
    got = run(flash, prompts(spec, flash, 4, max_tokens=8))
    # bf16 with other kernels: the first tokens must agree (later ones may part at a near-tie)
    assert [t[:2] for t in got.values()] == [t[:2] for t in want.values()]
    agree = sum(
        a == b for g, w in zip(got.values(), want.values(), strict=True) for a, b in zip(g, w, strict=True)
    )
    print(f"flashinfer vs sdpa, bf16: {agree}/{sum(map(len, want.values()))} greedy tokens equal")


@needs_cuda
def test_sdpa_on_cuda_decodes_eagerly(head_dim_64):
    """SDPA's plans change shape with every step: no graphs, no spare block, and it still decodes."""
    engine = cuda_engine(head_dim_64, attention_backend="sdpa")
    assert engine.attention_backend == "sdpa" and engine.graphs is None
    assert engine.kv.num_blocks == len(engine.blocks.blocks) == 128
    out = run(engine, prompts(ModelSpec.load(head_dim_64), engine, 3, max_tokens=4))
    assert all(len(tokens) == 4 for tokens in out.values())
