"""Streaming DiLoCo (`policy.fragments`, `policy.fragment_delay`, `policy.outer_wire_dtype`)
against a plain NumPy reference of the algorithm, written here from its description
(docs/policies.md, Douillard et al. 2025): F fragments of the parameters, fragment j mod F sent
at the end of sub-window j (K / F local steps), its sum applied tau steps into the next
sub-window, each fragment's own outer Nesterov step after its own warm-up, the rank's copy mixed
with the new global fragment, and int8/int4 codes with error feedback at the inputs and at each
owner's sum.

One 3-rank MPI job (its 2-rank cases on its first two ranks) runs every case through the real classes
(`tests/support/mpi_scripts/streaming_cases.py`: the real policy, `StreamingSync`,
`FragmentSync`, `FeedbackWireSum` and outer optimizer, with fixed dyadic gradients and start).

Exactness: every rounding the reference makes is the one the run makes, in the same order
(the Nesterov step as W_prev - lr g - (lr mu) v, the mix as mix W_i + (1 - mix) W, the owners'
float32 sums in rank order). So the coded cases must match bitwise: a last-bit difference
before a coding would move a value by a whole coding step. Uncoded, MPI's SUM adds 3 ranks in
an order of its own: those cases match to 1e-12 (2 ranks, or comm.deterministic: bitwise)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.support import streaming_inputs as job
from tests.support.jobs import explain, mpirun, write_small_classification

pytestmark = pytest.mark.mpi

SCRIPT = Path(__file__).resolve().parents[2] / "support" / "mpi_scripts" / "streaming_cases.py"

N_PARAMS = 6 * job.HIDDEN + job.HIDDEN + job.HIDDEN * 3 + 3    # an MLP on 6 features, 3 classes
STEPS_PER_EPOCH = 12             # per rank: 15 x the global batch rows, val_fraction 0.2
GROUP = 128                      # values per scale of the integer codes
QMAX = {"int8": 127, "int4": 7}


# ---- the reference ---------------------------------------------------------------------------

def cut(n: int, parts: int) -> list[tuple[int, int]]:
    """[0, n) in `parts` contiguous ranges, the first ones one longer."""
    size, rest = divmod(n, parts)
    bounds, lo = [], 0
    for k in range(parts):
        hi = lo + size + (k < rest)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def int_round_trip(values: np.ndarray, qmax: int) -> np.ndarray:
    """What a block of float64 `values` decodes to: float32, then per 128 values a float32
    scale (largest magnitude / qmax) and codes rint(x / scale), half to even."""
    x = values.astype(np.float32)
    back = np.zeros_like(x)
    for g in range(0, x.size, GROUP):
        part = x[g:g + GROUP]
        scale = np.float32(np.max(np.abs(part))) / np.float32(qmax)
        if scale > 0:
            back[g:g + GROUP] = np.clip(np.rint(part / scale), -qmax, qmax).astype(np.float32) * scale
    return back


class Reference:
    def __init__(self, ranks: int, fragments: int, delay: int, wire: str, k: int = job.K):
        n = N_PARAMS
        self.ranks, self.delay, self.wire = ranks, delay, wire
        self.sub = k // fragments
        self.bounds = cut(n, fragments)
        self.mix = 0.5 if delay > 0 else 0.0
        start = job.start_params(n)
        self.local = [start.copy() for _ in range(ranks)]
        self.glob = start.copy()
        self.prev, self.momentum = start.copy(), np.zeros(n)
        self.syncs = [0] * fragments                # each fragment's syncs (its warm-up)
        self.position = [0] * ranks
        self.sent_residual = [np.zeros(n) for _ in range(ranks)]
        self.sum_residual = [np.zeros(n) for _ in range(ranks)]
        self.started = 0
        self.in_flight = None                       # (fragment, what each rank sent, weights)

    def run(self, epochs: int):
        for _ in range(epochs):
            left = STEPS_PER_EPOCH
            while left:
                count = min(self.sub, left)
                left -= count
                self.sub_window(count, last=left == 0)
        return self

    def local_steps(self, count: int) -> None:
        for r in range(self.ranks):
            for _ in range(count):
                self.local[r] -= job.INNER_LR * job.gradient(r, self.position[r], N_PARAMS)
                self.position[r] += 1

    def sub_window(self, count: int, last: bool) -> None:
        early = min(self.delay, count) if self.in_flight else 0
        self.local_steps(early)
        if self.in_flight:
            self.apply()
        self.local_steps(count - early)
        j = self.started % len(self.bounds)
        self.started += 1
        lo, hi = self.bounds[j]
        weight = 1.0 / count                         # policy.gamma = -1: a rank's move over its steps
        if self.wire == "null":
            sent = [weight * w[lo:hi] for w in self.local]
        else:                                        # the coded wire sends differences from the agreed model
            sent = [(w[lo:hi] - self.glob[lo:hi]) * weight for w in self.local]
        self.in_flight = (j, sent, [weight] * self.ranks)
        if last or self.delay == 0:
            self.apply()

    def coded_sum(self, lo: int, sent: list[np.ndarray]) -> np.ndarray:
        """Each owner's segment: every rank codes its values plus its carried error, the owner
        adds the decoded codes in float32 in rank order and codes that sum plus its own carried
        error; everyone decodes the owners' codes."""
        qmax = QMAX[self.wire]
        out = np.empty(sent[0].size)
        for owner, (a, b) in enumerate(cut(sent[0].size, self.ranks)):
            total = np.zeros(b - a, np.float32)
            for r in range(self.ranks):
                carried = self.sent_residual[r][lo + a:lo + b]
                values = sent[r][a:b] + carried
                decoded = int_round_trip(values, qmax)
                carried[...] = values - decoded
                total += decoded
            carried = self.sum_residual[owner][lo + a:lo + b]
            values = total.astype(np.float64) + carried
            out[a:b] = int_round_trip(values, qmax)
            carried[...] = values - out[a:b]
        return out

    def apply(self) -> None:
        j, sent, weights = self.in_flight
        self.in_flight = None
        lo, hi = self.bounds[j]
        total = sum(weights)
        if self.wire == "null":
            new = sum(sent[1:], sent[0].copy()) / total
        else:
            new = self.coded_sum(lo, sent) / total + self.glob[lo:hi]
        self.syncs[j] += 1
        prev, v = self.prev[lo:hi], self.momentum[lo:hi]
        if self.syncs[j] > job.OUTER_WARMUP:                   # outer Nesterov on the pseudo-gradient
            g = prev - new
            v *= job.OUTER_MU
            v += g
            new = prev - job.OUTER_LR * g - (job.OUTER_LR * job.OUTER_MU) * v
        prev[...] = new
        self.glob[lo:hi] = new
        for w in self.local:
            w[lo:hi] = new if self.mix == 0 else self.mix * w[lo:hi] + (1 - self.mix) * new


