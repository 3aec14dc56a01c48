"""The GPU path's decisions, checked on any machine: which attention backend runs and why (with
its fallback), the CUDA-graph batch buckets and the padding of a decode step, the paged metadata
the kernels read, and the flags. The kernels themselves run in tests/llm_stage/test_gpu_kernels.py
(CUDA only, scripts/gpu-check)."""

from __future__ import annotations

import argparse
import logging
from types import SimpleNamespace

import pytest
import torch

from mmcache.llm_stage.attention import SdpaBackend
from mmcache.llm_stage.attention_select import BackendChoice, choose_backend, log_choice, make_backend
from mmcache.llm_stage.cuda_graphs import DecodeGraphs, bucket, build_graphs, capture_sizes, is_decode_only
from mmcache.llm_stage.engine import Engine
from mmcache.llm_stage.kv_cache import KVCache
from mmcache.llm_stage.model_runner import ModelRunner
from mmcache.llm_stage.paged_layout import paged_layout
from mmcache.llm_stage.scheduler import StepItem
from mmcache.llm_stage.sequence import Sequence
from mmcache.llm_stage.text_model import TextLM
from mmcache.shared.block_hash import root_hash
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.config import LLMConfig, add_arguments, from_args
from mmcache.shared.keys import Fingerprint
from mmcache.shared.messages import SamplingParams
from tests.llm_stage.paged_reference import PagedReference

CUDA = torch.device("cuda")
CPU = torch.device("cpu")
BS = 4  # tokens per block in these tests


def always() -> bool:
    return True


def never() -> bool:
    return False


# --- backend choice ----------------------------------------------------------------------------


def test_auto_takes_flashinfer_only_where_it_can_run():
    assert choose_backend("auto", CUDA, torch.bfloat16, 128, always).name == "flashinfer"
    assert choose_backend("auto", CUDA, torch.float16, 64, always).name == "flashinfer"
    for device, dtype, head_dim, importable, why in [
        (CPU, torch.bfloat16, 128, always, "needs CUDA"),
        (CUDA, torch.float32, 128, always, "float16/bfloat16"),
        (CUDA, torch.bfloat16, 32, always, "head_dim"),
        (CUDA, torch.bfloat16, 128, never, "not installed"),
    ]:
        choice = choose_backend("auto", device, dtype, head_dim, importable)
        assert choice.name == "sdpa" and why in choice.reason
        assert not choice.fell_back  # auto asked for nothing in particular


def test_sdpa_is_taken_when_asked_even_where_flashinfer_runs():
    choice = choose_backend("sdpa", CUDA, torch.bfloat16, 128, always)
    assert choice == BackendChoice("sdpa", "sdpa", "asked for") and not choice.fell_back


def test_flashinfer_asked_for_where_it_cannot_run_falls_back_with_a_warning(caplog):
    choice = choose_backend("flashinfer", CPU, torch.float32, 32, always)
    assert choice.name == "sdpa" and choice.fell_back
    with caplog.at_level(logging.INFO, logger="mmcache.llm_stage.attention_select"):
        log_choice(choice)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "flashinfer asked for, running sdpa instead: flashinfer needs CUDA" in record.getMessage()


def lm_shape(layers: int = 2, kv_heads: int = 2, head_dim: int = 8) -> SimpleNamespace:
    """What KVCache reads of a model: its layer count and K/V head shape."""
    return SimpleNamespace(layers=[None] * layers, num_kv_heads=kv_heads, head_dim=head_dim)


def test_a_flashinfer_that_fails_to_load_leaves_sdpa_serving():
    try:
        import flashinfer  # noqa: F401

        pytest.skip("flashinfer is installed here: its load does not fail")
    except ImportError:
        pass
    kv = KVCache(lm_shape(), 4, BS, CPU, torch.float32)
    wanted = BackendChoice("flashinfer", "flashinfer", "pretend it imports")
    backend, choice = make_backend(wanted, kv, 4, 0.5)
    assert isinstance(backend, SdpaBackend)
    assert choice.name == "sdpa" and choice.fell_back and "failed to load" in choice.reason


# --- CUDA-graph buckets ------------------------------------------------------------------------


def test_capture_sizes_are_small_powers_then_multiples_of_eight_up_to_the_cap():
    assert capture_sizes(64, 256) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert capture_sizes(64, 20) == (1, 2, 4, 8, 16, 20)  # never past --max-num-seqs, which is captured
    assert capture_sizes(3, 64) == (1, 2, 3)
    assert capture_sizes(1, 64) == (1,)
    assert capture_sizes(0, 64) == ()


def test_a_batch_runs_in_the_smallest_captured_size_that_holds_it():
    sizes = capture_sizes(64, 256)
    assert [bucket(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 17, 63, 64)] == [1, 2, 4, 4, 8, 8, 16, 24, 64, 64]
    assert bucket(65, sizes) is None  # past the largest: eager
    assert bucket(0, sizes) is None
    assert bucket(1, ()) is None


