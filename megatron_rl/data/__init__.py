"""Pure data transforms (docs/DESIGN.md sections 1-3, 6): rollouts -> validated lists -> left-padded tensor block ->
prompt-based mini-batches -> THD packed micro-batches. No megatron-core import, no torch.distributed."""

from megatron_rl.data.batch import (
    TrainingBatch,
    convert_prompts_responses_to_batch_tensors,
    left_pad,
    response_values,
    right_aligned_mask,
)
from megatron_rl.data.generator_output import GeneratorOutput, is_scalar_reward, validate_generator_output
from megatron_rl.data.merge import merge_stepwise_output
from megatron_rl.data.minibatch import compute_prompt_end_indices, compute_prompt_mini_batch_boundaries
from megatron_rl.data.packing import PackedBatch, pack, packing_alignment, pad_packed_to, unpack_response

__all__ = [
    "GeneratorOutput",
    "PackedBatch",
    "TrainingBatch",
    "compute_prompt_end_indices",
    "compute_prompt_mini_batch_boundaries",
    "convert_prompts_responses_to_batch_tensors",
    "is_scalar_reward",
    "left_pad",
    "merge_stepwise_output",
    "pack",
    "packing_alignment",
    "pad_packed_to",
    "response_values",
    "right_aligned_mask",
    "unpack_response",
    "validate_generator_output",
]
