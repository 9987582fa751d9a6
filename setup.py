"""megatron_rl package. ``patches/`` installs as ``megatron_rl.patches`` (no top-level ``patches`` module).

megatron-core: exactly the range CI tests (docs/MEGATRON_CORE.md): 0.16.1 (newest for Python 3.11) through
0.19.x (Python >= 3.12). ``scripts/setup.sh`` pins one end per interpreter with a constraint.
"""

from setuptools import find_packages, setup

setup(
    name="megatron_rl",
    version="0.1.0",
    description="Megatron-core backend for RL post-training (PPO/GRPO, multi-turn agents)",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]) + ["megatron_rl.patches"],
    package_dir={"megatron_rl.patches": "patches"},
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.20",  # the tested range; extend it with docs/MEGATRON_CORE.md
        "pyyaml",
        "numpy",
        "psutil",  # megatron-core's checkpoint saver hangs without it (docs/CHECKPOINTS.md section 5)
        "einops",
        "packaging",  # megatron_rl.patches compares the installed megatron-core with the supported range
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis", "pytest-timeout", "pytest-xdist"],
        "hf": ["transformers>=5,<6", "safetensors", "mbridge==0.15.1", "peft"],
        "demo": ["tqdm", "tensorboard", "matplotlib", "pyarrow", "openai"],  # the main job: progress, logs, plot,
        # prompt files; openai: the client of job.agent functions (examples/tool_agent)
        "gpu": ["transformer-engine"],
        # launch.scheduler=ray (megatron_rl/launch/ray_driver.py; job/ray_launch_config.py); [default]: the dashboard's
        # job server, for `ray job submit` / `ray job stop` (+~60 MB, ~15 s to install: aiohttp, opencensus, ...)
        "ray": ["ray[default]==2.60.0"],
    },
)
