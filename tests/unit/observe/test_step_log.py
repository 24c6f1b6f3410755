"""Which steps the per-step log (steps.jsonl, TensorBoard) records: pure, on a made-up clock."""

from hpc_rlx.observe.step_log import StepSampler


def run_epochs(sampler: StepSampler, epochs: int, steps: int, step_s: float) -> list[int]:
    recorded, now, step = [], 0.0, 0
    for _ in range(epochs):
        sampler.start(step, now, {})
        for k in range(1, steps + 1):
            step, now = step + 1, now + step_s
            if sampler.add(step, now, {"samples": 32.0 * k, "loss_sum": 1.0 * k}) is not None:
                recorded.append(step)
    return recorded


def test_epochs_shorter_than_the_interval_still_get_records():
    # 3 epochs of 22 steps at 1 ms: each epoch lasts 22 ms, far under a 100 ms interval
    recorded = run_epochs(StepSampler(22, min_interval_s=0.1), epochs=3, steps=22, step_s=0.001)
    assert recorded == [1]                        # the first step, then nothing within 0.1 s


def test_records_keep_the_interval_across_epoch_starts():
    recorded = run_epochs(StepSampler(22, min_interval_s=0.1), epochs=10, steps=22, step_s=0.001)
    assert recorded and all(b - a >= 100 for a, b in zip(recorded, recorded[1:])), recorded
    assert len(recorded) >= 2                     # 220 ms of training: more than one record


def test_long_epochs_are_recorded_at_the_stride():
    recorded = run_epochs(StepSampler(1000, max_per_epoch=10, min_interval_s=0.0), epochs=1,
                          steps=1000, step_s=0.01)
    assert recorded == list(range(100, 1001, 100))
