"""CuTe DSL kernels for Blackwell (SM100: capability 10.0 and 10.3)."""
