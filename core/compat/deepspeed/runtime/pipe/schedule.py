"""``deepspeed.runtime.pipe.schedule``: DeepSpeed 0.19.8's pipeline schedules as instruction streams.

A schedule yields, step by step, the instructions one stage runs (load a micro-batch, forward, send the activation,
...): :class:`TrainSchedule` is DeepSpeed's synchronous 1F1B, :class:`InferenceSchedule` its forward-only schedule,
:class:`DataParallelSchedule` gradient accumulation without a pipeline. The streams are DeepSpeed's, step for step
and buffer for buffer, for scripts and tools that build or inspect them (to plan buffers, to print or check a
schedule, to subclass :class:`PipeSchedule`).

torsh's pipeline engine does not execute these instructions: it runs the same 1F1B order with
``torch.distributed.pipelining`` (:mod:`torsh.engine.pipeline.engine`), so a custom schedule subclass describes a
plan here but does not change how ``engine.train_batch()`` runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from torsh.engine.pipeline.module import call_to_str

__all__ = ["PipeSchedule", "InferenceSchedule", "TrainSchedule", "DataParallelSchedule", "PipeInstruction",
           "OptimizerStep", "ReduceGrads", "ReduceTiedGrads", "BufferOpInstruction", "LoadMicroBatch", "ForwardPass",
           "BackwardPass", "SendActivation", "RecvActivation", "SendGrad", "RecvGrad"]  # fmt: skip


class PipeSchedule(ABC):
    """The steps one stage (``stage_id`` of ``stages``) runs for a batch of ``micro_batches``; iterating yields each
    step's list of :class:`PipeInstruction` (a barrier may sit between two steps without deadlock)."""

    def __init__(self, micro_batches, stages, stage_id):
        super().__init__()
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    @abstractmethod
    def steps(self):
        """Yield each step's list of instructions."""

    def num_pipe_buffers(self) -> int:
        """The buffers this stage allocates (one per micro-batch unless a schedule needs fewer)."""
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id) -> bool:
        return 0 <= stage_id < self.stages

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def _buffer_idx(self, micro_batch_id) -> int:
        """The buffer a micro-batch uses: buffers are reused in turn."""
        assert self._valid_micro_batch(micro_batch_id)
        return micro_batch_id % self.num_pipe_buffers()

    def __iter__(self):
        self.it = None
        return self

    def __next__(self):
        if self.it is None:
            self.it = self.steps()
        return next(self.it)


class InferenceSchedule(PipeSchedule):
    """Forward passes only, ``micro_batches + stages - 1`` steps, two buffers used in turn: even stages send before
    they receive and odd stages the other way round, so that neighbours pair up."""

    def steps(self):
        for step_id in range(self.micro_batches + self.stages - 1):
            micro_batch_id = step_id - self.stage_id
            even_stage = self.stage_id % 2 == 0
            recv_buf, send_buf = (step_id % 2, (step_id + 1) % 2) if even_stage else ((step_id + 1) % 2, step_id % 2)
            cmds: list[PipeInstruction] = []
            if (self.is_first_stage or self.is_last_stage) and self._valid_micro_batch(micro_batch_id):
                cmds.append(LoadMicroBatch(recv_buf))
            send = self._valid_stage(self.next_stage) and self._valid_micro_batch(micro_batch_id - 1)
            recv = self._valid_stage(self.prev_stage) and self._valid_micro_batch(micro_batch_id)
            pair = [SendActivation(send_buf)] * send + [RecvActivation(recv_buf)] * recv
            cmds += pair if even_stage else pair[::-1]
            if self._valid_micro_batch(micro_batch_id):
                cmds.append(ForwardPass(recv_buf))
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 2


