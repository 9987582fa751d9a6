"""Start the run's launchers: on this machine, through srun inside a Slurm allocation, or by submitting to
Slurm (``plan.py`` decides; docs/CLUSTER.md). The ``launch`` config section is the job config's
(``job/launch_config.py``)."""
