"""The ``single_turn`` environment: a prompt file (``data.py``), a user's reward function (``reward.py``),
their config sections (``config.py``) and the ``Environment`` (``environment.py``)."""
