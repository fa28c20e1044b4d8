"""Running one trial: on a warm local pool of rank processes (pool.py), under torchrun on one
or several nodes, or as a SLURM step (launchers.py), with its timeout, its process tree killed
after it, and its outcome read from what the ranks printed."""
