"""The demo: an application of the library on a toy multi-turn game (game, sampler, config, main job).

Nothing in ``megatron_rl`` outside this package imports it. ``python -m megatron_rl.demo.main`` (what
``run_megatron.sh`` launches) runs the RL loop; ``demo/config.py`` composes the library config with the demo's
own ``demo`` section.
"""
