"""The LLM engine in-process on one device, per attention backend and with/without CUDA graphs:
prefill tokens/s, TTFT of a ~220-token prompt, and decode ms/step with output tokens/s at a few
batch sizes (the engine's own step loop; no HTTP, no encoder: what the GPU path changes).

Run by scripts/gpu-check on a GPU; it also runs on CPU (``--device cpu --shape tiny``) to check
the harness. The checkpoint is generated offline: ``--shape mid`` is Qwen2-0.5B's text shape
(hidden 896, 24 layers, 14 heads, 2 KV heads, head_dim 64, MLP 4864, vocab 151936 untied: 630 M
text parameters) on the tiny tokenizer and vision tower, random weights; ``2b`` is Qwen2-VL-2B's
text shape (head_dim 128).
Every figure is a median over repeats, with min-max beside it; the device syncs before each clock
read (the sampler's ``tolist`` does so at the end of every step).

    python -m mmcache.benchmarks.gpu_engine --shape mid --device cuda [--batches 1,8,32,64] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from mmcache.llm_stage.engine import Engine
from mmcache.llm_stage.sequence import Sequence
from mmcache.shared.block_hash import root_hash
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.config import LLMConfig
from mmcache.shared.messages import SamplingParams
from mmcache.tiny_model import make_tiny_model

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "mid": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "mrope_section": [8, 12, 12],
    },
    "2b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "mrope_section": [16, 24, 24],
    },
}
CONFIGS = (("sdpa", 0), ("flashinfer", 0), ("flashinfer", 64))  # (attention backend, graph max batch)
PREFILL_TOKENS = 2048
TTFT_TOKENS = 220
DECODE_PROMPT = 128
DECODE_STEPS = 12  # per window
WINDOWS = 3
REPEATS = 5
KV_CACHE_GB = 4.0  # ample for these batches; sized from free memory, a 141 GB GPU's pool starts slowly


def sized_checkpoint(root: Path, shape: str) -> Path:
    """The tiny qwen2-vl checkpoint with the text model of ``shape`` (random, seeded, bf16)."""
    tiny = make_tiny_model(root / "tiny", "qwen2-vl")
    if not SHAPES[shape]:
        return tiny
    out = root / shape
    if (out / "model.safetensors").exists():
        return out
    from transformers import AutoConfig, AutoModelForImageTextToText

    shutil.copytree(tiny, out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    dims = dict(SHAPES[shape])
    config["text_config"]["rope_parameters"]["mrope_section"] = dims.pop("mrope_section")
    config["text_config"].update(dims, max_window_layers=dims["num_hidden_layers"], dtype="bfloat16")
    config["text_config"].pop("layer_types", None)  # one per layer: rebuilt for the new depth
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(out), dtype=torch.bfloat16)
    (out / "model.safetensors").unlink()
    model.save_pretrained(out, safe_serialization=True)
    return out


def _seqs(spec: ModelSpec, engine: Engine, n: int, length: int, max_tokens: int, seed: int) -> list[Sequence]:
    gen = torch.Generator().manual_seed(seed)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    root = root_hash(spec.weights_fingerprint, None)
    return [
        Sequence.new(
            seed * 1000 + i,
            torch.randint(10, 1900, (length,), generator=gen).tolist(),  # random: no prefix hits
            [],
            root,
            sampling,
            engine.max_model_len,
            spec.eos_token_ids,
            spec.tokens_per_second,
        )
        for i in range(n)
    ]


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _until_first_tokens(engine: Engine, seqs: list[Sequence]) -> float:
    """Submit ``seqs``; step until each has its first token; seconds taken."""
    _sync(engine)
    began = time.perf_counter()
    for seq in seqs:
        engine.submit(seq)
    waiting = {seq.seq_id for seq in seqs}
    while waiting:
        for out in engine.step().outputs:
            if out.token_id is not None:
                waiting.discard(out.seq_id)
    _sync(engine)
    return time.perf_counter() - began


def _drain(engine: Engine) -> None:
    while engine.has_work():
        engine.step()


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def measure(engine: Engine, spec: ModelSpec, batches: list[int], quick: bool) -> dict[str, Any]:
    repeats = 2 if quick else REPEATS
    seed = iter(range(1, 10_000))
    out: dict[str, Any] = {}
    _until_first_tokens(engine, _seqs(spec, engine, 2, 64, 1, next(seed)))  # warm-up
    _drain(engine)
    prefill = []
    for _ in range(repeats):
        prefill.append(
            PREFILL_TOKENS
            / _until_first_tokens(engine, _seqs(spec, engine, 1, PREFILL_TOKENS, 1, next(seed)))
        )
        _drain(engine)
    out["prefill_tok_s"] = _stats(prefill)
    ttft = []
    for _ in range(repeats):
        ttft.append(1000 * _until_first_tokens(engine, _seqs(spec, engine, 1, TTFT_TOKENS, 1, next(seed))))
        _drain(engine)
    out["ttft_ms"] = _stats(ttft)
    for batch in batches:
        steps = 2 + WINDOWS * DECODE_STEPS
        _until_first_tokens(engine, _seqs(spec, engine, batch, DECODE_PROMPT, steps + 2, next(seed)))
        engine.step()  # the first decode step (graph buffers, allocator) outside the clock
        windows = []
        for _ in range(WINDOWS if not quick else 1):
            _sync(engine)
            began = time.perf_counter()
            for _ in range(DECODE_STEPS):
                engine.step()
            _sync(engine)
            windows.append(1000 * (time.perf_counter() - began) / DECODE_STEPS)
        _drain(engine)
        out[f"decode_b{batch}_ms_step"] = _stats(windows)
        out[f"decode_b{batch}_tok_s"] = _stats([batch * 1000 / w for w in windows])
    return out


def run(
    shape: str, device: str, batches: list[int], configs: list[tuple[str, int]], quick: bool, root: Path
) -> list[dict[str, Any]]:
    path = sized_checkpoint(root, shape)
    spec = ModelSpec.load(path)
    rows = []
    for backend, graphs in configs:
        cfg = LLMConfig(
            model=str(path),
            device=device,
            attention_backend=backend,
            cuda_graph_max_batch=graphs,
            max_num_seqs=max(batches),
            max_num_batched_tokens=PREFILL_TOKENS,
            max_model_len=4096,
            kv_cache_gb=KV_CACHE_GB,
        )
        began = time.perf_counter()
        engine = Engine(cfg, spec)
        start_s = time.perf_counter() - began
        ran = f"{engine.attention_backend}{'+graphs' if engine.graphs is not None else ''}"
        wanted = f"{backend}{'+graphs' if graphs else ''}"
        if any(r["ran"] == ran for r in rows):
            print(f"{wanted}: runs as {ran}, measured already; skipped", flush=True)
            continue
        row = {"wanted": wanted, "ran": ran, "start_s": start_s, "dtype": str(engine.dtype)}
        row.update(measure(engine, spec, batches, quick))
        rows.append(row)
        print(json.dumps(row), flush=True)
        del engine
        if device != "cpu":
            torch.cuda.empty_cache()
    return rows


def anchors(device: str, weight_bytes: int, quick: bool) -> dict[str, float]:
    """The device's physical limits, measured now: copy bandwidth (read + write of a 1 GiB bf16
    tensor) and bf16 matmul throughput, and the batch-1 decode time they bound (every weight read
    once per step)."""
    dev = torch.device(device)
    n = 8192 if dev.type == "cuda" else 2048
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=dev)  # 1 GiB
    dst = torch.empty_like(src)
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    copies, matmuls = [], []
    for _ in range(2 if quick else 5):
        for work, out, amount in (
            (lambda: dst.copy_(src), copies, 2 * src.nbytes),
            (lambda: a @ b, matmuls, 2 * n**3),
        ):
            work()  # warm
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            began = time.perf_counter()
            work()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            out.append(amount / (time.perf_counter() - began))
    bandwidth = statistics.median(copies)
    return {
        "copy_GB_s": bandwidth / 1e9,
        "matmul_TFLOP_s": statistics.median(matmuls) / 1e12,
        "weights_GB": weight_bytes / 1e9,
        "decode_b1_bound_ms": 1000 * weight_bytes / (bandwidth / 2),  # a copy moves its bytes twice
    }


def decode_weight_bytes(path: Path) -> int:
    """Bytes of the weights a decode step reads, in bf16: the text model's, from the checkpoint's
    tensor shapes, less the embedding (its rows are gathered, not read whole) and the vision tower."""
    from safetensors import safe_open

    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors file is not iterable)
                if "visual" in key or "embed_tokens" in key:
                    continue
                total += 2 * math.prod(f.get_slice(key).get_shape())
    return total


def table(rows: list[dict[str, Any]]) -> str:
    keys = [k for k in rows[0] if isinstance(rows[0][k], dict)] if rows else []
    lines = ["| figure (median [min-max]) | " + " | ".join(r["ran"] for r in rows) + " |"]
    lines.append("|---" * (len(rows) + 1) + "|")
    for key in keys:
        cells = [f"{r[key]['median']:.4g} [{r[key]['min']:.4g}-{r[key]['max']:.4g}]" for r in rows]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines.append("| engine start, s | " + " | ".join(f"{r['start_s']:.1f}" for r in rows) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="mid")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument(
        "--configs", default=",".join(f"{b}:{g}" for b, g in CONFIGS), help="backend:graph_max,..."
    )
    parser.add_argument("--root", default="/tmp/mmcache-gpu-bench", help="where checkpoints are generated")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a harness check)")
    parser.add_argument("--json", default="", help="also write the rows here")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    configs = [(c.split(":")[0], int(c.split(":")[1])) for c in args.configs.split(",")]
    if args.device != "cpu":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = run(args.shape, args.device, batches, configs, args.quick, Path(args.root))
    print(f"\n{args.shape} checkpoint on {args.device}:\n{table(rows)}", flush=True)
    weight_bytes = decode_weight_bytes(sized_checkpoint(Path(args.root), args.shape))
    limits = anchors(args.device, weight_bytes, args.quick)
    print("limits: " + ", ".join(f"{k} {v:.4g}" for k, v in limits.items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "limits": limits}, indent=1))


if __name__ == "__main__":
    main()
