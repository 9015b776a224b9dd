"""ReusedBuffer: one tensor reused across collectives, its storage held only while in use."""

from __future__ import annotations

import torch

from fsdp_compose._buffer import ReusedBuffer

CPU = torch.device("cpu")


def test_storage_exists_only_between_take_and_release():
    buffer = ReusedBuffer()
    tensor = buffer.take(6, torch.float32, CPU)
    assert tensor.shape == (6,) and tensor.untyped_storage().nbytes() == 24
    tensor.copy_(torch.arange(6.0))  # usable memory
    buffer.release()
    assert tensor.untyped_storage().nbytes() == 0


def test_the_same_request_reuses_the_tensor():
    buffer = ReusedBuffer()
    first = buffer.take(6, torch.float32, CPU)
    buffer.release()
    again = buffer.take(6, torch.float32, CPU)
    assert again is first and again.untyped_storage().nbytes() == 24


def test_another_size_or_dtype_gets_a_new_tensor():
    buffer = ReusedBuffer()
    first = buffer.take(6, torch.float32, CPU)
    buffer.release()
    bigger = buffer.take(8, torch.float32, CPU)
    assert bigger is not first and bigger.numel() == 8
    buffer.release()
    other_dtype = buffer.take(8, torch.bfloat16, CPU)
    assert other_dtype.dtype == torch.bfloat16 and other_dtype.untyped_storage().nbytes() == 16


def test_first_taken_in_inference_mode_is_still_writable_outside():
    buffer = ReusedBuffer()
    with torch.inference_mode():
        buffer.take(4, torch.float32, CPU)
        buffer.release()
    tensor = buffer.take(4, torch.float32, CPU)
    assert not tensor.is_inference()
    tensor.add_(1)  # an in-place write outside inference mode
