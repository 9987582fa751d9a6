"""Config validation with context parallelism: accepted layouts, and errors that name the field."""

from __future__ import annotations

import pytest

from megatron_rl.config import ConfigError, ModelConfig, ParallelConfig
from megatron_rl.data.packing import packing_alignment
from megatron_rl.model.builder import build_transformer_config


@pytest.mark.parametrize("tp, pp, cp, sp", [(1, 1, 2, False), (1, 2, 2, False), (2, 1, 2, True), (2, 2, 4, False)])
def test_cp_layouts_are_accepted(tp, pp, cp, sp):
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              context_parallel_size=cp, sequence_parallel=sp)
    parallel.check_world_size(tp * pp * cp * 2)
    config = build_transformer_config(ModelConfig(), parallel)
    assert config.context_parallel_size == cp
    assert packing_alignment(tp, cp, sp) == 2 * cp * tp


def test_cp_errors_name_the_field():
    with pytest.raises(ConfigError, match="parallel.context_parallel_size=0"):
        ParallelConfig(context_parallel_size=0)
    with pytest.raises(ConfigError, match="sequence_parallel"):
        ParallelConfig(context_parallel_size=2, sequence_parallel=True)  # still needs tp > 1
    with pytest.raises(ConfigError, match="context_parallel_size = 4"):
        ParallelConfig(context_parallel_size=2, tensor_model_parallel_size=2).check_world_size(6)
    with pytest.raises(ValueError, match="num_query_groups=2 is not divisible by tensor_model_parallel_size=4"):
        build_transformer_config(ModelConfig(), ParallelConfig(tensor_model_parallel_size=4, context_parallel_size=2))
