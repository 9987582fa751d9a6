"""Former home of the main job and the digit game; each module here re-exports its new place so old imports and
``python -m megatron_rl.demo.main`` keep working: the job is ``megatron_rl/job/``, the game
``megatron_rl/environments/next_digit/``, the sampler ``megatron_rl/inference/builtin_engine.py``."""
