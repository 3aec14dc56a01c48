"""Stage configuration: frozen dataclasses built from CLI flags and ``MMCACHE_*`` variables.

Each field becomes ``--field-name`` and ``MMCACHE_FIELD_NAME``; a flag beats the
variable, the variable beats the default. Validation lives in ``__post_init__``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

_C = TypeVar("_C")


def opt(default: Any, help: str) -> Any:
    """A config field with its ``--help`` text."""
    return field(default=default, metadata={"help": help})


def env_name(name: str) -> str:
    return "MMCACHE_" + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse(kind: type, raw: str, name: str) -> Any:
    if kind is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{env_name(name)}={raw!r} is not a boolean")
    return kind(raw)


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: AbstractSet[str] = frozenset()) -> None:
    """Add one flag per field of ``cls`` (defaults stay ``None`` so we can tell what was given)."""
    hints = typing.get_type_hints(cls)
    existing = {a.dest for a in parser._actions}
    for f in dataclasses.fields(cls):
        if f.name in skip or f.name in existing:
            continue
        kind = hints[f.name]
        text = f"{f.metadata.get('help', '')} [env {env_name(f.name)}; default {f.default!r}]"
        if kind is bool:
            parser.add_argument(flag_name(f.name), dest=f.name, action="store_const", const=True, help=text)
        else:
            parser.add_argument(flag_name(f.name), dest=f.name, type=kind, default=None, help=text)


def from_args(cls: type[_C], ns: argparse.Namespace | None = None, **overrides: Any) -> _C:
    """Build ``cls`` from parsed flags, then environment, then defaults."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cast(Any, cls)):  # a config dataclass
        given = getattr(ns, f.name, None) if ns is not None else None
        if f.name in overrides:
            values[f.name] = overrides[f.name]
        elif given is not None:
            values[f.name] = given
        elif (raw := os.environ.get(env_name(f.name))) is not None:
            values[f.name] = _parse(hints[f.name], raw, f.name)
    return cls(**values)


def to_flags(cfg: Any) -> list[str]:
    """Inverse of :func:`from_args` for non-default fields (used to launch child stages)."""
    out: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value == f.default:
            continue
        if isinstance(value, bool):
            if value:
                out.append(flag_name(f.name))
        else:
            out += [flag_name(f.name), str(value)]
    return out


