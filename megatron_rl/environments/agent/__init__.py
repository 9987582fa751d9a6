"""OpenAI-client agents: a user's function ``function(base_url, **row) -> reward`` (``job.agent=<file.py>:<function>``)
that talks to an OpenAI-compatible endpoint the job serves per episode. ``environment.py`` is the ``Environment``
(episodes on rank 0, the same rollouts on every rank); ``endpoint.py`` the loopback HTTP endpoint and the record
of each episode's calls (token-exact via ``../conversation.py``); ``tool_parsers.py`` the tool-call parsers
(``rollout.tool_call_parser``)."""
