"""Few-row weight products on AMX or AVX512-BF16 (``shared/cpu_packed.c``) and the helper threads
they share with decode attention (``shared/cpu_pool.c``).

The kernel replaces oneDNN only where it computes oneDNN's products bit for bit, so a decode
step's rows equal what oneDNN computes for them; these tests hold it to that,
prove the kernel (not oneDNN) ran, and check the helpers: products from several threads, a forked
child without the parent's helpers, and idle helpers that sleep instead of holding a core.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from mmcache.shared import cpu_kernels, linear
from mmcache.shared.linear import Projection, packing_supported

BF16 = torch.bfloat16
LIB = cpu_kernels.kernels()
PACKED = LIB is not None and bool(LIB.packed_isa) and packing_supported(torch.empty(1, dtype=BF16))
needs_packed = pytest.mark.skipif(not PACKED, reason="this CPU has neither AMX nor AVX512-BF16")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weights(n: int, k: int, bias: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = _gen(seed)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(BF16)
    return weight, torch.randn(n, generator=gen).to(BF16) if bias else None


class _Counting:
    """cpu_kernels.packed_product, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.inner = cpu_kernels.packed_product

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


@needs_packed
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_run_on_the_packed_kernel_and_equal_onednn_bit_for_bit(monkeypatch, bias: bool) -> None:
    weight, b = _weights(192, 160, bias)
    proj = Projection(weight, b)
    assert proj.kind == "onednn" and proj.kernels is not None
    counting = _Counting()
    monkeypatch.setattr(cpu_kernels, "packed_product", counting)
    x = torch.randn(64, 160, generator=_gen(1)).to(BF16)
    residual = torch.randn(64, 192, generator=_gen(2)).to(BF16)
    for rows in (1, 5, 16, 17, 64):  # one tile, a partial one, and several passes over a block
        ours = proj.prescaled(x[:rows])
        joined = proj.add_to(residual[:rows], x[:rows])
        assert torch.equal(ours, linear._ONEDNN_PRODUCT(x[:rows], proj.weight, b, "none", [], ""))
        assert torch.equal(joined, linear._ONEDNN_BINARY(x[:rows], residual[:rows], proj.weight, b, "add"))
    assert counting.calls == 10
    many = proj.add_to(residual, x)
    for row in (0, 31, 63):  # a row alone equals that row among 64 (160 inputs: one partial sum)
        assert torch.equal(proj.add_to(residual[row : row + 1], x[row : row + 1]), many[row : row + 1])
    x_strided = torch.randn(3, 320, generator=_gen(3)).to(BF16)[:, ::2]  # rows of a wider tensor
    assert not x_strided.is_contiguous()
    want = linear._ONEDNN_PRODUCT(x_strided.contiguous(), proj.weight, b, "none", [], "")
    assert torch.equal(proj.prescaled(x_strided), want)  # not row-contiguous: oneDNN computes it


@needs_packed
@pytest.mark.parametrize(("n", "k"), [(128, 2048), (256, 4864)])
def test_long_inputs_sum_in_onednns_order_for_every_row_count(n: int, k: int) -> None:
    """Over thousands of inputs oneDNN's AVX512-BF16 kernel sums in partial sums whose length
    changes with the row count: the kernel follows it for every row count it takes, not only the
    ones its probe tried."""
    weight, b = _weights(n, k, True, seed=7)
    proj = Projection(weight, b)
    assert proj.kernels is not None
    x = torch.randn(cpu_kernels.PACKED_ROWS, k, generator=_gen(8)).to(BF16)
    residual = torch.randn(cpu_kernels.PACKED_ROWS, n, generator=_gen(9)).to(BF16)
    # AMX: up to 21 rows (over 4864 inputs oneDNN's own 33- or 64-row product rounds a row
    # otherwise than the row alone, which this kernel gives); AVX512-BF16: every row count.
    top = cpu_kernels.PACKED_ROWS if proj.kernels.packed_isa == "avx512-bf16" else 21
    for rows in (r for r in (*range(1, 9), 13, 21, 40, cpu_kernels.PACKED_ROWS) if r <= top):
        want = linear._ONEDNN_BINARY(x[:rows], residual[:rows], proj.weight, b, "add")
        assert torch.equal(proj.add_to(residual[:rows], x[:rows]), want), rows
        for row in range(rows):  # oneDNN's row alone: the kernel's one-row order
            alone = linear._ONEDNN_PRODUCT(x[row : row + 1], proj.weight, b, "none", [], "")
            assert torch.equal(proj.prescaled(x[row : row + 1]), alone)