def split_list(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


MAX_WORKERS = 64


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{flag_name(name)} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


METRICS_PORT_HELP = (
    "HTTP port of this replica's Prometheus /metrics (0: any free port, listed by the processor's "
    "/health; -1: off)"
)
LOG_FORMAT_HELP = "log format: text, or json (one object per line)"
LOG_FORMATS = ("text", "json")
ATTENTION_BACKENDS = ("auto", "sdpa", "flashinfer")
DTYPE_HELP = (
    "weights dtype: auto (the checkpoint's; bfloat16 on a CPU only with native bfloat16, and there "
    "the vision tower in float32 where bfloat16 products are the slower (Intel without AMX); a "
    "float32 checkpoint in bfloat16 on GPU), float32, bfloat16, float16"
)
MAX_CUDA_GRAPH_BATCH = 512  # each captured size holds its own graph: keep their number bounded


def _observability(metrics_port: int, log_format: str) -> None:
    if not -1 <= metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be -1 (off), 0 (any) or a port, got {metrics_port}")
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    model: str = opt("", "checkpoint directory (Hugging Face format)")
    bind: str = opt("tcp://0.0.0.0:5556", "ZeroMQ address the encoder binds")
    device: str = opt("auto", "torch device: auto, cpu, cuda, cuda:N")
    dtype: str = opt("auto", DTYPE_HELP)
    max_batch_tokens: int = opt(
        0, "most patches in one vision forward (chunks of requests batch); 0: 4096 on a GPU, 2048 on CPU"
    )
    max_queue: int = opt(4096, "most chunks waiting for a forward; more are refused with 503")
    torch_threads: int = opt(0, "torch intra-op CPU threads (0 = torch's default: every core)")
    encoder_cache_gb: float = opt(2.0, "embedding cache size, GiB (0 disables)")
    handoff_ttl: float = opt(60.0, "seconds an encoded chunk stays pinned waiting for its LLM fetch")
    no_cache: bool = opt(False, "disable every cache tier (for comparisons)")
    metrics_port: int = opt(0, METRICS_PORT_HELP)
    log_format: str = opt("text", LOG_FORMAT_HELP)

    def __post_init__(self) -> None:
        _observability(self.metrics_port, self.log_format)
        _positive("max_batch_tokens", self.max_batch_tokens, allow_zero=True)
        _positive("max_queue", self.max_queue)
        _positive("torch_threads", self.torch_threads, allow_zero=True)
        _positive("encoder_cache_gb", self.encoder_cache_gb, allow_zero=True)
        _positive("handoff_ttl", self.handoff_ttl)

    @property
    def cache_bytes(self) -> int:
        return 0 if self.no_cache else int(self.encoder_cache_gb * (1 << 30))


@dataclass(frozen=True, slots=True)
class LLMConfig:
    model: str = opt("", "checkpoint directory (Hugging Face format)")
    bind: str = opt("tcp://0.0.0.0:5557", "ZeroMQ address the LLM stage binds")
    device: str = opt("auto", "torch device: auto, cpu, cuda, cuda:N")
    dtype: str = opt("auto", DTYPE_HELP)
    max_model_len: int = opt(0, "longest prompt + output in tokens (0 = the model's max_position_embeddings)")
    max_num_seqs: int = opt(64, "most sequences decoded together")
    max_num_batched_tokens: int = opt(2048, "most tokens in one engine step (longer prefills are chunked)")
    kv_cache_gb: float = opt(
        0.0, "memory for the paged KV cache, GiB (0 = auto: 9/10 of free device memory on CUDA, 0.5 on CPU)"
    )
    block_size: int = opt(16, "tokens per KV block (and per prefix-cache hash)")
    num_kv_blocks: int = opt(0, "KV blocks in the pool (0 = as many as --kv-cache-gb holds)")
    max_queue: int = opt(1024, "most requests waiting; more are refused with 503")
    fetch_timeout: float = opt(30.0, "seconds to wait for embedding rows from an encoder")
    max_repairs: int = opt(3, "times one request may ask the processor to re-encode rows its encoders lost")
    repair_timeout: float = opt(120.0, "seconds to wait for the processor to re-encode lost rows")
    torch_threads: int = opt(0, "torch intra-op CPU threads (0 = torch's default: every core)")
    no_cache: bool = opt(False, "disable every cache tier (for comparisons)")
    no_prefix_cache: bool = opt(False, "disable the KV prefix cache only")
    no_prompt_logprob_store: bool = opt(
        False, "keep no prompt logprobs beside the KV blocks (prompt_logprobs are then always computed)"
    )
    attention_backend: str = opt(
        "auto",
        "attention over the paged KV cache: auto (flashinfer on CUDA when it imports and fits the model, "
        "else sdpa), sdpa, or flashinfer (falls back to sdpa, with a warning, where it cannot run)",
    )
    cuda_graph_max_batch: int = opt(
        64,
        "largest decode batch replayed from a captured CUDA graph (CUDA with the flashinfer backend "
        "only; larger batches run eagerly); 0: no CUDA graphs",
    )
    kv_store: str = opt(
        "",
        "shared KV tier: redis:// URL of a Redis/Valkey server every LLM replica shares (empty = off); "
        "full blocks' KV is written there and read on a local prefix miss",
    )
    kv_store_timeout: float = opt(0.5, "seconds one read or write of the shared KV store may take")
    kv_store_queue: int = opt(256, "KV blocks waiting to be written to the store; more are dropped (counted)")
    metrics_port: int = opt(0, METRICS_PORT_HELP)
    log_format: str = opt("text", LOG_FORMAT_HELP)

    def __post_init__(self) -> None:
        _observability(self.metrics_port, self.log_format)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if not 0 <= self.cuda_graph_max_batch <= MAX_CUDA_GRAPH_BATCH:
            raise ValueError(
                f"--cuda-graph-max-batch must be 0 (off) to {MAX_CUDA_GRAPH_BATCH}, "
                f"got {self.cuda_graph_max_batch}"
            )
        if self.kv_store and not self.kv_store.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"--kv-store must be a redis:// (or rediss://, unix://) URL, got {self.kv_store!r}"
            )
        for name in (
            "kv_store_timeout",
            "kv_store_queue",
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "max_queue",
            "fetch_timeout",
            "repair_timeout",
        ):
            _positive(name, getattr(self, name))
        _positive("kv_cache_gb", self.kv_cache_gb, allow_zero=True)
        _positive("max_repairs", self.max_repairs, allow_zero=True)
        _positive("max_model_len", self.max_model_len, allow_zero=True)
        _positive("num_kv_blocks", self.num_kv_blocks, allow_zero=True)
        _positive("torch_threads", self.torch_threads, allow_zero=True)

    @property
    def prefix_cache(self) -> bool:
        return not (self.no_cache or self.no_prefix_cache)

    @property
    def kv_tier(self) -> bool:
        """The shared KV tier is on: a store is given and the prefix cache it extends is on."""
        return bool(self.kv_store) and self.prefix_cache


