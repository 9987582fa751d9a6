"""The main job (``run_megatron.sh``): ``main.py`` the RL loop, ``config.py`` its sections, ``reporting.py`` what
it logs and leaves behind, ``preflight.py`` the checks before any rank starts. Tasks live in
``megatron_rl/environments``, rollout engines in ``megatron_rl/inference``."""
