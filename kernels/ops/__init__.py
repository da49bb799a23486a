"""Triton kernels (``logprob``, ``losses``, ``advantages``) and the ``torch.library`` custom ops that dispatch
between them and ``fastpo.kernels.reference`` (``library``). Nothing here imports triton at package import:
the kernel modules are imported on first use of the Triton path (see ``library.triton_module``)."""
