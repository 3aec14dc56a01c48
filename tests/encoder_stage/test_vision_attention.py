"""The vision towers' attention through the compiled kernel: taken inside our tower's forward for
every family on a CPU that is not Intel's, within float32 roundings of SDPA's, and SDPA everywhere
else (Intel CPUs, GPUs, outside our forward)."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from mmcache.encoder_stage import tower_kernels, vision_attention
from mmcache.encoder_stage.vision import VisionInput, VisionTower
from mmcache.shared import cpu_kernels
from mmcache.shared.checkpoint import ModelSpec
from mmcache.tiny_model import TINY_MODEL_ARCHS


def _pixels(seed: int, height: int = 224, width: int = 448) -> VisionInput:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (1, 3, height, width), dtype=torch.uint8, generator=gen)
    return VisionInput("image", pixels)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch", TINY_MODEL_ARCHS)
def test_every_family_takes_the_kernel_and_stays_within_sdpa_roundings(
    tiny_models, arch: str, dtype: str, monkeypatch
) -> None:
    monkeypatch.setattr(vision_attention, "cpu_vendor", lambda: "AuthenticAMD")  # whatever runs the suite
    tower = VisionTower(ModelSpec.load(tiny_models[arch]), device="cpu", dtype=dtype)
    assert tower.model.config._attn_implementation == vision_attention.NAME
    calls = []
    kernel = cpu_kernels.vision_attention

    def counting(lib, q, k, v, scale):
        calls.append(q.shape)
        return kernel(lib, q, k, v, scale)

    monkeypatch.setattr(cpu_kernels, "vision_attention", counting)
    chunks = [_pixels(5), _pixels(6, 224, 224)]
    ours = tower.encode(chunks)
    blocks = len(tower.model.blocks)
    # every block, every item of the batch (windowed families: every window too)
    assert len(calls) >= blocks * len(chunks)
    tower.model.config._attn_implementation = "sdpa"
    reference = tower.encode(chunks)
    for got, want in zip(ours, reference, strict=True):
        if dtype == "float32":
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:  # bfloat16 activations round differently after the first block: a few steps of 2^-8
            assert (got.float() - want.float()).abs().max().item() <= 0.05 * want.float().abs().max().item()


def test_intel_cpus_and_gpus_name_sdpa_and_the_fingerprint_says_which(tiny_models, monkeypatch) -> None:
    cpu = torch.device("cpu")
    assert vision_attention.implementation(cpu, "GenuineIntel") == vision_attention.SDPA
    assert vision_attention.implementation(cpu, "AuthenticAMD") == vision_attention.NAME
    assert vision_attention.implementation(cpu, "") == vision_attention.NAME  # no vendor_id (aarch64)
    assert vision_attention.implementation(torch.device("cuda"), "AuthenticAMD") == vision_attention.SDPA
    spec = ModelSpec.load(tiny_models["qwen2-vl"])
    calls = []
    monkeypatch.setattr(cpu_kernels, "vision_attention", lambda *args: calls.append(args))
    fingerprints = {}
    for vendor in ("GenuineIntel", "AuthenticAMD"):
        monkeypatch.setattr(vision_attention, "cpu_vendor", lambda vendor=vendor: vendor)
        tower = VisionTower(spec, device="cpu", dtype="float32")
        fingerprints[vendor] = tower.fingerprint
        if vendor == "GenuineIntel":
            assert tower.model.config._attn_implementation == vision_attention.SDPA
            tower.encode([_pixels(3)])
            assert not calls  # never the kernel
    # the two compute different roundings: their embeddings are cached apart
    assert fingerprints["GenuineIntel"] != fingerprints["AuthenticAMD"]


def test_outside_our_forward_the_registered_attention_is_sdpa(tiny_models) -> None:
    VisionTower(ModelSpec.load(tiny_models["qwen2-vl"]), device="cpu", dtype="float32")  # registers it
    gen = torch.Generator().manual_seed(7)
    # as a tower's attention gets them: (1, heads, n, head_dim) views of its (n, 3, heads, head_dim) qkv
    q, k, v = (t.transpose(0, 1)[None] for t in torch.randn(50, 3, 4, 16, generator=gen).unbind(1))
    module = torch.nn.Module()
    want, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.25, dropout=0.0, is_causal=False)
    got, _ = vision_attention.attention(module, q, k, v, None, scaling=0.25, dropout=0.0, is_causal=False)
    assert torch.equal(got, want)  # no kernels held: transformers' own
    lib = cpu_kernels.kernels()
    assert lib is not None
    with tower_kernels.active(lib):
        inside, _ = vision_attention.attention(module, q, k, v, None, scaling=0.25)
        causal, _ = vision_attention.attention(module, q, k, v, None, scaling=0.25, is_causal=True)
    torch.testing.assert_close(inside, want, atol=1e-6, rtol=1e-5)
    assert not torch.equal(inside, want)  # the kernel's sums, not SDPA's
    want_causal, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.25, dropout=0.0, is_causal=True)
    assert torch.equal(causal, want_causal)  # what the kernel does not take goes to SDPA


def test_the_kernel_takes_only_what_it_computes() -> None:
    q = torch.randn(10, 4, 16).transpose(0, 1)[None]  # heads head_dim apart, as a tower's projection
    assert vision_attention.fits(q, q, q, None, 0.0, False)
    assert not vision_attention.fits(q, q, q, torch.ones(10, 10, dtype=torch.bool), 0.0, False)  # a mask
    assert not vision_attention.fits(q, q, q, None, 0.1, False)  # dropout
    assert not vision_attention.fits(q, q, q, None, 0.0, True)  # causal
    assert not vision_attention.fits(q.half(), q.half(), q.half(), None, 0.0, False)  # float16
    odd = torch.randn(10, 4, 40).transpose(0, 1)[None]
    assert not vision_attention.fits(odd, odd, odd, None, 0.0, False)  # head_dim not a multiple of 16
    two = torch.randn(2, 10, 4, 16).transpose(1, 2)
    assert not vision_attention.fits(two, two, two, None, 0.0, False)  # a batch of items
    few = torch.randn(10, 2, 16).transpose(0, 1)[None]
    assert not vision_attention.fits(torch.randn(1, 4, 10, 16), q, q, None, 0.0, False)  # heads apart
    assert not vision_attention.fits(q, few, few, None, 0.0, False)  # grouped key heads
