"""fastpo: a performance-first trainer for LLM agents with multi-turn reinforcement learning.

Subpackages: ``fastpo.envs`` (batched environments, C++ core in ``fastpo._C``), ``fastpo.kernels``
(Triton kernels with torch fallbacks). Importing ``fastpo`` imports neither torch nor transformers.
"""

__version__ = "0.1.0"
