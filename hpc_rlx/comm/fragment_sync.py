"""One fragment's outer sync in flight: a staged copy of the fragment and of the bucket's tail,
summed over the ranks without blocking the inner steps (``policy.fragments``).

The windowed policies' bucket is ``[payload | tail]``; a fragment sync sums ``payload[lo:hi]``
and the whole tail (weight, every rank's report, the control flags). Those are not contiguous,
and the inner steps go on writing their gradients into the payload while the sum is in flight,
so both are copied into a staging array of their own, ``[fragment | tail]``, which the sum works
on. The bucket's layout stays the only layout: the staging array is the bucket's tail behind a
slice of its payload.

How the sum runs depends on the path (`reduce.ReductionPath`):

- MPI's SUM (`reduce.HostSum`, an overlappable path): one ``Iallreduce`` per chunk of at most
  ``comm.bucket_cap_mb``, started at once and waited for `policy.fragment_delay` steps later;
- the ordered sum (``comm.deterministic``) and the coded outer wire
  (``policy.outer_wire_dtype``): they take more than one MPI call with work in between, so they
  run whole when the fragment is waited for; the overlap is then lost, the schedule is not.

`sent` keeps this rank's contribution as it was handed over (an in-place ``Iallreduce`` owns the
staging array until it completes): a checkpoint taken while the sum is in flight saves it, and
the resumed run starts the same sum again.
"""

from __future__ import annotations

import time

import numpy as np

from hpc_rlx.comm.reduce import Reduced, chunk_bounds, mpi_module, ring_bytes


class StagedFragment:
    """The bucket-shaped view (`payload`, `tail`, `buffer`, `payload_size`) of one fragment and
    the tail, which a reduction path sums as it sums a bucket."""

    def __init__(self, n: int, tail_size: int, dtype):
        self.buffer = np.empty(int(n) + int(tail_size), dtype)
        self.payload = self.buffer[:n]
        self.tail = self.buffer[n:]
        self.payload_size = int(n)


class FragmentSync:
    """Start the sum of one staged fragment (`start`), then `wait` for it. One in flight at a
    time; a path with `overlappable` runs as non-blocking Allreduces, any other whole at
    `wait`."""

    def __init__(self, path, chunk_elems: int, bounds: list[tuple[int, int]], tail_size: int, dtype):
        self.path = path
        self.chunk_elems = int(chunk_elems)
        self.bounds = list(bounds)
        self.tail_size = int(tail_size)
        self._staged = {j: StagedFragment(hi - lo, tail_size, dtype) for j, (lo, hi) in enumerate(bounds)}
        self.sent = np.empty(max(hi - lo for lo, hi in bounds) + tail_size, dtype)
        self.fragment: int | None = None     # the fragment in flight
        self._requests: list = []
        self._cancelled = False      # the run stopped with this fragment in flight (`cancel`)

    def stage(self, fragment: int) -> StagedFragment:
        """The staging array of `fragment`, for the caller to fill."""
        return self._staged[fragment]

    def start(self, comm, fragment: int) -> None:
        """Start summing the staged `fragment` (filled by the caller) over `comm`."""
        if self.fragment is not None:
            raise RuntimeError(f"fragment {self.fragment} is still in flight")
        staged = self._staged[fragment]
        self.sent[:staged.buffer.size] = staged.buffer
        self.fragment = fragment
        self._requests, self._cancelled = [], False
        if self.path.overlappable and comm.size > 1:
            mpi = mpi_module()
            for lo, hi in chunk_bounds(staged.buffer.size, self.chunk_elems):
                self._requests.append(comm.Iallreduce(mpi.IN_PLACE, staged.buffer[lo:hi], op=mpi.SUM))

    def restart(self, comm, fragment: int, sent: np.ndarray) -> None:
        """Start again the sum a checkpoint found in flight, from the contribution it saved."""
        staged = self._staged[fragment]
        staged.buffer[...] = sent[:staged.buffer.size]
        self.start(comm, fragment)

    @property
    def in_flight(self) -> bool:
        return self.fragment is not None

    def wait(self, comm) -> tuple[int, StagedFragment, Reduced, float]:
        """Complete the sum in flight: (fragment, its summed staging, what the sum did, the
        seconds this call waited)."""
        if self.fragment is None or self._cancelled:
            raise RuntimeError("no fragment in flight")
        t0 = time.perf_counter()
        fragment, staged = self.fragment, self._staged[self.fragment]
        if self._requests:
            mpi_module().Request.Waitall(self._requests)
            done = Reduced(len(self._requests), ring_bytes(comm, staged.buffer.nbytes),
                           f"{self.path.path}, fragment")
        elif comm.size > 1:
            if self.path.keeps_state_by_index:     # the coded wire keeps residuals by parameter index
                self.path.offset = self.bounds[fragment][0]
            done = self.path.run(staged, comm, 0)
        else:
            done = Reduced(0, 0, f"{self.path.path}, fragment")
        self.fragment, self._requests = None, []
        return fragment, staged, done, time.perf_counter() - t0

    def cancel(self) -> None:
        """The run stops with a sum in flight: MPI's requests are completed (a path that runs at
        `wait` never ran) and the result is dropped, but the fragment stays marked in flight with
        its `sent` contribution, so a checkpoint taken now keeps it and the resumed run starts
        the same sum again."""
        if self._requests:
            mpi_module().Request.Waitall(self._requests)
        self._requests, self._cancelled = [], True
