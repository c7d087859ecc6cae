"""Pure algorithm math with registries: no models, no optimizers, no I/O.

    registry.py        register(kind, name, **flags) / get(kind, name) / names(kind) / flag(...); a config
                       may name a user's `package.module:function` instead of a registered name
    reduce.py          masked_mean, aggregate (sum | token_mean | sequence_mean | constant | sequence_sum)
    advantages.py      "advantage_estimator": grpo, dr_grpo, grpo_batch, rloo, reinforce_pp; gae, whiten
    policy_losses.py   "policy_loss" (one kind, one term signature; PPO's and GRPO's `loss_type`, the engine's
                       loss_fn): ppo, dapo, bnpo, grpo, dr_grpo, gspo, cispo, cispo_clip, sapo, luspo, vespo,
                       importance_sampling, dro; compute_policy_loss (the objective around a term); ppo_value_loss
    kl.py              "kl_estimator": k1, k2, k3; kl_penalized_rewards; Adaptive/FixedKLController
    preference.py      "preference_loss": sigmoid, ipo, hinge, orpo (flag needs_reference); bradley_terry_loss
    dapo.py            DAPO's overlong_penalty and groups_with_spread (dynamic sampling's filter)

Adding a variant is one function with the kind's signature (in the docstring of its module) and one
`@register(kind, "name")` line above it; a config then names it by that string.
"""

from rl.algos import advantages, kl, policy_losses, preference, reduce  # noqa: F401  (fills the registries)
from rl.algos.registry import get, names, register  # noqa: F401
