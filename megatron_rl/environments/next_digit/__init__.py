"""The next-digit game (the default config's task): ``game.py`` the rules, ``tokenizer.py`` its 16-token
vocabulary, ``rollout.py`` episodes played through a rollout engine, ``environment.py`` the ``Environment``."""
