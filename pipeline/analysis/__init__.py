"""Analysis of trained checkpoints: per-layer attention distance D_l and ΔD_l (`prism attention-distance`)."""
