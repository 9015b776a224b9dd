"""On an accelerator: the streams units gather and reduce on, beside the one that computes,
so that collectives overlap compute (Note [side streams])."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol, cast

import torch

# Note [side streams]: on the compute stream a collective would wait for every kernel queued
# before it; on its own stream the all-gather waits only for what it reads, and the
# reduce-scatter only for the gradients. Events order the streams, and memory is reused
# without Tensor.record_stream, as every reuse of a block waits for its last use:
# - The gathered buffer (allocated on the all-gather stream) is freed once its copy-out is
#   queued on the compute stream; the all-gather stream waits for the latest copy-out before
#   it allocates again (`gathering`). Inputs the compute stream allocated (pieces kept after
#   forward) stay referenced until the compute stream waited for the gather.
# - The reduce-scatter's input (allocated on the compute stream) is freed only after the
#   compute stream waited for the reduction. The reduce-scatter stream waits for the compute
#   stream before each reduction (`reducing`), so its output (a `.grad`, freed later on the
#   compute stream) is reused only once the compute stream is done with it. HSDP's partial
#   sums are added on that stream too.
# - The compute stream writes what the all-gather reads (sharded parameters, new layouts,
#   kept pieces), so the all-gather stream waits for it (`follow_compute`) at each
#   iteration's first forward, at an explicit unshard, and before gathering those.


class _DeviceModule(Protocol):  # what we use of torch.cuda, torch.xpu, ...
    def Stream(self, device: torch.device, priority: int = 0) -> torch.Stream: ...

    def current_stream(self, device: torch.device) -> torch.Stream: ...

    def stream(self, stream: torch.Stream) -> AbstractContextManager[object]: ...


class SideStreams:
    """One device's all-gather and reduce-scatter streams, and the latest copy-out event."""

    def __init__(self, device: torch.device) -> None:
        self._module = cast(_DeviceModule, torch.get_device_module(device))
        self.device = device
        # High priority, as their kernels are short and others wait for them.
        self.all_gather = self._module.Stream(device, priority=-1)
        self.reduce_scatter = self._module.Stream(device, priority=-1)
        self._copied_out: torch.Event | None = None  # on the compute stream

    def _current(self) -> torch.Stream:
        return self._module.current_stream(self.device)

    def follow_compute(self, event: torch.Event | None = None) -> None:
        """Gathers from now on see what the compute stream wrote so far (or before `event`)."""
        if event is None:
            self.all_gather.wait_stream(self._current())
        else:
            event.wait(self.all_gather)

    @contextmanager
    def gathering(self) -> Iterator[None]:
        """The all-gather stream, current, after the latest copy-out."""
        if self._copied_out is not None:
            self.all_gather.wait_event(self._copied_out)
        with self._module.stream(self.all_gather):
            yield

    def gathered(self) -> torch.Event:
        """An event for the gather just issued, for the compute stream to wait for."""
        return self.all_gather.record_event()

    def copied_out(self) -> None:
        """A gathered buffer was copied out on the compute stream and freed."""
        self._copied_out = self._current().record_event()

    @contextmanager
    def reducing(self) -> Iterator[None]:
        """The reduce-scatter stream, current, after everything the compute stream queued."""
        self.reduce_scatter.wait_stream(self._current())
        with self._module.stream(self.reduce_scatter):
            yield

    def reduced(self) -> torch.Event:
        return self.reduce_scatter.record_event()

    @contextmanager
    def detour(self, stream: torch.Stream) -> Iterator[None]:
        """`stream` (a user's all-reduce hook's), current, between reduce-scatter stream work."""
        stream.wait_stream(self.reduce_scatter)
        with self._module.stream(stream):
            yield
        self.reduce_scatter.wait_stream(stream)


@functools.cache  # one pair of streams per device, shared by every unit on it
def side_streams(device: torch.device) -> SideStreams | None:
    """The side streams for `device`; None on the CPU and on devices without streams."""
    if device.type in ("cpu", "meta") or not hasattr(torch.get_device_module(device), "Stream"):
        return None
    return SideStreams(device)
