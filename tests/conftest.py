import os

# Rank processes and this process share 2 cores: keep intra-op threads at one (FACTS.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")