# ---- the runs --------------------------------------------------------------------------------

ALL = [(f, tau, wire) for f in (2, 4) for tau in (0, 1, 2) for wire in ("null", "int8", "int4")]


def cases(ranks: int) -> list[tuple]:
    """Every (F, tau) uncoded and with one code, the other code on the other world size: every
    case of `ALL` runs once, on 2 or 3 ranks (fewer runs keep the CI time down)."""
    coded = [("int8", "int4")[(f + tau + ranks) % 2] for f, tau, _ in ALL]
    return [c for c, code in zip(ALL, coded) if c[2] in ("null", code)]


def whole(ranks: int) -> list[tuple]:
    """F = 1, tau = 0: the whole DiLoCo sync, uncoded and coded. Uncoded on 3 ranks, the whole
    sync's blocking Allreduce and the fragment's non-blocking one may add the ranks in different
    orders (Open MPI's do): there both sum in rank order (comm.deterministic, flag True)."""
    return [(1, 0, "null", ranks > 2), (1, 0, ("int8", "int4")[ranks % 2], False)]


def _name(case) -> str:
    ordered = ["ordered"] if case[3:] and case[3] else []
    return ",".join(ordered + [str(c) for c in case[:3]])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """{ranks: {case: what the run kept}}: one 3-rank job, its 2-rank cases on the first two."""
    tmp = tmp_path_factory.mktemp("streaming")
    args = [str(SCRIPT), str(tmp)]
    names = {}
    for ranks in (3, 2):
        data = write_small_classification(tmp / f"data{ranks}.h5", 15 * job.BATCH * ranks, seed=0)
        names[ranks] = [_name(c) for c in cases(ranks) + whole(ranks)] + ["forced," + _name(c) for c in whole(ranks)]
        args += ["--ranks", str(ranks), str(data)] + names[ranks]
    proc = mpirun(3, args, timeout=240)
    assert proc.returncode == 0, explain(proc)
    return {ranks: {c: dict(np.load(tmp / str(ranks) / f"{c}.npz")) for c in names[ranks]} for ranks in names}


def _check(ranks, got, ref, exact: bool, what: str) -> float:
    pairs = [(got["global"], ref.glob)] + [(got["local"][r], ref.local[r]) for r in range(ranks)]
    if not exact:
        worst = max(float(np.max(np.abs(a - b))) for a, b in pairs)
        assert worst <= 1e-12, f"{what}: off the reference by {worst:.3g}"
        return worst
    for r in range(ranks):
        assert np.array_equal(got["local"][r], ref.local[r]), f"{what}: rank {r} off the reference by " \
            f"{np.max(np.abs(got['local'][r] - ref.local[r])):.3g}"
    assert np.array_equal(got["global"], ref.glob), what
    if "sent_residual" in got:
        for r in range(ranks):
            assert np.array_equal(got["sent_residual"][r], ref.sent_residual[r]), f"{what}: rank {r}'s residual"
            assert np.array_equal(got["sum_residual"][r], ref.sum_residual[r]), f"{what}: owner {r}'s residual"
    return 0.0


@pytest.mark.parametrize("ranks", [2, 3])
def test_streaming_diloco_equals_the_reference(runs, ranks):
    got = runs[ranks]
    for case in cases(ranks) + whole(ranks):
        f, tau, wire = int(case[0]), int(case[1]), case[2]
        ref = Reference(ranks, f, tau, wire).run(job.EPOCHS)
        # coded or in rank order: bitwise, codes, residuals and all; else MPI's order of 3 ranks
        exact = wire != "null" or ranks == 2 or _name(case).startswith("ordered")
        _check(ranks, got[_name(case)], ref, exact=exact, what=f"{ranks} ranks, {case}")
        assert not np.array_equal(got[_name(case)]["global"], job.start_params(N_PARAMS))


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_fragment_path_with_one_fragment_and_no_delay_is_the_whole_sync_bitwise(runs, ranks):
    got = runs[ranks]
    for case in whole(ranks):
        whole_sync, forced = got[_name(case)], got["forced," + _name(case)]
        for key in whole_sync:
            if key != "seconds":
                assert np.array_equal(whole_sync[key], forced[key]), (case, key)


def test_the_reference_tells_the_cases_apart():
    # the schedule, the delay and the code each change what the reference computes (so a run
    # that ignored one of them could not match it by chance)
    finals = {case: Reference(2, int(case[0]), int(case[1]), case[2]).run(2).glob for case in ALL}
    values = list(finals.values())
    assert all(not np.array_equal(a, b) for i, a in enumerate(values) for b in values[i + 1:])
