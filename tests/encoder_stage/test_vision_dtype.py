"""``--dtype auto`` for the vision tower of a bfloat16 checkpoint on a CPU: bfloat16 where its
products pay, else float32 inside the tower with the features rounded to bfloat16 on the way out
(what an LLM stage on ``auto`` rounds them to), cached apart from either of the others."""

from __future__ import annotations

import torch

from mmcache.encoder_stage import vision
from mmcache.encoder_stage.vision import VisionInput, VisionTower
from mmcache.shared import torch_utils
from mmcache.shared.checkpoint import ModelSpec


def test_auto_computes_in_float32_where_bfloat16_does_not_pay(mid_model, monkeypatch) -> None:
    spec = ModelSpec.load(mid_model)
    assert spec.saved_dtype == "bfloat16"
    # a CPU with bfloat16 instructions, whatever runs the suite (emulated ones are only slower)
    monkeypatch.setattr(torch_utils, "cpu_has_bfloat16", lambda: True)
    gen = torch.Generator().manual_seed(11)
    chunk = VisionInput("image", torch.randint(0, 256, (1, 3, 84, 112), dtype=torch.uint8, generator=gen))

    towers = {}
    for pays in (True, False):
        monkeypatch.setattr(vision, "bfloat16_products_pay", lambda pays=pays: pays)
        towers[pays] = VisionTower(spec, device="cpu", dtype="auto")
    assert (towers[True].dtype, towers[True].features_dtype) == (torch.bfloat16, torch.bfloat16)
    assert (towers[False].dtype, towers[False].features_dtype) == (torch.float32, torch.bfloat16)
    # an explicit dtype is kept as asked
    asked = VisionTower(spec, device="cpu", dtype="bfloat16")
    assert (asked.dtype, asked.features_dtype) == (torch.bfloat16, torch.bfloat16)
    float32 = VisionTower(spec, device="cpu", dtype="float32")

    (got,) = towers[False].encode([chunk])
    (exact,) = float32.encode([chunk])
    assert got.dtype == torch.bfloat16 and exact.dtype == torch.float32
    assert torch.equal(got, exact.to(torch.bfloat16))  # the float32 tower's features, rounded once
    (bf16,) = towers[True].encode([chunk])
    assert not torch.equal(got, bf16)  # a bfloat16 tower rounds at every step
    prints = {towers[True].fingerprint, towers[False].fingerprint, float32.fingerprint}
    assert len(prints) == 3 and asked.fingerprint == towers[True].fingerprint
