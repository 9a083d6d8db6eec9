"""The C allocator keeps freed CPU memory for a compiled pipeline unless the plan says not to."""

import subprocess
import sys

import pytest
import torch

import fxpipe
from fxpipe.allocator import _glibc, describe, keep_freed_memory, kept

glibc = pytest.mark.skipif(_glibc() is None,
                           reason="the allocator is only set where malloc is glibc's")

# a fresh process: the allocator's settings last as long as the process that made them
_SYSTEM = """
import torch, fxpipe
from fxpipe.allocator import kept
pipe = fxpipe.compile(fxpipe.models.MLP(), fxpipe.Plan(stages=2, cpu_memory="system"),
                      example_inputs=(torch.randn(8, 32),))
print(kept(), "CPU memory" in repr(pipe))
"""


@glibc
def test_compile_keeps_freed_memory_on_the_cpu_and_says_so():
    pipe = fxpipe.compile(fxpipe.models.MLP(), fxpipe.Plan(stages=2),
                          example_inputs=(torch.randn(8, 32),))
    assert kept() and keep_freed_memory()  # set once; asking again changes nothing
    assert "CPU memory: freed memory kept for reuse (Plan(cpu_memory='keep'))" in repr(pipe)
    assert "an earlier compile in this process set it" in describe("system")


@glibc
def test_memory_freed_and_allocated_again_is_reused_not_faulted_in_afresh():
    import resource  # Unix only, as glibc is

    keep_freed_memory()

    def faults() -> int:  # pages the process touched that had to be mapped in
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    counts = []
    for _ in range(5):  # as a step does: the same large tensors made, used and freed
        before = faults()
        blocks = [torch.ones(4 << 20, dtype=torch.uint8) for _ in range(8)]  # 32 MiB, touched
        del blocks
        counts.append(faults() - before)
    pages = (32 << 20) // resource.getpagesize()
    assert sum(counts[1:]) < pages  # the rounds after the first find their pages mapped


@glibc
def test_system_leaves_the_allocator_as_it_comes():
    done = subprocess.run([sys.executable, "-c", _SYSTEM], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]  # set nothing, said nothing


def test_keep_without_glibc_says_the_allocator_is_as_it_comes(monkeypatch):
    monkeypatch.setattr("fxpipe.allocator._kept", False)
    monkeypatch.setattr("fxpipe.allocator._glibc", lambda: None)
    assert not keep_freed_memory() and not kept()
    assert describe("keep") == ("CPU memory: as the allocator handles it "
                                "(Plan(cpu_memory='keep') needs glibc's malloc)")
    assert describe("system") is None