@needs_packed
def test_more_rows_than_the_kernel_takes_and_weights_it_cannot_read_stay_on_onednn(monkeypatch) -> None:
    proj = Projection(*_weights(128, 64, False))
    counting = _Counting()
    monkeypatch.setattr(cpu_kernels, "packed_product", counting)
    x = torch.randn(cpu_kernels.PACKED_ROWS + 1, 64, generator=_gen(4)).to(BF16)
    assert torch.equal(proj.prescaled(x), torch.nn.functional.linear(x, *_weights(128, 64, False)))
    assert counting.calls == 0
    for n, k in ((200, 64), (128, 80)):  # outputs not in blocks of 64, inputs not in tiles of 32
        odd = Projection(*_weights(n, k, False))
        assert odd.kind == "onednn" and odd.kernels is None


@needs_packed
def test_products_from_several_threads_take_turns() -> None:
    projs = [Projection(*_weights(256, 96, True, seed)) for seed in range(4)]
    inputs = [torch.randn(3, 96, generator=_gen(10 + i)).to(BF16) for i in range(4)]
    want = [
        linear._ONEDNN_PRODUCT(x, p.weight, p.bias, "none", [], "")
        for p, x in zip(projs, inputs, strict=True)
    ]
    wrong: list[int] = []

    def work(i: int) -> None:
        for _ in range(300):
            if not torch.equal(projs[i].prescaled(inputs[i]), want[i]):
                wrong.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@needs_packed
def test_a_forked_child_computes_without_the_parents_helpers() -> None:
    out = _run(
        """
        import os, torch
        from mmcache.shared.linear import Projection
        torch.set_num_threads(2)
        gen = torch.Generator().manual_seed(0)
        proj = Projection((torch.randn(256, 96, generator=gen) * 0.05).to(torch.bfloat16))
        x = torch.randn(2, 96, generator=gen).to(torch.bfloat16)
        want = proj.prescaled(x)  # the parent's helpers run
        assert proj.kernels is not None and proj.kernels.helpers == 1
        pid = os.fork()
        if pid == 0:
            os._exit(0 if all(torch.equal(proj.prescaled(x), want) for _ in range(50)) else 1)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        """
    )
    assert out.split() == ["child", "0"]


@needs_packed
def test_idle_helpers_sleep_instead_of_holding_a_core() -> None:
    """A helper spins briefly after its last task (the gaps inside a step), then sleeps: the
    process's CPU time over an idle second shows whether it does."""
    out = _run(
        """
        import time, torch
        from mmcache.shared.linear import Projection
        torch.set_num_threads(2)
        gen = torch.Generator().manual_seed(0)
        proj = Projection((torch.randn(256, 96, generator=gen) * 0.05).to(torch.bfloat16))
        proj.prescaled(torch.randn(1, 96, generator=gen).to(torch.bfloat16))
        cpu, wall = time.process_time(), time.perf_counter()
        time.sleep(1.0)
        print(proj.kernels.helpers, (time.process_time() - cpu) / (time.perf_counter() - wall))
        """
    )
    helpers, busy = out.split()
    assert int(helpers) == 1 and float(busy) < 0.1  # a spinning helper would show ~1.0 (a core)


@needs_packed
def test_helpers_asked_to_rest_sleep_at_once() -> None:
    """Before an operator with OpenMP threads of its own the helpers are told to rest: they sleep
    within microseconds, not after their spin (300 us)."""
    out = _run(
        """
        import time, torch
        from mmcache.shared import cpu_kernels
        from mmcache.shared.linear import Projection
        torch.set_num_threads(2)
        gen = torch.Generator().manual_seed(0)
        proj = Projection((torch.randn(256, 96, generator=gen) * 0.05).to(torch.bfloat16))
        x = torch.randn(1, 96, generator=gen).to(torch.bfloat16)
        lib = proj.kernels
        waits = []
        for _ in range(20):
            proj.prescaled(x)
            start = time.perf_counter()
            cpu_kernels.rest_helpers()
            while lib.pool_sleeping() < lib.helpers and time.perf_counter() - start < 0.1:
                pass
            waits.append(time.perf_counter() - start)
        print(min(waits))
        """
    )
    assert float(out) < 150e-6
