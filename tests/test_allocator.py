"""The C allocator keeps freed CPU memory for a compiled pipeline unless the plan says not to."""

import os

import pytest
import torch

import fxpipe
from fxpipe.allocator import keep_freed_memory, kept

glibc = pytest.mark.skipif(not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"),
                           reason="the allocator is only set where the C library is glibc")


@glibc
def test_compile_keeps_freed_memory_on_the_cpu_and_says_so():
    pipe = fxpipe.compile(fxpipe.models.MLP(), fxpipe.Plan(stages=2),
                          example_inputs=(torch.randn(8, 32),))
    assert kept() and keep_freed_memory()  # set once; asking again changes nothing
    assert "CPU memory: freed memory kept for reuse" in repr(pipe)


@glibc
def test_memory_freed_and_allocated_again_is_reused_not_mapped_afresh():
    keep_freed_memory()
    block = torch.empty(4 << 20, dtype=torch.uint8)  # 4 MiB: mapped on its own by default
    block.fill_(1)
    address = block.data_ptr()
    del block
    again = torch.empty(4 << 20, dtype=torch.uint8)
    assert again.data_ptr() == address  # the same heap block, its pages still mapped
