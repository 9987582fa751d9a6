"""Tasks the main job trains on, behind one protocol (``base.Environment``).

- ``base.py``: the protocol (``rollout``, ``evaluate``, ``random_baseline``, ``state_dict``) and ``Rollouts``.
- ``registry.py``: ``job.environment`` -> builder (``make_environment``).
- ``next_digit/``: the multi-turn toy game of the default config (its own 16-token vocabulary).
- ``single_turn/``: prompts from JSONL/Parquet files, one response each, a user's ``reward.function``.
"""
