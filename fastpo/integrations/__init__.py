"""fastpo's loss kernels inside other RL trainers.

* :mod:`fastpo.integrations.trl`: ``FastPOGRPOTrainer``, TRL's ``GRPOTrainer`` with the lm-head logprobs and the
  policy loss computed by ``fastpo.kernels`` (the ``[B, T, V]`` logits are never built).
* :mod:`fastpo.integrations.verl`: fastpo's PPO policy loss and advantage estimators registered in verl's
  ``register_policy_loss`` / ``register_adv_est`` registries under ``fastpo_*`` names.

Each submodule imports its peer (``trl`` / ``verl``) and fails with one ImportError line when it is absent; this
package itself imports nothing. docs/KERNELS.md lists what each integration honours and refuses.
"""
