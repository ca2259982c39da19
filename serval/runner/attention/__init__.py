"""Attention over the paged KV cache behind one interface (backend.py), with its backends: the native CPU
kernels (native_cpu.py), PyTorch SDPA as the reference (sdpa.py), and the choice between them (selector.py)."""