def seq_with(prompt_len: int, generated: int, table: list[int], seq_id: int = 1) -> Sequence:
    sampling = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    seq = Sequence.new(seq_id, list(range(1, prompt_len + 1)), [], ROOT, sampling, 1024, [], 1.0)
    seq.token_ids += list(range(100, 100 + generated))
    seq.block_table = table
    return seq


ROOT = root_hash(Fingerprint(b"\x09" * 16), None)


def test_only_steps_of_generated_single_tokens_are_replayed():
    a, b = seq_with(5, 2, [3, 7]), seq_with(9, 1, [1, 2, 5])
    decodes = [StepItem(a, 6, 7, True), StepItem(b, 9, 10, True)]
    assert is_decode_only(decodes)
    assert not is_decode_only([])
    assert not is_decode_only([*decodes, StepItem(seq_with(8, 0, [4, 6]), 0, 8, True)])  # a prefill
    last_prompt_token = StepItem(seq_with(8, 0, [4, 6]), 7, 8, True)  # may carry media rows
    assert not is_decode_only([last_prompt_token])
    assert not is_decode_only([StepItem(a, 6, 7, False)])  # samples nothing


# --- the paged metadata the kernels read -------------------------------------------------------


def test_paged_layout_lists_each_items_pages_and_writes_the_slots_sdpa_writes():
    a = seq_with(5, 2, [3, 7])  # tokens 0..6: blocks 3 (0-3) and 7 (4-6)
    b = seq_with(9, 1, [1, 2, 5])  # tokens 0..9
    c = seq_with(10, 0, [8, 0, 6])  # a chunk over a cached prefix: tokens 4..9
    items = [StepItem(a, 6, 7, True), StepItem(c, 4, 10, True), StepItem(b, 9, 10, True)]
    layout = paged_layout(items, BS)
    assert layout.qo_indptr == [0, 1, 7, 8]
    assert layout.kv_indptr == [0, 2, 5, 8]
    assert layout.kv_indices == [3, 7, 8, 0, 6, 1, 2, 5]
    assert layout.last_page_len == [3, 2, 2]  # 7 tokens, 10, 10 in blocks of 4
    kv = KVCache(lm_shape(), 9, BS, CPU, torch.float32)
    sdpa = SdpaBackend(kv, 4, 0.5).plan(items)
    assert layout.slots == sdpa.new_slots.tolist() == [7 * BS + 2, 0, 1, 2, 3, 6 * BS, 6 * BS + 1, 5 * BS + 1]


def test_a_padded_decode_batch_sends_its_dummies_to_the_spare_block_only():
    a, b = seq_with(5, 2, [3, 7]), seq_with(9, 1, [1, 2, 5])
    layout = paged_layout([StepItem(a, 6, 7, True), StepItem(b, 9, 10, True)], BS)
    spare = 10
    padded = layout.padded(4, spare, BS)
    assert padded.qo_indptr == [0, 1, 2, 3, 4]
    assert padded.kv_indptr == [0, 2, 5, 6, 7]
    assert padded.kv_indices == [3, 7, 1, 2, 5, spare, spare]
    assert padded.last_page_len == [3, 2, 1, 1]
    assert padded.slots == [*layout.slots, spare * BS, spare * BS]
    assert layout.padded(2, spare, BS) == layout
    with pytest.raises(ValueError, match="cannot pad"):
        layout.padded(1, spare, BS)
    chunk = paged_layout([StepItem(seq_with(10, 0, [8, 0, 6]), 4, 10, True)], BS)
    with pytest.raises(ValueError, match="single-token"):
        chunk.padded(2, spare, BS)


def test_a_block_table_too_short_for_the_tokens_is_refused():
    with pytest.raises(ValueError, match="need 3"):
        paged_layout([StepItem(seq_with(9, 1, [1, 2]), 9, 10, True)], BS)


def test_no_graphs_off_cuda_or_with_sdpa():
    kv = KVCache(lm_shape(), 4, BS, CPU, torch.float32)
    runner = SimpleNamespace(device=CPU, kv=kv)
    assert build_graphs(runner, SdpaBackend(kv, 4, 0.5), 64, 64, 3) is None
    assert build_graphs(runner, SdpaBackend(kv, 4, 0.5), 0, 64, 3) is None


# --- flags -------------------------------------------------------------------------------------


def test_flags_and_variables_set_the_backend_and_the_graph_cap(monkeypatch):
    parser = argparse.ArgumentParser()
    add_arguments(parser, LLMConfig)
    ns = parser.parse_args(["--attention-backend", "flashinfer", "--cuda-graph-max-batch", "8"])
    cfg = from_args(LLMConfig, ns)
    assert (cfg.attention_backend, cfg.cuda_graph_max_batch) == ("flashinfer", 8)
    default = LLMConfig()
    assert (default.attention_backend, default.cuda_graph_max_batch) == ("auto", 64)
    monkeypatch.setenv("MMCACHE_ATTENTION_BACKEND", "sdpa")
    monkeypatch.setenv("MMCACHE_CUDA_GRAPH_MAX_BATCH", "0")
    cfg = from_args(LLMConfig, parser.parse_args([]))
    assert (cfg.attention_backend, cfg.cuda_graph_max_batch) == ("sdpa", 0)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"attention_backend": "flash"}, "--attention-backend must be one of auto, sdpa, flashinfer"),
        ({"attention_backend": ""}, "--attention-backend"),
        ({"cuda_graph_max_batch": -1}, "--cuda-graph-max-batch must be 0"),
        ({"cuda_graph_max_batch": 513}, "--cuda-graph-max-batch must be 0"),
    ],
)
def test_bad_backend_flags_are_refused_with_the_flag_named(bad, message):
    with pytest.raises(ValueError, match=message):
        LLMConfig(**bad)