@dataclass(frozen=True, slots=True)
class ProcessorConfig:
    model: str = opt("", "checkpoint directory (Hugging Face format)")
    host: str = opt("0.0.0.0", "HTTP listen host")
    port: int = opt(8000, "HTTP listen port")
    encoder: str = opt("tcp://127.0.0.1:5556", "encoder stage address(es), comma separated")
    llm: str = opt("tcp://127.0.0.1:5557", "LLM stage address(es), comma separated")
    served_model_name: str = opt("", "model name in the API (default: the checkpoint directory's name)")
    allowed_local_media_path: str = opt("", "directories file:// URLs may read, comma separated (none)")
    allowed_media_networks: str = opt(
        "", "networks (CIDR, comma separated) http(s) media may come from despite being non-public"
    )
    media_fetch_timeout: float = opt(10.0, "seconds to fetch one http(s) media item")
    max_media_redirects: int = opt(3, "most redirects followed for one http(s) media item")
    video_fps: float = opt(2.0, "video frames sampled per second, from t=0")
    max_video_frames: int = opt(64, "most frames sampled from one video")
    max_video_seconds: float = opt(600.0, "longest video accepted, in seconds")
    max_image_pixels: int = opt(40_000_000, "largest decoded image (width*height); larger is refused")
    max_media_bytes: int = opt(64 << 20, "largest encoded media item in bytes")
    max_media_items: int = opt(16, "most images and videos in one request")
    max_request_bytes: int = opt(128 << 20, "largest HTTP request body in bytes")
    stage_timeout: float = opt(120.0, "seconds to wait for a stage reply before failing the request")
    max_concurrent_requests: int = opt(1024, "most requests in progress; more are refused with 503")
    max_failovers: int = opt(
        3, "times one request may move to another LLM replica (and re-place its encoding) when one dies"
    )
    workers: int = opt(1, "processor processes on the one HTTP port (SO_REUSEPORT), each with its own caches")
    torch_threads: int = opt(0, "torch intra-op CPU threads for resizing (0 = torch's default)")
    processor_cache_gb: float = opt(-1.0, "processor (pixel + layout) cache size, GiB; 0 disables; -1 = auto")
    allowed_origins: str = opt(
        "", "origins whose web pages may call the API (CORS), comma separated; * for any"
    )
    no_cache: bool = opt(False, "disable every cache tier (for comparisons)")
    log_format: str = opt("text", LOG_FORMAT_HELP)
    response_store_entries: int = opt(1024, "most responses kept for previous_response_id (0: none)")
    response_store_mb: float = opt(256.0, "most MiB the stored responses may hold (their images included)")
    response_store_ttl: float = opt(3600.0, "seconds a stored response is kept")
    batch_dir: str = opt("", "directory of batch files and jobs (kept across restarts); empty: batches off")
    batch_concurrency: int = opt(4, "batch lines in progress at once (each processor process)")
    max_batch_lines: int = opt(50_000, "most lines in one batch input file")

    def __post_init__(self) -> None:
        _observability(0, self.log_format)
        for name in (
            "port",
            "media_fetch_timeout",
            "video_fps",
            "max_video_frames",
            "max_video_seconds",
            "max_image_pixels",
            "max_media_bytes",
            "max_media_items",
            "max_request_bytes",
            "stage_timeout",
            "max_concurrent_requests",
            "workers",
            "response_store_ttl",
            "batch_concurrency",
            "max_batch_lines",
        ):
            _positive(name, getattr(self, name))
        if self.workers > MAX_WORKERS:
            raise ValueError(f"--workers must be at most {MAX_WORKERS}, got {self.workers}")
        if self.port > 65535:
            raise ValueError(f"--port must be at most 65535, got {self.port}")
        _positive("max_media_redirects", self.max_media_redirects, allow_zero=True)
        _positive("max_failovers", self.max_failovers, allow_zero=True)
        _positive("torch_threads", self.torch_threads, allow_zero=True)
        _positive("response_store_entries", self.response_store_entries, allow_zero=True)
        _positive("response_store_mb", self.response_store_mb, allow_zero=True)
        if not split_list(self.encoder) or not split_list(self.llm):
            raise ValueError("--encoder and --llm need at least one address each")

    @property
    def processor_cache_bytes(self) -> int:
        """Auto: a tenth of physical memory, at most 8 GiB."""
        if self.no_cache:
            return 0
        if self.processor_cache_gb >= 0:
            return int(self.processor_cache_gb * (1 << 30))
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return min(ram // 10, 8 << 30)

    @property
    def response_store_bytes(self) -> int:
        return int(self.response_store_mb * (1 << 20))

    @property
    def allowed_dirs(self) -> list[str]:
        return [os.path.realpath(p) for p in split_list(self.allowed_local_media_path)]
