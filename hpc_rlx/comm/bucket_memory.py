"""The fused bucket's memory: where its values live, apart from how they are summed.

One `BucketMemory` owns

- the layout (`bucket_layout.BucketLayout`: the payload of gradients or weighted parameters,
  then the named fields: counts, loss and metric sums, the loss weight, the control flags,
  per-rank slots);
- the host array and its views (`buffer`, `payload`, `tail`), which move as a whole into
  page-locked memory (a device twin), into the node's shared window (`share`) and back
  (`leave_window`), or into a shorter tail for fewer ranks (`relayout`), the payload's views
  staying valid where they can;
- the twin on the lead GPU (`attach_device`) and the explicit transfers between the two
  (`mark_device_fresh`, `payload_to_host`, `tail_to_device`, `tail_to_host`).

The tail always lives on the host and is never compressed. The reduction paths
(`hpc_rlx.comm.reduce`) sum a `BucketMemory`; which path runs is `path_choice`'s decision and
the bucket's (`collective.FusedBucket`), never the memory's.
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.comm.bucket_layout import BucketLayout
from hpc_rlx.comm.finite import all_finite
from hpc_rlx.base import backend
from hpc_rlx.base.errors import HpcRlxError


class BucketMemory:
    """The host array laid out by `layout`, its views, and its device twin, if any."""

    def __init__(self, layout: BucketLayout, dtype, xp=np):
        self.layout = layout
        self.payload_size = layout.payload_size
        self._view(xp.zeros(layout.size, dtype=dtype))
        self.window = None              # the node's shared window the host array lives in (`share`)
        self.device = None              # lead GPU of the device twin, if any
        self.device_buffer = None
        self.device_payload = None
        self.device_tail = None
        self.device_is_newest = False   # the lanes or the Allreduce left the newest payload there

    def _view(self, buffer) -> None:
        self.buffer = buffer
        self.payload = self.layout.payload_of(buffer)
        self.tail = self.layout.tail_of(buffer)

    # ---- the named fields of the tail -------------------------------------------------------
    def __getitem__(self, field: str):
        """A summed field as a float; a per-rank field as its slots (a view of the tail)."""
        return self.layout.read(self.tail, field)

    def __setitem__(self, field: str, value: float) -> None:
        self.layout.write(self.tail, field, value)

    def put(self, field: str, value: float, rank: int) -> None:
        """This rank's slot of a per-rank field (or a summed field: `rank` is ignored)."""
        self.layout.write(self.tail, field, value, rank)

    def flags(self) -> dict[str, bool]:
        """The reduced control flags (`bucket_layout.CONTROL_FLAGS`) after the Allreduce."""
        return self.layout.flags(self.tail)

    def zero_tail(self) -> None:
        self.tail[...] = 0

    # ---- where the host array lives ---------------------------------------------------------
    def attach_device(self, device: int) -> None:
        """A twin on GPU `device`, the host side moved to page-locked memory. Before anyone
        keeps a view of `payload` or `buffer`."""
        host = backend.pinned_empty(self.buffer.shape[0], self.buffer.dtype)
        host[...] = self.buffer
        self._view(host)
        self.device = int(device)
        self.device_buffer = backend.device_zeros(host.shape[0], host.dtype, self.device)
        self.device_payload = self.layout.payload_of(self.device_buffer)
        self.device_tail = self.layout.tail_of(self.device_buffer)
        self.device_is_newest = False

    def share(self, window) -> None:
        """Live in this rank's segment of the node's shared `window` (`node_memory`), the
        values coming along. Before anyone keeps a view of `payload` or `buffer`."""
        window.segment[...] = self.buffer
        self._view(window.segment)
        self.window = window

    def leave_window(self, copy: bool) -> None:
        """Off the node's shared window: into a private copy of the last values (`copy`: the
        window is about to be freed), or staying in the segment, which stays mapped (the window
        abandoned after a failure), so every view stays valid."""
        if copy:
            self._view(self.buffer.copy())
        self.window = None

    def relayout(self, world_size: int) -> bool:
        """The per-rank slots laid out again for `world_size` ranks (fewer: a failure shrank the
        job), in the same memory: every view of the payload stays valid. False where nothing
        moved (the same world, or no per-rank fields)."""
        if world_size == self.layout.world_size or not self.layout.rank_fields:
            return False
        if self.device is not None:
            raise HpcRlxError("a bucket with a GPU twin is not laid out again after a failure")
        old, self.layout = self.layout, self.layout.for_world(world_size)
        self._view(self.layout.within(self.buffer, old))
        return True

    # ---- explicit transfers between the host arrays and the device twin ----------------------
    def mark_device_fresh(self) -> None:
        """The lanes (or a CUDA-aware Allreduce) left the newest payload in `device_payload`."""
        if self.device_buffer is None:
            raise HpcRlxError("mark_device_fresh on a bucket without a device twin")
        self.device_is_newest = True

    def payload_to_host(self) -> None:
        """Bring a device-side payload down to `payload` (a no-op when the host is newest)."""
        if self.device_is_newest:
            backend.copy_to_host(self.payload, self.device_payload)
            self.device_is_newest = False

    def tail_to_device(self) -> None:
        backend.copy_to_device(self.device_tail, self.tail)

    def tail_to_host(self) -> None:
        backend.copy_to_host(self.tail, self.device_tail)

    def payload_finite(self) -> bool:
        """Whether every payload value is finite, checked where the newest payload lives."""
        if self.device_is_newest:
            xp = backend.array_module(self.device_payload)
            with backend.use_device(self.device):
                return bool(xp.isfinite(self.device_payload).all())
        return all_finite(self.payload)
