"""Checks and models of the kernels that need no GPU: lowering for CUDA (check_lowering),
compiling to machine code with registers and occupancy (check_compile, triton_compile), the
analytic H100 time model (perf_model), over the cases of lowering_cases.py at the Qwen2 shapes
of shapes.py."""
