"""megatron_rl: a Megatron-core training backend for RL post-training of LLMs.

Data flow and design: see ``docs/DESIGN.md`` and README.md. Subpackages are pipeline
stages: ``data`` (pure transforms), ``algorithms`` (pure math), ``model`` and ``distributed`` (the only
places touching megatron-core or torch.distributed), ``trainer`` (the order of stages).
"""

__version__ = "0.1.0"

from megatron_rl import early_signals as _early_signals

_early_signals.install()  # under run_megatron.sh: a preemption warning while starting is kept, not fatal

from megatron_rl import warnings_filter as _warnings_filter

_warnings_filter.install()  # before megatron-core is imported: its known fallback warnings -> one line

from megatron_rl import lazy_compile as _lazy_compile

_lazy_compile.install()  # before megatron-core is imported: its torch.compile calls at import time are deferred (W36)
