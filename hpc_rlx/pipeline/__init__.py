"""Pipeline parallelism: a model split into stages across ranks (``parallel.pipeline_stages``).

The stages themselves are ``graph.partition`` (``StageGraph``) with the executor's
``stage_forward``/``stage_backward``. Here:

- schedule: GPipe and 1F1B action lists, laid on a time grid (idle slots, live activations);
  pure;
- grid: D replicas x S stages, the pipeline and data-parallel communicators (``Comm.Split``);
- buffers: the layout of the messages between neighbouring stages (pure);
- engine: one rank's share of a step (Isend/Irecv of activations and their gradients, the
  loss carried down with the gradients) and of validation;
- stage_lanes: a stage's CPU lanes, each micro-batch's rows split over them;
- adapters: ``PipelineLaneSet`` and ``PipelineBucket``, the engine behind the interfaces the
  loop drives (``runtime.lanes.LaneSet`` and the fused bucket), with how the step's decisions
  reach every rank in the same step.
"""