class TrainSchedule(PipeSchedule):
    """DeepSpeed's synchronous 1F1B: ``2 * (micro_batches + stages - 1)`` steps alternating forward and backward
    half-steps (a stage works forward on the steps of its own parity), then the tied-weight and data-parallel
    gradient reductions and the optimizer step at the end."""

    def steps(self):
        total_steps = 2 * (self.micro_batches + self.stages - 1)
        prev_micro_batch_id = -1
        for step_id in range(total_steps):
            micro_batch_id, is_forward = self._step_to_micro_batch(step_id)
            prev_valid = self._valid_micro_batch(prev_micro_batch_id)
            curr_valid = self._valid_micro_batch(micro_batch_id)
            prev_buffer = self._buffer_idx(prev_micro_batch_id) if prev_valid else None
            curr_buffer = self._buffer_idx(micro_batch_id) if curr_valid else None
            cmds: list[PipeInstruction] = []
            if is_forward:  # the gradient of the previous micro-batch goes back; this one's activation comes in
                if prev_valid and self._valid_stage(self.prev_stage):
                    cmds.append(SendGrad(prev_buffer))
                if curr_valid and self._valid_stage(self.prev_stage):
                    cmds.append(RecvActivation(curr_buffer))
            else:  # this micro-batch's gradient comes in; the previous one's activation goes on
                if curr_valid and self._valid_stage(self.next_stage):
                    cmds.append(RecvGrad(curr_buffer))
                if prev_valid and self._valid_stage(self.next_stage):
                    cmds.append(SendActivation(prev_buffer))
            if (self.is_first_stage or self.is_last_stage) and is_forward and curr_valid:
                cmds.append(LoadMicroBatch(curr_buffer))
            if curr_valid:
                cmds.append(ForwardPass(curr_buffer) if is_forward else BackwardPass(curr_buffer))
            if step_id == total_steps - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            prev_micro_batch_id = micro_batch_id
            yield cmds

    def num_pipe_buffers(self) -> int:
        """The forward passes in flight at once on this stage (their activations wait for the backward): the
        stages after it, at most the micro-batches, at least 2."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))

    def _step_to_micro_batch(self, step_id) -> tuple[int, bool]:
        """The micro-batch a step works on (possibly out of range: an idle step) and whether it is a forward."""
        is_forward = step_id % 2 == self.stage_id % 2
        if is_forward:
            return step_id // 2 - self.stage_id // 2, True
        return step_id // 2 - self.stages + 1 + self.stage_id // 2, False


class DataParallelSchedule(PipeSchedule):
    """Gradient accumulation without a pipeline: load, forward and backward each micro-batch in one buffer, then
    reduce and step."""

    def steps(self):
        for step_id in range(self.micro_batches):
            cmds = [LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0), BackwardPass(buffer_id=0)]
            if step_id == self.micro_batches - 1:
                cmds += [ReduceGrads(), OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 1


class PipeInstruction:
    """One instruction of a schedule; its keyword arguments are kept as attributes (and in ``kwargs``)."""

    def __init__(self, **kwargs):
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self):
        return call_to_str(self.name, **self.kwargs)


class OptimizerStep(PipeInstruction):
    """Step the optimizer and zero the gradients (after :class:`ReduceGrads` and :class:`ReduceTiedGrads`)."""


class ReduceGrads(PipeInstruction):
    """Reduce the gradients over the data-parallel ranks."""


class ReduceTiedGrads(PipeInstruction):
    """Reduce the gradients of weights tied across stages (e.g. embeddings) over those stages."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on one of the stage's pipeline buffers (``buffer_id``)."""

    def __init__(self, buffer_id, **kwargs):
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Load the next micro-batch into the buffer (first and last stages: inputs and labels)."""


class ForwardPass(BufferOpInstruction):
    """Compute the stage's forward on the buffer's inputs."""


class BackwardPass(BufferOpInstruction):
    """Back-propagate the buffer's outputs with the gradients received for them."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's outputs to the next stage (paired with its :class:`RecvActivation`)."""


class RecvActivation(BufferOpInstruction):
    """Receive the previous stage's activation into the buffer's inputs."""


class SendGrad(BufferOpInstruction):
    """Send the gradient of the buffer's inputs to the previous stage (paired with its :class:`RecvGrad`)."""


class RecvGrad(BufferOpInstruction):
    """Receive the next stage's gradient of the buffer's outputs."""
