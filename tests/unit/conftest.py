"""The unit suite runs torch ops on one thread. Its models are tiny, so each op costs its dispatch, not its
arithmetic: a second intra-op thread only adds a hand-off, and on a busy machine a wait for a descheduled
thread (measured: test_export.py and test_profiling.py take 5x the CPU time with two threads under load).
The integration suite's processes get the same count through OMP_NUM_THREADS=1."""

import torch

torch.set_num_threads(1)
