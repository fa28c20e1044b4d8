import os

# Trials and spawned test groups run one thread per rank: ranks share the machine's cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore")
