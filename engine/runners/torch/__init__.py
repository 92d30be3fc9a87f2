"""The torch runner: CUDA with Triton kernels, CPU with C++ decode kernels."""
