"""2 MiB pages for the host buffers the kernels stream (hybridllm.host_pages): the native weights
and the KV rows already written go to huge pages, nothing unwritten becomes resident, and no value
changes. The page checks read this process's /proc/self/smaps; they need Linux 6.1+
(``MADV_COLLAPSE``) and are skipped where the kernel cannot collapse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridllm import host_pages
from hybridllm.kvcache.base import KVSpec, MemoryLedger
from hybridllm.kvcache.storage import DenseKV
from hybridllm.loading.quantized_loader import release_load_scratch

MIB = 1024 * 1024


def huge_bytes_around(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address`` (bytes)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.fixture(autouse=True)
def fresh_heap() -> None:
    """Freed heap pages go back to the OS first, so that a test's buffers start on fresh 4 KiB pages
    (glibc reuses the memory of an earlier test's large buffers, already collapsed)."""
    release_load_scratch()


@pytest.fixture(scope="module")
def can_collapse() -> None:
    probe = torch.ones(6 * MIB, dtype=torch.uint8)
    if not Path("/proc/self/smaps").exists() or host_pages.collapse_tensor(probe) == 0:
        pytest.skip("this kernel does not collapse pages to 2 MiB (MADV_COLLAPSE, Linux 6.1+)")


def test_whole_pages_are_the_aligned_pages_inside_the_range():
    page = host_pages.HUGE_PAGE
    assert host_pages.whole_pages(0, 3 * page) == (0, 3 * page)
    assert host_pages.whole_pages(1, 3 * page) == (page, 2 * page)  # [1, 3 pages + 1): pages 1 and 2 are whole
    assert host_pages.whole_pages(page - 1, page + 1) == (page, page)
    assert host_pages.whole_pages(5, page) == (page, 0)
    assert host_pages.collapse(12345, 100) == 0  # nothing whole: no call


def test_a_written_tensor_goes_to_huge_pages_with_its_values(can_collapse):
    tensor = torch.randint(0, 255, (9 * MIB,), dtype=torch.uint8)
    before = tensor.clone()
    collapsed = host_pages.collapse_tensor(tensor)
    assert collapsed >= 8 * MIB - 2 * MIB  # the whole pages inside 9 MiB: at least 7 of them
    assert huge_bytes_around(tensor.data_ptr() + 4 * MIB) >= collapsed
    assert torch.equal(tensor, before)


def test_native_weights_are_held_on_huge_pages(can_collapse):
    from hybridllm.kernels.native_linear import NativeQuantLinear

    codes = torch.randint(-127, 128, (2048, 4096), dtype=torch.int8)  # 8 MiB of codes
    layer = NativeQuantLinear.from_int8_rows(codes, torch.rand(2048) / 100)
    weight = layer.weight
    assert weight.nbytes >= 8 * MIB
    assert huge_bytes_around(weight.data_ptr() + weight.nbytes // 2) >= 4 * MIB
    x = torch.randn(3, 4096)
    assert torch.equal(layer(x), NativeQuantLinear.from_int8_rows(codes, layer.row_scales)(x))


def _store(capacity: int) -> DenseKV:
    spec = KVSpec(n_layers=1, n_kv_heads=4, head_dim=128, dtype=torch.float32, device=torch.device("cpu"),
                  max_tokens=1 << 16)
    store = DenseKV(MemoryLedger(), "host", torch.device("cpu"), spec)
    store.reserve(capacity)  # (1, 4, capacity, 128) float32: 512 bytes a row
    return store


def test_kv_rows_go_to_huge_pages_once_written_and_unwritten_rows_stay_out(can_collapse):
    capacity = 8192  # 4 MiB of rows per head, 16 MiB per field
    store = _store(capacity)
    keys = store.buffer.tensors["k"]
    huge_before = huge_bytes_around(keys.data_ptr() + 8 * MIB)
    torch.manual_seed(0)
    first = torch.randn(1, 4, 1024, 128)
    store.append(first, first + 1)  # 512 KiB of each head's 4 MiB: no page is 7/8 written
    assert huge_bytes_around(keys.data_ptr() + 8 * MIB) == huge_before
    rest = torch.randn(1, 4, capacity - 1024, 128)
    store.append(rest, rest - 1)  # every row written: every whole page of both fields
    assert huge_bytes_around(keys.data_ptr() + 8 * MIB) >= huge_before + 12 * MIB
    values = store.buffer.tensors["v"]
    assert huge_bytes_around(values.data_ptr() + 8 * MIB) >= 12 * MIB
    k, v = store.read()
    assert torch.equal(k, torch.cat([first, rest], dim=2)) and torch.equal(v, torch.cat([first + 1, rest - 1], dim=2))


def test_rows_a_native_step_wrote_go_to_huge_pages_at_the_next_claim(can_collapse):
    from hybridllm.kvcache.dynamic import DynamicCache

    spec = KVSpec(n_layers=1, n_kv_heads=4, head_dim=128, dtype=torch.float32, device=torch.device("cpu"),
                  max_tokens=1 << 16)
    cache = DynamicCache(spec)
    cache.reserve(8192 + 64)  # 64 rows of each head's run stay unwritten
    claimed = cache.in_place_rows([0], 8192)  # the step writes rows 0 .. 8191 itself
    keys = cache.storage_tensors()["device"][0]  # (1, 4, capacity, 128): whole pages of 128 tokens
    assert claimed.write_row == 0 and 8192 + 64 <= keys.shape[2] <= 8192 + 256
    keys.fill_(0.5)
    huge_before = huge_bytes_around(keys.data_ptr() + 8 * MIB)
    cache.in_place_rows([0], 1)  # the next step: rows before it are written
    assert huge_bytes_around(keys.data_ptr() + 8 * MIB) >= huge_before + 12 * MIB
    assert bool((keys[:, :, :8192] == 0.5).all())
