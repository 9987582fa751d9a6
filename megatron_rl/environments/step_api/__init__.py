"""Step-API environments: a user's class with ``reset()`` and ``step(response)`` (``job.environment=
<file.py>:<Class>``), run turn by turn by the job. ``user_class.py`` finds, checks and calls the class;
``environment.py`` is the ``Environment`` (episodes through the engine, token-exact via ``../conversation.py``;
failed episodes through ``../failures.py``)."""
