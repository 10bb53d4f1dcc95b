"""Packed multi-item attention: the mask of docs/score-semantics.md over a pass of many sequences and items.

- `rule`: the packing rule (who sees whom) and the score math every path shares.
- `host_tables`: the host tables, the mask's block structure computed on the host, so that each path's cost follows
  the visible keys, never T x T.
- `xla`: the plain-XLA paths: the dense reference, the block-sparse path, the cascade path (CPU's default).
- `device_tables`: the kernels' tables, made on the device from the host tables at each kernel's tile sizes.
- `tpu`, `gpu`: the Pallas kernels, for TPU and for CUDA (Mosaic GPU); `gpu_ws`: a warp-specialized CUDA kernel
  (PACKSCORE_GPU_KERNEL=ws).
- `selection`: which path serves which ATTENTION setting and which kernel which device: the engine reads it.
"""
