"""Native CPU kernels for decode steps: ``decode.cpp``, built at run time (``build``) and bound
through ctypes (``native``). See :mod:`hybridllm.kernels.native`."""
