"""2 MiB pages for the host buffers the kernels stream (hybridllm.host_pages): the native weights
go to huge pages, nothing unwritten becomes resident, and no value changes. The page checks read
this process's /proc/self/smaps; they need Linux 6.1+ (``MADV_COLLAPSE``) and are skipped where
the kernel cannot collapse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridllm import host_pages
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