# --- the graph runner's buffers and padding, replayed without CUDA -----------------------------


def test_padded_decode_replays_give_the_eager_logits_and_write_only_owned_and_spare_blocks(tiny_models):
    """Decode steps through DecodeGraphs (fixed buffers refilled per step, batches padded to the
    captured sizes) against the SDPA runner's forward over the same pool, step by step. Off CUDA a
    "graph" reruns the captured call, so what is checked is everything but the capture itself."""
    lm = TextLM(ModelSpec.load(tiny_models["qwen2-vl"]), CPU, torch.float32)
    size, blocks = 16, 24
    spare = blocks  # the block past those sequences own
    kv = KVCache(lm, blocks + 1, size, CPU, torch.float32)
    paged = PagedReference(kv, lm.num_heads, lm.scaling, max_pages_per_seq=4)
    eager = ModelRunner(lm, kv)  # SDPA
    graphs = DecodeGraphs(ModelRunner(lm, kv, paged), paged, (1, 2, 4), spare)
    graphs.capture()
    seqs = [seq_with(5, 0, [7], 1), seq_with(20, 0, [2, 11], 2), seq_with(33, 0, [0, 5, 9, 20], 3)]
    for seq in seqs:
        (logits,) = eager.forward([StepItem(seq, 0, seq.num_tokens, True)])[0]
        seq.token_ids.append(int(logits.argmax()))
    kv.kv[:, spare * size : (spare + 1) * size] = 0  # the capture's dummy rows wrote here
    for step in range(8):
        alive = seqs if step < 5 else seqs[2:]  # 3 rows (padded to 4), then 1
        items = [StepItem(s, s.num_tokens - 1, s.num_tokens, True) for s in alive]
        got = graphs.run(items)
        assert got is not None and got.shape[0] == len(alive)
        got = got.clone()
        want = eager.forward(items)[0]  # recomputes the same rows into the same slots
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for seq, row in zip(alive, want, strict=True):
            seq.token_ids.append(int(row.argmax()))
    assert graphs.replays == 8
    per_block = kv.kv.view(kv.kv.shape[0], blocks + 1, size, -1)
    owned = {b for s in seqs for b in s.block_table}
    assert per_block[:, [b for b in range(blocks) if b not in owned]].abs().sum() == 0  # nobody else's
    assert per_block[:, spare, 0].abs().sum() > 0  # the padding row of the 3-row steps wrote here
    assert per_block[:, spare, 1:].abs().sum() == 0  # and only its one slot
    prefill = [StepItem(seq_with(8, 0, [1]), 0, 8, True)]
    assert graphs.run(prefill) is None  # not a decode step: the caller runs it eagerly
    five = [StepItem(s, s.num_tokens - 1, s.num_tokens, True) for s in [*seqs, *seqs[:2]]]
    assert graphs.run(five) is None  # past the largest captured size


@pytest.mark.parametrize("wanted", ["auto", "sdpa", "flashinfer"])
def test_on_cpu_every_choice_serves_the_sdpa_path_as_before(tiny_models, wanted, caplog):
    """Whatever is asked for, a CPU engine runs the SDPA backend over a pool of exactly the blocks
    it hands out (no spare block, no graphs), and greedy tokens equal the plain runner's."""
    path = tiny_models["qwen2-vl"]
    spec = ModelSpec.load(path)
    cfg = LLMConfig(
        model=str(path), device="cpu", dtype="float32", num_kv_blocks=40, attention_backend=wanted
    )
    with caplog.at_level(logging.INFO):
        engine = Engine(cfg, spec)
    assert engine.attention_backend == "sdpa" and engine.graphs is None
    assert type(engine.runner.attention) is SdpaBackend
    assert engine.kv.num_blocks == len(engine.blocks.blocks) == 40
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "attention" in r.getMessage()]
    assert len(warned) == (1 if wanted == "flashinfer" else 0)
    seq = seq_with(21, 0, [], 1)
    engine.submit(seq)
    while engine.has_work():
        engine.step()
    # the same prompt through a bare SDPA runner over a fresh pool, greedy
    lm = TextLM(spec, CPU, torch.float32)
    runner = ModelRunner(lm, KVCache(lm, 6, 16, CPU, torch.float32))
    ref = seq_with(21, 0, list(range(6)), 2)  # 21 + 64 tokens fit 6 blocks
    while ref.num_tokens < seq.num_tokens:
        start = 0 if ref.num_tokens == 21 else ref.num_tokens - 1
        (logits,) = runner.forward([StepItem(ref, start, ref.num_tokens, True)])[0]
        ref.token_ids.append(int(logits.argmax()))
    assert seq.token_ids == ref.token_ids
