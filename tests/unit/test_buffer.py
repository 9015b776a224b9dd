"""ReusedBuffer: one tensor reused across collectives, its storage held only while in use."""

from __future__ import annotations

import torch

from fsdp_compose.comm.collectives import ReusedBuffer

CPU = torch.device("cpu")


def test_storage_exists_only_between_take_and_release():
    buffer = ReusedBuffer()
    tensor = buffer.take(((2, 3), torch.float32, CPU))
    assert tensor.shape == (2, 3) and tensor.untyped_storage().nbytes() == 24
    tensor.copy_(torch.arange(6.0).view(2, 3))  # usable memory
    buffer.release()
    assert tensor.untyped_storage().nbytes() == 0


def test_the_same_request_reuses_the_tensor():
    buffer = ReusedBuffer()
    first = buffer.take(((2, 3), torch.float32, CPU))
    buffer.release()
    again = buffer.take(((2, 3), torch.float32, CPU))
    assert again is first and again.untyped_storage().nbytes() == 24
    assert buffer.flat.shape == (6,) and buffer.flat.data_ptr() == again.data_ptr()


def test_another_shape_or_dtype_gets_a_new_tensor():
    buffer = ReusedBuffer()
    first = buffer.take(((2, 3), torch.float32, CPU))
    buffer.release()
    transposed = buffer.take(((3, 2), torch.float32, CPU))
    assert transposed is not first and transposed.shape == (3, 2)
    buffer.release()
    bigger = buffer.take(((2, 4), torch.float32, CPU))
    assert bigger.shape == (2, 4)
    buffer.release()
    other_dtype = buffer.take(((2, 4), torch.bfloat16, CPU))
    assert other_dtype.dtype == torch.bfloat16 and other_dtype.untyped_storage().nbytes() == 16


def test_an_equal_spec_that_is_another_object_reuses_the_tensor():
    buffer = ReusedBuffer()
    first = buffer.take(((2, 3), torch.float32, CPU))
    buffer.release()
    again = buffer.take(((2, 3), torch.float32, torch.device("cpu")))
    assert again is first and again.untyped_storage().nbytes() == 24


def test_first_taken_in_inference_mode_is_still_writable_outside():
    buffer = ReusedBuffer()
    with torch.inference_mode():
        buffer.take(((1, 4), torch.float32, CPU))
        buffer.release()
    tensor = buffer.take(((1, 4), torch.float32, CPU))
    assert not tensor.is_inference()
    tensor.add_(1)  # an in-place write outside inference mode
